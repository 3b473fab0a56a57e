"""Sweep the tiles of the small-M projection-backward GEMMs (kernels/projection_backward.py)
against cuBLAS on the suite-B layer (N = 6144 rows of W, K = 4096), CUDA-graph replay times.

    python benchmarks/sweep_projection_gemms.py --out DIR [--m 128,131,256,512,586]

Writes DIR/sweep-projection-gemms.json: per M, cuBLAS grad_input / grad_weight / both, every
config's time (or its error) and the best pair. This is how ``gemm_configs`` was filled in.
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

from fusion_pass.kernels import projection_backward as pb

N_QKV, K_HIDDEN = 6144, 4096

GRAD_INPUT = [pb.GradInputConfig(*c) for c in [
    # pointer loads (session 5 sweep 1's best)
    (64, 64, 128, 4, 4, 2), (128, 64, 256, 8, 3, 1), (128, 128, 128, 8, 3, 1), (128, 64, 256, 8, 3, 2),
    # TMA loads
    (64, 64, 128, 4, 4, 2, True), (64, 128, 128, 4, 3, 2, True), (128, 64, 128, 8, 4, 1, True),
    (128, 64, 128, 8, 4, 2, True), (128, 64, 64, 4, 4, 2, True), (64, 64, 256, 8, 3, 1, True),
    (64, 64, 128, 4, 6, 2, True), (128, 128, 128, 8, 3, 1, True), (128, 64, 256, 8, 3, 2, True),
    (64, 64, 128, 4, 4, 4, True), (128, 64, 128, 8, 5, 2, True),
]]
GRAD_WEIGHT = [pb.GradWeightConfig(*c) for c in [
    (16, 128, 128, 4, 4), (32, 256, 128, 8, 4),  # pointer loads
    # persistent TMA: (..., tma, programs per SM, flatten)
    (16, 128, 128, 4, 4, True, 2, False), (32, 128, 128, 4, 4, True, 2, False),
    (64, 128, 128, 4, 3, True, 2, False), (64, 128, 128, 8, 3, True, 1, False),
    (32, 128, 256, 8, 3, True, 1, False), (64, 128, 256, 8, 3, True, 1, False),
    (16, 128, 128, 4, 4, True, 2, True), (32, 128, 128, 4, 4, True, 2, True),
    (64, 128, 128, 8, 3, True, 1, True), (64, 256, 128, 8, 3, True, 1, False),
    (32, 128, 128, 4, 4, True, 3, False), (64, 128, 256, 8, 3, True, 1, True),
]]


def key_of(cfg) -> str:
    return ",".join(str(v) for v in dataclasses.astuple(cfg))


BY_KEY = {key_of(c): c for c in GRAD_INPUT + GRAD_WEIGHT}


def graph_us(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, return_mode="median") * 1e3


def rel_err(a, b) -> float:
    """max |a - b| / max |b|: one wrong tile shows (a norm-wise error would average it away)."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--m", default="128,131,256,512,586")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 1
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    W = torch.randn(N_QKV, K_HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    rows = []
    for M in (int(m) for m in args.m.split(",")):
        G = torch.randn(M, N_QKV, device="cuda", dtype=torch.bfloat16, generator=gen)
        X = torch.randn(M, K_HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
        ref_gi, ref_gw = torch.mm(G, W), torch.mm(G.t(), X)
        row = dict(M=M, cublas_grad_input_us=graph_us(lambda: torch.mm(G, W)),
                   cublas_grad_weight_us=graph_us(lambda: torch.mm(G.t(), X)),
                   cublas_both_us=graph_us(lambda: (torch.mm(G, W), torch.mm(G.t(), X))),
                   grad_input={}, grad_weight={})
        for cfg in GRAD_INPUT:
            key = key_of(cfg)
            try:
                err = rel_err(pb.grad_input_partials([G], [W], cfg), ref_gi)
                row["grad_input"][key] = dict(us=graph_us(lambda c=cfg: pb.grad_input_partials([G], [W], c)),
                                              err=err)
            except Exception as e:  # noqa: BLE001 - a config that does not compile is recorded
                row["grad_input"][key] = dict(error=f"{type(e).__name__}: {str(e)[:120]}")
        for cfg in GRAD_WEIGHT:
            key = key_of(cfg)
            try:
                err = rel_err(pb.grad_weight(G, X, cfg=cfg), ref_gw)
                row["grad_weight"][key] = dict(us=graph_us(lambda c=cfg: pb.grad_weight(G, X, cfg=c)), err=err)
            except Exception as e:  # noqa: BLE001
                row["grad_weight"][key] = dict(error=f"{type(e).__name__}: {str(e)[:120]}")

        def best(d):
            ok = {k: v for k, v in d.items() if "us" in v and v["err"] < 1e-2}
            return sorted(ok.items(), key=lambda kv: kv[1]["us"])[:4]

        bi, bw = best(row["grad_input"]), best(row["grad_weight"])
        row["best_grad_input"], row["best_grad_weight"] = bi, bw
        print(f"M={M}: cuBLAS grad_input {row['cublas_grad_input_us']:.1f} grad_weight "
              f"{row['cublas_grad_weight_us']:.1f} both {row['cublas_both_us']:.1f}", flush=True)
        print("   grad_input  best: " + "; ".join(f"{k} {v['us']:.1f}" for k, v in bi), flush=True)
        print("   grad_weight best: " + "; ".join(f"{k} {v['us']:.1f}" for k, v in bw), flush=True)
        bad = [k for d in (row["grad_input"], row["grad_weight"]) for k, v in d.items()
               if "error" in v or v["err"] >= 1e-2]
        if bad:
            print(f"   failed or wrong: {bad}", flush=True)
        if bi and bw:
            ci, cw = BY_KEY[bi[0][0]], BY_KEY[bw[0][0]]
            row["best_pair_us"] = graph_us(lambda: (pb.grad_input_partials([G], [W], ci),
                                                    pb.grad_weight(G, X, cfg=cw)))
            print(f"   best pair {row['best_pair_us']:.1f} vs cuBLAS both {row['cublas_both_us']:.1f}", flush=True)
        rows.append(row)
        del G, X, ref_gi, ref_gw
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=datetime.date.today().isoformat(), N=N_QKV, K=K_HIDDEN, rows=rows)
    (out / "sweep-projection-gemms.json").write_text(json.dumps(meta, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
