"""``python -m fusion_pass demo``: the forward fusion on a small Qwen3-style model, end to end.

The embedded model is a stack of Qwen3-style attention layers written the way Hugging Face
writes them (``q_norm``/``k_norm`` per head, ``apply_rotary_pos_emb`` on cos/sin shared by all
layers, ``StaticCache``'s ``index_copy_``, attention over the updated cache). The demo
compiles it with and without the pass, prints the match report and the graph of one layer
before/after, checks the numerics against eager, and times eager / compiled / compiled with
the pass. On CUDA the fused op runs the Triton kernel; on CPU it runs the PyTorch reference
(or the kernel under ``TRITON_INTERPRET=1``), and the timings say so.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import fusion_pass
from fusion_pass.graph_text import CapturingPass


class RMSNorm(nn.Module):
    """``Qwen3RMSNorm``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class Qwen3StyleAttention(nn.Module):
    """``Qwen3Attention`` with a static K/V cache, attention over the whole updated cache."""

    def __init__(self, hidden: int, q_heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.groups = q_heads // kv_heads
        self.q_proj = nn.Linear(hidden, q_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(q_heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim)
        self.k_norm = RMSNorm(head_dim)

    def forward(self, hidden_states, cos, sin, k_cache, v_cache, cache_position, mask):
        hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        k = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k_cache.index_copy_(2, cache_position, k)
        v_cache.index_copy_(2, cache_position, v)
        keys = k_cache.repeat_interleave(self.groups, dim=1)
        values = v_cache.repeat_interleave(self.groups, dim=1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(*hidden_states.shape[:-1], -1))


class Qwen3StyleModel(nn.Module):
    """A stack of attention layers (residual, no MLP): the part this package fuses, repeated."""

    def __init__(self, layers=4, hidden=512, q_heads=8, kv_heads=2, head_dim=64, theta=1e6) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Qwen3StyleAttention(hidden, q_heads, kv_heads, head_dim) for _ in range(layers))
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim),
                             persistent=False)
        with torch.no_grad():
            for layer in self.layers:
                for norm in (layer.q_norm, layer.k_norm):
                    norm.weight.copy_(1 + 0.1 * torch.randn_like(norm.weight))

    def forward(self, hidden_states, k_caches, v_caches, cache_position):
        # Hugging Face's rotary module: cos/sin computed once per forward, shared by all layers.
        freqs = cache_position[None, :, None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(hidden_states.dtype), emb.sin().to(hidden_states.dtype)
        cache_len = k_caches[0].shape[2]
        mask = torch.arange(cache_len, device=hidden_states.device)[None, :] <= cache_position[:, None]
        for layer, k_cache, v_cache in zip(self.layers, k_caches, v_caches):
            hidden_states = hidden_states + layer(hidden_states, cos, sin, k_cache, v_cache, cache_position, mask)
        return hidden_states


def _time_us(fn, device: torch.device, repeats: int) -> float:
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, return_mode="median") * 1e3
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusion_pass demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64, help="prefill length")
    parser.add_argument("--cache-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per variant (CPU)")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    dtype = torch.bfloat16
    torch.manual_seed(0)
    model = Qwen3StyleModel(layers=args.layers).to(device=device, dtype=dtype).eval()
    heads, head_dim = model.layers[0].k_proj.out_features // 64, 64
    hidden_states = torch.randn(args.batch, args.seq, 512, device=device, dtype=dtype)
    position = torch.arange(args.seq, device=device)

    def fresh_caches():
        shape = (args.batch, heads, args.cache_len, head_dim)
        return ([torch.zeros(shape, device=device, dtype=dtype) for _ in model.layers],
                [torch.zeros(shape, device=device, dtype=dtype) for _ in model.layers])

    backend = "Triton kernel" if device.type == "cuda" else (
        "Triton interpreter" if __import__("os").environ.get("TRITON_INTERPRET") == "1" else "PyTorch reference")
    print(f"fusion_pass demo: {args.layers} Qwen3-style layers, hidden 512, 8 q / {heads} kv heads, head_dim 64, "
          f"B={args.batch} S={args.seq}, cache {args.cache_len}, {dtype}, on {device} (fused op runs the {backend})")

    with torch.no_grad():
        k_ref, v_ref = fresh_caches()
        reference = model(hidden_states, k_ref, v_ref, position)

        # Both compiles cold on disk (no FX graph, AOT or autotune cache), stock first: the second
        # still finds this process warm (imports, compile workers), which the timing line says.
        torch._dynamo.reset()
        stock = torch.compile(model)
        k_stock, v_stock = fresh_caches()
        start = time.perf_counter()
        with torch._inductor.config.patch(force_disable_caches=True), warnings.catch_warnings():
            warnings.filterwarnings("ignore", "dynamo_pgo force disabled")  # what the line above asks for
            stock_out = stock(hidden_states, k_stock, v_stock, position)
        stock_compile_s = time.perf_counter() - start

        fusion_pass.reset_report()
        options = fusion_pass.options(devices=(device.type,))
        capture = CapturingPass(options["post_grad_custom_pre_pass"])
        options["post_grad_custom_pre_pass"] = capture
        fused = torch.compile(model, options=options)
        k_fused, v_fused = fresh_caches()
        start = time.perf_counter()
        # The demo must see the pass run: no cache may serve the graph.
        with torch._inductor.config.patch(force_disable_caches=True), warnings.catch_warnings():
            warnings.filterwarnings("ignore", "dynamo_pgo force disabled")
            fused_out = fused(hidden_states, k_fused, v_fused, position)
        fused_compile_s = time.perf_counter() - start

    print("\n== match report")
    print(fusion_pass.report())

    print("\n== post-grad graph of the first layer's prologue, before the pass (excerpt)")
    print(_layer_excerpt(capture.before[0], "aten.rsqrt", "aten.index_put", 6))
    print("\n== after the pass")
    print(_layer_excerpt(capture.after[0], "fusion_pass.", "fusion_pass.", 4))

    print("\n== numerics against eager (bf16)")
    scale = reference.float().abs().max().item()
    for name, out, k_caches in (("stock compile", stock_out, k_stock), ("compile + fusion_pass", fused_out, k_fused)):
        err = (out.float() - reference.float()).abs().max().item()
        cache_err = max((a.float() - b.float()).abs().max().item() for a, b in zip(k_caches, k_ref))
        print(f"  {name:22s} max |out - eager| = {err:.4f} (|eager| <= {scale:.2f}), max |k_cache - eager| = {cache_err:.4f}")
    fused_err = (fused_out.float() - reference.float()).abs().max().item()
    stock_err = (stock_out.float() - reference.float()).abs().max().item()
    ok = fused_err <= max(2 * stock_err, 2.0**-6 * scale)
    print(f"  {'OK' if ok else 'MISMATCH'}: the fused model is as close to eager as stock compile is")

    print(f"\n== prefill time, median ({'triton do_bench, L2 flushed' if device.type == 'cuda' else f'{args.repeats} runs, wall clock'})")
    with torch.no_grad():
        caches = fresh_caches()
        timings = {
            "eager": _time_us(lambda: model(hidden_states, *caches, position), device, args.repeats),
            "torch.compile": _time_us(lambda: stock(hidden_states, *caches, position), device, args.repeats),
            "torch.compile + fusion_pass": _time_us(lambda: fused(hidden_states, *caches, position), device, args.repeats),
        }
    for name, us in timings.items():
        print(f"  {name:28s} {us:10.1f} us")
    print(f"  first compile, no disk caches: {stock_compile_s:.1f} s stock (compiled first), "
          f"{fused_compile_s:.1f} s with the pass (compiled second, in a process the first compile warmed)")
    if device.type != "cuda":
        print("  (no CUDA: the fused op ran its CPU path; these timings say nothing about GPU speed)")
    return 0 if ok and fusion_pass.match_counts().get("qk_norm_rope_cache") == args.layers else 1


def _layer_excerpt(text: str, first: str, last: str, context: int) -> str:
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if first in line), 0)
    end = next((i for i, line in enumerate(lines) if last in line and i >= start), start)
    return "\n".join("  " + line for line in lines[max(0, start - context): end + 2])
