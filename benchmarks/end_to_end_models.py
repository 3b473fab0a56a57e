"""The models of ``bench_end_to_end.py``: geometry, Hugging Face configs, the StaticCache, and how each
variant (eager, stock ``torch.compile``, ``torch.compile`` with the pass) runs a model."""

from __future__ import annotations

import dataclasses
import inspect
import math

import torch

import fusion_pass

VARIANTS = ("eager", "stock_compile", "fusion_pass")
DTYPE = torch.bfloat16
BF16_EPS = 2.0**-8
FWD_FAMILY, TRAIN_FAMILY = "qk_norm_rope_cache", "qkv_rope_qk_norm"
BWD_OP = "fusion_pass.qkv_rope_qk_norm_backward.default"


@dataclasses.dataclass
class Geometry:
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int


def perturb_norms(model: torch.nn.Module) -> None:
    """RMSNorm weights of ones would hide a weight applied twice or not at all."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.copy_((1 + 0.1 * torch.randn(p.shape, generator=g)).to(p.dtype))


def build_model(cls, config, device: str, dtype: torch.dtype):
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(config)
    model = model.to(device=device, dtype=dtype)
    perturb_norms(model)
    return model


def qwen3_config(g: Geometry, max_positions: int):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=g.vocab, hidden_size=g.hidden, intermediate_size=g.intermediate, num_hidden_layers=g.layers,
        num_attention_heads=g.q_heads, num_key_value_heads=g.kv_heads, head_dim=g.head_dim,
        max_position_embeddings=max_positions, tie_word_embeddings=False, use_cache=True,
        attn_implementation="sdpa",
    )


def gemma4_config(g: Geometry, max_positions: int):
    """Gemma4 text layers as the 31B model pairs them: a sliding layer (head_dim 256) and a full one
    (head_dim 512, partial "proportional" rotary), q/k normed per head; the geometry's heads and hidden
    size; no per-layer input embeddings (the 31B model has none). The window (the 31B model's is 1024)
    is set past the cases' contexts: a sliding cache that is full is written by a roll or a cat, which
    the pass does not fuse (a reported near-miss), and these cases measure both layers' fused kernel."""
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(
        vocab_size=g.vocab, hidden_size=g.hidden, intermediate_size=g.intermediate, num_hidden_layers=g.layers,
        num_attention_heads=g.q_heads, num_key_value_heads=g.kv_heads, head_dim=256, global_head_dim=512,
        layer_types=["sliding_attention", "full_attention"] * (g.layers // 2) + ["sliding_attention"] * (g.layers % 2),
        sliding_window=4096, hidden_size_per_layer_input=0, max_position_embeddings=max_positions,
        tie_word_embeddings=False, use_cache=True, attn_implementation="sdpa",
    )


def glm4moe_config(g: Geometry, max_positions: int):
    """GLM-4.5's attention (q/k normed per head, partial rotary factor 0.5) at the geometry's heads;
    every layer takes the dense MLP (``first_k_dense_replace``): the prologue is the same in MoE layers."""
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(
        vocab_size=g.vocab, hidden_size=g.hidden, intermediate_size=g.intermediate, num_hidden_layers=g.layers,
        num_attention_heads=g.q_heads, num_key_value_heads=g.kv_heads, head_dim=g.head_dim,
        max_position_embeddings=max_positions, use_qk_norm=True, first_k_dense_replace=g.layers,
        tie_word_embeddings=False, use_cache=True, attn_implementation="sdpa",
    )


def use_glm_interleaved_rope(on: bool) -> None:
    """Swap transformers' GLM ``apply_rotary_pos_emb`` (interleaved pairs) into ``modeling_glm4_moe``
    (``glminterleaved_*`` cases), or put GLM-4.5's own back."""
    from transformers.models.glm import modeling_glm
    from transformers.models.glm4_moe import modeling_glm4_moe

    own = getattr(modeling_glm4_moe, "_own_apply_rotary_pos_emb", modeling_glm4_moe.apply_rotary_pos_emb)
    modeling_glm4_moe._own_apply_rotary_pos_emb = own
    modeling_glm4_moe.apply_rotary_pos_emb = modeling_glm.apply_rotary_pos_emb if on else own


def hunyuan_config(g: Geometry, max_positions: int):
    from transformers import HunYuanDenseV1Config

    return HunYuanDenseV1Config(
        vocab_size=g.vocab, hidden_size=g.hidden, intermediate_size=g.intermediate, num_hidden_layers=g.layers,
        num_attention_heads=g.q_heads, num_key_value_heads=g.kv_heads, head_dim=g.head_dim,
        max_position_embeddings=max_positions, attention_bias=False, tie_word_embeddings=False,
        use_cache=False, attn_implementation="sdpa",
    )


def cache_kwarg_name(model) -> str:
    """transformers >= 5 names the cache argument ``cache`` (``past_key_values`` is deprecated there)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def new_static_cache(config, max_cache_len: int, batch: int, device: str, dtype: torch.dtype):
    """A StaticCache allocated eagerly (outside any compiled region, so its tensors get static addresses)."""
    from transformers import StaticCache

    cache = StaticCache(config=config, max_cache_len=max_cache_len)
    # Gemma4's layers differ in head_dim: their caches are allocated by the eager prefill instead.
    if hasattr(cache, "early_initialization") and not config.model_type.startswith("gemma4"):
        cache.early_initialization(batch, config.num_key_value_heads, config.head_dim, dtype, torch.device(device))
    return cache


def set_cache_length(cache, length: int) -> None:
    """StaticLayer (transformers >= 5) writes at its ``cumulative_length``, not at cache_position."""
    for layer in getattr(cache, "layers", []):
        counter = getattr(layer, "cumulative_length", None)
        if isinstance(counter, torch.Tensor):
            counter.fill_(length)
        if isinstance(getattr(layer, "cumulative_length_int", None), int):  # sliding layers keep both
            layer.cumulative_length_int = length


def lm_kwargs(model, cache, input_ids: torch.Tensor, start: int) -> dict:
    batch, seq = input_ids.shape
    position = torch.arange(start, start + seq, device=input_ids.device)
    return {"input_ids": input_ids, cache_kwarg_name(model): cache, "cache_position": position,
            "position_ids": position[None].expand(batch, -1).contiguous(), "use_cache": True}


def make_lm_step(fn, cache, kwargs: dict, start: int, cudagraphs: bool):
    """One forward call that (re)writes the cache rows [start, start + S): returns the logits."""

    def step():
        set_cache_length(cache, start)
        if cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        return fn(**kwargs).logits

    return step


def compile_variant(model, variant: str, device: str, cudagraphs: bool):
    torch._dynamo.reset()
    fusion_pass.reset_report()
    if variant == "eager":
        return model
    if variant == "stock_compile":
        return torch.compile(model, dynamic=False, mode="reduce-overhead" if cudagraphs else None)
    options = dict(fusion_pass.options(devices=(device,)))
    if cudagraphs:  # torch.compile takes mode or options, not both: merge what the mode sets
        options.update(torch._inductor.list_mode_options("reduce-overhead"))
    return torch.compile(model, dynamic=False, options=options)


def cudagraph_skips() -> int:
    return int(torch._dynamo.utils.counters["inductor"].get("cudagraph_skips", 0))


def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def grad_errors(model, ref_grads: dict) -> tuple[float, str]:
    worst, worst_name = 0.0, ""
    for n, p in model.named_parameters():
        ref = ref_grads.get(n)
        if ref is None and p.grad is None:
            continue
        if ref is None or p.grad is None:
            return math.inf, f"{n} (gradient missing in one of the two)"
        err = max_abs_err(p.grad, ref) / max(ref.float().abs().max().item(), 1e-30)
        if err > worst:
            worst, worst_name = err, n
    return worst, worst_name
