"""The rotary tables computed inside the fused forward kernel (``patterns/rotary_tables.py``).

CPU: the forward replacement is traced with its kernel as a graph node (as on CUDA), behind the
rotary embedding as Hugging Face writes it; the rewrite must point the kernel at the positions,
drop the table ops, and give the outputs of the kernel that read the tables (the kernel runs
under the Triton interpreter). Spellings that compute other tables must keep theirs.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table, triton_kernel_wrapper_functional
from torch._inductor.fx_passes.post_grad import decompose_triton_kernel_wrapper_functional
from torch.fx.experimental.proxy_tensor import make_fx

import fusion_pass
from fusion_pass.kernels import qk_norm_rope_cache_triton as cache_kernel
from fusion_pass.kernels import triton_device
from fusion_pass.patterns import qk_norm_rope_cache as forward_pattern
from fusion_pass.patterns.rotary_tables import compute_tables_in_kernels

BF16 = torch.bfloat16
B, S, HQ, HKV, D, L = 2, 5, 4, 2, 32, 16
VARIANT = forward_pattern.Variant("bshd", "dense")


@pytest.fixture(autouse=True)
def kernels_in_cpu_graphs(monkeypatch):
    monkeypatch.setattr(triton_device, "IN_GRAPH_DEVICE_TYPES", ("cuda", "cpu"))


def hf_rotary(position_ids, inv_freq, scaling=1.0):
    """``Qwen3RotaryEmbedding.forward`` (the matmul form)."""
    inv_freq_expanded = inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
    position_ids_expanded = position_ids[:, None, :].float()
    freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(BF16), (emb.sin() * scaling).to(BF16)


def elementwise_rotary(positions, inv_freq, scaling=1.0):
    """The same tables spelled elementwise, from a [S] position vector (``fusion_pass.demo``)."""
    freqs = positions[None, :, None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(BF16), (emb.sin() * scaling).to(BF16)


def in_graph_positions_rotary(position_ids, inv_freq, scaling=1.0):
    """Positions computed in the graph (``arange(past, past + S)``, as transformers derives them
    from ``cache_position``); the test passes ``inv_freq`` in the model dtype, as ``model.to(bf16)``
    leaves the buffer."""
    positions = (torch.arange(position_ids.shape[-1]) + 40000)[None].expand(position_ids.shape[0], -1)
    return hf_rotary(positions, inv_freq, scaling)


def fp64_rotary(position_ids, inv_freq, scaling=1.0):
    """Other tables: angles in fp64 (rounded differently from the model's fp32 ones)."""
    freqs = position_ids[:, :, None].double() * inv_freq.double()
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(BF16), (emb.sin() * scaling).to(BF16)


def inputs(seed=0, position_vector=False, inv_freq_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)

    def t(*shape):
        return torch.randn(*shape, generator=g).to(BF16)

    inv_freq = (1.0 / 1e6 ** (torch.arange(0, D, 2, dtype=torch.float32) / D)).to(inv_freq_dtype)
    position_ids = torch.tensor([[7, 900, 31000, 5, 123456]] * B)
    if position_vector:
        position_ids = position_ids[0]
    return [t(B, S, HQ, D), t(B, S, HKV, D), t(B, HKV, S, D), t(D) + 1, t(D) + 1, t(B, HKV, L, D),
            t(B, HKV, L, D), torch.arange(3, 3 + S), position_ids, inv_freq]


def traced(rotary, scaling=1.0, position_vector=False, inv_freq_dtype=torch.float32):
    def prologue(q, k, v, qw, kw, k_cache, v_cache, cache_position, position_ids, inv_freq):
        cos, sin = rotary(position_ids, inv_freq, scaling)
        return forward_pattern._fused(VARIANT, q, k, v, qw, kw, cos.unsqueeze(1), sin.unsqueeze(1), k_cache,
                                      v_cache, cache_position, 1e-6, 1e-6)

    return make_fx(prologue, tracing_mode="fake")(*inputs(position_vector=position_vector,
                                                          inv_freq_dtype=inv_freq_dtype))


def kernel_launch(gm):
    (hop,) = [n for n in gm.graph.nodes if n.target is triton_kernel_wrapper_functional]
    return hop.kwargs["kwargs"]


def table_ops(gm):
    return [n for n in gm.graph.nodes if n.target in (torch.ops.aten.cos.default, torch.ops.aten.sin.default)]


@pytest.mark.parametrize("rotary,scaling", [(hf_rotary, 1.0), (hf_rotary, 0.75), (elementwise_rotary, 1.0),
                                            (in_graph_positions_rotary, 1.0)],
                         ids=["hf_matmul", "hf_matmul_attention_scaling", "elementwise_positions_vector",
                              "positions_computed_bf16_inv_freq"])
def test_rotary_tables_move_into_the_kernel(rotary, scaling):
    vector = rotary is elementwise_rotary
    freq_dtype = BF16 if rotary is in_graph_positions_rotary else torch.float32
    tables = traced(rotary, scaling, vector, freq_dtype)
    fused = copy.deepcopy(tables)
    assert compute_tables_in_kernels(fused.graph) == 1
    fused.recompile()
    launch = kernel_launch(fused)
    assert launch["ROPE_FROM_POSITIONS"] and launch["cos_ptr"] is None and launch["sin_ptr"] is None
    assert launch["ATTENTION_SCALING"] == scaling and launch["position_ids_ptr"].meta["val"].dtype == torch.int64
    assert not table_ops(fused), fused.graph
    (hop,) = [n for n in fused.graph.nodes if n.target is triton_kernel_wrapper_functional]
    _, eager_kwargs = hop.meta["eager_input_vals"]  # the strides Inductor enforces: the same containers
    assert type(eager_kwargs["kwargs"]) is type(hop.kwargs["kwargs"])
    assert eager_kwargs["kwargs"]["position_ids_ptr"] is launch["position_ids_ptr"].meta["val"]
    # The tile and grid are launch_config's (the same rule as for tables).
    q, k = launch["q_out_ptr"].meta["val"], launch["k_out_ptr"].meta["val"]
    config = cache_kernel.launch_config(q.shape[0], q.shape[1], k.shape[1], q.shape[2], q.shape[3], q.element_size())
    assert {name: launch[name] for name in config.constexprs()} == config.constexprs()
    assert list(hop.kwargs["grid"]) == [tuple(config.grid)] and eager_kwargs["grid"] == hop.kwargs["grid"]
    assert kernel_side_table.get_kernel(hop.kwargs["kernel_idx"]).configs[0].num_warps == config.num_warps
    lowered = copy.deepcopy(fused)  # torch 2.11 raised here on a plain dict in eager_input_vals
    decompose_triton_kernel_wrapper_functional(lowered.graph)
    args = inputs(position_vector=vector, inv_freq_dtype=freq_dtype)
    want, got = tables(*args), fused(*args)
    for a, b in zip(want, got):
        # cos/sin in the kernel (numpy's under the interpreter) against torch's: a rare 1-ulp flip
        # of a bf16 table entry; every output stays within one bf16 ulp of its scale.
        assert a.shape == b.shape
        assert (a.float() - b.float()).abs().max() <= 2 ** -7 * a.float().abs().max()
        assert (a == b).float().mean() > 0.99


def test_tables_of_another_rounding_stay_tables():
    """fp64 angles round differently: not the function the kernel computes."""
    gm = traced(fp64_rotary)
    assert compute_tables_in_kernels(gm.graph) == 0
    assert kernel_launch(gm)["cos_ptr"] is not None and table_ops(gm)


def test_inv_freq_rounded_in_the_graph_stays_tables():
    """``inv_freq.to(bf16)`` inside the graph rounds the frequencies the kernel would read in fp32."""
    gm = traced(lambda p, f, s: hf_rotary(p, f.to(BF16), s))
    assert compute_tables_in_kernels(gm.graph) == 0


def test_tables_passed_in_stay_tables():
    def prologue(q, k, v, qw, kw, k_cache, v_cache, cache_position, cos, sin):
        return forward_pattern._fused(VARIANT, q, k, v, qw, kw, cos.unsqueeze(1), sin.unsqueeze(1), k_cache,
                                      v_cache, cache_position, 1e-6, 1e-6)

    args = inputs()[:8] + [torch.randn(B, S, D).to(BF16), torch.randn(B, S, D).to(BF16)]
    gm = make_fx(prologue, tracing_mode="fake")(*args)
    assert compute_tables_in_kernels(gm.graph) == 0


def test_a_table_another_node_reads_stays_computed():
    """Tables also returned (another consumer) are kept; the kernel still computes its own."""
    def prologue(q, k, v, qw, kw, k_cache, v_cache, cache_position, position_ids, inv_freq):
        cos, sin = hf_rotary(position_ids, inv_freq)
        out = forward_pattern._fused(VARIANT, q, k, v, qw, kw, cos.unsqueeze(1), sin.unsqueeze(1), k_cache,
                                     v_cache, cache_position, 1e-6, 1e-6)
        return (*out, cos)

    gm = make_fx(prologue, tracing_mode="fake")(*inputs())
    assert compute_tables_in_kernels(gm.graph) == 1
    gm.recompile()
    assert kernel_launch(gm)["ROPE_FROM_POSITIONS"]
    assert [n.target for n in table_ops(gm)] == [torch.ops.aten.cos.default]  # sin had no other reader


class _PrologueWithRotary(torch.nn.Module):
    """``Qwen3StylePrologue`` behind the rotary embedding as Hugging Face computes it."""

    def __init__(self, **geometry):
        super().__init__()
        from qwen3_style import Qwen3StylePrologue

        self.prologue = Qwen3StylePrologue(**geometry)
        head_dim = geometry["head_dim"]
        self.register_buffer("inv_freq", 1.0 / 1e6 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim),
                             persistent=False)

    def forward(self, hidden_states, position_ids, k_cache, v_cache, cache_position):
        cos, sin = hf_rotary(position_ids, self.inv_freq)
        return self.prologue(hidden_states, cos, sin, k_cache, v_cache, cache_position)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_compiled_prologue_launches_no_table_kernel():
    """Compiled with the pass on CUDA: our kernel computes cos/sin itself (no Inductor kernel
    computes a cos or sin), equal to eager within a bf16 ulp of the scale."""
    import re

    from torch._inductor.utils import run_and_get_code

    from qwen3_style import make_inputs

    model = _PrologueWithRotary(hidden=256, q_heads=8, kv_heads=2, head_dim=128).to("cuda", BF16)
    hidden, _, _, k_cache, v_cache, cache_position = (t.cuda() for t in make_inputs(
        seq=9, hidden=256, kv_heads=2, head_dim=128, cache_len=64))
    position_ids = (cache_position + 40000)[None].expand(2, -1)
    ref_caches = [k_cache.clone(), v_cache.clone()]
    with torch.no_grad():
        q_ref, _ = model(hidden, position_ids, *ref_caches, cache_position)
        (q, _), codes = run_and_get_code(torch.compile(model, options=fusion_pass.options()), hidden, position_ids,
                                         k_cache, v_cache, cache_position)
    code = "\n".join(codes)
    assert fusion_pass.match_counts().get("qk_norm_rope_cache") == 1
    assert "_qk_norm_rope_cache" in code and "fusion_pass" not in code
    assert not re.findall(r"triton_\w*(?:cos|sin)\w*\.run\(", code), "a table kernel still runs"
    scale = q_ref.float().abs().max()
    assert (q.float() - q_ref.float()).abs().max() <= 2 ** -7 * scale
    for got, want in zip((k_cache, v_cache), ref_caches):
        assert (got.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()
