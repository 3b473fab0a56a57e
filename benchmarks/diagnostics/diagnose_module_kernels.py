"""Which kernels a compiled suite-F module launches, and the device time of each (one profiled call).

    python benchmarks/diagnostics/diagnose_module_kernels.py --out DIR [--case S,C,B ...]

For each case, the Hugging Face-style prologue of ``bench_compiled.py`` compiled with the pass: the
generated wrapper (DIR/F-S{S}-C{C}-B{B}-pass-wrapper.py) and, from ``torch.profiler`` over 20 calls,
every CUDA kernel with its mean device time (DIR/module-kernels.md). A module at its floor launches
one kernel per layer and nothing else. Without CUDA: says so and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import fusion_pass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the suites
from compiled_modules import DTYPE, F_D, F_HKV, F_HQ, F_L, F_THETA, Qwen3Prologue, RotaryEmbedding  # noqa: E402


def profile_case(seq: int, cached: int, batch: int, out: str) -> list[str]:
    from torch._inductor.utils import run_and_get_code

    g = torch.Generator(device="cuda").manual_seed(seq)
    module = Qwen3Prologue().to("cuda", DTYPE)
    module.rotary_emb.inv_freq = RotaryEmbedding(F_D, F_THETA).inv_freq.cuda()
    pos = torch.arange(cached, cached + seq, device="cuda")
    x = [torch.randn(batch, seq, h * F_D, device="cuda", generator=g).to(DTYPE) for h in (F_HQ, F_HKV, F_HKV)]
    caches = [torch.zeros(batch, F_HKV, F_L, F_D, device="cuda", dtype=DTYPE) for _ in range(2)]
    args = (*x, pos[None].expand(batch, -1).contiguous(), *caches, pos)
    torch._dynamo.reset()
    fusion_pass.reset_report()
    fn = torch.compile(module, dynamic=False, options=fusion_pass.options())
    with torch.no_grad():
        _, codes = run_and_get_code(fn, *args)
        with open(os.path.join(out, f"F-S{seq}-C{cached}-B{batch}-pass-wrapper.py"), "w") as f:
            f.write("\n\n".join(codes))
        for _ in range(3):
            fn(*args)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                fn(*args)
            torch.cuda.synchronize()
    lines = [f"## S{seq} C{cached} B{batch}: fused {fusion_pass.match_counts()}", "",
             "| kernel | calls | mean device us |", "|---|---|---|"]
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
        if e.device_time_total > 0:
            lines.append(f"| {e.key[:90]} | {e.count} | {e.device_time_total / e.count:.2f} |")
    return lines + [""]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--case", action="append", default=None, help="S,C,B (repeatable); default 293,131,1 and 4096,2048,1")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("diagnose_module_kernels.py profiles CUDA kernels; no CUDA here, nothing to do.")
        return 0
    torch._inductor.config.force_disable_caches = True
    os.makedirs(args.out, exist_ok=True)
    lines = [f"# Kernels of the compiled F module with the pass ({torch.cuda.get_device_name()}, torch "
             f"{torch.__version__})", ""]
    for spec in args.case or ["293,131,1", "4096,2048,1"]:
        lines += profile_case(*(int(v) for v in spec.split(",")), args.out)
    with open(os.path.join(args.out, "module-kernels.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
