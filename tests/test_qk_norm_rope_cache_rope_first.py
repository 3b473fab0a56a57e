"""The forward fusion in HunYuan's order: RoPE, then the per-head norm of the rotated q and k,
then the cache write (``HunYuanDenseV1Attention``). Exact match counts, bit-exact numerics
against eager, the op's ``rope_first`` computed as the reference computes it, and the Qwen3
order never fused as the HunYuan one or the other way round."""

from __future__ import annotations

import pytest
import torch

import fusion_pass
from fusion_pass.demo import apply_rotary_pos_emb
from fusion_pass.kernels.qk_norm_rope_cache_reference import NORM_STYLES, qk_norm_rope_cache_reference
from compile_capture import eager, fused_count, run_fused
from fused_op_calls import random_op_args
from prologue_variants import PAGED_WRITES, DensePrologue, PagedPrologue, make_paged_inputs
from qwen3_style import make_inputs


def fused_calls(graph_text: str) -> list[str]:
    return [line for line in graph_text.splitlines() if "fusion_pass.qk_norm_rope" in line]


@pytest.mark.parametrize("dtype,batch,seq", [(torch.bfloat16, 2, 5), (torch.float16, 2, 5), (torch.bfloat16, 1, 1)])
def test_dense_cache_rope_then_norm_fuses_once_and_is_bit_exact(dtype, batch, seq):
    model = DensePrologue(rope_first=True).to(dtype)
    inputs = list(make_inputs(batch=batch, seq=seq, dtype=dtype))
    (q_ref, _), ref_inputs = eager(model, inputs)
    (q_out, _), capture = run_fused(model, inputs)
    assert fused_count() == 1
    calls = fused_calls(capture.after[0])
    assert len(calls) == 1 and "rope_first=True" in calls[0], calls
    assert "near-miss" not in fusion_pass.report()
    assert torch.equal(q_out, q_ref)
    assert torch.equal(inputs[3], ref_inputs[3]) and torch.equal(inputs[4], ref_inputs[4])


@pytest.mark.parametrize("cache_write", PAGED_WRITES)
def test_paged_cache_rope_then_norm_fuses_once_and_is_bit_exact(cache_write):
    model = PagedPrologue(layout="tokens", cache_write=cache_write, rope_first=True).to(torch.bfloat16)
    inputs = list(make_paged_inputs(layout="tokens", cache_write=cache_write))
    (q_ref, _), ref_inputs = eager(model, inputs)
    (q_out, _), capture = run_fused(model, inputs)
    assert fused_count() == 1
    calls = fused_calls(capture.after[0])
    assert len(calls) == 1 and "qk_norm_rope_paged_cache" in calls[0] and "rope_first=True" in calls[0], calls
    assert torch.equal(q_out, q_ref)
    assert torch.equal(inputs[3], ref_inputs[3]) and torch.equal(inputs[4], ref_inputs[4])


def test_dynamic_true_rope_then_norm_fuses_with_eps_tensors():
    model = DensePrologue(rope_first=True, q_eps=1e-2, k_eps=3e-1).to(torch.bfloat16)
    inputs = list(make_inputs())
    (q_ref, _), ref_inputs = eager(model, inputs)
    (q_out, _), capture = run_fused(model, inputs, dynamic=True)
    assert fused_count() == 1
    assert "fusion_pass.qk_norm_rope_cache_eps_tensor" in capture.after[0] and "rope_first=True" in capture.after[0]
    assert torch.equal(q_out, q_ref)
    assert torch.equal(inputs[3], ref_inputs[3])


def test_with_the_training_family_enabled_the_cache_fusion_takes_the_layer():
    """``qkv_rope_qk_norm`` fuses projections -> RoPE -> norm for training: an inference layer
    that writes a cache must get the cache fusion (one Triton kernel), not that one."""
    model = DensePrologue(rope_first=True).to(torch.bfloat16)
    inputs = list(make_inputs())
    (q_ref, _), ref_inputs = eager(model, inputs)
    (q_out, _), _ = run_fused(model, inputs, families=("qk_norm_rope_cache", "qkv_rope_qk_norm"))
    assert fusion_pass.match_counts() == {"qk_norm_rope_cache": 1}
    assert torch.equal(q_out, q_ref)
    assert torch.equal(inputs[3], ref_inputs[3])


def test_rope_then_norm_without_cache_write_is_a_reported_near_miss():

    class RopeNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norms = DensePrologue(rope_first=True)  # its q_norm / k_norm

        def forward(self, q, k, cos, sin):
            q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            return self.norms.q_norm(q), self.norms.k_norm(k)

    model = RopeNorm().to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 5, h, 16, generator=g).to(torch.bfloat16) for h in (4, 2))
    cos, sin = make_inputs()[1:3]
    run_fused(model, [q, k, cos, sin])
    assert fused_count() == 0
    assert "RoPE -> per-head RMSNorm without a matching K/V cache write (left unfused) (x2)" in fusion_pass.report()


def test_qwen3_order_is_still_fused_without_rope_first():
    """The two orders are different graphs: each is fused with its own op arguments."""
    model = DensePrologue(norm_after_transpose=True).to(torch.bfloat16)
    inputs = list(make_inputs())
    (q_ref, _), _ = eager(model, inputs)
    (q_out, _), capture = run_fused(model, inputs)
    assert fused_count() == 1
    assert "rope_first" not in capture.after[0]
    assert torch.equal(q_out, q_ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm", NORM_STYLES)
def test_op_rope_first_matches_the_reference_and_differs_from_norm_first(norm, dtype):
    args = dict(random_op_args(dtype, 64, norm=norm, seed=1, cache_position=torch.arange(3, 8)), norm=norm)

    def clone(a):
        return {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in a.items()}

    ref, norm_first = clone(args), clone(args)
    q_out, k_out = torch.ops.fusion_pass.qk_norm_rope_cache(**args, rope_first=True)
    q_ref, k_ref = qk_norm_rope_cache_reference(**ref, rope_first=True)
    if dtype == torch.bfloat16:
        assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    else:  # numpy's fp32 statistic can flip an fp16 rounding under the interpreter: 1 ulp
        torch.testing.assert_close(q_out, q_ref, rtol=2 * 2.0**-10, atol=0)
        torch.testing.assert_close(k_out, k_ref, rtol=2 * 2.0**-10, atol=0)
    assert torch.equal(args["k_cache"][:, :, 3:8], k_out) and torch.equal(args["v_cache"], ref["v_cache"])
    q_norm_first, _ = qk_norm_rope_cache_reference(**norm_first)
    assert not torch.equal(q_out, q_norm_first)
