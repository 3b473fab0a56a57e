"""Suite B of WORKLOADS.md on the GPU: backward of QKV projection -> RoPE -> per-head RMSNorm.

    python benchmarks/bench_backward.py --out DIR [--cases all|quick] [--no-compile]

Measures, in this order: device copy bandwidth (large D2D copy, read + write bytes), bf16 matmul
rate (8192^3), then per case (S, B):

  floor_us          max(2 GEMMs' FLOPs / matmul rate, bytes that must move / copy bandwidth)
  gemms_us          the two cuBLAS GEMMs alone (grad_qkv @ W, grad_qkv.T @ hidden) on a random grad_qkv
  eager_us          plain-PyTorch backward from the workload's inputs (autograd-correct: un-rotates
                    query_pre_norm with the inverse rotation), elementwise math in fp32, grad_qkv cast
                    to bf16, bf16 GEMMs (what autograd of a bf16 model runs)
  stock_compile_us  torch.compile of that eager function (static shapes, one compile per case);
                    stock_compile_graph_us the same replayed as a CUDA graph
  fusion_pass_us    ours: torch.ops.fusion_pass.qkv_rope_qk_norm_backward, the eager op (argument checks,
                    the elementwise Triton pass, the torch GEMMs); compiled training graphs launch the same
                    kernels from Inductor's wrapper instead (benchmarks/bench_compiled.py times that)
  kernels_us        the same kernels through full_backward_triton (no op dispatch, fewer checks)
  host_us           host time per op call (200 calls without synchronizing): above the device time,
                    do_bench measures the host
  elementwise_us    the elementwise pass alone;  gemm_us: projection_gemms alone
  rel_err           max over outputs of max|ours - ref| / max|ref|, ref = float64 autograd
  sol_score(_graph) SOL-ExecBench's score against stock compile, 1 / (1 + (T - floor) / (T_stock - floor)),
                    in default mode (do_bench) and under graph replay

Timing: ``triton.testing.do_bench(fn, return_mode="median")`` (L2 flushed between runs); for ours,
kernels_us, host_us and the two GEMMs the least of ``REPEATS`` such medians taken in turn (all of
them in the JSON: ``repeats_us``), which keeps the lent machine's slow host spells out.
Our kernel is fed the pre-RoPE q/k (strided views of qkv = hidden @ W.T, computed once in setup),
where the workload gives query_pre_norm: the bytes read are identical.

Writes DIR/<date>-<gpu>-backward.{json,md,png}. Without CUDA: says so and exits 0
(``tests/test_benchmark_workloads.py`` checks the workload on CPU). The workload (inputs, eager backward, the calls
timed, the float64 reference) is ``backward_workload.py``; the tables ``backward_report.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import torch
import triton

from backward_report import write_markdown, write_plot
from backward_workload import (
    SUITE, Geometry, bytes_moved, eager_backward, elementwise_call, make_inputs, ours, ours_kernels, reference64,
    rel_err, workload_args)
from bench_common import attempt, bench, bench_graph, host_us, log, result_header, result_stem, synchronize
from fusion_pass.kernels import projection_backward as pb
from fusion_pass.kernels import qkv_rope_qk_norm_backward_triton as kb

CASES = [(128, 1), (128, 4), (128, 16), (128, 32), (128, 64), (131, 1), (256, 1), (256, 8), (256, 16),
         (256, 32), (293, 2), (512, 1), (541, 4), (1024, 2), (1571, 1), (2048, 2)]
QUICK = [(128, 1), (256, 1), (293, 2), (2048, 2)]
REPEATS = 3  # do_bench medians per case for ours and the two cuBLAS GEMMs; the least is reported
DEVICE = "cuda"
MEAN_KEYS = ("floor_us", "gemms_us", "eager_us", "stock_compile_us", "fusion_pass_us", "kernels_us", "host_us",
             "elementwise_us", "gemm_us", "stock_compile_graph_us", "fusion_pass_graph_us", "elementwise_graph_us",
             "gemms_graph_us")


def measure_ceilings():
    """(copy TB/s read + write on 1 GiB, bf16 matmul TFLOP/s at 8192^3)."""
    n = 1 << 29
    x = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    copy_tbps = 2 * x.numel() * x.element_size() / (bench(lambda: y.copy_(x)) * 1e-6) / 1e12
    del x, y
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    tflops = 2 * 8192 ** 3 / (bench(lambda: a @ b) * 1e-6) / 1e12
    del a, b
    torch.cuda.empty_cache()
    return copy_tbps, tflops


def load_anchors(path):
    for p in (path, "shared/anchors", "../shared/anchors", "/work/shared/anchors"):
        if p and pathlib.Path(p, "h200-eager-and-stock-compile.json").exists():
            data = json.loads(pathlib.Path(p, "h200-eager-and-stock-compile.json").read_text())
            return {(c["S"], c["B"]): c for c in data.get("bwd", [])}
    return {}


def sol_score(t_us, stock_us, floor_us):
    """SOL-ExecBench's score of a time against stock compile's: 1 at the floor, 0.5 at stock's."""
    if t_us is None or stock_us is None or stock_us <= floor_us:
        return None
    return 1.0 / (1.0 + (t_us - floor_us) / (stock_us - floor_us))


def run_case(S, B, copy_tbps, mm_tflops, compiled, stock_earlier, anchors, g: Geometry = SUITE) -> dict:
    """One case (S tokens, batch B): its floor, checks against float64 autograd, then the timings."""
    M = B * S
    t = make_inputs(S, B, DEVICE, g)
    flops = 2 * (2 * M * g.qkv * g.hidden)
    nbytes = bytes_moved(S, B, g)
    row = dict(S=S, B=B, M=M, flops=flops, bytes=nbytes,
               floor_us=max(flops / (mm_tflops * 1e12), nbytes / (copy_tbps * 1e12)) * 1e6)
    ref = reference64(t)
    row["rel_err"], errs = rel_err(ours(t), ref)
    row["rel_err_per_output"] = dict(zip(
        ("grad_hidden", "grad_cos", "grad_sin", "grad_W", "grad_q_norm_w", "grad_k_norm_w"), errs))
    wargs = workload_args(t)
    row["eager_rel_err"], _ = rel_err(eager_backward(*wargs), ref)
    if compiled is not None:
        t0 = time.perf_counter()
        attempt(row, "stock_compile_rel_err", lambda: rel_err(compiled(*wargs), ref)[0])  # compiles this shape
        synchronize()
        row["stock_compile_first_call_s"] = time.perf_counter() - t0
    del ref
    torch.cuda.empty_cache()

    g_rand = torch.randn(M, g.qkv, device=DEVICE, dtype=torch.bfloat16)
    h2 = t["hidden"].view(M, -1)

    def gemms():
        return torch.mm(g_rand, t["W"]), torch.mm(g_rand.t(), h2)

    elementwise = elementwise_call(t)
    row["gemm_us"] = bench(lambda: pb.projection_gemms([g_rand], h2, [t["W"]]))
    row["elementwise_us"] = bench(elementwise)
    # ours and the GEMMs it is compared with: the least of REPEATS medians taken in turn (the lent
    # host has slow spells that last seconds; the minimum keeps them out of both columns).
    repeats = {"gemms": [], "ours": [], "kernels": [], "host": []}
    for _ in range(REPEATS):
        repeats["gemms"].append(bench(gemms))
        repeats["ours"].append(bench(lambda: ours(t)))
        repeats["kernels"].append(bench(lambda: ours_kernels(t)))
        repeats["host"].append(host_us(lambda: ours(t)))
    for key, name in (("gemms_us", "gemms"), ("fusion_pass_us", "ours"), ("kernels_us", "kernels"), ("host_us", "host")):
        row[key] = min(repeats[name])
    row["repeats_us"] = repeats
    attempt(row, "elementwise_graph_us", lambda: bench_graph(elementwise))
    attempt(row, "fusion_pass_graph_us", lambda: bench_graph(lambda: ours(t)))
    attempt(row, "gemms_graph_us", lambda: bench_graph(gemms))
    row["eager_us"] = bench(lambda: eager_backward(*wargs))
    if row.get("stock_compile_rel_err") is not None:
        row["stock_compile_us"] = bench(lambda: compiled(*wargs))
        attempt(row, "stock_compile_graph_us", lambda: bench_graph(lambda: compiled(*wargs)))
    if stock_earlier is not None:
        for key in ("stock_compile_us", "stock_compile_graph_us", "stock_compile_rel_err"):
            row[key] = stock_earlier.get(key)
    row["sol_score"] = sol_score(row["fusion_pass_us"], row.get("stock_compile_us"), row["floor_us"])
    row["sol_score_graph"] = sol_score(row.get("fusion_pass_graph_us"), row.get("stock_compile_graph_us"),
                                       row["floor_us"])
    an = anchors.get((S, B), {})
    row.update(anchor_gemms_us=an.get("cublas_two_gemms_us"), anchor_stock_compile_us=an.get("compiled_us"))
    del t, g_rand
    torch.cuda.empty_cache()
    return row


def run_gpu(args) -> int:
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    anchors = load_anchors(args.anchors)
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name()
    log(f"{gpu}, torch {torch.__version__}, triton {triton.__version__}")
    copy_tbps, mm_tflops = measure_ceilings()
    log(f"ceilings: copy {copy_tbps:.2f} TB/s (read+write), bf16 matmul {mm_tflops:.0f} TFLOP/s")
    stock_from = None
    if args.stock_from:
        earlier = json.loads(pathlib.Path(args.stock_from).read_text())
        if (earlier.get("torch"), earlier.get("triton")) != (torch.__version__, triton.__version__):
            raise SystemExit(f"--stock-from {args.stock_from}: other torch/triton versions than this run's")
        stock_from = {(c["S"], c["B"]): c for c in earlier["cases"]}
        log(f"stock torch.compile column taken from {args.stock_from} ({earlier.get('date')})")
    compiled = torch.compile(eager_backward, dynamic=False) if not args.no_compile and stock_from is None else None
    cases = QUICK if args.cases == "quick" else CASES
    # The host's first seconds of op calls ran slow in earlier runs: warm it up, and re-measure the
    # first case at the end (``first_case_again_us``) to see any order effect.
    t_warm = make_inputs(*cases[0], DEVICE)
    t_end = time.perf_counter() + 2.0
    while time.perf_counter() < t_end:
        ours(t_warm)
    torch.cuda.synchronize()
    del t_warm

    rows, compile_spent = [], 0.0
    for S, B in cases:
        row = run_case(S, B, copy_tbps, mm_tflops, compiled if compile_spent < args.compile_budget_s else None,
                       None if stock_from is None else stock_from.get((S, B), {}), anchors)
        compile_spent += row.get("stock_compile_first_call_s", 0.0)
        rows.append(row)
        pathlib.Path(result_stem(out_dir, "backward") + ".partial.json").write_text(json.dumps(
            dict(copy_TBps=copy_tbps, mm_TFLOPs=mm_tflops, cases=rows), indent=1))  # a run cut short keeps these
        log(f"S={S:5d} B={B:3d} M={row['M']:5d}  " + "  ".join(
            f"{k[:-3]} {row[k]:.1f}" for k in MEAN_KEYS if isinstance(row.get(k), float))
            + f"  rel_err {row['rel_err']:.1e}  sol {row['sol_score']} / graph {row['sol_score_graph']}")

    t_first = make_inputs(*cases[0], DEVICE)
    first_case_again_us = bench(lambda: ours(t_first))
    log(f"first case again: ours {first_case_again_us:.1f} us (in the loop: {rows[0]['fusion_pass_us']:.1f})")
    del t_first

    def mean(key):
        vals = [r.get(key) for r in rows]
        return sum(vals) / len(vals) if vals and None not in vals else None

    means = {k: mean(k) for k in MEAN_KEYS + ("sol_score", "sol_score_graph")}
    summary = dict(**result_header("B"), mm_TFLOPs=mm_tflops, copy_TBps=copy_tbps,
                   cases_selected=args.cases, means=means, first_case_again_us=first_case_again_us,
                   stock_compile_source=(f"{os.path.basename(args.stock_from)} (an earlier run, same GPU and "
                                         "versions)" if args.stock_from else "this run"),
                   fusion_pass_over_floor=means["fusion_pass_us"] / means["floor_us"],
                   config=dict(ELEMENTWISE_PROGRAMS_PER_SM=kb.ELEMENTWISE_PROGRAMS_PER_SM), cases=rows)
    stem = pathlib.Path(result_stem(out_dir, "backward"))
    stem.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    write_markdown(stem.with_suffix(".md"), summary)
    wrote = [".json", ".md"] + ([".png"] if write_plot(stem.with_suffix(".png"), rows) else [])
    log("suite means: " + ", ".join(f"{k}={v:.3g}" for k, v in means.items() if v is not None))
    log(f"wrote {stem}{{{','.join(wrote)}}} (stock compile time spent: {compile_spent:.0f} s)")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--cases", choices=("all", "quick"), default="all")
    p.add_argument("--no-compile", action="store_true", help="skip the stock torch.compile column")
    p.add_argument("--compile-budget-s", type=float, default=180.0,
                   help="stop compiling new cases once this much compile time was spent")
    p.add_argument("--anchors", default=None, help="folder with h200-eager-and-stock-compile.json")
    p.add_argument("--stock-from", default=None,
                   help="take the stock torch.compile column from this earlier result JSON (same GPU, torch and "
                        "triton: stock Inductor does not depend on this project) instead of compiling it")
    args = p.parse_args()
    if not torch.cuda.is_available():
        log("bench_backward.py times on a CUDA GPU; none here, nothing to do (tests/test_benchmark_workloads.py "
            "checks its workload on CPU).")
        return 0
    return run_gpu(args)


if __name__ == "__main__":
    sys.exit(main())
