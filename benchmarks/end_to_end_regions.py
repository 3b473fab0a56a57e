"""The fused regions of ``bench_end_to_end.py`` alone, at a case's geometry: what share of a step
they are, and what the pass should save (``SHARE_METHOD``). CUDA only."""

from __future__ import annotations

import statistics

import torch

from bench_common import error_text, log
from end_to_end_models import DTYPE, Geometry, max_abs_err, perturb_norms


SHARE_METHOD = (
    "fused op(s) alone at the case's geometry: N calls captured in one CUDA graph, replayed between CUDA events "
    "(median per call; GPU time only, no host overhead, inputs L2-warm), times the layer count, over the pass "
    "variant's step time. Inference: also the unfused region (Qwen3RMSNorm per head -> apply_rotary_pos_emb -> "
    "index_copy_) under stock torch.compile timed the same way; predicted saving = layers x (region stock - op). "
    "Training: the backward op (it includes the two q/k/v projection GEMMs; the region's forward is Inductor's own "
    "code in the pass variant, as in stock compile, and is not counted); 'excl. GEMMs' subtracts FLOP-equal "
    "cuBLAS GEMMs timed the same way."
)


def gpu_time_us(fn, calls: int = 20, trials: int = 15) -> tuple[float, str]:
    """Median GPU time of one fn() call: `calls` calls captured in one CUDA graph, replayed between CUDA
    events. Falls back to a plain loop between events (host overhead included when host-bound)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    method = "cuda_graph_replay"
    graph = None
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        run = graph.replay
    except Exception as e:  # noqa: BLE001
        method = f"event_loop (graph capture failed: {type(e).__name__})"
        graph = None
        torch.cuda.synchronize()

        def run():
            for _ in range(calls):
                fn()

        run()
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(times), method


class PrologueRegion(torch.nn.Module):
    """The region qk_norm_rope_cache replaces, as Qwen3Attention and StaticLayer.update write it."""

    def __init__(self, head_dim: int, eps: float) -> None:
        super().__init__()
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

        self.q_norm = Qwen3RMSNorm(head_dim, eps=eps)
        self.k_norm = Qwen3RMSNorm(head_dim, eps=eps)

    def forward(self, q, k, v, cos, sin, k_cache, v_cache, cache_position):
        from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

        # q [B, S, Hq, D], k / v [B, S, Hkv, D]: views of the projection outputs
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(k).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k_cache.index_copy_(2, cache_position, k)
        v_cache.index_copy_(2, cache_position, v.transpose(1, 2))
        return q, k


def rope_tables(batch: int, seq: int, start: int, head_dim: int, device: str):
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    pos = torch.arange(start, start + seq, device=device).float()
    emb = torch.cat([pos[:, None] * inv_freq] * 2, dim=-1)[None].expand(batch, seq, head_dim)
    return emb.cos().to(DTYPE).contiguous(), emb.sin().to(DTYPE).contiguous()


def inference_region_times(batch, seq, start, cache_len, g: Geometry, eps: float) -> dict:
    device = "cuda"
    gen = torch.Generator(device=device).manual_seed(7)

    def rnd(*shape):
        return torch.randn(*shape, device=device, generator=gen).to(DTYPE)

    q_proj, k_proj, v_proj = rnd(batch, seq, g.q_heads, g.head_dim), rnd(batch, seq, g.kv_heads, g.head_dim), \
        rnd(batch, seq, g.kv_heads, g.head_dim)
    cos, sin = rope_tables(batch, seq, start, g.head_dim, device)
    k_cache = torch.zeros(batch, g.kv_heads, cache_len, g.head_dim, device=device, dtype=DTYPE)
    v_cache = torch.zeros_like(k_cache)
    position = torch.arange(start, start + seq, device=device)
    region = PrologueRegion(g.head_dim, eps).to(device=device, dtype=DTYPE)
    perturb_norms(region)
    qw, kw = region.q_norm.weight.detach(), region.k_norm.weight.detach()
    out: dict = {"method": SHARE_METHOD}
    with torch.no_grad():
        def op():
            return torch.ops.fusion_pass.qk_norm_rope_cache(
                q_proj.transpose(1, 2), k_proj.transpose(1, 2), v_proj.transpose(1, 2), qw, kw, cos, sin,
                k_cache, v_cache, position, eps, eps)

        q_op, k_op = op()
        ref_q, ref_k = region(q_proj, k_proj, v_proj, cos, sin, k_cache.clone(), v_cache.clone(), position)
        out["op_vs_region_max_abs_err"] = max(max_abs_err(q_op, ref_q), max_abs_err(k_op, ref_k))
        out["op_us_per_layer"], out["op_timing"] = gpu_time_us(op)
        try:
            torch._dynamo.reset()
            compiled = torch.compile(region, dynamic=False)
            compiled(q_proj, k_proj, v_proj, cos, sin, k_cache, v_cache, position)
            out["region_stock_compile_us_per_layer"], out["region_timing"] = gpu_time_us(
                lambda: compiled(q_proj, k_proj, v_proj, cos, sin, k_cache, v_cache, position))
        except Exception as e:  # noqa: BLE001
            out["region_stock_compile_error"] = error_text(e)
        finally:
            torch._dynamo.reset()
    log(f"    fused region alone: op {out['op_us_per_layer']:.1f} us/layer, stock-compiled region "
        f"{out.get('region_stock_compile_us_per_layer', float('nan')):.1f} us/layer")
    return out


def training_region_times(batch, seq, g: Geometry, eps: float) -> dict:
    device = "cuda"
    gen = torch.Generator(device=device).manual_seed(11)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, generator=gen) * scale).to(DTYPE)

    q_size, kv_size = g.q_heads * g.head_dim, g.kv_heads * g.head_dim
    hidden = rnd(batch, seq, g.hidden)
    weights = [rnd(n, g.hidden, scale=g.hidden ** -0.5) for n in (q_size, kv_size, kv_size)]
    qw, kw = 1 + rnd(g.head_dim, scale=0.1), 1 + rnd(g.head_dim, scale=0.1)
    cos, sin = rope_tables(1, seq, 0, g.head_dim, device)  # HF's rotary module: [1, S, D] for shared positions
    out: dict = {"method": SHARE_METHOD}
    with torch.no_grad():
        def fwd():  # only to produce the saved tensors the backward op reads
            return torch.ops.fusion_pass.qkv_rope_qk_norm(hidden, weights, [], qw, kw, cos, sin, g.q_heads,
                                                          g.kv_heads, eps, eps)

        _, _, _, q_rstd, k_rstd, saved = fwd()
        q_pre = saved[0].view(batch, seq, g.q_heads, g.head_dim)
        k_pre = saved[1].view(batch, seq, g.kv_heads, g.head_dim)
        grad_q = rnd(batch, g.q_heads, seq, g.head_dim)
        grad_k, grad_v = rnd(batch, g.kv_heads, seq, g.head_dim), rnd(batch, g.kv_heads, seq, g.head_dim)

        def bwd():
            return torch.ops.fusion_pass.qkv_rope_qk_norm_backward(
                grad_q, grad_k, grad_v, q_pre, k_pre, q_rstd, k_rstd, cos, sin, qw, kw, hidden, weights,
                False, True, True, True, False)

        out["backward_op_us_per_layer"], out["backward_op_timing"] = gpu_time_us(bwd)
        hidden2d = hidden.view(batch * seq, g.hidden)
        w_cat = torch.cat(weights, dim=0)
        grad_cat = rnd(batch * seq, q_size + 2 * kv_size)
        out["backward_gemms_us_per_layer"], _ = gpu_time_us(lambda: (grad_cat @ w_cat, grad_cat.t() @ hidden2d))
    out["non_gemm_us_per_layer"] = max(0.0, out["backward_op_us_per_layer"] - out["backward_gemms_us_per_layer"])
    log(f"    fused backward op alone per layer: {out['backward_op_us_per_layer']:.1f} us (GEMMs "
        f"{out['backward_gemms_us_per_layer']:.1f})")
    return out
