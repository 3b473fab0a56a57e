"""Every variant of the forward op on the GPU, at a model's geometry, against the reference.

The CPU tests run each variant (norm forms, RoPE before the norm, partial rotary, interleaved
pairs, paged caches) through the Triton interpreter on toy shapes. These run the compiled kernel
on CUDA at Qwen3-8B's attention geometry (32 query heads, 8 key/value heads, head_dim 128, and
head_dim 64 for the partial/interleaved forms) with an odd sequence length, bf16 and fp16.

Bound: GPU and reference differ only where the fp32 RMS statistic (summed in another order)
flips a rounding tie (see test_qk_norm_rope_cache_kernel.py), so at most ``MAX_DIFFERING`` of
the elements may differ at all, and none by more than ``MAX_ULPS`` ulps at the scale of the
row's largest reference value (about the RoPE terms' scale; a wrong rotation, norm form or
pass-through moves many elements by many of those). Cache rows: the written ones hold exactly k_rotated
and v, every other row is bit-identical to before.
"""

from __future__ import annotations

import pytest
import torch

import fusion_pass  # noqa: F401  (registers torch.ops.fusion_pass.*)
from fusion_pass.kernels.qk_norm_rope_cache_reference import qk_norm_rope_cache_reference, write_cache_rows_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MAX_DIFFERING = 1e-3
MAX_ULPS = 3.0
_MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}

VARIANTS = {
    "qwen3": dict(),
    "gemma3_one_plus_weight": dict(norm="fp32_one_plus_weight"),
    "torch_rms_norm_fp32_weight": dict(norm="fp32_weight"),
    "no_weight": dict(norm="no_weight"),
    "rope_first_hunyuan": dict(rope_first=True),
    "partial_rotary_glm": dict(rotary_dim=64),
    "partial_rotary_quarter": dict(rotary_dim=32),
    "interleaved_gptj": dict(interleaved=True),
    "interleaved_rope_first": dict(interleaved=True, rope_first=True),
    # the other norm forms with interleaved pairs and with RoPE first (the whole-row path's weights)
    "interleaved_one_plus_weight": dict(interleaved=True, norm="fp32_one_plus_weight"),
    "interleaved_no_weight": dict(interleaved=True, norm="no_weight"),
    "rope_first_fp32_weight": dict(rope_first=True, norm="fp32_weight"),
    "interleaved_rope_first_fp32_weight": dict(interleaved=True, rope_first=True, norm="fp32_weight"),
    # partial rotary on interleaved pairs (GLM-4-9B's RoPE), and with RoPE first
    "partial_interleaved_glm": dict(interleaved=True, rotary_dim=64),
    "partial_interleaved_rope_first_one_plus_weight": dict(interleaved=True, rotary_dim=64, rope_first=True,
                                                           norm="fp32_one_plus_weight"),
    "rope_first_partial": dict(rope_first=True, rotary_dim=64),
    # Qwen3.5's: partial rotary with the ``1 + w`` norm
    "partial_rotary_one_plus_weight": dict(rotary_dim=64, norm="fp32_one_plus_weight"),
}


def make_args(variant: dict, dtype: torch.dtype, batch=2, seq=541, q_heads=32, kv_heads=8, head_dim=128,
              cache_len=4096, seed=0) -> dict:
    """Dense-op keyword arguments on CUDA: q/k/v transposed views of [B, S, H, D] (as Hugging Face
    passes them), cos/sin [B, S, rotary width], caches poisoned with random rows, shuffled
    positions with one negative (one past the cache fails the op's device assert: see
    ``test_kernels_in_graph.test_out_of_range_position_fails_like_stock_compile_unless_asserts_are_off``).
    """
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)

    norm = variant.get("norm", "weight")
    width = variant.get("rotary_dim") or head_dim
    positions = torch.randperm(cache_len, generator=g, device="cuda")[:seq]
    positions[seq // 3] -= cache_len  # the same row, counted from the end (rows stay distinct)
    weight_offset = 0.0 if norm == "fp32_one_plus_weight" else 1.0
    weighted = norm != "no_weight"
    return dict(
        q=randn(batch, seq, q_heads, head_dim).transpose(1, 2),
        k=randn(batch, seq, kv_heads, head_dim, scale=3.0).transpose(1, 2),
        v=randn(batch, seq, kv_heads, head_dim).transpose(1, 2),
        q_weight=randn(head_dim, scale=0.3) + weight_offset if weighted else None,
        k_weight=randn(head_dim, scale=0.3) + weight_offset if weighted else None,
        cos=torch.rand(batch, seq, width, generator=g, device="cuda").mul(2).sub(1).to(dtype),
        sin=torch.rand(batch, seq, width, generator=g, device="cuda").mul(2).sub(1).to(dtype),
        k_cache=randn(batch, kv_heads, cache_len, head_dim),
        v_cache=randn(batch, kv_heads, cache_len, head_dim),
        cache_position=positions,
        q_eps=1e-6, k_eps=1e-5, **variant,
    )


def cloned(args: dict) -> dict:
    return {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in args.items()}


def check_close(out: torch.Tensor, ref: torch.Tensor, name: str, rounded_to: torch.dtype | None = None) -> None:
    """At most MAX_DIFFERING of the elements differ, none by more than MAX_ULPS ulps of the
    row's largest reference value (ulps of ``rounded_to``, default the outputs' dtype: the last
    rounding a flipped tie can move)."""
    differing = (out != ref).float().mean().item()
    scale = ref.float().abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(ref.dtype).tiny)
    ulp = torch.exp2(torch.floor(torch.log2(scale)) - _MANTISSA_BITS[rounded_to or ref.dtype])
    ulps = ((out.float() - ref.float()).abs() / ulp).max().item()
    print(f"{name}: {differing:.2e} of the elements differ, max {ulps:.2f} ulps of the row scale")
    assert differing <= MAX_DIFFERING, f"{name}: {differing:.2e} of the elements differ"
    assert ulps <= MAX_ULPS, f"{name}: {ulps:.2f} ulps"


def check_cache(after: torch.Tensor, before: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, name: str):
    """The written rows hold exactly ``rows``; every other row is bit-identical to ``before``."""
    expected = before.clone()
    write_cache_rows_reference(expected, positions, rows)
    assert torch.equal(after, expected), name


def check_dense_op(args: dict, name: str, rounded_to: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense-cache op on ``args`` against the reference (``check_close``) and its cache writes
    (``check_cache``); returns (q_out, k_out)."""
    ref = cloned(args)
    q_out, k_out = torch.ops.fusion_pass.qk_norm_rope_cache(**args)
    q_ref, k_ref = qk_norm_rope_cache_reference(**cloned(args) | dict(k_cache=ref["k_cache"].clone(),
                                                                           v_cache=ref["v_cache"].clone()))
    check_close(q_out, q_ref, f"{name} q", rounded_to)
    check_close(k_out, k_ref, f"{name} k", rounded_to)
    check_cache(args["k_cache"], ref["k_cache"], ref["cache_position"], k_out, f"{name} k_cache")
    check_cache(args["v_cache"], ref["v_cache"], ref["cache_position"], ref["v"], f"{name} v_cache")
    return q_out, k_out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_gpu_dense_cache_variant_matches_reference(name, dtype):
    check_dense_op(make_args(VARIANTS[name], dtype, seed=len(name)), name)


@pytest.mark.parametrize("name", ["qwen3", "gemma3_one_plus_weight", "rope_first_hunyuan", "partial_rotary_glm",
                                  "interleaved_gptj"])
def test_gpu_paged_cache_variant_matches_reference(name):
    """vLLM's layout: the tokens of all sequences in one row, a [num_blocks, 16, Hkv, D] cache
    written through a slot mapping (a negative slot included)."""
    tokens, kv_heads, head_dim, blocks, block_size = 777, 8, 128, 128, 16
    args = make_args(VARIANTS[name], torch.bfloat16, batch=1, seq=tokens, cache_len=blocks * block_size,
                     seed=3 + len(name))
    slots = args.pop("cache_position")
    dense_k, dense_v = args.pop("k_cache"), args.pop("v_cache")
    key_cache = dense_k[0].transpose(0, 1).contiguous().view(blocks, block_size, kv_heads, head_dim)
    value_cache = dense_v[0].transpose(0, 1).contiguous().view(blocks, block_size, kv_heads, head_dim)
    key_before, value_before = key_cache.clone(), value_cache.clone()
    q_out, k_out = torch.ops.fusion_pass.qk_norm_rope_paged_cache(
        **args, key_cache=key_cache, value_cache=value_cache, slot_mapping=slots)
    q_ref, k_ref = qk_norm_rope_cache_reference(
        **args, k_cache=dense_k.clone(), v_cache=dense_v.clone(), cache_position=slots)
    check_close(q_out, q_ref, f"paged {name} q")
    check_close(k_out, k_ref, f"paged {name} k")
    # The same slot semantics as a [1, Hkv, slots, D] dense cache (paged_cache_rows' view).
    for after, before, rows, what in ((key_cache, key_before, k_out, "key_cache"),
                                      (value_cache, value_before, args["v"], "value_cache")):
        check_cache(after.view(-1, kv_heads, head_dim).transpose(0, 1).unsqueeze(0),
                    before.view(-1, kv_heads, head_dim).transpose(0, 1).unsqueeze(0), slots, rows, f"paged {name} {what}")


@pytest.mark.parametrize("name", ["qwen3", "gemma3_one_plus_weight"])
@pytest.mark.parametrize("head_dim,kv_heads", [(256, 16), (512, 4)])
def test_gpu_large_head_dims_match_reference(head_dim, kv_heads, name):
    """Gemma4's head dims: 256 on its sliding layers, 512 on its full-attention ones (32 query heads)."""
    args = make_args(VARIANTS[name], torch.bfloat16, kv_heads=kv_heads, head_dim=head_dim, cache_len=2048, seed=head_dim)
    check_dense_op(args, f"D{head_dim} {name}")


@pytest.mark.parametrize("name", ["qwen3", "gemma3_one_plus_weight", "no_weight"])
def test_gpu_autocast_over_fp32_weights_matches_reference(name):
    """bf16 autocast over an fp32 model: bf16 q/k/v, fp32 norm weights and tables, fp32 outputs
    and k cache, bf16 v cache (Qwen3's form rounds the normalized row, the others their output,
    to bf16). A flipped tie moves a bf16-rounded value, so the outputs are compared at bf16 ulps."""
    args = make_args(VARIANTS[name], torch.bfloat16, seed=11)
    for arg in ("q_weight", "k_weight", "cos", "sin", "k_cache"):
        if args[arg] is not None:
            args[arg] = args[arg].float()
    q_out, k_out = check_dense_op(args, f"autocast {name}", rounded_to=torch.bfloat16)
    assert q_out.dtype == k_out.dtype == torch.float32
