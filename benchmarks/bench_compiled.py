"""Suites F and B as a user's compiled code runs them: stock torch.compile vs torch.compile + fusion_pass,
in default mode and replayed as CUDA graphs, in one process.

    python benchmarks/bench_compiled.py --out DIR [--suites F,B] [--cases all|quick]

F: a Hugging Face Qwen3-style prologue module (``Qwen3RotaryEmbedding``'s matmul form from
``inv_freq`` and ``position_ids``, ``q_norm``/``k_norm`` per head on [B, S, H, D], transpose,
``apply_rotary_pos_emb``, ``StaticCache``-style ``index_copy_`` into [B, 8, 262144, 128] caches), the 13
cases of WORKLOADS.md F. B: a HunyuanImage-3-style block (fused QKV ``nn.Linear``, split, RoPE, per-head
RMSNorm) forward + backward as a training step runs it (``torch.autograd.grad`` of q, k, v with given
gradients, w.r.t. hidden and every parameter), the 16 cases of WORKLOADS.md B.

Per case and variant (eager, stock, fusion_pass):
  *_us        ``triton.testing.do_bench`` median (L2 flushed): default mode, the host's cost included
              whenever the host is slower than the device
  *_graph_us  ``do_bench_cudagraph`` median: the same calls replayed as a CUDA graph (device time)
  *_host_us   host time per call: 30 calls issued back to back, host clock, no synchronization inside;
              the least of 5 such samples
Every compiled variant's error against eager is recorded before it is timed (F: max |q, k - eager| and
max |written cache rows - eager's|, relative to max |q|; B: max relative error over every gradient), and
whether the pass variant fused (``fusion_pass.match_counts()``). Floors: F bytes that must move over the copy
bandwidth measured in this run; B the three projection GEMMs (forward and two backward) alone, cuBLAS,
timed in this run.

Writes DIR/<date>-<gpu>-compiled.{json,md}. Without CUDA: says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import fusion_pass
from bench_common import (
    attempt, bench, bench_graph, copy_bandwidth_tbps, host_us, interleaved_timing, log, result_header, result_stem)
from compiled_modules import (
    B_D, B_HIDDEN, B_HKV, B_HQ, DTYPE, F_D, F_HKV, F_HQ, F_L, F_THETA, FusedQKVBlock, Qwen3Prologue, RotaryEmbedding)

F_CASES = [(1, 0, 1), (1, 2048, 4), (128, 0, 1), (128, 0, 2), (128, 0, 8), (256, 128, 1), (256, 1024, 8),
           (293, 131, 1), (512, 256, 2), (541, 0, 1), (1024, 512, 1), (2048, 0, 1), (4096, 2048, 1)]
F_QUICK = [(1, 2048, 4), (128, 0, 8), (293, 131, 1), (4096, 2048, 1)]
B_CASES = [(128, 1), (128, 4), (128, 16), (128, 32), (128, 64), (131, 1), (256, 1), (256, 8), (256, 16),
           (256, 32), (293, 2), (512, 1), (541, 4), (1024, 2), (1571, 1), (2048, 2)]
B_QUICK = [(128, 1), (256, 8), (541, 4), (2048, 2)]


# ---------------------------------------------------------------------------------------------


def time_interleaved(r: dict, kept: dict, rounds: int = 40, calls: int = 20) -> None:
    """Default mode, the compiled variants taking turns (``interleaved_timing``): the median time
    of each, and the paired ratio pass / stock with its quartiles over the rounds."""
    def run():
        medians, r["interleaved_ratio"] = interleaved_timing(kept, "fusion_pass", "stock", rounds, calls)
        return medians

    attempt(r, "interleaved_us", run)


def compile_variant(module, variant):
    torch._dynamo.reset()
    fusion_pass.reset_report()
    if variant == "eager":
        return module
    options = fusion_pass.options() if variant == "fusion_pass" else None
    return torch.compile(module, dynamic=False, options=options)


def time_variant(r: dict, name: str, fn) -> None:
    attempt(r, f"{name}_us", lambda: bench(fn))
    attempt(r, f"{name}_graph_us", lambda: bench_graph(fn))
    attempt(r, f"{name}_host_us", lambda: host_us(fn, calls=30))


def f_case(seq: int, cached: int, batch: int, copy_tbps: float, code_dir: str | None = None) -> dict:
    per_token = 2 * F_HQ * F_D * 2 + 5 * F_HKV * F_D * 2 + 16
    r = dict(S=seq, C=cached, B=batch, bytes=batch * seq * per_token)
    r["floor_us"] = r["bytes"] / (copy_tbps * 1e12) * 1e6
    g = torch.Generator(device="cuda").manual_seed(seq * 1000 + batch)
    module = Qwen3Prologue().to("cuda", DTYPE)
    module.rotary_emb.inv_freq = RotaryEmbedding(F_D, F_THETA).inv_freq.cuda()  # fp32, as HF keeps it
    pos = torch.arange(cached, cached + seq, device="cuda")
    x = [torch.randn(batch, seq, h * F_D, device="cuda", generator=g).to(DTYPE) for h in (F_HQ, F_HKV, F_HKV)]
    caches = [torch.randn(batch, F_HKV, F_L, F_D, device="cuda", generator=g).to(DTYPE) for _ in range(2)]
    args = (*x, pos[None].expand(batch, -1).contiguous(), *caches, pos)
    kept = {}  # the compiled variants, timed again taking turns (default mode)
    with torch.no_grad():
        q_ref, k_ref = module(*args)
        rows_ref = [c[:, :, cached:cached + seq].clone() for c in caches]
        for variant in ("eager", "stock", "fusion_pass"):
            fn_c = compile_variant(module, variant)
            if variant == "fusion_pass" and code_dir:
                from torch._inductor.utils import run_and_get_code

                out, codes = run_and_get_code(fn_c, *args)
                with open(os.path.join(code_dir, f"F-S{seq}-B{batch}-pass-wrapper.py"), "w") as f:
                    f.write("\n\n".join(codes))
            else:
                out = fn_c(*args)
            torch.cuda.synchronize()
            if variant == "fusion_pass":
                r["fused"] = fusion_pass.match_counts().get("qk_norm_rope_cache", 0) == 1
            scale = max(q_ref.abs().max().item(), 1e-30)
            r[f"{variant}_max_err"] = max((out[0].float() - q_ref.float()).abs().max().item(),
                                          (out[1].float() - k_ref.float()).abs().max().item()) / scale
            r[f"{variant}_cache_rows_err"] = max(
                (c[:, :, cached:cached + seq].float() - want.float()).abs().max().item() for c, want in
                zip(caches, rows_ref)) / max(rows_ref[0].abs().max().item(), 1e-30)
            time_variant(r, variant, lambda fn_c=fn_c: fn_c(*args))
            if variant != "eager":
                kept[variant] = lambda fn_c=fn_c: fn_c(*args)
            del out
        time_interleaved(r, kept)
    torch._dynamo.reset()
    del x, caches, args, module, kept
    torch.cuda.empty_cache()
    return r


def b_case(seq: int, batch: int, mm_probe: bool = True) -> dict:
    r = dict(S=seq, B=batch, M=batch * seq)
    torch.manual_seed(seq * 100 + batch)
    module = FusedQKVBlock().to("cuda", DTYPE)
    hidden = torch.randn(batch, seq, B_HIDDEN, device="cuda", dtype=DTYPE, requires_grad=True)
    angles = torch.rand(1, seq, B_D // 2, device="cuda") * 6.28
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(DTYPE), emb.sin().to(DTYPE)
    grads = [torch.randn(batch, h, seq, B_D, device="cuda", dtype=DTYPE) for h in (B_HQ, B_HKV, B_HKV)]
    leaves = [hidden, *module.parameters()]
    W = module.qkv_proj.weight.detach()
    grad_qkv = torch.randn(batch * seq, W.shape[0], device="cuda", dtype=DTYPE)
    h2 = hidden.detach().view(batch * seq, -1)
    attempt(r, "gemms_us", lambda: bench(lambda: (h2 @ W.t(), grad_qkv @ W, grad_qkv.t() @ h2)))
    attempt(r, "gemms_graph_us", lambda: bench_graph(lambda: (h2 @ W.t(), grad_qkv @ W, grad_qkv.t() @ h2)))
    ref = None
    kept = {}  # the compiled variants, timed again taking turns (default mode)
    for variant in ("eager", "stock", "fusion_pass"):
        fn_c = compile_variant(module, variant)

        def step(fn_c=fn_c):
            return torch.autograd.grad(fn_c(hidden, cos, sin), leaves, grads)

        got = step()
        torch.cuda.synchronize()
        if variant == "fusion_pass":
            r["fused"] = fusion_pass.match_counts().get("qkv_rope_qk_norm", 0) == 1
        if ref is None:
            ref = got
        else:
            r[f"{variant}_max_rel_err"] = max(
                ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
                for a, b in zip(got, ref))
        del got
        time_variant(r, variant, step)
        if variant != "eager":
            kept[variant] = step
    time_interleaved(r, kept)
    torch._dynamo.reset()
    del module, hidden, grads, ref, grad_qkv, kept
    torch.cuda.empty_cache()
    return r


def means(rows: list[dict], keys) -> dict:
    out = {}
    for k in keys:
        vals = [row.get(k) for row in rows]
        out[k] = sum(vals) / len(vals) if vals and all(v is not None for v in vals) else None
    inter = [row.get("interleaved_us") for row in rows]
    if inter and all(inter):
        out["interleaved_us"] = {v: sum(i[v] for i in inter) / len(inter) for v in inter[0]}
    ratios = [row.get("interleaved_ratio") for row in rows]
    if ratios and all(ratios):
        out["interleaved_ratio"] = dict(median=sum(x["median"] for x in ratios) / len(ratios),
                                        worst=max(x["median"] for x in ratios))
    return out


def fmt(v, spec=".1f"):
    return "—" if v is None else format(v, spec)


def markdown(result: dict) -> str:
    lines = [f"# Compiled suites, {result['gpu']}, torch {result['torch']}, triton {result['triton']}, "
             f"{result['date']}", ""]
    for suite, key in (("F", "F"), ("B", "B")):
        rows = result.get(key)
        if not rows:
            continue
        floor = "floor_us" if suite == "F" else "gemms_us"
        lines += [f"## Suite {suite} ({len(rows)} cases; us; floor: "
                  f"{'bytes / copy bandwidth' if suite == 'F' else 'the three projection GEMMs alone'})", "",
                  "| case | floor | eager | stock | pass | pass / stock | stock, interleaved | pass, interleaved | "
                  "pass / stock, paired rounds: median [quartiles] | stock graph | pass graph | pass graph / stock graph | pass graph / floor "
                  "| host stock | host pass | fused |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows + [dict(result["means"][suite], case="mean")]:
            name = r.get("case") or (f"S{r['S']} C{r['C']} B{r['B']}" if suite == "F" else f"S{r['S']} B{r['B']}")
            ratio = (r["fusion_pass_us"] / r["stock_us"]) if r.get("fusion_pass_us") and r.get("stock_us") else None
            gratio = (r["fusion_pass_graph_us"] / r["stock_graph_us"]
                      if r.get("fusion_pass_graph_us") and r.get("stock_graph_us") else None)
            gfloor = (r["fusion_pass_graph_us"] / r[floor] if r.get("fusion_pass_graph_us") and r.get(floor) else None)
            inter = r.get("interleaved_us") or {}
            paired = r.get("interleaved_ratio") or {}
            iratio = (f"{paired['median']:.3f} [{paired['q1']:.3f}, {paired['q3']:.3f}]" if "q1" in paired else
                      f"{paired['median']:.3f} (worst {paired['worst']:.3f})" if paired else "—")
            lines.append(f"| {name} | {fmt(r.get(floor))} | {fmt(r.get('eager_us'))} | {fmt(r.get('stock_us'))} | "
                         f"{fmt(r.get('fusion_pass_us'))} | {fmt(ratio, '.3f')} | {fmt(inter.get('stock'))} | "
                         f"{fmt(inter.get('fusion_pass'))} | {iratio} | {fmt(r.get('stock_graph_us'))} | "
                         f"{fmt(r.get('fusion_pass_graph_us'))} | {fmt(gratio, '.3f')} | {fmt(gfloor, '.2f')} | "
                         f"{fmt(r.get('stock_host_us'))} | {fmt(r.get('fusion_pass_host_us'))} | "
                         f"{r.get('fused', '')} |")
        lines.append("")
    return "\n".join(lines)


def plot_f(result: dict, path: str) -> None:
    """Suite F per case: CUDA-graph replay over the bytes floor (stock, pass) and the default-mode
    paired ratio pass / stock, as DIR/<date>-<gpu>-compiled-F.png."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plot")
        return
    rows = result["F"]
    names = [f"S{r['S']}\nC{r['C']}\nB{r['B']}" for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(13, 7), sharex=True)
    for i, (key, label) in enumerate((("stock_graph_us", "stock torch.compile"), ("fusion_pass_graph_us", "+ fusion_pass"))):
        top.bar([j + (i - 0.5) * 0.4 for j in range(len(rows))],
                [r[key] / r["floor_us"] if r.get(key) else float("nan") for r in rows], 0.4, label=label)
    top.axhline(1.0, color="black", linewidth=0.8)
    top.axhline(1.1, color="gray", linewidth=0.8, linestyle="--", label="1.1x floor")
    top.set_yscale("log")
    top.set_ylabel("CUDA-graph replay / floor")
    top.legend()
    paired = [(r.get("interleaved_ratio") or {}) for r in rows]
    bottom.bar(range(len(rows)), [p.get("median", float("nan")) for p in paired], 0.5,
               yerr=[[p["median"] - p["q1"] if "q1" in p else 0 for p in paired],
                     [p["q3"] - p["median"] if "q3" in p else 0 for p in paired]], color="tab:orange")
    bottom.axhline(1.0, color="black", linewidth=0.8)
    bottom.set_ylabel("default mode: pass / stock\n(paired rounds, quartiles)")
    bottom.set_xticks(range(len(rows)))
    bottom.set_xticklabels(names, fontsize=8)
    top.set_title(f"Suite F, Hugging Face-style module, {result['gpu']}, torch {result['torch']}, {result['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"wrote {path}")


def part(cases: list, spec: str) -> list:
    """The K-th of N contiguous, near-equal slices of ``cases``; ``spec`` is "K/N", 1 <= K <= N."""
    k, n = (int(x) for x in spec.split("/"))
    if not 1 <= k <= n:
        raise ValueError(f"--part: expected K/N with 1 <= K <= N, got {spec!r}")
    return cases[(k - 1) * len(cases) // n: k * len(cases) // n]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--suites", default="F,B")
    p.add_argument("--cases", choices=["all", "quick"], default="all")
    p.add_argument("--part", default="1/1", help="K/N: only the K-th of N equal slices of each suite's cases "
                   "(to split a suite over device calls)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        log("bench_compiled.py measures on a CUDA GPU; none here, nothing to do.")
        return 0
    torch._inductor.config.force_disable_caches = True
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    os.makedirs(args.out, exist_ok=True)
    result = dict(**result_header("compiled"), means={})
    path = result_stem(args.out, "compiled")
    suites = {s.strip() for s in args.suites.split(",")}
    keys = [f"{v}{s}" for v in ("eager", "stock", "fusion_pass") for s in ("_us", "_graph_us", "_host_us")]

    def save():
        with open(path + ".json", "w") as f:
            json.dump(result, f, indent=1)
        with open(path + ".md", "w") as f:
            f.write(markdown(result))

    if "F" in suites:
        copy_tbps = copy_bandwidth_tbps()
        result["copy_TBps"] = copy_tbps
        result["F"] = []
        for case in part(F_QUICK if args.cases == "quick" else F_CASES, args.part):
            t0 = time.perf_counter()
            r = f_case(*case, copy_tbps, args.out if case == (128, 0, 1) else None)
            result["F"].append(r)
            result["means"]["F"] = means(result["F"], ["floor_us", *keys])
            save()
            log(f"F {case}: floor {r['floor_us']:.1f} stock {fmt(r.get('stock_us'))} pass {fmt(r.get('fusion_pass_us'))}"
                f" | graph stock {fmt(r.get('stock_graph_us'))} pass {fmt(r.get('fusion_pass_graph_us'))} | host "
                f"stock {fmt(r.get('stock_host_us'))} pass {fmt(r.get('fusion_pass_host_us'))} | fused {r.get('fused')}"
                f" err {r.get('fusion_pass_max_err', 0):.1e} rows {r.get('fusion_pass_cache_rows_err', 0):.1e} "
                f"({time.perf_counter() - t0:.0f} s)")
    if "B" in suites:
        result["B"] = []
        for case in part(B_QUICK if args.cases == "quick" else B_CASES, args.part):
            t0 = time.perf_counter()
            r = b_case(*case)
            result["B"].append(r)
            result["means"]["B"] = means(result["B"], ["gemms_us", "gemms_graph_us", *keys])
            save()
            log(f"B {case}: gemms {fmt(r.get('gemms_us'))} stock {fmt(r.get('stock_us'))} pass "
                f"{fmt(r.get('fusion_pass_us'))} | graph stock {fmt(r.get('stock_graph_us'))} pass "
                f"{fmt(r.get('fusion_pass_graph_us'))} | host stock {fmt(r.get('stock_host_us'))} pass "
                f"{fmt(r.get('fusion_pass_host_us'))} | fused {r.get('fused')} err {r.get('fusion_pass_max_rel_err')}"
                f" stock err {r.get('stock_max_rel_err')} ({time.perf_counter() - t0:.0f} s)")
    save()
    if result.get("F"):
        plot_f(result, path + "-F.png")
    log(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
