"""The Triton kernel behind ``fusion_pass.qk_norm_rope_cache`` against the PyTorch reference.

Without CUDA the kernel runs under the Triton interpreter (``TRITON_INTERPRET=1``, set below
before anything imports Triton); shapes stay small because the interpreter costs ~1 ms per
program. With CUDA the same tests run on the GPU, plus the ``gpu``-marked ones (model-sized
shapes, a 262144-row cache addressed past 2^31 elements, no recompile per sequence length).

Error unit: ulps at the scale of the RoPE terms (``rope_ulp_error``), because the final
``round(x*cos) + round(rotate_half(x)*sin)`` can cancel. The kernel rounds like the reference;
the only differences come from the fp32 RMS statistic (summation order, rsqrt), which can
flip one rounding that the weight and RoPE products then carry: bounds in ``MAX_ULPS``
(measured on the H200 with kernel v3: at most 2 bf16 ulps in the benchmark, on < 0.1 % of the
elements; the GPU bound stays at 3 until the tests themselves report their maximum).
"""

from __future__ import annotations

import dataclasses

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import fusion_pass  # noqa: E402,F401  (registers torch.ops.fusion_pass.*)
from fusion_pass.kernels import qk_norm_rope_cache_triton as kernel  # noqa: E402
from fusion_pass.kernels import qk_norm_rope_cache_reference as cache_reference  # noqa: E402
from fusion_pass.kernels.qk_norm_rope_cache_reference import (  # noqa: E402
    qk_norm_rope_cache_reference,
    rms_norm_reference,
)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")
needs_kernel = pytest.mark.skipif(not (CUDA or INTERPRETED), reason="needs CUDA or TRITON_INTERPRET=1")

pytestmark = needs_kernel

# Interpreter: exact emulation of the reference's rounding (0 bf16 ulps measured). GPU: Triton
# sums the squares in another order than torch's mean, so the fp32 statistic can differ in its
# last bit; where a normalized value sits on a bf16 rounding tie that flips it by one ulp, and
# the weight and RoPE products carry that on, on a tiny fraction of elements (checked below).
MAX_ULPS = {torch.bfloat16: 3.0 if CUDA else 1.0, torch.float16: 3.0 if CUDA else 2.0, torch.float32: 8.0}
EPS_Q, EPS_K = 1e-6, 1e-5


# ----------------------------------------------------------------------------------------
# Building cases
# ----------------------------------------------------------------------------------------


def inv_freq_for(head_dim: int, theta: float = 1e7) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=DEVICE) / head_dim))


def make_case(
    batch=2, q_heads=4, kv_heads=2, seq=5, head_dim=64, cache_len=32, dtype=torch.bfloat16,
    layout="hf", cos_batch=1, positions=None, seed=0,
):
    """Random inputs; caches poisoned with random data (never zeros) so a stray write shows.

    layout: "hf" (transposed views of [B, S, H, D], as Hugging Face gives), "contiguous"
    ([B, H, S, D]) or "fused" (q/k/v are non-dense slices of one [B, S, (Hq + 2 Hkv) * D] buffer).
    """
    g = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=DEVICE)

    if layout == "hf":
        q = randn(batch, seq, q_heads, head_dim).transpose(1, 2)
        k = randn(batch, seq, kv_heads, head_dim, scale=3.0).transpose(1, 2)
        v = randn(batch, seq, kv_heads, head_dim).transpose(1, 2)
    elif layout == "contiguous":
        q = randn(batch, q_heads, seq, head_dim)
        k = randn(batch, kv_heads, seq, head_dim, scale=3.0)
        v = randn(batch, kv_heads, seq, head_dim)
    elif layout == "fused":
        qkv = randn(batch, seq, (q_heads + 2 * kv_heads) * head_dim)
        q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        q = q.unflatten(-1, (q_heads, head_dim)).transpose(1, 2)
        k = k.unflatten(-1, (kv_heads, head_dim)).transpose(1, 2)
        v = v.unflatten(-1, (kv_heads, head_dim)).transpose(1, 2)
    else:
        raise ValueError(layout)
    if positions is None:
        positions = torch.randperm(cache_len, generator=g)[:seq]
    cache_position = torch.as_tensor(positions, dtype=torch.int64).to(DEVICE)
    position_ids = (cache_position.clamp(0, cache_len - 1)[None, :] + torch.arange(cos_batch, device=DEVICE)[:, None] * 3)
    cos, sin = cache_reference.rope_cos_sin_reference(position_ids, inv_freq_for(head_dim), 1.0, dtype)
    return dict(
        q=q, k=k, v=v,
        q_weight=(torch.rand(head_dim, generator=g) + 0.5).to(dtype=dtype, device=DEVICE),
        k_weight=(torch.rand(head_dim, generator=g) + 0.5).to(dtype=dtype, device=DEVICE),
        cos=cos, sin=sin,
        k_cache=randn(batch, kv_heads, cache_len, head_dim),
        v_cache=randn(batch, kv_heads, cache_len, head_dim),
        cache_position=cache_position,
    )


def expected_cache(before: torch.Tensor, cache_position: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``before`` with rows[:, :, s] at cache_position[s] for positions in [-L, L) only (negative
    ones count from the end: PyTorch's own indexing below does that)."""
    valid = (cache_position >= -before.shape[2]) & (cache_position < before.shape[2])
    out = before.clone()
    out[:, :, cache_position[valid]] = rows[:, :, valid]
    return out


def check_against_reference(case, q_out, k_out, k_cache_before, v_cache_before, max_ulps=None, cos=None, sin=None):
    """q_out/k_out within the ulp bound of the reference; caches = before + exactly the written rows."""
    cos = case["cos"] if cos is None else cos
    sin = case["sin"] if sin is None else sin
    dtype = case["q"].dtype
    bound = MAX_ULPS[dtype] if max_ulps is None else max_ulps
    q_ref, k_ref = qk_norm_rope_cache_reference(
        case["q"], case["k"], case["v"], case["q_weight"], case["k_weight"], cos, sin,
        # int64 positions: the reference's index_copy_ rejects the int32 ones the op accepts.
        k_cache_before.clone(), v_cache_before.clone(), case["cache_position"].long(), EPS_Q, EPS_K,
    )
    q_err = cache_reference.rope_ulp_error(q_out, q_ref, rms_norm_reference(case["q"], case["q_weight"], EPS_Q), cos, sin)
    k_err = cache_reference.rope_ulp_error(k_out, k_ref, rms_norm_reference(case["k"], case["k_weight"], EPS_K), cos, sin)
    assert q_err <= bound, f"q_out: {q_err} ulps > {bound}"
    assert k_err <= bound, f"k_out: {k_err} ulps > {bound}"
    position = case["cache_position"].to(torch.int64)
    # Written rows hold exactly k_out / v; every other row is bit-identical to before.
    assert torch.equal(case["k_cache"], expected_cache(k_cache_before, position, k_out))
    assert torch.equal(case["v_cache"], expected_cache(v_cache_before, position, case["v"]))
    return max(q_err, k_err)


def run_kernel(case, check_positions=True, **tile):
    q_out, k_out = torch.empty_like(case["q"]), torch.empty_like(case["k"])
    k_before, v_before = case["k_cache"].clone(), case["v_cache"].clone()
    kernel.qk_norm_rope_cache_triton(
        case["q"], case["k"], case["v"], case["q_weight"], case["k_weight"], case["cos"], case["sin"],
        case["k_cache"], case["v_cache"], case["cache_position"], EPS_Q, EPS_K, q_out, k_out, tile=tile,
        check_positions=check_positions,
    )
    return q_out, k_out, k_before, v_before


def run_and_check(case, max_ulps=None, check_positions=True, **tile):
    q_out, k_out, k_before, v_before = run_kernel(case, check_positions, **tile)
    return check_against_reference(case, q_out, k_out, k_before, v_before, max_ulps)


# ----------------------------------------------------------------------------------------
# Interpreter-sized tests (also run on CUDA)
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
# 512: Gemma4's full-attention layers.
@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
def test_dtypes_and_head_dims(dtype, head_dim):
    run_and_check(make_case(head_dim=head_dim, dtype=dtype, seed=head_dim))


@pytest.mark.parametrize(
    "q_heads,kv_heads,seq",
    [(4, 4, 1), (8, 2, 5), (6, 1, 33), (12, 4, 3), (3, 3, 2), (16, 8, 1)],
)
def test_gqa_ratios_and_seq_lens(q_heads, kv_heads, seq):
    run_and_check(make_case(q_heads=q_heads, kv_heads=kv_heads, seq=seq, cache_len=64, cos_batch=2, seed=seq))


@pytest.mark.parametrize("seq", [293, 541])
def test_odd_long_seq(seq):
    run_and_check(make_case(batch=1, q_heads=2, kv_heads=1, seq=seq, head_dim=64, cache_len=1024, seed=seq))


def test_decode_one_token_batched():
    # S = 1 with a per-batch cos table and the cache nearly full.
    run_and_check(make_case(batch=3, q_heads=8, kv_heads=2, seq=1, head_dim=128, cache_len=16, cos_batch=3,
                            positions=[15]))


def test_without_asserts_out_of_range_positions_are_skipped_and_negative_ones_count_from_the_end():
    """Device asserts off (Inductor's ``assert_indirect_indexing=False``): never a write out of bounds."""
    length = 16
    # -5 writes row 11 (Python indexing, as ``cache[:, :, pos] = k``); outside [-L, L) is skipped.
    positions = [3, -5, length, 0, -length - 1, length + 100, 2**40, -(2**40), length - 1]
    case = make_case(seq=len(positions), cache_len=length, positions=positions, cos_batch=2, seed=3)
    run_and_check(case, check_positions=False)


def test_without_asserts_all_positions_out_of_range_leave_caches_untouched():
    case = make_case(seq=4, cache_len=8, positions=[8, 9, -9, -20], seed=4)
    q_out, k_out, k_before, v_before = run_kernel(case, check_positions=False)
    assert torch.equal(case["k_cache"], k_before) and torch.equal(case["v_cache"], v_before)
    check_against_reference(case, q_out, k_out, k_before, v_before)


@pytest.mark.skipif(not INTERPRETED, reason="the interpreter's assert (CUDA: test_gpu_out_of_range_position_asserts)")
def test_an_out_of_range_position_fails_the_device_assert_where_asserts_are_compiled_in(monkeypatch):
    """The interpreter compiles asserts out unless Triton's ``debug`` option is on; with it on,
    as a CUDA launch with ``check_positions`` and Inductor's launches have it, the kernel stops."""
    from triton.runtime import interpreter
    from triton.runtime.errors import InterpreterError

    builder = interpreter.interpreter_builder
    monkeypatch.setattr(builder, "options", dataclasses.replace(builder.options, debug=True))
    run_and_check(make_case(seq=4, cache_len=8, positions=[1, -8, 2, 7], seed=6))  # in range: no assert
    for bad in (8, -9):
        case = make_case(seq=4, cache_len=8, positions=[1, bad, 2, 3], seed=6)
        with pytest.raises(InterpreterError, match=r"cache_position out of range"):
            run_kernel(case)


def test_int32_cache_position():
    case = make_case(seq=7, cache_len=40, seed=5)
    case["cache_position"] = case["cache_position"].to(torch.int32)
    run_and_check(case)


@pytest.mark.parametrize("layout", ["contiguous", "fused"])
def test_input_layouts(layout):
    run_and_check(make_case(layout=layout, q_heads=6, kv_heads=2, seq=9, head_dim=64, cos_batch=2, seed=6))


def test_strided_caches_and_outputs_write_nothing_outside():
    """Caches and outputs are views into padded, poisoned buffers: the padding must survive."""
    dtype, batch, q_heads, kv_heads, seq, head_dim, length, pad = torch.bfloat16, 2, 4, 2, 6, 64, 24, 16
    case = make_case(batch=batch, q_heads=q_heads, kv_heads=kv_heads, seq=seq, head_dim=head_dim,
                     cache_len=length, dtype=dtype, seed=7)
    # Caches: [B, L, Hkv, D + pad] storage viewed as [B, Hkv, L, D] (row stride != D, head stride < row stride).
    k_store = torch.randn(batch, length, kv_heads, head_dim + pad, device=DEVICE).to(dtype)
    v_store = torch.randn(batch, length, kv_heads, head_dim + pad, device=DEVICE).to(dtype)
    case["k_cache"] = k_store[..., :head_dim].transpose(1, 2)
    case["v_cache"] = v_store[..., :head_dim].transpose(1, 2)
    k_store_before, v_store_before = k_store.clone(), v_store.clone()
    # Outputs: contiguous [B, H, S, D + pad] buffers (strides differ from q's HF layout).
    q_out_store = torch.randn(batch, q_heads, seq, head_dim + pad, device=DEVICE).to(dtype)
    k_out_store = torch.randn(batch, kv_heads, seq, head_dim + pad, device=DEVICE).to(dtype)
    q_pad_before, k_pad_before = q_out_store[..., head_dim:].clone(), k_out_store[..., head_dim:].clone()
    q_out, k_out = q_out_store[..., :head_dim], k_out_store[..., :head_dim]
    k_before, v_before = case["k_cache"].clone(), case["v_cache"].clone()
    kernel.qk_norm_rope_cache_triton(
        case["q"], case["k"], case["v"], case["q_weight"], case["k_weight"], case["cos"], case["sin"],
        case["k_cache"], case["v_cache"], case["cache_position"], EPS_Q, EPS_K, q_out, k_out,
    )
    check_against_reference(case, q_out, k_out, k_before, v_before)
    assert torch.equal(k_store[..., head_dim:], k_store_before[..., head_dim:])
    assert torch.equal(v_store[..., head_dim:], v_store_before[..., head_dim:])
    assert torch.equal(q_out_store[..., head_dim:], q_pad_before)
    assert torch.equal(k_out_store[..., head_dim:], k_pad_before)


@pytest.mark.parametrize(
    "head_dim,overrides",
    [
        (64, dict(heads_per_program=4, tokens_per_program=8)),  # heads > Hkv, tokens > S: masked tails
        (64, dict(heads_per_program=1, tokens_per_program=1, num_warps=1)),
        (96, {}),  # non-power-of-two D: the half (48) is padded to 64 and masked
        (48, dict(tokens_per_program=2)),
        (16, {}),
        (64, dict(heads_per_program=2, blocks_per_program=2)),  # 3 q blocks: a full q program, a masked tail
        # One head per block, several blocks per program, and head counts they do not divide:
        (64, dict(heads_per_program=1, tokens_per_program=4, blocks_per_program=4)),
        (64, dict(heads_per_program=1, tokens_per_program=8, blocks_per_program=5)),
        # One grid axis, a token block's groups consecutive: the program id splits into both.
        (64, dict(heads_per_program=1, tokens_per_program=2, blocks_per_program=4, group_major=True)),
        (64, dict(heads_per_program=2, tokens_per_program=4, group_major=True)),
    ],
)
def test_partial_tiles(head_dim, overrides):
    run_and_check(make_case(q_heads=6, kv_heads=2, seq=5, head_dim=head_dim, seed=head_dim), **overrides)


def test_the_streaming_tile_as_the_rule_picks_it():
    """B x S >= STREAM_FROM_TOKENS with no overrides: one head x 128 tokens per block (D = 16),
    4 blocks per program, a masked tail of q heads (6 = 4 + 2), of tokens (STREAM_FROM_TOKENS + 37,
    37 past a multiple of 128) and of cache positions; cos/sin read from tables and computed from
    positions."""
    seq = kernel.STREAM_FROM_TOKENS + 37
    config = kernel.launch_config(1, 6, 2, seq, 16, 2)
    assert (config.heads_per_program, config.tokens_per_program, config.blocks_per_program) == (1, 128, 4)
    case = make_case(batch=1, q_heads=6, kv_heads=2, seq=seq, head_dim=16, cache_len=seq + 3, seed=12)
    run_and_check(case)
    position_ids = torch.arange(seq, device=DEVICE)[None] * 7
    inv_freq = inv_freq_for(16)
    q_out, k_out = torch.empty_like(case["q"]), torch.empty_like(case["k"])
    k_before, v_before = case["k_cache"].clone(), case["v_cache"].clone()
    kernel.qk_norm_rope_cache_from_positions_triton(
        case["q"], case["k"], case["v"], case["q_weight"], case["k_weight"], position_ids, inv_freq, 1.0,
        case["k_cache"], case["v_cache"], case["cache_position"], EPS_Q, EPS_K, q_out, k_out)
    cos, sin = cache_reference.rope_cos_sin_reference(position_ids, inv_freq, 1.0, torch.bfloat16)
    check_against_reference(case, q_out, k_out, k_before, v_before, MAX_ULPS[torch.bfloat16] + 1, cos=cos, sin=sin)


def test_empty_sequence_is_a_no_op():
    case = make_case(seq=0, seed=8)
    q_out, k_out, k_before, v_before = run_kernel(case)
    assert q_out.numel() == 0 and torch.equal(case["k_cache"], k_before) and torch.equal(case["v_cache"], v_before)


def test_no_query_heads_still_writes_k_out_and_both_caches():
    """Hq = 0 with non-empty k/v (issue 18 item 4): nothing to do for q, everything for k and v."""
    run_and_check(make_case(q_heads=0, kv_heads=2, seq=5, seed=9))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("position_batch,scaling", [(2, 1.0), (1, 0.7071)])
@pytest.mark.parametrize("tile", [dict(blocks_per_program=1), dict(blocks_per_program=3),
                                  dict(heads_per_program=1, tokens_per_program=4, blocks_per_program=3)],
                         ids=["one-block", "three-blocks", "one-head-blocks"])
def test_from_positions(dtype, position_batch, scaling, tile):
    """cos/sin computed in the kernel from position_ids and inv_freq, positions up to 262143."""
    batch, head_dim, length = 2, 64, 64
    case = make_case(batch=batch, q_heads=4, kv_heads=2, seq=7, head_dim=head_dim, cache_len=length, dtype=dtype,
                     seed=9)
    position_ids = torch.tensor([[0, 1, 5, 4096, 131071, 262100, 262143], [7, 3, 2, 1, 0, 99999, 200000]],
                                device=DEVICE)[:position_batch]
    if position_batch == 1:
        position_ids = position_ids.expand(batch, -1)  # batch stride 0
    inv_freq = inv_freq_for(head_dim)
    q_out, k_out = torch.empty_like(case["q"]), torch.empty_like(case["k"])
    k_before, v_before = case["k_cache"].clone(), case["v_cache"].clone()
    kernel.qk_norm_rope_cache_from_positions_triton(
        case["q"], case["k"], case["v"], case["q_weight"], case["k_weight"], position_ids, inv_freq, scaling,
        case["k_cache"], case["v_cache"], case["cache_position"], EPS_Q, EPS_K, q_out, k_out,
        tile=tile,
    )
    cos, sin = cache_reference.rope_cos_sin_reference(position_ids, inv_freq, scaling, dtype)
    # One more ulp than the tensor path: an fp32 cos/sin one ulp off can flip its own rounding.
    check_against_reference(case, q_out, k_out, k_before, v_before, MAX_ULPS[dtype] + 1, cos=cos, sin=sin)


def test_from_positions_reference_matches_composition():
    case = make_case(seq=3, seed=10)
    position_ids = torch.tensor([[5, 6, 7], [1, 2, 3]], device=DEVICE)
    inv_freq = inv_freq_for(64)
    k_a, v_a, k_b, v_b = (case[n].clone() for n in ("k_cache", "v_cache", "k_cache", "v_cache"))
    args = (case["q"], case["k"], case["v"], case["q_weight"], case["k_weight"])
    q1, k1 = cache_reference.qk_norm_rope_cache_from_positions_reference(
        *args, position_ids, inv_freq, 1.0, k_a, v_a, case["cache_position"], EPS_Q, EPS_K)
    cos, sin = cache_reference.rope_cos_sin_reference(position_ids, inv_freq, 1.0, torch.bfloat16)
    q2, k2 = qk_norm_rope_cache_reference(*args, cos, sin, k_b, v_b, case["cache_position"], EPS_Q, EPS_K)
    assert torch.equal(q1, q2) and torch.equal(k1, k2) and torch.equal(k_a, k_b) and torch.equal(v_a, v_b)


def test_op_dispatches_to_the_kernel():
    """The registered op, run eagerly: in-place caches, eager strides, values of the reference."""
    case = make_case(q_heads=8, kv_heads=2, seq=6, head_dim=128, cos_batch=2, seed=11)
    k_before, v_before = case["k_cache"].clone(), case["v_cache"].clone()
    k_ptr, v_ptr = case["k_cache"].data_ptr(), case["v_cache"].data_ptr()
    q_out, k_out = torch.ops.fusion_pass.qk_norm_rope_cache(
        case["q"], case["k"], case["v"], case["q_weight"], case["k_weight"], case["cos"], case["sin"],
        case["k_cache"], case["v_cache"], case["cache_position"], EPS_Q, EPS_K,
    )
    assert q_out.stride() == case["q"].stride() and k_out.stride() == case["k"].stride()
    assert case["k_cache"].data_ptr() == k_ptr and case["v_cache"].data_ptr() == v_ptr
    check_against_reference(case, q_out, k_out, k_before, v_before)


def test_launch_config_rule():
    """Qwen3-Coder-480B (Hq 96, Hkv 8, D 128, bf16), with or without cos/sin computed in the kernel."""
    # From STREAM_FROM_TOKENS tokens on: one head x 16 tokens per block (one 16-byte vector per lane
    # per half row with 4 warps), STREAM_BLOCKS = 4 blocks of one tensor per program:
    # 96 / 4 = 24 q groups, then 2 k and 2 v groups, a token block's 28 groups on consecutive
    # program ids of grid axis 0.
    big = kernel.launch_config(1, 96, 8, 4096, 128, 2)
    assert (big.heads_per_program, big.tokens_per_program, big.blocks_per_program, big.num_warps) == (1, 16, 4, 4)
    assert big.group_major and big.constexprs()["GROUP_MAJOR"]
    assert big.grid == (256 * (24 + 2 + 2), 1, 1)
    at_threshold = kernel.launch_config(8, 96, 8, kernel.STREAM_FROM_TOKENS // 8, 128, 2)
    assert at_threshold.grid == (kernel.STREAM_FROM_TOKENS // 8 // 16 * 28, 1, 8)
    # Below it: 8 heads x 4 tokens, one block per program, 12 + 1 + 1 groups on grid axis 1.
    small = kernel.launch_config(1, 96, 8, kernel.STREAM_FROM_TOKENS - 1, 128, 2)
    assert (small.heads_per_program, small.tokens_per_program, small.blocks_per_program, small.num_warps) == (
        8, 4, 1, 4)
    assert not small.group_major
    assert small.grid == (kernel.STREAM_FROM_TOKENS // 4, 14, 1)
    decode = kernel.launch_config(4, 96, 8, 1, 128, 2)
    assert (decode.heads_per_program, decode.tokens_per_program, decode.num_warps) == (8, 1, 2)
    assert decode.grid == (1, 14, 4)
    # Many short rows (batched decode, short chunks) keep the small tile: the streaming tile's
    # 16 tokens would be mostly masked.
    for batch, seq in ((1024, 1), (256, 4), (128, 15)):
        c = kernel.launch_config(batch, 96, 8, seq, 128, 2)
        assert (c.heads_per_program, c.blocks_per_program) == (8, 1), (batch, seq)
    assert kernel.launch_config(64, 96, 8, 16, 128, 2).heads_per_program == 1
    # Other head dims and dtypes keep one vector per lane: D 64 -> 32 tokens; fp32 D 128 -> 8.
    assert kernel.launch_config(1, 32, 8, 4096, 64, 2).tokens_per_program == 32
    assert kernel.launch_config(1, 32, 8, 4096, 128, 4).tokens_per_program == 8
    # A head count the blocks do not divide: a masked tail group (Hq 6 -> 2 q groups of 4).
    assert kernel.launch_config(1, 6, 2, 4096, 128, 2).grid == (256 * (2 + 1 + 1), 1, 1)
    # Overrides win over the rule.
    tuned = kernel.launch_config(1, 96, 8, 4096, 128, 2, tokens_per_program=4)
    assert (tuned.heads_per_program, tuned.tokens_per_program, tuned.blocks_per_program) == (8, 4, 1)
    # No new constexpr configuration for a new S once S >= 4 within either tile
    # (seq_len itself is not specialized).
    constexprs = {
        (c.half_block, c.heads_per_program, c.tokens_per_program, c.blocks_per_program, c.num_warps, c.group_major)
        for s in (4, 5, 128, 255, 256, 293, 541, 1024, 4096, 100000)
        for c in [kernel.launch_config(1, 96, 8, s, 128, 2)]
    }
    assert len(constexprs) == 2
    if not INTERPRETED:
        assert "seq_len" in kernel._qk_norm_rope_cache_kernel.do_not_specialize


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    batch=st.integers(1, 3),
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 3),
    seq=st.integers(1, 24),
    head_dim=st.sampled_from([16, 32, 64, 128]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    layout=st.sampled_from(["hf", "contiguous", "fused"]),
    per_batch_cos=st.booleans(),
    out_of_range=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_property_random_shapes(batch, kv_heads, group, seq, head_dim, dtype, layout, per_batch_cos, out_of_range,
                                seed):
    length = seq + 8
    g = torch.Generator().manual_seed(seed)
    positions = torch.randperm(length, generator=g)[:seq]
    bad = torch.tensor([-length - 1, length, length + 5, -length - 7])[: min(out_of_range, seq)]
    positions[: bad.numel()] = bad
    case = make_case(batch=batch, q_heads=kv_heads * group, kv_heads=kv_heads, seq=seq, head_dim=head_dim,
                     cache_len=length, dtype=dtype, layout=layout, cos_batch=batch if per_batch_cos else 1,
                     positions=positions.tolist(), seed=seed)
    run_and_check(case, check_positions=not bad.numel())  # out-of-range ones: skipped with asserts off


# ----------------------------------------------------------------------------------------
# GPU-only tests
# ----------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("seq,batch", [(1, 4), (293, 1), (541, 2), (2048, 1)])
def test_gpu_model_shapes_bf16_within_three_ulps_and_mostly_exact(seq, batch):
    case = make_case(batch=batch, q_heads=96, kv_heads=8, seq=seq, head_dim=128, cache_len=4096,
                     positions=list(range(100, 100 + seq)), seed=seq)
    q_in = case["q"].clone()
    assert run_and_check(case) <= MAX_ULPS[torch.bfloat16]
    q_out = torch.empty_like(q_in)
    k_out = torch.empty_like(case["k"])
    kernel.qk_norm_rope_cache_triton(
        q_in, case["k"], case["v"], case["q_weight"], case["k_weight"], case["cos"], case["sin"],
        case["k_cache"], case["v_cache"], case["cache_position"], EPS_Q, EPS_K, q_out, k_out,
    )
    q_ref = qk_norm_rope_cache_reference(
        q_in, case["k"], case["v"], case["q_weight"], case["k_weight"], case["cos"], case["sin"],
        case["k_cache"].clone(), case["v_cache"].clone(), case["cache_position"].long(), EPS_Q, EPS_K,
    )[0]
    differing = (q_out != q_ref).float().mean().item()
    print(f"S={seq} B={batch}: {differing:.2e} of q elements differ from the reference")
    # v1 (roundings folded into bf16 FMAs by the compiler) differed on ~12 %; a flipped tie
    # of the fp32 statistic touches ~3e-6 of the normalized values.
    assert differing < 1e-3


@needs_cuda
@pytest.mark.gpu
def test_gpu_from_positions_model_shape():
    batch, seq, head_dim = 2, 541, 128
    case = make_case(batch=batch, q_heads=96, kv_heads=8, seq=seq, head_dim=head_dim, cache_len=262144,
                     positions=list(range(261000, 261000 + seq)), seed=12)
    position_ids = case["cache_position"][None, :].expand(batch, -1)
    inv_freq = inv_freq_for(head_dim)
    q_out, k_out = torch.empty_like(case["q"]), torch.empty_like(case["k"])
    k_before, v_before = case["k_cache"].clone(), case["v_cache"].clone()
    kernel.qk_norm_rope_cache_from_positions_triton(
        case["q"], case["k"], case["v"], case["q_weight"], case["k_weight"], position_ids, inv_freq, 1.0,
        case["k_cache"], case["v_cache"], case["cache_position"], EPS_Q, EPS_K, q_out, k_out,
    )
    cos, sin = cache_reference.rope_cos_sin_reference(position_ids, inv_freq, 1.0, torch.bfloat16)
    check_against_reference(case, q_out, k_out, k_before, v_before, 2.0, cos=cos, sin=sin)


@needs_cuda
@pytest.mark.gpu
def test_gpu_cache_offsets_past_int32():
    """[9, 8, 262144, 128] bf16 caches: the last rows sit past element 2^31 (B = 8 ends exactly at it)."""
    batch, kv_heads, length, head_dim = 9, 8, 262144, 128
    dtype = torch.bfloat16
    positions = torch.tensor([length - 1, length - 3, 0, length], device=DEVICE)  # the last one: skipped
    seq = positions.numel()
    g = torch.Generator(device=DEVICE).manual_seed(13)
    q = torch.randn(batch, seq, 16, head_dim, device=DEVICE, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(batch, seq, kv_heads, head_dim, device=DEVICE, generator=g).to(dtype).transpose(1, 2)
    v = torch.randn(batch, seq, kv_heads, head_dim, device=DEVICE, generator=g).to(dtype).transpose(1, 2)
    weights = torch.rand(2, head_dim, device=DEVICE, generator=g).to(dtype) + 0.5
    k_cache = torch.full((batch, kv_heads, length, head_dim), 7.0, dtype=dtype, device=DEVICE)
    v_cache = torch.full((batch, kv_heads, length, head_dim), -7.0, dtype=dtype, device=DEVICE)
    assert (batch - 1) * k_cache.stride(0) + (kv_heads - 1) * k_cache.stride(1) + (length - 1) * head_dim >= 2**31
    cos, sin = cache_reference.rope_cos_sin_reference(positions.clamp(max=length - 1)[None], inv_freq_for(head_dim), 1.0, dtype)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    kernel.qk_norm_rope_cache_triton(q, k, v, weights[0], weights[1], cos, sin, k_cache, v_cache, positions,
                                     EPS_Q, EPS_K, q_out, k_out, check_positions=False)
    q_ref, k_ref = qk_norm_rope_cache_reference(
        q, k, v, weights[0], weights[1], cos, sin, k_cache[:, :, :1].clone(), v_cache[:, :, :1].clone(),
        torch.full_like(positions, -1), EPS_Q, EPS_K)
    assert cache_reference.rope_ulp_error(q_out, q_ref, rms_norm_reference(q, weights[0], EPS_Q), cos, sin) <= 1.0
    assert cache_reference.rope_ulp_error(k_out, k_ref, rms_norm_reference(k, weights[1], EPS_K), cos, sin) <= 1.0
    for s, p in enumerate(positions.tolist()[:3]):
        assert torch.equal(k_cache[:, :, p], k_out[:, :, s]), p
        assert torch.equal(v_cache[:, :, p], v[:, :, s]), p
    # Neighbours of the written rows (and the rows a 32-bit wrap-around would hit) are untouched.
    for p in (length - 2, length - 4, 1, 2, length // 2):
        assert bool((k_cache[:, :, p] == 7.0).all()) and bool((v_cache[:, :, p] == -7.0).all()), p


def _compiled_variants(fn) -> int:
    caches = getattr(fn, "device_caches", None)
    if not caches:
        pytest.skip("this Triton has no JITFunction.device_caches")
    return sum(len(entry[0]) for entry in caches.values())


@needs_cuda
@pytest.mark.gpu
def test_gpu_no_recompile_for_new_seq_lens():
    def call(seq):
        case = make_case(batch=1, q_heads=96, kv_heads=8, seq=seq, head_dim=128, cache_len=4096,
                         positions=list(range(seq)), seed=seq)
        run_kernel(case)

    call(5)  # the small tile
    call(2048)  # the streaming tile (>= STREAM_FROM_TOKENS tokens)
    before = _compiled_variants(kernel._qk_norm_rope_cache_kernel)
    for seq in (4, 16, 293, 541, 1000, 1024, 1500, 4096):
        call(seq)
    assert _compiled_variants(kernel._qk_norm_rope_cache_kernel) == before
