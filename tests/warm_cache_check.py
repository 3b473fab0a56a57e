"""One compile of a Qwen3-style prologue with the pass on CUDA, in its own process, with Inductor's
caches on: ``python warm_cache_check.py CACHE_DIR``. Prints one JSON line: cache hits and misses,
matches, whether the generated code launched our kernel, and the outputs' checksum. Run twice with
the same CACHE_DIR by ``test_kernels_in_graph.test_gpu_warm_cache_in_a_fresh_process_serves_the_fused_graph``."""

from __future__ import annotations

import json
import os
import sys

os.environ["TORCHINDUCTOR_CACHE_DIR"] = sys.argv[1]
os.environ["TRITON_CACHE_DIR"] = os.path.join(sys.argv[1], "triton")

import torch  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from torch._inductor.utils import run_and_get_code  # noqa: E402

import fusion_pass  # noqa: E402
from qwen3_style import Qwen3StylePrologue, make_inputs  # noqa: E402

torch.manual_seed(0)
model = Qwen3StylePrologue(hidden=256, q_heads=8, kv_heads=2, head_dim=128).to("cuda", torch.bfloat16)
inputs = [t.cuda() for t in make_inputs(hidden=256, kv_heads=2, head_dim=128, cache_len=40)]
ref_inputs = [t.clone() for t in inputs]
with torch.no_grad():
    q_ref, _ = model(*ref_inputs)
    compiled = torch.compile(model, options=fusion_pass.options())
    (q, _), codes = run_and_get_code(compiled, *inputs)
torch.cuda.synchronize()
code = "\n".join(codes)
print(json.dumps(dict(
    fx_hits=counters["inductor"]["fxgraph_cache_hit"], fx_misses=counters["inductor"]["fxgraph_cache_miss"],
    aot_hits=counters["aot_autograd"]["autograd_cache_hit"],
    matches=fusion_pass.match_counts().get("qk_norm_rope_cache", 0),
    kernel_in_code="_qk_norm_rope_cache_kernel" in code, op_in_code="torch.ops.fusion_pass" in code,
    q_sum=float(q.double().sum()), k_cache_sum=float(inputs[3].double().sum()),
    q_err=float((q.float() - q_ref.float()).abs().max() / q_ref.float().abs().max()),
    k_cache_err=float((inputs[3].float() - ref_inputs[3].float()).abs().max()),
)))
