"""Reproduce Inductor's crash under CUDA graphs on a tiny Hugging Face Qwen3 (torch 2.11, H200).

    python -X faulthandler benchmarks/diagnostics/diagnose_cudagraph_crash.py [--stock] [--mode M]

A 2-layer Qwen3 (hidden 512, 8/2 heads, head_dim 128), compiled with ``mode="reduce-overhead"``,
runs a prefill of 33 tokens then 3 decode steps (batch 2) on a StaticCache that is created
lazily inside the compiled prefill (``tests/test_qk_norm_rope_cache_model.py``'s
``_prefill_and_decode_on``). On the H200 with torch 2.11 it segfaulted in Inductor's static
Triton launcher while autotuning a mask kernel during the cudagraph-trees warm-up, with the
pass and with ``--stock`` alike; with ``TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER=0`` Triton's own
launcher raised "Pointer argument must be either uint64 or have data_ptr method" instead
(``benchmarks/results/2026-11-29-h200-cudagraph-crash.log``). Run each variant in its own
process (a segfault ends it). Prints ``ok`` with the match counts when it survives. The
supported recipe (cache allocated eagerly, decode compiled with static shapes) is
``tests/cudagraph_decode_check.py``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))

import fusion_pass  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stock", action="store_true", help="do not install the pass")
    parser.add_argument("--mode", default="reduce-overhead")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("diagnose_cudagraph_crash.py needs CUDA; nothing to do.")
        return 0
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from test_qk_norm_rope_cache_model import _prefill_and_decode_on

    config = Qwen3Config(vocab_size=256, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=128, max_position_embeddings=256)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16).cuda().eval()
    input_ids = torch.randint(0, config.vocab_size, (2, 33), device="cuda")
    if not args.stock:
        fusion_pass.install()
    compiled = torch.compile(model, mode=None if args.mode == "default" else args.mode)
    print(f"compiling ({'stock' if args.stock else 'with the pass'}, mode {args.mode}, static launcher "
          f"{torch._inductor.config.use_static_cuda_launcher})", flush=True)
    _prefill_and_decode_on(compiled, config, input_ids, 128, 3)
    torch.cuda.synchronize()
    print("ok", fusion_pass.match_counts(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
