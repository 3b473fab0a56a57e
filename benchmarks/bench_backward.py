"""Suite B of WORKLOADS.md on the GPU: backward of QKV projection -> RoPE -> per-head RMSNorm.

    python benchmarks/bench_backward.py --out DIR [--cases all|quick] [--no-compile]

Measures, in this order: device copy bandwidth (large D2D copy, read + write bytes), bf16 matmul
rate (8192^3), then per case (S, B):

  floor_us          max(2 GEMMs' FLOPs / matmul rate, bytes that must move / copy bandwidth)
  gemms_us          the two cuBLAS GEMMs alone (grad_qkv @ W, grad_qkv.T @ hidden) on a random grad_qkv
  eager_us          plain-PyTorch backward from the workload's inputs (autograd-correct: un-rotates
                    query_pre_norm with the inverse rotation), elementwise math in fp32, grad_qkv cast
                    to bf16, bf16 GEMMs (what autograd of a bf16 model runs)
  stock_compile_us  torch.compile of that eager function (static shapes, one compile per case)
  fusion_pass_us    ours: torch.ops.fusion_pass.qkv_rope_qk_norm_backward, the eager op (argument checks,
                    the elementwise Triton pass, the torch GEMMs); compiled training graphs launch the same
                    kernels from Inductor's wrapper instead (benchmarks/bench_compiled.py times that)
  kernels_us        the same kernels through full_backward_triton (no op dispatch, fewer checks)
  host_us           host time per op call (200 calls without synchronizing): above the device time,
                    do_bench measures the host
  elementwise_us    the elementwise pass alone;  gemm_us: projection_gemms alone
  rel_err           max over outputs of max|ours - ref| / max|ref|, ref = float64 autograd

Timing: ``triton.testing.do_bench(fn, return_mode="median")`` (L2 flushed between runs); for ours,
kernels_us, host_us and the two GEMMs the least of ``REPEATS`` such medians taken in turn (all of
them in the JSON: ``repeats_us``), which keeps the lent machine's slow host spells out.
Our kernel is fed the pre-RoPE q/k (strided views of qkv = hidden @ W.T, computed once in setup),
where the workload gives query_pre_norm: the bytes read are identical.

Writes DIR/<date>-<gpu>-backward.{json,md,png}. Without CUDA: says so, runs a tiny correctness check
of the kernels under the Triton interpreter, exits 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import triton  # noqa: E402

from fusion_pass.kernels import projection_backward as pb  # noqa: E402
from fusion_pass.kernels import qkv_rope_qk_norm_backward_triton as kb  # noqa: E402
from bench_common import log, result_stem  # noqa: E402

HQ, HKV, D, HIDDEN = 32, 8, 128, 4096
QKV = (HQ + 2 * HKV) * D
EPS = 1e-6
CASES = [(128, 1), (128, 4), (128, 16), (128, 32), (128, 64), (131, 1), (256, 1), (256, 8), (256, 16),
         (256, 32), (293, 2), (512, 1), (541, 4), (1024, 2), (1571, 1), (2048, 2)]
QUICK = [(128, 1), (256, 1), (293, 2), (2048, 2)]
REPEATS = 3  # do_bench medians per case for ours and the two cuBLAS GEMMs; the least is reported
DEVICE = "cuda"


# ---------------------------------------------------------------------------------------------
# Forward (for the float64 reference) and the eager backward of WORKLOADS.md B
# ---------------------------------------------------------------------------------------------
def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_half_t(y):
    """Transpose of rotate_half: <rotate_half(x), y> = <x, rotate_half_t(y)>."""
    y1, y2 = y.chunk(2, dim=-1)
    return torch.cat((y2, -y1), dim=-1)


def forward(hidden, W, cos, sin, wq, wk, B, S):
    acc = torch.promote_types(hidden.dtype, torch.float32)
    qkv = (hidden @ W.t()).view(B, S, QKV)
    q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
    q = q.view(B, S, HQ, D).transpose(1, 2)
    k = k.view(B, S, HKV, D).transpose(1, 2)
    v = v.view(B, S, HKV, D).transpose(1, 2)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    outs = []
    for x, w in ((q, wq), (k, wk)):
        x = x * c + rotate_half(x) * s
        x32 = x.to(acc)
        outs.append(w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype))
    return outs[0], outs[1], v


def eager_backward(grad_query, grad_key, grad_value, hidden_states, cos, sin, qkv_weight,
                   q_norm_weight, k_norm_weight, query_pre_norm, key_pre_norm, q_rstd, k_rstd):
    """WORKLOADS.md B backward from its inputs, with autograd's gradients (inverse rotation)."""
    B, _, S, _ = grad_query.shape
    c, s = cos.float().unsqueeze(1), sin.float().unsqueeze(1)

    def norm_rope_bwd(g, x, r, w):
        g, x, r, w = g.float(), x.float(), r.float(), w.float()
        gw = (g * x * r).sum((0, 1, 2))
        gn = g * w
        dx = r * (gn - x * r * r * (gn * x).mean(-1, keepdim=True))
        q = x * c - rotate_half(x) * s  # un-rotate: the inverse of x = q*c + rotate_half(q)*s
        gcos = (dx * q).sum(1)
        gsin = (dx * rotate_half(q)).sum(1)
        dq = dx * c + rotate_half_t(dx * s)
        return dq, gw, gcos, gsin

    dq, gwq, gcq, gsq = norm_rope_bwd(grad_query, query_pre_norm, q_rstd, q_norm_weight)
    dk, gwk, gck, gsk = norm_rope_bwd(grad_key, key_pre_norm, k_rstd, k_norm_weight)
    dt = hidden_states.dtype
    grad_qkv = torch.cat([dq.transpose(1, 2).reshape(B, S, -1), dk.transpose(1, 2).reshape(B, S, -1),
                          grad_value.float().transpose(1, 2).reshape(B, S, -1)], dim=-1)
    grad_qkv = grad_qkv.reshape(B * S, -1).to(dt)
    h2 = hidden_states.reshape(B * S, -1)
    grad_hidden = (grad_qkv @ qkv_weight).view(B, S, -1)
    grad_w = grad_qkv.t() @ h2
    return (grad_hidden, (gcq + gck).to(dt), (gsq + gsk).to(dt), grad_w, gwq.to(dt), gwk.to(dt))


# ---------------------------------------------------------------------------------------------
# Inputs of one case (consistent: q/k, pre-norm values and rstd all derived from hidden @ W.T)
# ---------------------------------------------------------------------------------------------
def make_inputs(S, B, device, dtype=torch.bfloat16, hidden_size=HIDDEN):
    gen = torch.Generator(device=device).manual_seed(1000 * S + B)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, generator=gen) * scale).to(dtype)

    hidden = rnd(B, S, hidden_size)
    W = rnd(QKV, hidden_size, scale=hidden_size ** -0.5)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, device=device).float() / D))
    ang = torch.arange(S, device=device).float()[:, None] * inv
    emb = torch.cat((ang, ang), -1)[None].expand(B, S, D)
    cos, sin = emb.cos().to(dtype).contiguous(), emb.sin().to(dtype).contiguous()
    wq, wk = 1 + rnd(D, scale=0.2), 1 + rnd(D, scale=0.2)
    gq, gk, gv = rnd(B, HQ, S, D), rnd(B, HKV, S, D), rnd(B, HKV, S, D)

    qkv = (hidden.view(B * S, -1) @ W.t()).view(B, S, QKV)
    q = qkv[..., : HQ * D].view(B, S, HQ, D)
    k = qkv[..., HQ * D: (HQ + HKV) * D].view(B, S, HKV, D)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)

    def pre_norm(x):
        xt = x.transpose(1, 2)
        xr = xt * c + rotate_half(xt) * s
        return xr, torch.rsqrt(xr.float().pow(2).mean(-1) + EPS)

    xq, rq = pre_norm(q)
    xk, rk = pre_norm(k)
    return dict(hidden=hidden, W=W, cos=cos, sin=sin, wq=wq, wk=wk, gq=gq, gk=gk, gv=gv,
                q=q, k=k, rq=rq, rk=rk, xq=xq.contiguous(), xk=xk.contiguous())


def workload_args(t):
    """The workload's argument list (bf16 rstd [B, H, S, 1], as the suite passes it)."""
    return (t["gq"], t["gk"], t["gv"], t["hidden"], t["cos"], t["sin"], t["W"], t["wq"], t["wk"],
            t["xq"], t["xk"], t["rq"].to(t["hidden"].dtype).unsqueeze(-1),
            t["rk"].to(t["hidden"].dtype).unsqueeze(-1))


def ours(t):
    """The op the training pass puts into the backward graph, called as the compiled graph calls it."""
    gh, gw, _, gnorm, gcs = torch.ops.fusion_pass.qkv_rope_qk_norm_backward(
        t["gq"], t["gk"], t["gv"], t["q"], t["k"], t["rq"], t["rk"], t["cos"], t["sin"], t["wq"], t["wk"],
        t["hidden"], [t["W"]], False, True, True, True, True)
    return gh[0], gcs[0], gcs[1], gw[0], gnorm[0], gnorm[1]


def ours_kernels(t):
    """The same kernels through the Python entry point, without the op's dispatch and checks."""
    B, S = t["hidden"].shape[:2]
    out = kb.full_backward_triton(t["gq"], t["gk"], t["gv"], t["q"], t["k"], t["rq"], t["rk"], t["cos"],
                                  t["sin"], t["wq"], t["wk"], t["hidden"].view(B * S, -1), t["W"])
    return (out["grad_hidden"].view(B, S, -1), out["grad_cos"], out["grad_sin"], out["grad_weight"],
            out["grad_q_weight"], out["grad_k_weight"])


def reference64(t):
    B, S = t["hidden"].shape[:2]
    leaves = [t[n].double().requires_grad_(True) for n in ("hidden", "W", "cos", "sin", "wq", "wk")]
    outs = forward(leaves[0].view(B * S, -1), *leaves[1:], B, S)
    torch.autograd.backward(outs, [t[n].double() for n in ("gq", "gk", "gv")])
    h, W, c, s, wq, wk = (x.grad for x in leaves)
    return h, c, s, W, wq, wk


def rel_err(vals, refs):
    errs = [((v.double() - r).abs().max() / r.abs().max().clamp_min(1e-30)).item() for v, r in zip(vals, refs)]
    return max(errs), errs


def bytes_moved(S, B, hidden_size=HIDDEN, el=2):
    M = B * S
    grads_in = M * QKV * el  # grad_q, grad_k, grad_v
    saved = M * (HQ + HKV) * D * el + M * (HQ + HKV) * el + 2 * B * S * D * el  # q/k, rstd, cos/sin
    weights = QKV * hidden_size * el + 2 * D * el  # W, norm weights
    hidden = M * hidden_size * el
    outs = M * hidden_size * el + QKV * hidden_size * el + 2 * B * S * D * el + 2 * D * el
    return grads_in + saved + weights + hidden + outs


# ---------------------------------------------------------------------------------------------
def cpu_check() -> int:
    log("no CUDA device: the benchmark needs a GPU. Running a tiny correctness check under the Triton "
        "interpreter instead.")
    S, B, hidden_size = 5, 2, 64
    global HQ, HKV, D, QKV
    HQ, HKV, D = 4, 2, 64
    QKV = (HQ + 2 * HKV) * D
    t = make_inputs(S, B, "cpu", hidden_size=hidden_size)
    err, errs = rel_err(ours(t), reference64(t))
    log(f"  the backward op: max rel err vs float64 {err:.2e}")
    if err > 3e-2:
        log("  FAILED")
        return 1
    err, errs = rel_err(ours_kernels(t), reference64(t))
    log(f"  S={S} B={B} Hq={HQ} Hkv={HKV} D={D} hidden={hidden_size} bf16, kernels + torch GEMMs: max rel err "
        f"vs float64 {err:.2e} ({', '.join(f'{e:.1e}' for e in errs)})")
    if err > 3e-2:
        log("  FAILED")
        return 1
    e_err, _ = rel_err(eager_backward(*workload_args(t)), reference64(t))
    log(f"  eager reference implementation: max rel err {e_err:.2e}")
    log("ok")
    return 0


def measure_ceilings():
    from triton.testing import do_bench

    n = 1 << 29  # 1 GiB of bf16
    x = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), return_mode="median")
    copy_tbps = 2 * x.numel() * x.element_size() / (ms * 1e-3) / 1e12
    del x, y
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, return_mode="median")
    tflops = 2 * 8192 ** 3 / (ms * 1e-3) / 1e12
    del a, b
    torch.cuda.empty_cache()
    return copy_tbps, tflops


def load_anchors(path):
    for p in (path, "shared/anchors", "../shared/anchors", "/work/shared/anchors"):
        if p and pathlib.Path(p, "h200-eager-and-stock-compile.json").exists():
            data = json.loads(pathlib.Path(p, "h200-eager-and-stock-compile.json").read_text())
            return {(c["S"], c["B"]): c for c in data.get("bwd", [])}
    return {}


def run_gpu(args) -> int:
    from triton.testing import do_bench

    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from diagnose_device_time import host_us  # host time per call, calls not synchronized

    def bench(fn):
        return do_bench(fn, return_mode="median") * 1e3  # us

    def bench_graph(fn):
        # Device time without the host's launch cost: the calls replayed as one CUDA graph.
        try:
            return triton.testing.do_bench_cudagraph(fn, return_mode="median") * 1e3
        except Exception as e:  # noqa: BLE001 - recorded as missing, the run goes on
            log(f"    graph replay failed: {type(e).__name__}: {str(e)[:200]}")
            return None

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    anchors = load_anchors(args.anchors)
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    date = datetime.date.today().isoformat()
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
    compiled = (torch.compile(eager_backward, dynamic=False)
                if not args.no_compile and stock_from is None else None)
    compile_spent = 0.0

    cases = QUICK if args.cases == "quick" else CASES
    # The host's first seconds of op calls ran slow in earlier runs (run 6: the first three cases'
    # elementwise do_bench 251-258 us, later cases of the same size ~100): warm it up, and
    # re-measure the first case at the end (``first_case_again_us``) to see any order effect.
    t_warm = make_inputs(*cases[0], DEVICE)
    t_end = time.perf_counter() + 2.0
    while time.perf_counter() < t_end:
        ours(t_warm)
    torch.cuda.synchronize()
    del t_warm

    rows = []
    for S, B in cases:
        M = B * S
        t = make_inputs(S, B, DEVICE)
        flops = 2 * (2 * M * QKV * HIDDEN)
        nbytes = bytes_moved(S, B)
        floor_us = max(flops / (mm_tflops * 1e12), nbytes / (copy_tbps * 1e12)) * 1e6

        ref = reference64(t)
        err, errs = rel_err(ours(t), ref)
        wargs = workload_args(t)
        eager_err, _ = rel_err(eager_backward(*wargs), ref)
        stock_err = None
        if compiled is not None and compile_spent < args.compile_budget_s:
            t0 = time.perf_counter()
            stock_err, _ = rel_err(compiled(*wargs), ref)  # compiles this shape
            torch.cuda.synchronize()
            compile_spent += time.perf_counter() - t0
        del ref
        torch.cuda.empty_cache()

        g_rand = torch.randn(M, QKV, device=DEVICE, dtype=torch.bfloat16)
        h2 = t["hidden"].view(M, -1)
        variants = {}
        gemm_us = bench(lambda: pb.projection_gemms([g_rand], h2, [t["W"]]))
        grad_qkv = torch.empty(M, QKV, device=DEVICE, dtype=torch.bfloat16)
        nq, nk = HQ * D, HKV * D

        def elementwise():
            return kb.qk_norm_rope_backward_triton(
                t["gq"], t["gk"], t["gv"], t["q"], t["k"], t["rq"], t["rk"], t["cos"], t["sin"], t["wq"],
                t["wk"], grad_qkv[:, :nq], grad_qkv[:, nq: nq + nk], grad_qkv[:, nq + nk:], True, True)

        elementwise_us = bench(elementwise)
        # ours and the GEMMs it is compared with: the least of REPEATS medians taken in turn. The
        # host of the lent H200 has slow spells that last seconds (run 7: single medians 2-3x the
        # same case measured later, in host_us too); the minimum keeps them out of both columns.
        repeats = {"gemms": [], "ours": [], "kernels": [], "host": []}
        for _ in range(REPEATS):
            repeats["gemms"].append(bench(lambda: (torch.mm(g_rand, t["W"]), torch.mm(g_rand.t(), h2))))
            repeats["ours"].append(bench(lambda: ours(t)))
            repeats["kernels"].append(bench(lambda: ours_kernels(t)))
            repeats["host"].append(host_us(lambda: ours(t)))
        gemms_us, fusion_us, kernels_us, op_host_us = (min(repeats[k]) for k in ("gemms", "ours", "kernels", "host"))
        elementwise_graph_us = bench_graph(elementwise)
        fusion_graph_us = bench_graph(lambda: ours(t))
        gemms_graph_us = bench_graph(lambda: (torch.mm(g_rand, t["W"]), torch.mm(g_rand.t(), h2)))
        eager_us = bench(lambda: eager_backward(*wargs))
        stock_us = bench(lambda: compiled(*wargs)) if stock_err is not None else None
        if stock_from is not None:
            stock_us = stock_from.get((S, B), {}).get("stock_compile_us")
            stock_err = stock_from.get((S, B), {}).get("stock_compile_rel_err")
        an = anchors.get((S, B), {})
        row = dict(S=S, B=B, M=M, flops=flops, bytes=nbytes, floor_us=floor_us, gemms_us=gemms_us,
                   eager_us=eager_us, stock_compile_us=stock_us, fusion_pass_us=fusion_us,
                   elementwise_us=elementwise_us, gemm_us=gemm_us, gemm_variants_us=variants or None,
                   kernels_us=kernels_us, host_us=op_host_us, repeats_us=repeats,
                   fusion_pass_graph_us=fusion_graph_us, elementwise_graph_us=elementwise_graph_us,
                   gemms_graph_us=gemms_graph_us,
                   rel_err=err, rel_err_per_output=dict(zip(
                       ("grad_hidden", "grad_cos", "grad_sin", "grad_W", "grad_q_norm_w", "grad_k_norm_w"), errs)),
                   eager_rel_err=eager_err, stock_compile_rel_err=stock_err,
                   anchor_gemms_us=an.get("cublas_two_gemms_us"), anchor_stock_compile_us=an.get("compiled_us"))
        rows.append(row)
        # A run cut short keeps the cases it measured.
        pathlib.Path(result_stem(out_dir, "backward") + ".partial.json").write_text(json.dumps(
            dict(copy_TBps=copy_tbps, mm_TFLOPs=mm_tflops, cases=rows), indent=1))
        log(f"S={S:5d} B={B:3d} M={M:5d}  floor {floor_us:7.1f}  gemms {gemms_us:7.1f}  eager {eager_us:7.1f}  "
            f"stock {stock_us if stock_us is None else round(stock_us, 1)}  ours {fusion_us:7.1f} "
            f"({fusion_us / floor_us:.2f}x floor; elementwise {elementwise_us:.1f} + gemm {gemm_us:.1f})  "
            f"rel_err {err:.1e}" + (f"  gemm variants {({k: round(v, 1) for k, v in variants.items()})}"
                                    if variants else ""))
        del t, g_rand, grad_qkv
        torch.cuda.empty_cache()

    def mean(key):
        vals = [r[key] for r in rows if r[key] is not None]
        return sum(vals) / len(vals) if len(vals) == len(rows) else None

    t_first = make_inputs(*cases[0], DEVICE)
    first_case_again_us = bench(lambda: ours(t_first))
    log(f"first case again: ours {first_case_again_us:.1f} us (in the loop: {rows[0]['fusion_pass_us']:.1f})")
    del t_first

    means = {k: mean(k) for k in ("floor_us", "gemms_us", "eager_us", "stock_compile_us", "fusion_pass_us",
                                  "kernels_us", "host_us",
                                  "elementwise_us", "gemm_us", "fusion_pass_graph_us", "elementwise_graph_us",
                                  "gemms_graph_us")}
    summary = dict(suite="B", gpu=gpu, torch=torch.__version__, triton=triton.__version__, date=date,
                   mm_TFLOPs=mm_tflops, copy_TBps=copy_tbps, cases_selected=args.cases, means=means,
                   first_case_again_us=first_case_again_us,
                   fusion_pass_us_measures="torch.ops.fusion_pass.qkv_rope_qk_norm_backward (until run 6: "
                                           "full_backward_triton, now kernels_us)",
                   stock_compile_source=(f"{os.path.basename(args.stock_from)} (an earlier run, same GPU and "
                                         "versions)" if args.stock_from else "this run"),
                   fusion_pass_over_floor=(means["fusion_pass_us"] / means["floor_us"]),
                   small_m_faster_than_gemms={f"{r['S']}x{r['B']}": r["fusion_pass_us"] < r["gemms_us"]
                                              for r in rows if r["M"] <= 586},
                   config=dict(ELEMENTWISE_PROGRAMS_PER_SM=kb.ELEMENTWISE_PROGRAMS_PER_SM),
                   cases=rows)
    stem = pathlib.Path(result_stem(out_dir, "backward"))
    stem.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    write_markdown(stem.with_suffix(".md"), summary)
    wrote = [".json", ".md"] + ([".png"] if write_plot(stem.with_suffix(".png"), rows) else [])
    log(f"suite means: floor {means['floor_us']:.1f}  gemms {means['gemms_us']:.1f}  ours "
        f"{means['fusion_pass_us']:.1f} ({summary['fusion_pass_over_floor']:.3f}x floor)  eager "
        f"{means['eager_us']:.1f}  stock {means['stock_compile_us']}")
    log(f"wrote {stem}{{{','.join(wrote)}}} (compile time spent: {compile_spent:.0f} s)")
    return 0


def write_markdown(path, summary):
    f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    lines = [f"# Suite B backward, {summary['gpu']} ({summary['date']})", "",
             f"torch {summary['torch']}, triton {summary['triton']}; ceilings: copy {summary['copy_TBps']:.2f} TB/s, "
             f"bf16 matmul {summary['mm_TFLOPs']:.0f} TFLOP/s; stock compile column from "
             f"{summary.get('stock_compile_source', 'this run')}. Times in µs: do_bench median (host launch cost "
             "included where the GPU waits for it), and `graph` = the same calls replayed as a CUDA graph "
             "(device time).", "",
             "`ours` is the backward op as the compiled training graph calls it; `kernels` the same kernels "
             "through the Python entry point; `host` the op's host time per call (do_bench measures the host "
             "where it exceeds the device time). "
             + ("`ours`, `kernels`, `host` and `2 cuBLAS GEMMs`: the least of "
                f"{len(next(iter(summary['cases'][0]['repeats_us'].values())))} do_bench medians taken in turn "
                "(each column's own minimum); every other do_bench column one median."
                if summary["cases"] and summary["cases"][0].get("repeats_us") else
                "Every do_bench column: one median."), "",
             "| S | B | M | floor | 2 cuBLAS GEMMs | eager | stock compile | ours | ours/floor | kernels | host | "
             "elementwise | our GEMMs | 2 GEMMs graph | ours graph | ours graph/floor | elementwise graph | rel err |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary["cases"]:
        lines.append(f"| {r['S']} | {r['B']} | {r['M']} | {f(r['floor_us'])} | {f(r['gemms_us'])} | "
                     f"{f(r['eager_us'])} | {f(r['stock_compile_us'])} | {f(r['fusion_pass_us'])} | "
                     f"{r['fusion_pass_us'] / r['floor_us']:.2f} | {f(r.get('kernels_us'))} | {f(r.get('host_us'))} | "
                     f"{f(r['elementwise_us'])} | "
                     f"{f(r['gemm_us'])} ({r['gemm_route']}) | {f(r.get('gemms_graph_us'))} | "
                     f"{f(r.get('fusion_pass_graph_us'))} | "
                     f"{(r['fusion_pass_graph_us'] / r['floor_us']) if r.get('fusion_pass_graph_us') else float('nan'):.2f} | "
                     f"{f(r.get('elementwise_graph_us'))} | {r['rel_err']:.1e} |")
    m = summary["means"]
    lines.append(f"| **mean** | | | {f(m['floor_us'])} | {f(m['gemms_us'])} | {f(m['eager_us'])} | "
                 f"{f(m['stock_compile_us'])} | {f(m['fusion_pass_us'])} | "
                 f"{summary['fusion_pass_over_floor']:.3f} | {f(m.get('kernels_us'))} | {f(m.get('host_us'))} | "
                 f"{f(m['elementwise_us'])} | {f(m['gemm_us'])} | "
                 f"{f(m.get('gemms_graph_us'))} | {f(m.get('fusion_pass_graph_us'))} | "
                 f"{(m['fusion_pass_graph_us'] / m['floor_us']) if m.get('fusion_pass_graph_us') else float('nan'):.3f} | "
                 f"{f(m.get('elementwise_graph_us'))} | |")
    var = [r for r in summary["cases"] if r["gemm_variants_us"]]
    if var:
        lines += ["", "GEMM routes for M <= 586, graph replay (µs): torch = two cuBLAS calls, streams = the "
                  "same on two streams, triton = the Triton kernels of kernels/projection_backward.py.", "",
                  "| S | B | torch | streams | triton |", "|---|---|---|---|---|"]
        for r in var:
            v = r["gemm_variants_us"]
            lines.append(f"| {r['S']} | {r['B']} | {f(v['torch'])} | {f(v['streams'])} | {f(v['triton'])} |")
    path.write_text("\n".join(lines) + "\n")


def write_plot(path, rows):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not installed: no PNG written")
        return False
    labels = [f"{r['S']}x{r['B']}" for r in rows]
    series = [("2 cuBLAS GEMMs", "gemms_us"), ("stock compile", "stock_compile_us"), ("ours", "fusion_pass_us")]
    fig, ax = plt.subplots(figsize=(12, 4.5))
    width = 0.8 / len(series)
    for i, (name, key) in enumerate(series):
        ys = [(r[key] / r["floor_us"]) if r[key] is not None else 0 for r in rows]
        ax.bar([x + i * width for x in range(len(rows))], ys, width, label=name)
    ax.axhline(1.0, color="k", lw=0.8, ls="--", label="floor")
    ax.set_xticks([x + width for x in range(len(rows))], labels, rotation=45, ha="right")
    ax.set_ylabel("time / floor")
    ax.set_xlabel("S x B")
    ax.set_title("Suite B backward (lower is better)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


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
        return cpu_check()
    return run_gpu(args)


if __name__ == "__main__":
    sys.exit(main())
