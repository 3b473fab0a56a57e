"""Training fusion ``qk_norm_rope_backward``: one tensor's per-head RMSNorm <-> RoPE, backward ours (issue 17).

Table-driven: blocks spelled the ways training code writes them (where q/k come from, the norm's
spelling, rotate_half's, the order and placement, what requires grad), compiled with AOT autograd
and Inductor's joint-graph passes (``joint_pass_backend``: the graphs then run eagerly, CPU, no
C++ codegen). Each must fuse both tensors, call our backward op twice, and give eager's gradients
(fp32: within 1e-5 relative). Look-alikes must be left alone.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import fusion_pass
from fusion_pass.kernels import triton_device
from fusion_pass.kernels.qk_norm_rope_backward_op import backward_in_graph
from fusion_pass.patterns import qk_norm_rope_backward as pattern
from qkv_rope_qk_norm_models import OpCounter, compare_grads, joint_pass_backend, op_counts

FAMILY = "qk_norm_rope_backward"
OP = "fusion_pass.qk_norm_rope_backward.default"
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EPS = 32, 4, 2, 16, 1e-6


def _norm(x, weight, spelling):
    dtype = x.dtype
    if spelling == "qwen3":
        h = x.float()
        return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(dtype)
    if spelling == "two_casts_mean_of_product":  # torch.mean(h * h), two .float() calls
        return weight * (x.float() * torch.rsqrt(torch.mean(x.float() * x.float(), -1, keepdim=True) + EPS)).to(dtype)
    if spelling == "reciprocal_sqrt_weight_right":
        h = x.float()
        return (h * (1 / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + EPS))).to(dtype) * weight
    if spelling == "gemma3":  # Gemma3RMSNorm (Qwen3-Next's and Qwen3.5's q/k norms alike)
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * (1.0 + weight.float())).type_as(x)
    if spelling == "gemma3n":  # Gemma3nRMSNorm / Gemma4RMSNorm
        h = x.float()
        return (h * torch.pow(h.pow(2).mean(-1, keepdim=True) + EPS, -0.5) * weight.float()).type_as(x)
    if spelling == "f_rms_norm":  # nn.RMSNorm(head_dim) / F.rms_norm with a weight
        return nn.functional.rms_norm(x, (x.shape[-1],), weight, EPS)
    if spelling == "pow_minus_half_no_weight":
        h = x.float()
        return (h * torch.pow(h.pow(2).mean(-1, keepdim=True) + EPS, -0.5)).to(dtype)
    raise ValueError(spelling)


def _rotate(x, spelling):
    half = x.shape[-1] // 2
    if spelling == "slices":
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    if spelling == "chunk":
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    if spelling == "lookalike":  # not a rotation: the first half negated in place
        return torch.cat((-x[..., :half], x[..., half:]), dim=-1)
    if spelling == "unflatten":
        x1, x2 = x.unflatten(-1, (2, -1)).unbind(-2)
        return torch.cat((-x2, x1), dim=-1)
    raise ValueError(spelling)


class LoRALinear(nn.Module):
    """peft's LoRA ``Linear``: frozen base plus ``lora_B(lora_A(dropout(x))) * scaling``."""

    def __init__(self, in_features: int, out_features: int, rank: int = 4):
        super().__init__()
        self.base_layer = nn.Linear(in_features, out_features, bias=True).requires_grad_(False)
        self.lora_A = nn.Linear(in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, out_features, bias=False)
        nn.init.normal_(self.lora_B.weight, std=0.1)  # peft starts at zero; a zero B hides wrong grads
        self.dropout = nn.Identity()
        self.scaling = 2.0

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(self.dropout(x))) * self.scaling


class SpelledBlock(nn.Module):
    """q/k/v projection -> per-head norm <-> RoPE -> SDPA, spelled per the arguments. ``rotary_dim``:
    RoPE on the first features only, as GLM-4.5 / Qwen3-Next / Qwen3.5 write it (partial rotary)."""

    def __init__(self, projection="separate", norm="qwen3", rotate="slices", placement="qwen3", rotary_dim=HEAD_DIM):
        super().__init__()
        self.projection, self.norm, self.rotate, self.placement = projection, norm, rotate, placement
        self.rotary_dim = rotary_dim
        sizes = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM)
        if projection.startswith("fused"):
            self.qkv = nn.Linear(HIDDEN, sum(sizes), bias=False)
        else:
            linear = LoRALinear if projection == "lora" else (lambda i, o: nn.Linear(i, o, bias=False))
            self.q_proj, self.k_proj, self.v_proj = (linear(HIDDEN, n) for n in sizes)
            if projection == "frozen":
                for p in (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight):
                    p.requires_grad_(False)
        self.q_norm = nn.Parameter(1 + 0.1 * torch.randn(HEAD_DIM))
        self.k_norm = nn.Parameter(1 + 0.1 * torch.randn(HEAD_DIM))
        self.sizes = sizes

    def _project(self, x):
        if self.projection == "fused_split":
            return self.qkv(x).split(self.sizes, dim=-1)
        if self.projection == "fused_slices":
            qkv = self.qkv(x)
            q_end, k_end = self.sizes[0], self.sizes[0] + self.sizes[1]
            return qkv[..., :q_end], qkv[..., q_end:k_end], qkv[..., k_end:]
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def _rope(self, x, cos, sin):
        if self.rotary_dim == HEAD_DIM:
            return x * cos + _rotate(x, self.rotate) * sin
        rotary_dim = cos.shape[-1]  # transformers' Glm4MoeAttention / Qwen3NextAttention
        x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
        return torch.cat([x_rot * cos + _rotate(x_rot, self.rotate) * sin, x_pass], dim=-1)

    def forward(self, x, cos, sin):
        batch, seq, _ = x.shape
        if self.rotary_dim < HEAD_DIM:  # the model's rotary embedding makes rotary_dim-wide tables
            half = self.rotary_dim // 2
            cos, sin = torch.cat((cos[..., :half], cos[..., :half]), -1), torch.cat((sin[..., :half], sin[..., :half]), -1)
        q, k, v = (t.view(batch, seq, -1, HEAD_DIM) for t in self._project(x))
        q_weight, k_weight = self.q_norm, self.k_norm
        if self.placement == "qwen3":  # norm on [B, S, H, D], transpose, RoPE
            q, k = _norm(q, q_weight, self.norm).transpose(1, 2), _norm(k, k_weight, self.norm).transpose(1, 2)
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        elif self.placement == "gemma3":  # transpose, norm, RoPE
            q, k = _norm(q.transpose(1, 2), q_weight, self.norm), _norm(k.transpose(1, 2), k_weight, self.norm)
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        elif self.placement == "gemma3n":  # norm, RoPE on [B, S, H, D] (unsqueeze_dim=2), transpose
            cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
            q = self._rope(_norm(q, q_weight, self.norm), cos, sin).transpose(1, 2)
            k = self._rope(_norm(k, k_weight, self.norm), cos, sin).transpose(1, 2)
        else:  # "hunyuan": transpose, RoPE, norm
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            q, k = self._rope(q.transpose(1, 2), cos, sin), self._rope(k.transpose(1, 2), cos, sin)
            q, k = _norm(q, q_weight, self.norm), _norm(k, k_weight, self.norm)
        v = v.transpose(1, 2)
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).reshape(batch, seq, -1)


CASES = {
    # name: (SpelledBlock kwargs, input requires grad, cos/sin require grad)
    "qwen3": (dict(), True, False),
    "lora": (dict(projection="lora"), True, False),
    "frozen_projections": (dict(projection="frozen"), True, False),
    "input_without_grad": (dict(), False, False),
    "frozen_projections_and_input": (dict(projection="frozen"), False, False),  # only the norm weights train
    "fused_qkv_split": (dict(projection="fused_split"), True, False),
    "fused_qkv_sliced": (dict(projection="fused_slices"), True, False),
    "rotate_half_chunk": (dict(rotate="chunk"), True, False),
    "rotate_half_unflatten": (dict(rotate="unflatten"), True, False),
    "norm_two_casts_mean_of_product": (dict(norm="two_casts_mean_of_product"), True, False),
    "norm_reciprocal_sqrt_weight_right": (dict(norm="reciprocal_sqrt_weight_right"), True, False),
    "norm_without_weight": (dict(norm="pow_minus_half_no_weight"), True, False),
    "norm_gemma3_one_plus_weight": (dict(norm="gemma3", placement="gemma3"), True, False),
    "norm_gemma3n_rope_before_transpose": (dict(norm="gemma3n", placement="gemma3n"), True, True),
    "norm_f_rms_norm_hunyuan_order": (dict(norm="f_rms_norm", placement="hunyuan"), True, False),
    "gemma3_placement": (dict(placement="gemma3"), True, False),
    "gemma3n_placement": (dict(placement="gemma3n"), True, False),
    "hunyuan_order_lora_chunk": (dict(placement="hunyuan", projection="lora", rotate="chunk"), True, False),
    "tables_require_grad": (dict(), True, True),
    "hunyuan_order_tables_require_grad": (dict(placement="hunyuan"), True, True),
    "partial_rotary_glm45": (dict(rotary_dim=HEAD_DIM // 2), True, False),
    "partial_rotary_qwen3_next_norm_tables_require_grad": (dict(norm="gemma3", rotary_dim=HEAD_DIM // 4), True, True),
    "partial_rotary_lora_chunk": (dict(projection="lora", rotate="chunk", rotary_dim=HEAD_DIM // 2), True, False),
}


def _inputs(input_grad: bool, tables_grad: bool, dtype=torch.float32, seq: int = 8):
    x = torch.randn(2, seq, HIDDEN, dtype=dtype, requires_grad=input_grad)
    angles = torch.randn(1, seq, HEAD_DIM // 2, dtype=torch.float32)
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    return x, cos.requires_grad_(tables_grad), sin.requires_grad_(tables_grad)


def _run(block, inputs, backend, backward_mode=None):
    """Forward (compiled with ``backend``, eager for None), then backward under ``backward_mode``."""
    out = torch.compile(block, backend=backend)(*inputs) if backend is not None else block(*inputs)
    grad = 1 + 0.1 * torch.arange(out.numel(), device=out.device).view(out.shape).sin().to(out.dtype)
    with backward_mode or contextlib.nullcontext():
        out.backward(grad)
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_spellings_train_fused_with_eager_gradients(case):
    kwargs, input_grad, tables_grad = CASES[case]
    torch.manual_seed(0)
    block = SpelledBlock(**kwargs)
    reference = copy.deepcopy(block)
    inputs = _inputs(input_grad, tables_grad)
    reference_inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    fusion_pass.install(devices="cpu", families=FAMILY)
    pattern.reset_variant_counts()
    calls = OpCounter()
    _run(block, inputs, joint_pass_backend(), calls)
    _run(reference, reference_inputs, None)
    assert fusion_pass.match_counts().get(FAMILY) == 2, fusion_pass.report()
    assert calls.counts[OP] == 2  # the backward ran our op, once per tensor
    names = [f"input_{i}" for i in range(3)]
    errors = compare_grads(block, reference, list(zip(names, inputs, reference_inputs)))
    assert errors and max(errors.values()) < 1e-5, sorted(errors.items(), key=lambda kv: -kv[1])[:3]


class BlockWithTensorConstant(SpelledBlock):
    """A tensor made inside ``forward`` (``torch.tensor``, as masking code does): AOT autograd lifts it
    to a ``get_attr`` constant (``_tensor_constant0``) of the joint graph's module."""

    def forward(self, x, cos, sin):
        return super().forward(x, cos, sin) * torch.tensor([1.0, 2.0]).repeat(HEADS * HEAD_DIM // 2)


def test_joint_graph_with_a_lifted_tensor_constant_fuses():
    """The forward copy that the patterns match reads the joint graph's constants (a copy without
    them raised ``AttributeError: ... '_tensor_constant0'`` and aborted the user's compile)."""
    torch.manual_seed(0)
    block = BlockWithTensorConstant()
    reference = copy.deepcopy(block)
    inputs = _inputs(True, False)
    reference_inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    fusion_pass.install(devices="cpu", families=FAMILY)
    _run(block, inputs, joint_pass_backend())
    _run(reference, reference_inputs, None)
    assert fusion_pass.match_counts() == {FAMILY: 2}, fusion_pass.report()
    errors = compare_grads(block, reference, [("x", inputs[0], reference_inputs[0])])
    assert max(errors.values()) < 1e-5, errors


class HunYuanBlockWithPositionTables(SpelledBlock):
    """HunYuan's order (transpose, RoPE, norm) with tables of one row per position, [S, D], that
    broadcast over batch and heads without an unsqueeze."""

    def forward(self, x, cos, sin):
        batch, seq, _ = x.shape
        q, k, v = (t.view(batch, seq, -1, HEAD_DIM).transpose(1, 2) for t in self._project(x))
        q, k = _norm(self._rope(q, cos, sin), self.q_norm, self.norm), _norm(self._rope(k, cos, sin), self.k_norm, self.norm)
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).reshape(batch, seq, -1)


@pytest.mark.parametrize("tables_grad", [False, True])
def test_tables_of_one_row_per_position_fuse(tables_grad):
    """cos/sin of shape [S, D] are the kernel's [1, S, D] rows: both tensors fuse with eager's
    gradients (those of the tables too). Such a match once reached the op, whose argument check then
    raised while Inductor traced it and aborted the compile."""
    torch.manual_seed(0)
    block = HunYuanBlockWithPositionTables(placement="hunyuan")
    reference = copy.deepcopy(block)
    x, cos, sin = _inputs(True, False)
    inputs = [x, cos[0].detach().requires_grad_(tables_grad), sin[0].detach().requires_grad_(tables_grad)]
    reference_inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    fusion_pass.install(devices="cpu", families=FAMILY)
    _run(block, inputs, joint_pass_backend())
    _run(reference, reference_inputs, None)
    assert fusion_pass.match_counts() == {FAMILY: 2}, fusion_pass.report()
    errors = compare_grads(block, reference, list(zip(["x", "cos", "sin"], inputs, reference_inputs)))
    assert max(errors.values()) < 1e-5, errors
    assert ("cos" in errors) == tables_grad


def test_the_region_backward_replaces_autograds_nodes():
    """The backward graph: our op twice, and none of the norm's backward ops (``pow(rstd, 3)``,
    the sums of the weight grad) left; the projection GEMMs stay autograd's."""
    torch.manual_seed(0)
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm.graph)
        return gm.forward

    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.fx_passes.joint_graph import joint_graph_passes

    def partition(gm, joint_inputs, **kw):
        joint_graph_passes(gm)
        return min_cut_rematerialization_partition(gm, joint_inputs, compiler="inductor", **kw)

    backend = aot_autograd(fw_compiler=keep, bw_compiler=keep, partition_fn=partition,
                           decompositions=select_decomp_table())
    fusion_pass.install(devices="cpu", families=FAMILY)
    block = SpelledBlock(projection="lora")
    _run(block, _inputs(True, False), backend)
    forward, backward = (op_counts(g) for g in graphs)
    assert backward.get(OP) == 2 and OP not in forward
    assert "aten.pow.Tensor_Scalar" not in backward  # the norm backward's rstd ** 3 is gone
    assert backward.get("aten.mm.default", 0) >= 6  # the GEMMs (base and adapters) stay


def test_lookalike_rotation_is_not_fused():
    """``cat((-x1, x2))`` has rotate_half's ops but is not RoPE: the match-time re-trace refuses it."""
    torch.manual_seed(0)
    fusion_pass.install(devices="cpu", families=FAMILY)
    _run(SpelledBlock(rotate="lookalike"), _inputs(True, False), joint_pass_backend())
    assert not fusion_pass.match_counts().get(FAMILY)


def test_dynamic_true_fuses_and_serves_other_lengths():
    """``torch.compile(dynamic=True)``: symbolic B and S, the eps float lifted to a graph input; the
    regions fuse (through the op, shapes being symbolic), and a second length reuses the graph."""
    torch.manual_seed(0)
    block = SpelledBlock(projection="lora")
    reference = copy.deepcopy(block)
    fusion_pass.install(devices="cpu", families=FAMILY)
    compiled = torch.compile(block, backend=joint_pass_backend(), dynamic=True)
    for seq in (8, 11):
        x = torch.randn(2, seq, HIDDEN, requires_grad=True)
        angles = torch.randn(1, seq, HEAD_DIM // 2).repeat(1, 1, 2)
        inputs = [x, angles.cos(), angles.sin()]
        compiled(*inputs).sum().backward()
        reference(*inputs).sum().backward()
        errors = compare_grads(block, reference)
        assert max(errors.values()) < 1e-5, sorted(errors.items(), key=lambda kv: -kv[1])[:3]
        block.zero_grad()
        reference.zero_grad()
    assert fusion_pass.match_counts() == {FAMILY: 2}, fusion_pass.report()  # one compile, two tensors


BF16_CASES = {
    "qwen3": dict(),
    "gemma3_one_plus_weight": dict(norm="gemma3", placement="gemma3"),
    "gemma3n_pow_rope_before_transpose": dict(norm="gemma3n", placement="gemma3n"),
    "f_rms_norm_hunyuan_order": dict(norm="f_rms_norm", placement="hunyuan", projection="lora"),
    "no_weight_chunk": dict(norm="pow_minus_half_no_weight", rotate="chunk"),
    "partial_rotary_gemma3_norm": dict(norm="gemma3", rotary_dim=HEAD_DIM // 4),
    "partial_rotary_f_rms_norm": dict(norm="f_rms_norm", rotary_dim=HEAD_DIM // 2),
}


@pytest.mark.parametrize("case", sorted(BF16_CASES))
def test_bf16_norm_forms_equal_the_unfused_graph(case):
    """bf16: each norm form's rounding is the kernel's (``NORM_STYLE``), so the fused backward gives
    the gradients of the same graph without the pass, bit for bit (tables requiring grad included)."""
    torch.manual_seed(0)
    block = SpelledBlock(**BF16_CASES[case]).to(torch.bfloat16)
    unfused = copy.deepcopy(block)
    inputs = _inputs(True, True, torch.bfloat16)
    unfused_inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    _run(unfused, unfused_inputs, joint_pass_backend())
    torch._dynamo.reset()
    fusion_pass.install(devices="cpu", families=FAMILY)
    _run(block, inputs, joint_pass_backend())
    assert fusion_pass.match_counts() == {FAMILY: 2}, fusion_pass.report()
    names = [f"input_{i}" for i in range(3)]
    errors = compare_grads(block, unfused, list(zip(names, inputs, unfused_inputs)))
    assert max(errors.values()) == 0, sorted(errors.items(), key=lambda kv: -kv[1])[:3]


AUTOCAST_CASES = {
    # name: SpelledBlock kwargs (all with LoRA projections, tables requiring grad)
    "qwen3": dict(),
    "hunyuan_order": dict(placement="hunyuan"),
    "gemma3_one_plus_weight": dict(norm="gemma3", placement="gemma3"),
    "gemma3n_rope_before_transpose": dict(norm="gemma3n", placement="gemma3n"),
    "f_rms_norm_hunyuan_order": dict(norm="f_rms_norm", placement="hunyuan"),
    "no_weight": dict(norm="pow_minus_half_no_weight"),
    "partial_rotary_qwen3_next": dict(norm="gemma3", rotary_dim=HEAD_DIM // 2),
    "partial_rotary_f_rms_norm": dict(norm="f_rms_norm", rotary_dim=HEAD_DIM // 2),
}


@pytest.mark.parametrize("case", sorted(AUTOCAST_CASES))
def test_autocast_over_an_fp32_model_fuses_like_the_unfused_graph(case):
    """bf16 autocast over an fp32 model (the Hugging Face Trainer's ``bf16=True``): bf16 projection
    outputs, fp32 weights and tables, each form ending in its own dtype (fp32 after Qwen3's
    ``w * n`` or RoPE, x's after ``type_as(x)``). Fused, with the unfused graph's gradients: fp32
    sums may differ in their last bits (summation order), and a dot product summed in another order
    can flip one bf16 rounding of the norm's input grad (seen once in 20 such blocks: 2.2e-4). A rounding
    in the wrong dtype (e.g. RoPE's backward in fp32 after Gemma's norm) moves them by ~4e-3."""
    torch.manual_seed(0)
    block = SpelledBlock(projection="lora", **AUTOCAST_CASES[case])
    unfused = copy.deepcopy(block)
    inputs = _inputs(True, True)
    unfused_inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _run(unfused, unfused_inputs, joint_pass_backend())
    torch._dynamo.reset()
    fusion_pass.install(devices="cpu", families=FAMILY)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _run(block, inputs, joint_pass_backend())
    assert fusion_pass.match_counts() == {FAMILY: 2}, fusion_pass.report()
    names = [f"input_{i}" for i in range(3)]
    errors = compare_grads(block, unfused, list(zip(names, inputs, unfused_inputs)))
    assert max(errors.values()) < 1e-3, sorted(errors.items(), key=lambda kv: -kv[1])[:3]


def test_tables_in_another_dtype_than_the_model_are_a_near_miss():
    """An fp32 model fed bf16 cos/sin without autocast: mixed dtypes the kernel does not take,
    found and reported, not fused."""
    torch.manual_seed(0)
    x, cos, sin = _inputs(True, False)
    fusion_pass.install(devices="cpu", families=FAMILY)
    _run(SpelledBlock(), [x, cos.to(torch.bfloat16), sin.to(torch.bfloat16)], joint_pass_backend())
    assert not fusion_pass.match_counts().get(FAMILY)
    assert "mixed dtypes" in fusion_pass.report()


@pytest.mark.parametrize("rotary_dim", [16, 6])
@pytest.mark.parametrize("rope_first", [False, True])
def test_kernel_nodes_equal_the_op(rope_first, rotary_dim, monkeypatch):
    """The CUDA form (Triton kernel nodes, traced on CPU tensors and run under the interpreter)
    computes what the op computes (full and partial rotary)."""
    monkeypatch.setattr(triton_device, "IN_GRAPH_DEVICE_TYPES", ("cuda", "cpu"))
    torch.manual_seed(0)
    batch, seq, heads, head_dim = 2, 8, 3, 16
    x = torch.randn(batch, seq, heads, head_dim, dtype=torch.bfloat16)
    grad = torch.randn(batch, heads, seq, head_dim, dtype=torch.bfloat16)
    rstd = torch.rand(batch, heads, seq, 1) + 0.5
    cos, sin = (torch.randn(1, seq, rotary_dim, dtype=torch.bfloat16) for _ in range(2))
    weight = torch.randn(head_dim, dtype=torch.bfloat16)
    args = (grad, x, rstd, cos, sin, weight)
    graph = make_fx(lambda *a: backward_in_graph(*a, True, True, rope_first), tracing_mode="fake")(*args)
    assert "triton_kernel_wrapper_functional" in str(graph.graph)
    got = graph(*args)
    expected = torch.ops.fusion_pass.qk_norm_rope_backward(*args, True, True, rope_first)
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
    for a, b in zip(got[1] + got[2], expected[1] + expected[2]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _lora_qwen3(layers: int = 2):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_hidden_layers=layers, vocab_size=128, max_position_embeddings=256, use_cache=False))
    model.requires_grad_(False)  # peft's LoRA: the base model frozen, adapters on q/k/v trained
    for layer in model.model.layers:
        attention = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            base = getattr(attention, name)
            lora = LoRALinear(base.in_features, base.out_features)
            lora.base_layer = base
            setattr(attention, name, lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("both_families", [False, True])
def test_hf_qwen3_lora_step_fused_with_eager_gradients(both_families):
    """transformers' Qwen3 with LoRA adapters on q/k/v (base frozen): every layer's q and k fused,
    gradients of the adapters equal eager's. With both training families installed, the projection
    family (which needs trainable projection weights) finds nothing and says nothing."""
    model = _lora_qwen3()
    reference = copy.deepcopy(model)
    fusion_pass.install(devices="cpu", families=None if both_families else FAMILY)
    ids = torch.randint(0, 128, (2, 16))
    calls = OpCounter()
    loss = torch.compile(model, backend=joint_pass_backend())(input_ids=ids, labels=ids).loss
    with calls:
        loss.backward()
    reference(input_ids=ids, labels=ids).loss.backward()
    assert fusion_pass.match_counts() == {FAMILY: 4}, fusion_pass.report()
    assert "near-miss" not in fusion_pass.report()
    assert calls.counts[OP] == 4
    errors = compare_grads(model, reference)
    assert errors and max(errors.values()) < 1e-5, sorted(errors.items(), key=lambda kv: -kv[1])[:3]


def test_hf_qwen3_full_training_keeps_the_projection_family():
    """Plain Qwen3 (projections trainable): the projection family fuses each layer whole, and the
    per-tensor family does not touch (or report) what it replaced."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_hidden_layers=2, vocab_size=128, max_position_embeddings=256, use_cache=False))
    fusion_pass.install(devices="cpu")
    ids = torch.randint(0, 128, (2, 16))
    torch.compile(model, backend=joint_pass_backend())(input_ids=ids, labels=ids).loss.backward()
    assert fusion_pass.match_counts() == {"qkv_rope_qk_norm": 2}, fusion_pass.report()
    assert "near-miss" not in fusion_pass.report()


def test_hf_qwen3_bf16_lora_step_within_stock_tolerance():
    """bf16 LoRA training step: the fused gradients are as close to eager's as stock compile's are
    (the kernel reproduces autograd's roundings; the tolerance is stock's own drift, x1.5)."""
    model = _lora_qwen3().to(torch.bfloat16)
    stock, reference = copy.deepcopy(model), copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 16))
    torch.compile(stock, backend=joint_pass_backend())(input_ids=ids, labels=ids).loss.backward()
    fusion_pass.install(devices="cpu", families=FAMILY)
    torch.compile(model, backend=joint_pass_backend())(input_ids=ids, labels=ids).loss.backward()
    reference(input_ids=ids, labels=ids).loss.backward()
    assert fusion_pass.match_counts() == {FAMILY: 4}, fusion_pass.report()
    fused_errors, stock_errors = compare_grads(model, reference), compare_grads(stock, reference)
    for name, error in fused_errors.items():
        assert error <= 1.5 * stock_errors[name] + 1e-2, (name, error, stock_errors[name])


GPU_CASES = {
    # name: (SpelledBlock kwargs, tokens B*S: 16 takes the head-tile kernel, 640 the token-row one)
    "qwen3": (dict(), 16),
    "hunyuan": (dict(placement="hunyuan"), 16),
    "qwen3_token_rows": (dict(), 640),
    "gemma3_one_plus_weight": (dict(norm="gemma3", placement="gemma3"), 640),
    "f_rms_norm_hunyuan_order": (dict(norm="f_rms_norm", placement="hunyuan"), 16),
    "partial_rotary_qwen3_next": (dict(norm="gemma3", rotary_dim=HEAD_DIM // 4), 16),
    "partial_rotary_glm45_token_rows": (dict(rotary_dim=HEAD_DIM // 2), 640),
    "autocast_over_fp32": (dict(), 640),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", sorted(GPU_CASES))
def test_gpu_lora_block_backward_is_our_kernel_launched_by_inductor(case):
    """CUDA, Inductor end to end, each kernel path (both orders, norm styles, partial rotary, bf16
    autocast over an fp32 block, both tilings): a LoRA block's backward code launches our
    elementwise kernel (no fusion_pass op call) and its gradients are as close to eager's as
    stock compile's."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    kwargs, tokens = GPU_CASES[case]
    autocast = case.startswith("autocast")
    dtype = torch.float32 if autocast else torch.bfloat16
    block = SpelledBlock(projection="lora", **kwargs).to("cuda", dtype)
    stock, reference = copy.deepcopy(block), copy.deepcopy(block)
    x, cos, sin = (t.detach().to("cuda") for t in _inputs(True, False, dtype, seq=tokens // 2))
    inputs = [x.requires_grad_(), cos, sin]
    mode = torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with mode:
        _run(stock, inputs, "inductor")
    torch._dynamo.reset()
    fusion_pass.install(families=FAMILY)
    with mode:
        _, codes = run_and_get_code(lambda: _run(block, inputs, "inductor"))
        _run(reference, inputs, None)
    assert fusion_pass.match_counts() == {FAMILY: 2}, fusion_pass.report()
    backward_code = "\n".join(c for c in codes if "_qk_norm_rope_bwd" in c)
    assert backward_code and "fusion_pass.qk_norm_rope_backward" not in backward_code
    fused, stock_errors = compare_grads(block, reference), compare_grads(stock, reference)
    for name, error in fused.items():
        assert error <= 1.5 * stock_errors[name] + 1e-2, (name, error, stock_errors[name])


def _hf_model(family: str) -> nn.Module:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    geometry = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, num_hidden_layers=2, vocab_size=128, max_position_embeddings=256, use_cache=False)
    if family == "gemma3":  # one sliding-window layer, one full: two rotary tables
        model = Gemma3ForCausalLM(Gemma3TextConfig(**geometry, sliding_window=8,
                                                   layer_types=["sliding_attention", "full_attention"]))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**geometry))
    with torch.no_grad():  # Gemma's weights are offsets from 1, Qwen3's the factors
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.1 * torch.randn_like(p) + (0.0 if family == "gemma3" else 1.0))
    return model


@pytest.mark.parametrize("family", ["gemma3", "qwen3_bf16_autocast"])
def test_hf_training_step_fuses_what_the_projection_family_cannot(family):
    """transformers' Gemma3 (the ``1 + w`` norm after the transpose) trained in fp32, and Qwen3 trained
    under bf16 autocast over fp32 weights (the Trainer's ``bf16=True``), all families installed: every
    q and k fused by the per-tensor family, gradients equal the unfused graph's (fp32 sums' last bits)."""
    model = _hf_model("gemma3" if family == "gemma3" else "qwen3")
    unfused = copy.deepcopy(model)
    region = torch.autocast("cpu", dtype=torch.bfloat16) if "autocast" in family else contextlib.nullcontext()
    ids = torch.randint(0, 128, (2, 16))
    with region:
        torch.compile(unfused, backend=joint_pass_backend())(input_ids=ids, labels=ids).loss.backward()
    torch._dynamo.reset()
    fusion_pass.install(devices="cpu")
    with region:
        torch.compile(model, backend=joint_pass_backend())(input_ids=ids, labels=ids).loss.backward()
    assert fusion_pass.match_counts() == {FAMILY: 4}, fusion_pass.report()
    errors = compare_grads(model, unfused)
    assert max(errors.values()) < 1e-5, sorted(errors.items(), key=lambda kv: -kv[1])[:3]


def test_peft_lora_step_fused_with_eager_gradients():
    """peft's own LoRA (``get_peft_model``, adapters on q/k/v, the base model frozen) on transformers'
    Qwen3: every q and k fused, the adapters' gradients equal eager's. (Dropout 0: a compiled graph
    draws other random masks than eager, which would hide the comparison.)"""
    import peft  # a test extra (pyproject.toml)
    model = peft.get_peft_model(_hf_model("qwen3"), peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj"]))
    for name, p in model.named_parameters():  # peft starts B at zero: give the adapters a gradient path
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    reference = copy.deepcopy(model)
    fusion_pass.install(devices="cpu")
    ids = torch.randint(0, 128, (2, 16))
    torch.compile(model, backend=joint_pass_backend())(input_ids=ids, labels=ids).loss.backward()
    reference(input_ids=ids, labels=ids).loss.backward()
    assert fusion_pass.match_counts() == {FAMILY: 4}, fusion_pass.report()
    errors = compare_grads(model, reference)
    assert errors and all("lora" in name for name in errors)
    assert max(errors.values()) < 1e-5, sorted(errors.items(), key=lambda kv: -kv[1])[:3]


def _partial_rotary_model(family: str) -> nn.Module:
    """transformers' GLM-4.5 (``Glm4MoeForCausalLM``, half the head rotated) and Qwen3-Next (a quarter,
    Gemma's ``1 + w`` norm, a linear-attention layer beside the full one), dense MLPs."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    geometry = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, num_hidden_layers=2, vocab_size=128, max_position_embeddings=256, use_cache=False)
    if family == "glm4_moe":
        model = Glm4MoeForCausalLM(Glm4MoeConfig(**geometry, partial_rotary_factor=0.5, use_qk_norm=True,
                                                 first_k_dense_replace=2))
    else:
        model = Qwen3NextForCausalLM(Qwen3NextConfig(
            **geometry, partial_rotary_factor=0.25, layer_types=["linear_attention", "full_attention"],
            mlp_only_layers=[0, 1], linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16,
            linear_value_head_dim=16))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.1 * torch.randn_like(p) + (0.0 if family == "qwen3_next" else 1.0))
    return model


@pytest.mark.parametrize("family,attention_layers", [("glm4_moe", 2), ("qwen3_next", 1)])
def test_hf_partial_rotary_training_step_fused_with_eager_gradients(family, attention_layers):
    """Partial rotary in training, on transformers' own model code: every q and k of every layer with
    the prologue fused (the kernel's ROT_HALF), every gradient within 1e-5 of the same compile's
    without the pass and of eager's (fp32). Qwen3-Next's linear-attention layer, which the pass does
    not touch, is judged against a float64 eager step: its decay parameters' (``A_log``, ``dt_bias``)
    gradients amplify fp32 rounding, so every fp32 evaluation order lands ~5e-4 from float64 (eager's,
    stock compile's and ours alike), and two of them differ by up to that much on another CPU. Each of
    its gradients must be no further from float64 than twice the further of eager's and stock's."""
    model = _partial_rotary_model(family)
    unfused, reference = copy.deepcopy(model), copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 16))
    torch.compile(unfused, backend=joint_pass_backend())(input_ids=ids, labels=ids).loss.backward()
    torch._dynamo.reset()
    fusion_pass.install(devices="cpu", families=FAMILY)
    loss = torch.compile(model, backend=joint_pass_backend())(input_ids=ids, labels=ids).loss
    with OpCounter() as calls:
        loss.backward()
    reference(input_ids=ids, labels=ids).loss.backward()
    assert fusion_pass.match_counts() == {FAMILY: 2 * attention_layers}, fusion_pass.report()
    assert calls.counts[OP] == 2 * attention_layers
    assert fusion_pass.near_misses() == {}
    if family == "qwen3_next":
        exact = copy.deepcopy(reference).double()
        exact.zero_grad(set_to_none=True)
        exact(input_ids=ids, labels=ids).loss.backward()
        ours, stock, eager = (compare_grads(m, exact) for m in (model, unfused, reference))
        linear = {n: (e, stock[n], eager[n]) for n, e in ours.items() if "linear_attn" in n}
        assert linear and all(e <= 2 * max(s, r) + 1e-6 for e, s, r in linear.values()), linear
    for against in (compare_grads(model, unfused), compare_grads(model, reference)):
        errors = {n: e for n, e in against.items() if "linear_attn" not in n}
        assert max(errors.values()) < 1e-5, sorted(errors.items(), key=lambda kv: -kv[1])[:3]
