"""Does the persistent TMA grad_weight kernel overlap one tile's store with the next tile's MMAs?

    python benchmarks/probe_grad_weight_overlap.py --out DIR            # timings, warp specialization
    ncu --clock-control none --kernel-name regex:_grad_weight_tma --launch-skip 2 --launch-count 1 \\
        python benchmarks/probe_grad_weight_overlap.py --calls 3          # one launch for a profiler

At M = 128 (N = 6144, K = 4096) the kernel took 19.9 us where the write floor is ~12.6 and the
tensor-core time ~10: about their sum, as if store and MMA ran in series (NOTES-backward.md,
session 5). This times the table's config against the same config with ``warp_specialize=True``
(producer warps issuing TMA loads, consumer warps doing MMAs and the store) and with more
programs per SM, graph replay, M = 128, 256, 512. Writes DIR/probe-grad-weight-overlap.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import pathlib
import sys

import torch
import triton

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from diagnose_device_time import graph_us  # noqa: E402

from fusion_pass.kernels import projection_backward as pb  # noqa: E402

N, K = 6144, 4096


def variants(M: int) -> dict[str, pb.GradWeightConfig]:
    base = pb.gemm_configs(M)[1]
    return {
        "table": base,
        "warp_specialize": dataclasses.replace(base, warp_specialize=True),
        "warp_specialize_no_flatten": dataclasses.replace(base, warp_specialize=True, flatten=False),
        "2 programs/SM": dataclasses.replace(base, programs_per_sm=2),
        "32x128x128 4 warps 3/SM": pb.GradWeightConfig(32, 128, 128, 4, 4, True, 3, True),
        "2 store slices": dataclasses.replace(base, store_slices=2),
        "2 store slices 4 stages": dataclasses.replace(base, store_slices=2, num_stages=4),
        "2 store slices BM 32 6 stages": dataclasses.replace(base, store_slices=2, block_m=32, num_stages=6),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--calls", type=int, default=0, help="just launch the table config this many times (M=128)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("probe_grad_weight_overlap.py needs CUDA")
        return 0
    gen = torch.Generator(device="cuda").manual_seed(0)
    if args.calls:
        G = torch.randn(128, N, device="cuda", dtype=torch.bfloat16, generator=gen)
        X = torch.randn(128, K, device="cuda", dtype=torch.bfloat16, generator=gen)
        for _ in range(args.calls):
            pb.grad_weight(G, X)
        torch.cuda.synchronize()
        return 0
    rows = []
    for M in (128, 256, 512, 586):
        G = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, generator=gen)
        X = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
        ref = torch.mm(G.t(), X)
        row = dict(M=M, cublas_us=graph_us(lambda: torch.mm(G.t(), X)))
        for name, cfg in variants(M).items():
            try:
                got = pb.grad_weight(G, X, cfg)
                exact = bool(torch.equal(got, ref))
                row[name] = dict(us=graph_us(lambda c=cfg: pb.grad_weight(G, X, c)), bit_equal_cublas=exact)
            except Exception as e:  # noqa: BLE001 - a variant that does not compile is the answer
                row[name] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
        print(f"M={M}: cuBLAS {row['cublas_us']:.1f}  " + "  ".join(
            f"{k} {v['us']:.1f}{'' if v['bit_equal_cublas'] else ' (bits differ)'}" if "us" in v
            else f"{k} FAILED {v['error'][:160]}" for k, v in row.items() if isinstance(v, dict)), flush=True)
        rows.append(row)
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "probe-grad-weight-overlap.json").write_text(json.dumps(dict(
            gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
            date=datetime.date.today().isoformat(), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
