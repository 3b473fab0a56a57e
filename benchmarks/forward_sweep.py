"""Suite F's launcher sweep: tile variants of the forward kernel under CUDA-graph replay, beside a
``copy_`` of the same bytes and an empty launch (for choosing the launch rule)."""

from __future__ import annotations

import dataclasses

import torch
import triton

from bench_common import bench_graph, log
from forward_report import fmt
from forward_workload import (
    DEVICE, DTYPE, EPS, HEAD_DIM, KV_HEADS, Q_HEADS, ROPE_THETA, QKNormRopeCache, case_bytes, check_caches,
    empty_cache, make_inputs)
from fusion_pass.kernels import qk_norm_rope_cache_reference as cache_reference
from fusion_pass.kernels import qk_norm_rope_cache_triton as kernel
from fusion_pass.kernels.qk_norm_rope_cache_reference import qk_norm_rope_cache_reference, rms_norm_reference

SWEEP_CASES = [(4096, 2048, 1), (2048, 0, 1), (1024, 512, 1), (541, 0, 1), (293, 131, 1), (128, 0, 8), (128, 0, 2),
               (1, 2048, 4)]
# Tile overrides of launch_config (TILE_OVERRIDES); {} = the rule. Each runs with cos/sin read from
# tables and computed from positions, on q/k/v laid out as Hugging Face's transposed views.
SWEEP_CONFIGS = [{}] + [
    dict(heads_per_program=1, tokens_per_program=16, num_warps=4, blocks_per_program=n) for n in (2, 8)
] + [dict(heads_per_program=1, tokens_per_program=16, num_warps=4, blocks_per_program=4, group_major=True)] + [
    dict(heads_per_program=8, tokens_per_program=t, num_warps=4, blocks_per_program=1) for t in (4, 2)]


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
