"""Where the time of our kernels goes on a GPU: host launch cost vs device time, and layout effects.

    python benchmarks/diagnostics/diagnose_device_time.py --out DIR

Three measurements per callable, all on the same inputs:

* ``bench_us``: ``triton.testing.do_bench`` median (what the suites report without CUDA graphs);
* ``graph_us``: CUDA-graph replay median (device time plus in-graph launch gaps only);
* ``host_us``: wall time per call of 200 back-to-back calls without synchronization (the host
  cost per call whenever it exceeds the device time; then the GPU idles between kernels).

Callables: the forward op and its bare Triton launcher on F cases; the backward elementwise pass
and the whole backward on B cases. Then forward layout experiments that explain the batch-8
cases (cache length, cos/sin per batch row or shared, same bytes as one long sequence) and a
small tile sweep; every variant of the forward op (norm forms, RoPE first, partial rotary,
interleaved, paged) at one shape. Writes DIR/diagnose-device-time.json and prints one line per measurement.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the suites beside diagnostics/

import fusion_pass  # noqa: E402,F401  (registers torch.ops.fusion_pass)
from fusion_pass.kernels import qk_norm_rope_cache_triton as fwd  # noqa: E402
from fusion_pass.kernels import qkv_rope_qk_norm_backward_triton as bwd  # noqa: E402

REP_MS = 50


def log(*args) -> None:
    print(*args, flush=True)


def bench_us(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=REP_MS, return_mode="median")) * 1e3


def graph_us(fn) -> float:
    params = inspect.signature(triton.testing.do_bench_cudagraph).parameters
    if "return_mode" in params:
        return float(triton.testing.do_bench_cudagraph(fn, rep=REP_MS, return_mode="median")) * 1e3
    return float(triton.testing.do_bench_cudagraph(fn, rep=REP_MS)) * 1e3


def host_us(fn, calls: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def measure(name: str, fn, results: list, **extra) -> dict:
    row = dict(name=name, **extra)
    for key, timer in (("bench_us", bench_us), ("graph_us", graph_us), ("host_us", host_us)):
        try:
            row[key] = timer(fn)
        except Exception as e:  # noqa: BLE001 - a diagnostic records failures and goes on
            row[key] = None
            row.setdefault("errors", {})[key] = f"{type(e).__name__}: {e}"[:300]
    results.append(row)
    log(f"{name:58s} " + "  ".join(f"{k} {row[k]:8.1f}" if row.get(k) is not None else f"{k} failed"
                                   for k in ("bench_us", "graph_us", "host_us")))
    return row


# ------------------------------------------------------------------------------------------
# Forward
# ------------------------------------------------------------------------------------------
HQ, HKV, D = 96, 8, 128


def forward_inputs(S, C, B, cache_len=262144, shared_cos=False, heads=(HQ, HKV), hf_views=False):
    """Forward inputs; ``hf_views``: q/k/v as the transposed views of [B, S, H, D] projections
    that Hugging Face attention hands the norm."""
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = torch.bfloat16
    pos = torch.arange(C, C + S, device="cuda")

    def heads_first(h):
        if hf_views:
            return torch.randn(B, S, h, D, device="cuda", generator=g).to(bf).transpose(1, 2)
        return torch.randn(B, h, S, D, device="cuda", generator=g).to(bf)

    hq, hkv = heads
    x = dict(
        q=heads_first(hq),
        k=heads_first(hkv),
        v=heads_first(hkv),
        qw=torch.rand(D, device="cuda", generator=g).to(bf) + 0.5,
        kw=torch.rand(D, device="cuda", generator=g).to(bf) + 0.5,
        kc=torch.zeros(B, hkv, cache_len, D, device="cuda", dtype=bf),
        vc=torch.zeros(B, hkv, cache_len, D, device="cuda", dtype=bf),
        pos=pos,
    )
    inv_freq = 1.0 / (1e7 ** (torch.arange(0, D, 2, dtype=torch.float32, device="cuda") / D))
    cos, sin = fwd.rope_cos_sin_reference(pos[None].expand(1 if shared_cos else B, S), inv_freq, 1.0, bf)
    x["cos"], x["sin"] = cos, sin
    x["q_out"], x["k_out"] = torch.empty_like(x["q"]), torch.empty_like(x["k"])
    return x


def forward_callables(x, **launch):
    """(the op, the launcher with ``launch`` as its tile overrides) on inputs ``x``."""
    def op():
        return torch.ops.fusion_pass.qk_norm_rope_cache(
            x["q"], x["k"], x["v"], x["qw"], x["kw"], x["cos"], x["sin"], x["kc"], x["vc"], x["pos"], 1e-6, 1e-6)

    def launcher():
        fwd.qk_norm_rope_cache_triton(
            x["q"], x["k"], x["v"], x["qw"], x["kw"], x["cos"], x["sin"], x["kc"], x["vc"], x["pos"], 1e-6, 1e-6,
            x["q_out"], x["k_out"], tile=launch)

    return op, launcher


def forward_section(results):
    for S, C, B in ((1, 2048, 4), (128, 0, 8), (2048, 0, 1), (4096, 2048, 1)):
        x = forward_inputs(S, C, B)
        op, launcher = forward_callables(x)
        measure(f"fwd op S={S} C={C} B={B}", op, results, kind="forward", S=S, C=C, B=B)
        measure(f"fwd launcher S={S} C={C} B={B}", launcher, results, kind="forward_launcher", S=S, C=C, B=B)
        del x
        torch.cuda.empty_cache()
    # The batch-8 cases run at 1.3-1.5x the floor where B = 1 cases of equal bytes run at 1.2x.
    for label, S, C, B, kw in (
        ("B=8 (256,1024,8)", 256, 1024, 8, {}),
        ("B=8 cache_len 4096", 256, 1024, 8, dict(cache_len=4096)),
        ("B=8 shared cos/sin", 256, 1024, 8, dict(shared_cos=True)),
        ("same bytes B=1 (2048,1024,1)", 2048, 1024, 1, {}),
        ("B=1 cache_len 4096 (2048,1024,1)", 2048, 1024, 1, dict(cache_len=4096)),
    ):
        x = forward_inputs(S, C, B, **kw)
        _, launcher = forward_callables(x)
        measure(f"layout {label}", launcher, results, kind="layout", S=S, C=C, B=B, variant=label)
        del x
        torch.cuda.empty_cache()
    for S, C, B in ((4096, 2048, 1), (256, 1024, 8)):
        x = forward_inputs(S, C, B)
        for tokens, heads, warps in ((4, 8, 4), (2, 8, 4), (8, 8, 4), (4, 8, 8), (8, 8, 8), (2, 8, 2)):
            _, launcher = forward_callables(x, tokens_per_program=tokens, heads_per_program=heads, num_warps=warps)
            measure(f"tiles t{tokens} h{heads} w{warps} ({S},{C},{B})", launcher, results, kind="tiles",
                    S=S, C=C, B=B, tokens=tokens, heads=heads, warps=warps)
        del x
        torch.cuda.empty_cache()


# Every variant of the forward op at Qwen3-8B's attention geometry (32 q / 8 kv heads, D 128, S 2048,
# q/k/v as Hugging Face's transposed views), against the default build (graph replay is the figure
# to read: device time). Paged: the same tokens through a slot mapping.
FORWARD_VARIANTS = {
    "qwen3": {}, "fp32_weight": dict(norm="fp32_weight"), "fp32_one_plus_weight": dict(norm="fp32_one_plus_weight"),
    "no_weight": dict(norm="no_weight"), "rope_first": dict(rope_first=True), "rotary_dim 64": dict(rotary_dim=64),
    "rotary_dim 32": dict(rotary_dim=32), "rotary_dim 64 fp32_one_plus_weight": dict(
        rotary_dim=64, norm="fp32_one_plus_weight"),
    "interleaved": dict(interleaved=True), "interleaved rope_first": dict(interleaved=True, rope_first=True),
    "interleaved fp32_one_plus_weight": dict(interleaved=True, norm="fp32_one_plus_weight"),
    "interleaved no_weight": dict(interleaved=True, norm="no_weight"),
    "rope_first fp32_weight": dict(rope_first=True, norm="fp32_weight"),
    "interleaved rotary_dim 64": dict(interleaved=True, rotary_dim=64),
    "rope_first rotary_dim 64": dict(rope_first=True, rotary_dim=64),
    "interleaved rope_first rotary_dim 64": dict(interleaved=True, rope_first=True, rotary_dim=64),
}


def variants_section(results, only=None):
    """``only``: the labels of ``FORWARD_VARIANTS`` to time (the default build always), or None: all."""
    S, C, B = 2048, 0, 1
    x = forward_inputs(S, C, B, cache_len=4096, heads=(32, 8), hf_views=True)
    for label, variant in FORWARD_VARIANTS.items():
        if only is not None and label != "qwen3" and label not in only:
            continue
        width = variant.get("rotary_dim", D)
        qw, kw = (None, None) if variant.get("norm") == "no_weight" else (x["qw"], x["kw"])

        def op(variant=variant, width=width, qw=qw, kw=kw):
            return torch.ops.fusion_pass.qk_norm_rope_cache(
                x["q"], x["k"], x["v"], qw, kw, x["cos"][..., :width], x["sin"][..., :width], x["kc"], x["vc"],
                x["pos"], 1e-6, 1e-6, **variant)

        measure(f"variant {label} ({S},{C},{B})", op, results, kind="forward_variant", S=S, C=C, B=B, variant=label)
    key_cache = x["kc"][0].transpose(0, 1).contiguous().view(-1, 16, HKV, D)
    value_cache = x["vc"][0].transpose(0, 1).contiguous().view(-1, 16, HKV, D)
    flat = {n: x[n].transpose(0, 1).reshape(1, x[n].shape[1], B * S, D) for n in ("q", "k", "v")}

    def paged():
        return torch.ops.fusion_pass.qk_norm_rope_paged_cache(
            flat["q"], flat["k"], flat["v"], x["qw"], x["kw"], x["cos"], x["sin"], key_cache, value_cache, x["pos"],
            1e-6, 1e-6)

    if only is None or "paged" in only:
        measure(f"variant paged ({S},{C},{B})", paged, results, kind="forward_variant", S=S, C=C, B=B,
                variant="paged")
    rows = [r for r in results if r.get("kind") == "forward_variant"]
    default = next(r for r in rows if r["variant"] == "qwen3")
    for r in rows:
        if r.get("graph_us") and default.get("graph_us"):
            r["graph_over_default"] = r["graph_us"] / default["graph_us"]
            log(f"  {r['name']}: graph {r['graph_us']:.2f} us, {r['graph_over_default']:.3f}x the default")
    del x
    torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------
# Backward
# ------------------------------------------------------------------------------------------
BHQ, BHKV, HIDDEN = 32, 8, 4096


def backward_inputs(S, B):
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = torch.bfloat16
    M, N = B * S, (BHQ + 2 * BHKV) * D

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=g).to(bf)

    qkv = rnd(B, S, N)
    t = dict(
        gq=rnd(B, BHQ, S, D), gk=rnd(B, BHKV, S, D), gv=rnd(B, BHKV, S, D),
        q=qkv[..., : BHQ * D].view(B, S, BHQ, D), k=qkv[..., BHQ * D: (BHQ + BHKV) * D].view(B, S, BHKV, D),
        rq=torch.rand(B, BHQ, S, device="cuda", generator=g) + 0.5,
        rk=torch.rand(B, BHKV, S, device="cuda", generator=g) + 0.5,
        cos=rnd(B, S, D), sin=rnd(B, S, D), wq=rnd(D), wk=rnd(D),
        hidden=rnd(M, HIDDEN), W=rnd(N, HIDDEN) * 0.02,
    )
    t["grad_qkv"] = torch.empty(M, N, device="cuda", dtype=bf)
    return t


# Elementwise-pass variants timed against the default (ELEMENTWISE_TILING "auto": v3 below
# ROWS_MIN_M tokens, v5 with ROWS_STAGES = 4 from there). Each changes only what it names.
ELEMENTWISE_VARIANTS = {
    "v3 head tiles": dict(ELEMENTWISE_TILING="head_tiles"),
    "v5 token rows": dict(ELEMENTWISE_TILING="token_rows"),
    "v5 stages 1": dict(ELEMENTWISE_TILING="token_rows", ROWS_STAGES=1),
    "v5 stages 2": dict(ELEMENTWISE_TILING="token_rows", ROWS_STAGES=2),
    "v5 stages 3": dict(ELEMENTWISE_TILING="token_rows", ROWS_STAGES=3),
    "v5 8 tokens": dict(ELEMENTWISE_TILING="token_rows", ROWS_TOKENS=8),
    "v5 8 tokens 2/SM": dict(ELEMENTWISE_TILING="token_rows", ROWS_TOKENS=8, ROWS_PROGRAMS_PER_SM=2),
    "v5 2/SM": dict(ELEMENTWISE_TILING="token_rows", ROWS_PROGRAMS_PER_SM=2),
    "v5 32 tokens 8 warps": dict(ELEMENTWISE_TILING="token_rows", ROWS_TOKENS=32, ROWS_NUM_WARPS=8),
    # session 5: whole token rows (no head slices, cos/sin written in-kernel) at small M
    "v5 1 token 0.5/SM": dict(ELEMENTWISE_TILING="token_rows", ROWS_TOKENS=1, ROWS_PROGRAMS_PER_SM=0.5),
    "v5 2 tokens 0.25/SM": dict(ELEMENTWISE_TILING="token_rows", ROWS_TOKENS=2, ROWS_PROGRAMS_PER_SM=0.25),
    "v5 4 tokens 0.2/SM": dict(ELEMENTWISE_TILING="token_rows", ROWS_TOKENS=4, ROWS_PROGRAMS_PER_SM=0.2),
    "v5 1 token 0.5/SM 2 stages": dict(ELEMENTWISE_TILING="token_rows", ROWS_TOKENS=1, ROWS_PROGRAMS_PER_SM=0.5,
                                       ROWS_STAGES=2),
    "v5 1 token 8 warps": dict(ELEMENTWISE_TILING="token_rows", ROWS_TOKENS=1, ROWS_PROGRAMS_PER_SM=0.5,
                               ROWS_NUM_WARPS=8),
}


def backward_section(results):
    nq, nk = BHQ * D, BHKV * D
    for S, B in ((128, 1), (512, 1), (128, 16), (256, 16), (128, 64)):
        t = backward_inputs(S, B)
        M = S * B
        gq = t["grad_qkv"]

        def elementwise(need_w=True, need_cs=True):
            return bwd.qk_norm_rope_backward_triton(
                t["gq"], t["gk"], t["gv"], t["q"], t["k"], t["rq"], t["rk"], t["cos"], t["sin"], t["wq"], t["wk"],
                gq[:, :nq], gq[:, nq: nq + nk], gq[:, nq + nk:], need_w, need_cs)

        def whole():
            return bwd.full_backward_triton(t["gq"], t["gk"], t["gv"], t["q"], t["k"], t["rq"], t["rk"], t["cos"],
                                            t["sin"], t["wq"], t["wk"], t["hidden"], t["W"])

        def gemms():
            return torch.mm(gq, t["W"]), torch.mm(gq.t(), t["hidden"])

        measure(f"bwd elementwise S={S} B={B}", elementwise, results, kind="bwd_elementwise", S=S, B=B, M=M)
        default_sums = [x.clone() for x in elementwise()]
        default_qkv = gq.clone()
        # Kernel and launch variants (module tunables, read at every launch); graph replay only.
        for label, tunables in ELEMENTWISE_VARIANTS.items():
            saved = {name: getattr(bwd, name) for name in tunables}
            try:
                for name, value in tunables.items():
                    setattr(bwd, name, value)
                row = dict(name=f"bwd elementwise {label} S={S} B={B}", kind="bwd_elementwise_variant", S=S, B=B,
                           M=M, variant=label, tunables=tunables)
                try:
                    gq.fill_(float("nan"))
                    sums = elementwise()
                    # Same grad_qkv bits as the default; the sums within a few final roundings.
                    row["matches_default"] = bool(torch.equal(gq, default_qkv)) and all(
                        torch.allclose(a.float(), b.float(), rtol=2e-2, atol=1e-2) for a, b in zip(sums, default_sums))
                    row["graph_us"] = graph_us(elementwise)
                    log(f"{row['name']:58s} graph_us {row['graph_us']:8.1f}  matches default {row['matches_default']}")
                except Exception as e:  # noqa: BLE001 - a diagnostic records failures and goes on
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                    log(f"{row['name']:58s} failed: {row['error']}")
                results.append(row)
            finally:
                for name, value in saved.items():
                    setattr(bwd, name, value)
        measure(f"bwd elementwise weights only S={S} B={B}", lambda: elementwise(True, False), results,
                kind="bwd_elementwise_weights", S=S, B=B, M=M)
        measure(f"bwd elementwise no w/cos grads S={S} B={B}", lambda: elementwise(False, False), results,
                kind="bwd_elementwise_plain", S=S, B=B, M=M)
        measure(f"bwd two cuBLAS GEMMs S={S} B={B}", gemms, results, kind="bwd_gemms", S=S, B=B, M=M)
        measure(f"bwd whole S={S} B={B}", whole, results, kind="bwd_whole", S=S, B=B, M=M)
        del t
        torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--sections", default="forward,backward", help="comma-separated: forward, variants, backward")
    parser.add_argument("--variants", default=None,
                        help="comma-separated labels of FORWARD_VARIANTS (and 'paged') to time; default all")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        log("diagnose_device_time.py measures GPU time; no CUDA device here, nothing to do.")
        return 0
    os.makedirs(args.out, exist_ok=True)
    results: list = []
    log(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    if "forward" in args.sections:
        forward_section(results)
    if "variants" in args.sections:
        variants_section(results, None if args.variants is None else set(args.variants.split(",")))
    if "backward" in args.sections:
        backward_section(results)
    with open(os.path.join(args.out, "diagnose-device-time.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                       results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
