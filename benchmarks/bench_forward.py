"""Suite F on one GPU: QK RMSNorm -> RoPE -> KV-cache write (Qwen3-Coder-480B attention prologue).

    python benchmarks/bench_forward.py --out DIR [--cases all|quick] [--skip-compile] [--no-sweep]

Per case (S, C, B) of WORKLOADS.md section F (Hq 96, Hkv 8, D 128, L 262144, bf16):

* floor_us: bytes that must move / measured device copy bandwidth. Bytes = read q, k, v +
  write q_out, k_out and the S new rows of each cache + 16 bytes of positions per token
  (position_ids and cache_position, int64): the convention of the anchors' ``bytes`` field
  (59408 for S = 1, B = 1). Compute is negligible (~10 flop per element).
* eager_us: the nn.Module below, which is WORKLOADS F written out (cos/sin from inv_freq and
  position_ids inside, norm on query [B, 96, S, 128], ``key_cache[:, :, cache_position] = ...``).
* stock_compile_us / _graph_us: ``torch.compile(module)``; the graph variant replays it as a
  CUDA graph (``do_bench_cudagraph``).
* fusion_pass_us / _graph_us: ``torch.compile(module, options=fusion_pass.options())``;
  ``fused`` records whether the pass matched (timed either way).
* op_us / op_graph_us: ``torch.ops.fusion_pass.qk_norm_rope_cache`` alone, cos/sin precomputed.
* positions_op_us: ``qk_norm_rope_cache_from_positions_triton`` alone (cos/sin in the kernel).

Every case is checked before it is timed: op vs reference (q_out, k_out within 1 bf16 ulp at the
RoPE-term scale, written cache rows bit-equal to k_out / v, sampled unwritten rows untouched),
and both compiled modules vs eager. Timing: ``triton.testing.do_bench(..., return_mode="median")``
(flushes L2 between runs) and ``do_bench_cudagraph``. Writes DIR/<date>-<gpu>-forward.{json,md,png}.

Without CUDA it runs a tiny correctness check under the Triton interpreter and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.testing  # noqa: E402

import fusion_pass  # noqa: E402
from bench_common import (  # noqa: E402
    attempt, bench, bench_graph, copy_bandwidth_tbps, log, result_stem, synchronize)
from fusion_pass.kernels import qk_norm_rope_cache_triton as kernel  # noqa: E402
from fusion_pass.kernels import qk_norm_rope_cache_reference as cache_reference  # noqa: E402
from fusion_pass.kernels.qk_norm_rope_cache_reference import (  # noqa: E402
    qk_norm_rope_cache_reference,
    rms_norm_reference,
    rotate_half,
)

Q_HEADS, KV_HEADS, HEAD_DIM, CACHE_LEN = 96, 8, 128, 262144
DTYPE = torch.bfloat16
EPS = 1e-6  # Qwen3 rms_norm_eps
ROPE_THETA = 10_000_000.0  # Qwen3-Coder-480B-A35B rope_theta
CASES = [(1, 0, 1), (1, 2048, 4), (128, 0, 1), (128, 0, 2), (128, 0, 8), (256, 128, 1), (256, 1024, 8),
         (293, 131, 1), (512, 256, 2), (541, 0, 1), (1024, 512, 1), (2048, 0, 1), (4096, 2048, 1)]
QUICK_CASES = [(1, 2048, 4), (128, 0, 8), (293, 131, 1), (4096, 2048, 1)]
SWEEP_CASES = [(4096, 2048, 1), (2048, 0, 1), (1024, 512, 1), (541, 0, 1), (293, 131, 1), (128, 0, 8), (128, 0, 2),
               (1, 2048, 4)]
# Tile overrides of launch_config (TILE_OVERRIDES); {} = the rule. Each runs with cos/sin read from
# tables and computed from positions, on q/k/v laid out as Hugging Face's transposed views.
SWEEP_CONFIGS = [{}] + [
    dict(heads_per_program=1, tokens_per_program=16, num_warps=4, blocks_per_program=n) for n in (2, 8)
] + [dict(heads_per_program=1, tokens_per_program=16, num_warps=4, blocks_per_program=4, group_major=True)] + [
    dict(heads_per_program=8, tokens_per_program=t, num_warps=4, blocks_per_program=1) for t in (4, 2)]
DEVICE = "cuda"  # a module global so that a CPU dry run can swap it
K_FILL, V_FILL = 1.5, -2.5  # cache contents before the run; unwritten rows must keep them


# ------------------------------------------------------------------------------------------
# The workload, as the eager module
# ------------------------------------------------------------------------------------------


class QKNormRopeCache(torch.nn.Module):
    """WORKLOADS.md F, line by line: RMSNorm(q, k) -> RoPE from inv_freq -> cache writes."""

    def __init__(self, head_dim: int, eps: float, theta: float, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.q_norm_weight = torch.nn.Parameter((torch.rand(head_dim, generator=g) + 0.5).to(dtype), requires_grad=False)
        self.k_norm_weight = torch.nn.Parameter((torch.rand(head_dim, generator=g) + 0.5).to(dtype), requires_grad=False)
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.eps = eps
        self.to(device)

    @staticmethod
    def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def forward(self, query, key, value, position_ids, key_cache, value_cache, cache_position):
        freqs = position_ids[..., None].float() * self.inv_freq  # [B, S, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(query.dtype).unsqueeze(1)  # [B, 1, S, D], broadcast over heads
        sin = emb.sin().to(query.dtype).unsqueeze(1)
        q = self.rms(query, self.q_norm_weight, self.eps)
        k = self.rms(key, self.k_norm_weight, self.eps)
        query_rotated = q * cos + rotate_half(q) * sin
        key_rotated = k * cos + rotate_half(k) * sin
        key_cache[:, :, cache_position] = key_rotated
        value_cache[:, :, cache_position] = value
        return query_rotated, key_rotated


def case_bytes(seq: int, batch: int) -> int:
    per_token = 2 * Q_HEADS * HEAD_DIM * 2 + 5 * KV_HEADS * HEAD_DIM * 2 + 16
    return batch * seq * per_token


# ------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------


def empty_cache() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------
# One case
# ------------------------------------------------------------------------------------------


def make_inputs(seq: int, cached: int, batch: int):
    device = DEVICE
    g = torch.Generator(device=device).manual_seed(seq * 1000 + batch)
    cache_position = torch.arange(cached, cached + seq, device=device)
    return dict(
        query=torch.randn(batch, Q_HEADS, seq, HEAD_DIM, device=device, generator=g).to(DTYPE),
        key=torch.randn(batch, KV_HEADS, seq, HEAD_DIM, device=device, generator=g).to(DTYPE) * 3,
        value=torch.randn(batch, KV_HEADS, seq, HEAD_DIM, device=device, generator=g).to(DTYPE),
        position_ids=cache_position[None, :].repeat(batch, 1),
        key_cache=torch.full((batch, KV_HEADS, CACHE_LEN, HEAD_DIM), K_FILL, dtype=DTYPE, device=device),
        value_cache=torch.full((batch, KV_HEADS, CACHE_LEN, HEAD_DIM), V_FILL, dtype=DTYPE, device=device),
        cache_position=cache_position,
    )


def untouched_rows(cached: int, seq: int) -> list[int]:
    rows = {0, 1, CACHE_LEN // 2, CACHE_LEN - 1, cached - 1, cached + seq, cached + seq + 1}
    return sorted(r for r in rows if 0 <= r < CACHE_LEN and not cached <= r < cached + seq)


def check_caches(x: dict, k_rows: torch.Tensor, cached: int, seq: int) -> None:
    """Written rows equal k_rows / value exactly; sampled unwritten rows still hold the fill."""
    kc, vc = x["key_cache"], x["value_cache"]
    if not torch.equal(kc[:, :, cached:cached + seq], k_rows):
        raise AssertionError("k_cache rows differ from k_out")
    if not torch.equal(vc[:, :, cached:cached + seq], x["value"]):
        raise AssertionError("v_cache rows differ from value")
    for r in untouched_rows(cached, seq):
        if not (bool((kc[:, :, r] == K_FILL).all()) and bool((vc[:, :, r] == V_FILL).all())):
            raise AssertionError(f"cache row {r} (not in cache_position) was modified")


def ulp_error(out_q, out_k, x: dict, module: QKNormRopeCache, cos, sin) -> float:
    q_ref, k_ref = (
        module.rms(x["query"], module.q_norm_weight, EPS), module.rms(x["key"], module.k_norm_weight, EPS)
    )
    cos4, sin4 = cos.unsqueeze(1), sin.unsqueeze(1)
    q_rot = q_ref * cos4 + rotate_half(q_ref) * sin4
    k_rot = k_ref * cos4 + rotate_half(k_ref) * sin4
    return max(cache_reference.rope_ulp_error(out_q, q_rot, q_ref, cos, sin),
               cache_reference.rope_ulp_error(out_k, k_rot, k_ref, cos, sin))


def run_case(seq: int, cached: int, batch: int, copy_tbps: float, skip_compile: bool, print_report: bool,
             skip_stock: bool = False) -> dict:
    r: dict = dict(S=seq, C=cached, B=batch, bytes=case_bytes(seq, batch))
    r["floor_us"] = r["bytes"] / (copy_tbps * 1e12) * 1e6
    module = QKNormRopeCache(HEAD_DIM, EPS, ROPE_THETA, DTYPE, DEVICE)
    x = make_inputs(seq, cached, batch)
    args = (x["query"], x["key"], x["value"], x["position_ids"], x["key_cache"], x["value_cache"], x["cache_position"])
    cos, sin = cache_reference.rope_cos_sin_reference(x["position_ids"], module.inv_freq, 1.0, DTYPE)
    qw, kw = module.q_norm_weight.detach(), module.k_norm_weight.detach()

    with torch.no_grad():
        # ---- correctness of the op (cos/sin tensors) against the reference, then timing
        def op():
            return torch.ops.fusion_pass.qk_norm_rope_cache(
                x["query"], x["key"], x["value"], qw, kw, cos, sin, x["key_cache"], x["value_cache"],
                x["cache_position"], EPS, EPS)

        q_out, k_out = op()
        check_caches(x, k_out, cached, seq)
        # The reference on a cache-free call (its cache writes go to a 1-row dummy, all skipped).
        skip = torch.full_like(x["cache_position"], -1)
        dummy = torch.empty(batch, KV_HEADS, 1, HEAD_DIM, dtype=DTYPE, device=DEVICE)
        q_ref, k_ref = qk_norm_rope_cache_reference(
            x["query"], x["key"], x["value"], qw, kw, cos, sin, dummy, dummy.clone(), skip, EPS, EPS)
        r["max_ulp"] = max(
            cache_reference.rope_ulp_error(q_out, q_ref, rms_norm_reference(x["query"], qw, EPS), cos, sin),
            cache_reference.rope_ulp_error(k_out, k_ref, rms_norm_reference(x["key"], kw, EPS), cos, sin),
        )
        if r["max_ulp"] > 1.0:
            log(f"    WARNING: op differs from the reference by {r['max_ulp']} bf16 ulps (> 1)")
        del q_ref, k_ref

        q_pos, k_pos = torch.empty_like(x["query"]), torch.empty_like(x["key"])

        def positions_op():
            kernel.qk_norm_rope_cache_from_positions_triton(
                x["query"], x["key"], x["value"], qw, kw, x["position_ids"], module.inv_freq, 1.0,
                x["key_cache"], x["value_cache"], x["cache_position"], EPS, EPS, q_pos, k_pos)

        positions_op()
        check_caches(x, k_pos, cached, seq)
        r["positions_max_ulp"] = ulp_error(q_pos, k_pos, x, module, cos, sin)

        # ---- eager module: reference values for the compiled ones
        q_eager, k_eager = module(*args)
        check_caches(x, k_eager, cached, seq)
        r["eager_vs_reference_ulp"] = ulp_error(q_eager, k_eager, x, module, cos, sin)

        attempt(r, "eager_us", lambda: bench(lambda: module(*args)))
        attempt(r, "op_us", lambda: bench(op))
        attempt(r, "op_graph_us", lambda: bench_graph(op))
        attempt(r, "positions_op_us", lambda: bench(positions_op))

        if not skip_compile:
            def compiled(options):
                torch._dynamo.reset()
                fn = torch.compile(module, dynamic=False, options=options)
                t0 = time.perf_counter()
                q_c, k_c = fn(*args)
                synchronize()
                log(f"    compiled in {time.perf_counter() - t0:.1f} s")
                check_caches(x, k_c, cached, seq)
                ulps = cache_reference.rope_ulp_error(q_c, q_eager, rms_norm_reference(x["query"], qw, EPS), cos, sin)
                ulps = max(ulps, cache_reference.rope_ulp_error(k_c, k_eager, rms_norm_reference(x["key"], kw, EPS), cos, sin))
                return (lambda: fn(*args)), ulps

            def stock():
                fn, r["stock_vs_eager_ulp"] = compiled(None)
                r["stock_compile_us"] = bench(fn)
                r["stock_compile_graph_us"] = bench_graph(fn)

            def with_pass():
                fusion_pass.reset_report()
                fn, r["fusion_pass_vs_eager_ulp"] = compiled(fusion_pass.options(devices=(DEVICE,)))
                r["fused"] = fusion_pass.match_counts().get("qk_norm_rope_cache", 0) > 0
                if print_report:
                    log(fusion_pass.report())
                if not r["fused"]:
                    log("    WARNING: fusion_pass did not match; timing the unfused compile anyway")
                elif r["fusion_pass_vs_eager_ulp"] > 1.0:
                    log(f"    WARNING: fused compile differs from eager by {r['fusion_pass_vs_eager_ulp']} ulps (> 1)")
                r["fusion_pass_us"] = bench(fn)
                r["fusion_pass_graph_us"] = bench_graph(fn)

            if not skip_stock:
                attempt(r, "stock", stock)
            attempt(r, "fusion_pass", with_pass)
            r.pop("stock", None)
            r.pop("fusion_pass", None)
            torch._dynamo.reset()
    del x, module
    empty_cache()
    return r


@triton.jit
def _empty_kernel(x_ptr):
    pass


def floor_references(seq: int, cached: int, batch: int, floor_us: float) -> list[dict]:
    """Two sweep rows beside a case's tiles, CUDA-graph replay: ``copy``, a ``copy_`` of the case's
    bytes (half read, half written) in one contiguous buffer, what the device's own copy does at
    that size; ``empty kernel``, one program doing nothing, the cost of a launch in a graph."""
    n = case_bytes(seq, batch) // 4  # bf16 elements per buffer
    src = torch.randn(n, device=DEVICE).to(DTYPE)
    dst = torch.empty_like(src)
    rows = []
    for name, fn in (("copy", lambda: dst.copy_(src)), ("empty kernel", lambda: _empty_kernel[(1,)](src))):
        us = bench_graph(fn, rep_ms=30)
        rows.append(dict(S=seq, C=cached, B=batch, cos_sin=name, tile={}, default=False, graph_us=us,
                         over_floor=us / floor_us))
        log(f"  sweep {seq},{cached},{batch} {name}: {us:.2f} us ({us / floor_us:.2f}x floor)")
    return rows


def sweep(copy_tbps: float) -> list[dict]:
    """Tile variants (``SWEEP_CONFIGS``) of the kernel compiled graphs launch (the graph entry, device
    asserts on), with cos/sin read from tables and computed from positions, CUDA-graph replay, on
    ``SWEEP_CASES``, with q/k/v laid out as Hugging Face's ``view(B, S, H, D).transpose(1, 2)``
    gives them (for choosing the rule)."""
    module = QKNormRopeCache(HEAD_DIM, EPS, ROPE_THETA, DTYPE, DEVICE)
    qw, kw = module.q_norm_weight.detach(), module.k_norm_weight.detach()
    rows = []
    for seq, cached, batch in SWEEP_CASES:
        x = make_inputs(seq, cached, batch)
        for name in ("query", "key", "value"):  # the transposed views of [B, S, H, D] projections
            x[name] = x[name].transpose(1, 2).contiguous().transpose(1, 2)
        cos, sin = cache_reference.rope_cos_sin_reference(x["position_ids"], module.inv_freq, 1.0, DTYPE)
        q_out, k_out = torch.empty_like(x["query"]), torch.empty_like(x["key"])
        floor_us = case_bytes(seq, batch) / (copy_tbps * 1e12) * 1e6
        # The reference's q on a cache-free call (its cache writes go to a 1-row dummy, all skipped).
        dummy = torch.empty(batch, KV_HEADS, 1, HEAD_DIM, dtype=DTYPE, device=DEVICE)
        q_ref, _ = qk_norm_rope_cache_reference(x["query"], x["key"], x["value"], qw, kw, cos, sin, dummy,
                                                dummy.clone(), torch.full_like(x["cache_position"], -1), EPS, EPS)
        q_normed = rms_norm_reference(x["query"], qw, EPS)
        rows += floor_references(seq, cached, batch, floor_us)
        for tile in SWEEP_CONFIGS:
            for cos_sin in ("tables", "positions"):
                tables = cos_sin == "tables"
                rope = {} if tables else dict(from_positions=kernel.RotaryFromPositions(x["position_ids"], module.inv_freq))
                row = dict(S=seq, C=cached, B=batch, cos_sin=cos_sin, tile=tile, default=not tile)
                try:
                    call = kernel.cache_kernel_call(
                        x["query"], x["key"], x["value"], qw, kw, cos if tables else None, sin if tables else None,
                        x["key_cache"], x["value_cache"], x["cache_position"], EPS, EPS, q_out, k_out, **rope,
                        tile=tile, in_graph=True)
                    config = kernel.launch_config(batch, Q_HEADS, KV_HEADS, seq, HEAD_DIM, 2, **tile)
                    row.update(dataclasses.asdict(config))

                    def launch(call=call):
                        call.run(device_asserts=True)

                    q_out.zero_()
                    launch()
                    check_caches(x, k_out, cached, seq)
                    row["max_ulp"] = cache_reference.rope_ulp_error(q_out, q_ref, q_normed, cos, sin)
                    row["graph_us"] = bench_graph(launch, rep_ms=30)
                    row["over_floor"] = row["graph_us"] / floor_us
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                log(f"  sweep {seq},{cached},{batch} {cos_sin} {tile}: {fmt(row.get('graph_us'))} us "
                    f"({fmt(row.get('over_floor'))}x floor) ulp {row.get('max_ulp')} {row.get('error', '')}")
                rows.append(row)
        del x, q_out, k_out, cos, sin, q_ref, q_normed
        empty_cache()
    return rows


# ------------------------------------------------------------------------------------------
# Reports
# ------------------------------------------------------------------------------------------

TIME_KEYS = ["floor_us", "eager_us", "stock_compile_us", "stock_compile_graph_us", "fusion_pass_us",
             "fusion_pass_graph_us", "op_us", "op_graph_us", "positions_op_us"]


def suite_means(cases: list[dict]) -> dict:
    means = {}
    for key in TIME_KEYS:
        values = [c.get(key) for c in cases]
        if values and all(v is not None for v in values):
            means[key] = sum(values) / len(values)
    return means


def fmt(v, digits=2) -> str:
    return "—" if v is None else (f"{v:.{digits}f}" if isinstance(v, float) else str(v))


def markdown(result: dict) -> str:
    lines = [
        f"# Suite F forward on {result['gpu']} ({result['date']})",
        "",
        f"torch {result['torch']}, triton {result['triton']}; device copy {result['copy_TBps']:.2f} TB/s; "
        "times in µs (median; `graph` = CUDA-graph replay); stock torch.compile columns from "
        f"{result.get('stock_compile_source', 'this run')}.",
        "",
        "| S | C | B | floor | eager | stock | stock graph | fusion_pass | fusion_pass graph | op | op graph "
        "| positions op | op graph / floor | max ulp | fused |",
        "|" + "---|" * 15,
    ]
    for c in result["cases"]:
        ratio = c["op_graph_us"] / c["floor_us"] if c.get("op_graph_us") else None
        lines.append("| " + " | ".join([
            str(c["S"]), str(c["C"]), str(c["B"]), *(fmt(c.get(k)) for k in TIME_KEYS),
            fmt(ratio, 2), fmt(c.get("max_ulp"), 0), fmt(c.get("fused")),
        ]) + " |")
    m = result["suite_means"]
    lines.append("| **mean** | | | " + " | ".join(fmt(m.get(k)) for k in TIME_KEYS) + " | | | |")
    if result.get("sweep"):
        lines += ["", "Launcher sweep (CUDA-graph replay, the graph entry, q/k/v as Hugging Face's transposed views):",
                  "", "| S | C | B | cos/sin | tokens | heads | warps | blocks per program | group major "
                  "| µs | / floor | max ulp | default rule |", "|" + "---|" * 13]
        for row in result["sweep"]:
            lines.append(f"| {row['S']} | {row['C']} | {row['B']} | {row['cos_sin']} | {row.get('tokens_per_program')} "
                         f"| {row.get('heads_per_program')} | {row.get('num_warps')} | {row.get('blocks_per_program')} "
                         f"| {row.get('group_major', '')} "
                         f"| {fmt(row.get('graph_us'))} | {fmt(row.get('over_floor'), 2)} | {fmt(row.get('max_ulp'), 1)} | "
                         f"{'yes' if row.get('default') else ''} |")
    errors = [(c["S"], c["C"], c["B"], c["errors"]) for c in result["cases"] if c.get("errors")]
    if errors:
        lines += ["", "Failures:", ""] + [f"- ({s}, {cc}, {b}): {e}" for s, cc, b, e in errors]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plot")
        return
    cases = result["cases"]
    series = [("stock_compile_graph_us", "stock compile (graph)"), ("fusion_pass_graph_us", "fusion_pass (graph)"),
              ("op_graph_us", "op alone (graph)")]
    fig, ax = plt.subplots(figsize=(13, 5))
    width = 0.8 / len(series)
    for i, (key, label) in enumerate(series):
        values = [c[key] / c["floor_us"] if c.get(key) else math.nan for c in cases]
        ax.bar([j + (i - 1) * width for j in range(len(cases))], values, width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(1.1, color="gray", linewidth=0.8, linestyle="--", label="1.1x floor")
    ax.set_yscale("log")
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([f"S{c['S']}\nC{c['C']}\nB{c['B']}" for c in cases], fontsize=8)
    ax.set_ylabel("time / byte floor")
    ax.set_title(f"Suite F on {result['gpu']}: time over the bytes floor (copy {result['copy_TBps']:.2f} TB/s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"wrote {path}")


# ------------------------------------------------------------------------------------------
# Without a GPU
# ------------------------------------------------------------------------------------------


def interpreter_check() -> None:
    """A tiny F-shaped case through the op under TRITON_INTERPRET=1, against the reference."""
    batch, q_heads, kv_heads, seq, head_dim, length = 1, 8, 2, 3, 128, 16
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, q_heads, seq, head_dim, generator=g).to(DTYPE)
    k = torch.randn(batch, kv_heads, seq, head_dim, generator=g).to(DTYPE)
    v = torch.randn(batch, kv_heads, seq, head_dim, generator=g).to(DTYPE)
    w = (torch.rand(2, head_dim, generator=g) + 0.5).to(DTYPE)
    positions = torch.tensor([5, 6, 7])
    inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    cos, sin = cache_reference.rope_cos_sin_reference(positions[None], inv_freq, 1.0, DTYPE)
    caches = [torch.randn(batch, kv_heads, length, head_dim, generator=g).to(DTYPE) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    q_out, k_out = torch.ops.fusion_pass.qk_norm_rope_cache(q, k, v, w[0], w[1], cos, sin, *caches, positions, EPS, EPS)
    q_ref, k_ref = qk_norm_rope_cache_reference(q, k, v, w[0], w[1], cos, sin, *ref_caches, positions, EPS, EPS)
    ulps = max(cache_reference.rope_ulp_error(q_out, q_ref, rms_norm_reference(q, w[0], EPS), cos, sin),
               cache_reference.rope_ulp_error(k_out, k_ref, rms_norm_reference(k, w[1], EPS), cos, sin))
    ok = ulps <= 1.0 and torch.equal(caches[1], ref_caches[1])
    ok = ok and torch.equal(caches[0][:, :, positions], k_out) and torch.equal(caches[0][:, :, :5], ref_caches[0][:, :, :5])
    log(f"interpreter check: max {ulps} bf16 ulp vs reference, caches {'ok' if ok else 'WRONG'}")
    if not ok:
        sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for the JSON / markdown / PNG results")
    parser.add_argument("--cases", choices=["all", "quick"], default="all")
    parser.add_argument("--skip-compile", action="store_true", help="time only eager and the kernels")
    parser.add_argument("--no-sweep", action="store_true", help="skip the launcher tile sweep")
    parser.add_argument("--sweep-only", action="store_true", help="run only the launcher tile sweep")
    parser.add_argument("--stock-from", default=None,
                        help="take the stock torch.compile columns from this earlier result JSON (same GPU, torch "
                             "and triton: stock Inductor does not depend on this project) instead of compiling them")
    args = parser.parse_args()

    if not torch.cuda.is_available():
        log("bench_forward.py needs CUDA to time anything; running the interpreter correctness check only.")
        interpreter_check()
        return

    os.makedirs(args.out, exist_ok=True)
    torch._inductor.config.force_disable_caches = True  # the pass must run (and count) on every compile
    start = time.perf_counter()
    date = datetime.date.today().isoformat()
    copy_tbps = copy_bandwidth_tbps()
    log(f"{torch.cuda.get_device_name()}: copy {copy_tbps:.3f} TB/s; torch {torch.__version__}, triton {triton.__version__}")
    stock_from = None
    if args.stock_from:
        with open(args.stock_from) as f:
            earlier = json.load(f)
        if (earlier.get("torch"), earlier.get("triton")) != (torch.__version__, triton.__version__):
            raise SystemExit(f"--stock-from {args.stock_from}: measured with torch {earlier.get('torch')} / triton "
                             f"{earlier.get('triton')}, not this run's {torch.__version__} / {triton.__version__}")
        stock_from = {(c["S"], c["C"], c["B"]): c for c in earlier["cases"]}
        log(f"stock torch.compile columns taken from {args.stock_from} ({earlier.get('date')})")
    cases = []
    for i, (seq, cached, batch) in enumerate([] if args.sweep_only else CASES if args.cases == "all" else QUICK_CASES):
        t0 = time.perf_counter()
        log(f"case S={seq} C={cached} B={batch}")
        try:
            r = run_case(seq, cached, batch, copy_tbps, args.skip_compile, print_report=(i == 0),
                         skip_stock=stock_from is not None)
            if stock_from is not None:
                earlier = stock_from.get((seq, cached, batch), {})
                for key in ("stock_compile_us", "stock_compile_graph_us", "stock_vs_eager_ulp"):
                    r[key] = earlier.get(key)
        except Exception as e:  # noqa: BLE001 - a failed correctness check is recorded, not fatal
            r = dict(S=seq, C=cached, B=batch, bytes=case_bytes(seq, batch),
                     floor_us=case_bytes(seq, batch) / (copy_tbps * 1e12) * 1e6,
                     errors={"case": f"{type(e).__name__}: {e}"[:500]})
            log(f"    CASE FAILED: {type(e).__name__}: {e}")
            torch.cuda.empty_cache()
        cases.append(r)
        with open(result_stem(args.out, "forward") + ".partial.json", "w") as f:  # a run cut short keeps these
            json.dump(dict(copy_TBps=copy_tbps, cases=cases), f, indent=1)
        log("    " + ", ".join(f"{k}={r[k]:.2f}" for k in TIME_KEYS + ["max_ulp"] if isinstance(r.get(k), float))
            + f", fused={r.get('fused')} ({time.perf_counter() - t0:.0f} s)")
    result = dict(
        suite="F", gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
        date=date, copy_TBps=copy_tbps, cases=cases, suite_means=suite_means(cases),
        stock_compile_source=(f"{os.path.basename(args.stock_from)} (an earlier run, same GPU and versions)"
                              if args.stock_from else "this run"),
    )
    if not args.no_sweep:
        result["sweep"] = sweep(copy_tbps)
    base = result_stem(args.out, "forward")
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(markdown(result))
    log(f"wrote {base}.json, {base}.md")
    if cases:
        plot(result, base + ".png")
    log("suite means (µs): " + ", ".join(f"{k}={v:.1f}" for k, v in result["suite_means"].items()))
    log(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
