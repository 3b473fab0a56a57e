"""Why a Qwen3 decode step compiled with the pass is slower than stock in default mode (no CUDA graphs).

    python benchmarks/diagnose_decode_default.py --out DIR [--batch 8] [--context 256]

The model and step of ``bench_end_to_end.py``'s ``qwen3_decode_B8_ctx256_default`` case. For stock
compile and compile + pass: the generated wrapper code (DIR/decode-<variant>.py), ``do_bench`` of the
step, and a torch.profiler table of 10 steps by self CUDA time and by CPU time (DIR/decode-<variant>-prof.txt).
"""

from __future__ import annotations

import argparse
import os

import torch
import triton.testing
from torch._inductor.utils import run_and_get_code

import bench_end_to_end as e2e


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=256)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    from transformers import Qwen3ForCausalLM

    torch._inductor.config.force_disable_caches = True
    g = e2e.Geometry(layers=2, hidden=4096, q_heads=32, kv_heads=8, head_dim=128, intermediate=16384, vocab=32000)
    config = e2e.qwen3_config(g, 4096)
    model = e2e.build_model(Qwen3ForCausalLM, config, "cuda", torch.bfloat16).eval()
    cache = e2e.new_static_cache(config, args.context + 256, args.batch, "cuda", torch.bfloat16)
    prompt = torch.randint(0, g.vocab, (args.batch, args.context), device="cuda")
    token = torch.randint(0, g.vocab, (args.batch, 1), device="cuda")
    with torch.no_grad():
        e2e.make_lm_step(model, cache, e2e.lm_kwargs(model, cache, prompt, 0), 0, False)()
        kwargs = e2e.lm_kwargs(model, cache, token, args.context)
        for variant in ("stock_compile", "fusion_pass"):
            fn = e2e.compile_variant(model, variant, "cuda", False)
            step = e2e.make_lm_step(fn, cache, kwargs, args.context, False)
            _, codes = run_and_get_code(step)
            with open(os.path.join(args.out, f"decode-{variant}.py"), "w") as f:
                f.write("\n\n# ----\n\n".join(codes))
            for _ in range(5):
                step()
            ms = triton.testing.do_bench(step, return_mode="median")
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    step()
                torch.cuda.synchronize()
            table = (f"{variant}: do_bench {ms:.3f} ms, matches {e2e.fusion_pass.match_counts()}\n\n"
                     + prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15) + "\n\n"
                     + prof.key_averages().table(sort_by="cpu_time_total", row_limit=15))
            with open(os.path.join(args.out, f"decode-{variant}-prof.txt"), "w") as f:
                f.write(table)
            print(f"{variant}: do_bench {ms:.3f} ms, matches {e2e.fusion_pass.match_counts()}", flush=True)
            torch._dynamo.reset()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
