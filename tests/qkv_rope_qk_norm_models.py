"""Models and a graph-only compile backend for the qkv_rope_qk_norm tests (training fusion).

- ``FusedQKVAttention``: HunyuanImage-3-style attention (one QKV weight, contiguous [q | k | v]
  rows, RoPE before the per-head norm), written with Hugging Face's own ``apply_rotary_pos_emb`` and
  ``HunYuanDenseV1RMSNorm``; ``lookalike=`` turns it into code that must NOT be fused.
- ``separate_attention``: Hugging Face's ``HunYuanDenseV1Attention`` itself (separate q/k/v).
- ``VariantStack``: one block per (structure, bias, norm trainable/frozen, cos/sin constant or
  requiring grad), each with its own input norm, in ONE graph: one compile covers every variant.
- ``OpCounter``: the ops that ran (a dispatch mode).
- ``joint_pass_backend``: AOT autograd plus Inductor's joint-graph passes (ours included), then
  the graphs run eagerly: the fusion and its numerics without Inductor's C++ codegen (~11 s per
  graph on the CI machines).
"""

from __future__ import annotations

import collections
import itertools

import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.fx_passes.joint_graph import joint_graph_passes
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import HunYuanDenseV1Config
from transformers.models.hunyuan_v1_dense.modeling_hunyuan_v1_dense import (
    HunYuanDenseV1Attention,
    HunYuanDenseV1RMSNorm,
    apply_rotary_pos_emb,
)

from fusion_pass.graph_text import CapturingPass
from fusion_pass.graph_text import graph_text

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 64, 4, 2, 16
EPS = 1e-6


def rope_tables(seq: int, head_dim: int = HEAD_DIM, dtype=torch.float32, batch: int = 1,
                requires_grad: bool = False, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [batch, S, D] as Hugging Face's rotary module computes them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    pos = torch.arange(seq, dtype=torch.float32)[None, :].expand(batch, seq)
    freqs = pos[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    return cos.requires_grad_(requires_grad), sin.requires_grad_(requires_grad)


def _lookalike_rotate(x: torch.Tensor) -> torch.Tensor:
    """rotate_half split at D/4 instead of D/2: same ops, different ints (a different rotation)."""
    cut = x.shape[-1] // 4
    return torch.cat((-x[..., cut:], x[..., :cut]), dim=-1)


def swapped_rotate_half(x: torch.Tensor) -> torch.Tensor:
    """rotate_half with the halves' roles swapped: cat((-x1, x2)) instead of cat((-x2, x1)). Same
    ops, same slice ints, same half boundary; only which slice is negated and which goes first
    differs (the pattern's pre-traced ints are wildcards: only role checks tell them apart)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., :half], x[..., half:]), dim=-1)


class _RotateHalfSwappedGrad(torch.autograd.Function):
    """rotate_half's forward (``cat((-x2, x1))``) with the backward of ``cat((-x1, x2))``: the
    gradient halves routed to the other halves of x, through the same ops autograd's derivative
    uses (``slice_backward``: zeros + slice_scatter). The forward is the modelled code (no_grad
    graphs may fuse it); a joint graph must not, or the custom gradient is silently replaced."""

    @staticmethod
    def forward(ctx, x):
        half = x.shape[-1] // 2
        ctx.shape = x.shape
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    @staticmethod
    def backward(ctx, grad):
        shape, dim = ctx.shape, len(ctx.shape) - 1
        half = shape[-1] // 2
        return (torch.ops.aten.slice_backward(-grad[..., :half], shape, dim, 0, half, 1)
                + torch.ops.aten.slice_backward(grad[..., half:], shape, dim, half, shape[-1], 1))


_LOOKALIKE_ROTATIONS = {"quarter_rotate": _lookalike_rotate, "swapped_halves": swapped_rotate_half,
                        "swapped_grad": _RotateHalfSwappedGrad.apply}


class FusedQKVAttention(nn.Module):
    """HunyuanImage-3-style attention block with one fused QKV projection.

    lookalike (structure that must not be fused): ``"norm_before_rope"``, ``"full_width_norm"``
    (one RMSNorm over the whole projection width, then heads), ``"grouped_split"`` (the official
    HunyuanImage-3.0 layout: rows grouped per kv head [q * G, k, v]), ``"quarter_rotate"``,
    ``"swapped_halves"`` (rotate_half as ``cat((-x1, x2))``: the same slices in other roles),
    ``"swapped_grad"`` (rotate_half with a custom backward routing the halves the other way:
    training only, its forward is the modelled code). ``rotate_half``: an equivalent spelling of
    ``rotate_half`` (e.g. through ``chunk``) in place of Hugging Face's.
    """

    def __init__(self, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, bias=False, eps=EPS,
                 lookalike: str | None = None, consumer: str = "sdpa", rotate_half=None):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.lookalike = heads, kv_heads, head_dim, lookalike
        self.rotate_half = rotate_half  # another spelling of rotate_half (the same function)
        self.consumer = consumer
        self.q_size, self.kv_size = heads * head_dim, kv_heads * head_dim
        self.qkv_proj = nn.Linear(hidden, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, hidden, bias=False)
        norm_width = self.q_size if lookalike == "full_width_norm" else head_dim
        self.query_layernorm = HunYuanDenseV1RMSNorm(norm_width, eps=eps)
        self.key_layernorm = HunYuanDenseV1RMSNorm(self.kv_size if lookalike == "full_width_norm" else head_dim,
                                                   eps=eps)

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, q_len, _ = hidden_states.shape
        qkv = self.qkv_proj(hidden_states)
        if self.lookalike == "grouped_split":
            groups = self.heads // self.kv_heads
            qkv = qkv.reshape(bsz, q_len, self.kv_heads, groups + 2, self.head_dim)
            q, k, v = torch.split(qkv, [groups, 1, 1], dim=3)
            query = q.reshape(bsz, q_len, self.heads, self.head_dim).transpose(1, 2)
            key = k.reshape(bsz, q_len, self.kv_heads, self.head_dim).transpose(1, 2)
            value = v.reshape(bsz, q_len, self.kv_heads, self.head_dim).transpose(1, 2)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            if self.lookalike == "full_width_norm":
                q, k = self.query_layernorm(q), self.key_layernorm(k)
            query = q.view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
            key = k.view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
            value = v.view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        if self.lookalike == "norm_before_rope":
            query, key = self.query_layernorm(query), self.key_layernorm(key)
        if self.lookalike in _LOOKALIKE_ROTATIONS or self.rotate_half is not None:
            rotate = _LOOKALIKE_ROTATIONS.get(self.lookalike, self.rotate_half)
            c, s = cos.unsqueeze(1), sin.unsqueeze(1)
            query, key = query * c + rotate(query) * s, key * c + rotate(key) * s
        else:
            query, key = apply_rotary_pos_emb(query, key, cos, sin)
        if self.lookalike in (None, "grouped_split", *_LOOKALIKE_ROTATIONS):
            query, key = self.query_layernorm(query), self.key_layernorm(key)
        if self.consumer == "bshd":
            # Not attention: a consumer whose gradients for q, k and v arrive [B, S, H, D]-ordered,
            # as from SDPA's CUDA kernels (CPU attention hands back [B, H, S, D]-contiguous ones).
            kv = torch.cat([key, value], dim=1)
            mixed = query.transpose(1, 2).reshape(bsz, q_len, -1) * kv.transpose(1, 2).reshape(bsz, q_len, -1)
            return self.o_proj(mixed)
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))


def tiny_config(bias: bool = False, attn_implementation: str = "sdpa", layers: int = 2) -> HunYuanDenseV1Config:
    """The tiny random HunYuanDenseV1 of the tests: hidden 64, 4 q heads, 2 kv heads, head_dim 16."""
    return HunYuanDenseV1Config(
        hidden_size=HIDDEN, intermediate_size=128, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM, num_hidden_layers=layers, vocab_size=128, max_position_embeddings=256,
        attention_bias=bias, attn_implementation=attn_implementation, use_cache=False, rms_norm_eps=EPS,
    )


class SeparateQKVAttention(nn.Module):
    """Hugging Face's ``HunYuanDenseV1Attention`` (q_proj / k_proj / v_proj), called like the model does."""

    def __init__(self, bias=False):
        super().__init__()
        self.attn = HunYuanDenseV1Attention(tiny_config(bias=bias), layer_idx=0)

    def forward(self, hidden_states, cos, sin):
        return self.attn(hidden_states, position_embeddings=(cos, sin), attention_mask=None)[0]


def make_block(structure: str, bias: bool, lookalike: str | None = None) -> nn.Module:
    """A fused-QKV block (``FusedQKVAttention``) or Hugging Face's separate-q/k/v attention."""
    return FusedQKVAttention(bias=bias, lookalike=lookalike) if structure == "fused" else SeparateQKVAttention(bias)


def norm_weights(block: nn.Module) -> list[nn.Parameter]:
    owner = block.attn if isinstance(block, SeparateQKVAttention) else block
    return [owner.query_layernorm.weight, owner.key_layernorm.weight]


#: (structure, bias, norm_grad, rope_grad) of the training blocks of ``VariantStack.all_variants``.
TRAINING_VARIANTS = list(itertools.product(("fused", "separate"), (False, True), (True, False), (False, True)))
INFERENCE_VARIANTS = list(itertools.product(("fused", "separate"), (False, True)))


class VariantStack(nn.Module):
    """Independent attention blocks summed: block i sees ``input_norm_i(x)`` and either the constant
    tables (cos, sin) or the ones requiring grad (cos_g, sin_g).

    specs: (structure, bias, norm_grad, rope_grad) per block; lookalikes: optional, one per block.
    """

    def __init__(self, specs: list[tuple[str, bool, bool, bool]], lookalikes: list[str | None] | None = None):
        super().__init__()
        self.specs = specs
        lookalikes = lookalikes or [None] * len(specs)
        self.blocks = nn.ModuleList(make_block(s, b, la) for (s, b, _, _), la in zip(specs, lookalikes))
        self.input_norms = nn.ModuleList(HunYuanDenseV1RMSNorm(HIDDEN, eps=EPS) for _ in specs)
        for block, (_, _, norm_grad, _) in zip(self.blocks, specs):
            for w in norm_weights(block):
                w.requires_grad_(norm_grad)

    def forward(self, x, cos, sin, cos_g=None, sin_g=None):
        out = x
        for block, norm, (_, _, _, rope_grad) in zip(self.blocks, self.input_norms, self.specs):
            c, s = (cos_g, sin_g) if rope_grad else (cos, sin)
            out = out + block(norm(x), c, s)
        return out


def region_text(graph: torch.fx.Graph) -> str:
    """``graph_text(graph, keep_constants=False)`` (no shapes, sizes or dims), except that getitem
    indices and the fusion ops' flags are kept: they say which output and which gradients."""
    text = graph_text(graph, keep_constants=False).splitlines()
    keep = graph_text(graph, keep_constants=True).splitlines()
    lines = [k if (" = getitem(" in k or " = fusion_pass." in k) else t for t, k in zip(text, keep)]
    return "\n".join(lines)


class RegionCapture(CapturingPass):
    """``CapturingPass`` recording ``region_text``: what the snapshots compare."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.before.append(region_text(graph))
        self.inner(graph)
        self.after.append(region_text(graph))
        self.after_graphs.append(graph)


def joint_pass_backend(capture: CapturingPass | None = None):
    """A torch.compile backend: AOT autograd with Inductor's decompositions and partitioner, and
    Inductor's joint-graph passes (where the training hook runs), then eager execution of
    the resulting graphs. ``capture`` wraps the installed joint pass to snapshot each graph."""
    import torch._inductor.config as inductor_config
    from fusion_pass.install import TRAINING_HOOK

    def run_joint_passes(gm: torch.fx.GraphModule) -> None:
        hook = getattr(inductor_config, TRAINING_HOOK)
        if capture is not None:
            capture.inner = hook
            hook = capture
        with inductor_config.patch(**{TRAINING_HOOK: hook}):
            joint_graph_passes(gm)

    def partition(gm, joint_inputs, **kwargs):
        run_joint_passes(gm)
        return min_cut_rematerialization_partition(gm, joint_inputs, compiler="inductor", **kwargs)

    def compiler(gm, example_inputs):
        return make_boxed_func(gm.forward)

    def inference_compiler(gm, example_inputs):
        run_joint_passes(gm)
        return make_boxed_func(gm.forward)

    return aot_autograd(
        fw_compiler=compiler, bw_compiler=compiler, inference_compiler=inference_compiler, partition_fn=partition,
        decompositions=select_decomp_table(), keep_inference_input_mutations=True,
    )


class OpCounter(TorchDispatchMode):
    """Counts the ops that run, by name (``counts["aten.mm.default"]``): compiled graphs call our
    ops through the dispatcher."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def op_counts(graph: torch.fx.Graph) -> dict[str, int]:
    """Call targets of a graph, counted (``aten.mm.default`` style names)."""
    counts: dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "call_function":
            name = str(node.target)
            counts[name] = counts.get(name, 0) + 1
    return counts


class FusedQKVPrologue(FusedQKVAttention):
    """Only the region: fused QKV projection -> split -> RoPE -> per-head norm; returns (q, k, v)."""

    def forward(self, hidden_states, cos, sin):
        bsz, q_len, _ = hidden_states.shape
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        query = q.view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        key = k.view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        value = v.view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        return self.query_layernorm(query), self.key_layernorm(key), value


def compare_grads(model: nn.Module, reference: nn.Module, extra: list[tuple[str, torch.Tensor, torch.Tensor]] = (),
                  ) -> dict[str, float]:
    """max |grad - grad_ref| / max |grad_ref| per parameter (and per extra (name, tensor, ref) input)."""
    errors = {}
    pairs = [(n, p, q) for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters())]
    for name, p, q in pairs + list(extra):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is None:
            continue
        scale = q.grad.float().abs().max().clamp_min(1e-30)
        errors[name] = ((p.grad.float() - q.grad.float()).abs().max() / scale).item()
    return errors


def train_beside_eager(compiled, model: nn.Module, reference: nn.Module, steps: int, backward) -> list[float]:
    """``steps`` AdamW steps of ``compiled`` (a compile of ``model``) and of its eager copy
    ``reference`` on the same random batches (ids [2, 16] below 128): the first step's gradients
    equal eager's within 1e-5, the losses track eager's. ``backward(loss)`` runs the compiled
    model's backward (and may assert on what it ran). Returns the compiled model's losses."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    losses, reference_losses = [], []
    for step in range(steps):
        ids = torch.randint(0, 128, (2, 16))
        loss = compiled(input_ids=ids, labels=ids).loss
        backward(loss)
        reference_loss = reference(input_ids=ids, labels=ids).loss
        reference_loss.backward()
        if step == 0:
            errors = compare_grads(model, reference)
            assert max(errors.values()) < 1e-5, sorted(errors.items(), key=lambda kv: -kv[1])[:3]
        losses.append(loss.item())
        reference_losses.append(reference_loss.item())
        for opt in (optimizer, reference_optimizer):
            opt.step()
            opt.zero_grad()
    torch.testing.assert_close(losses, reference_losses, rtol=1e-4, atol=1e-5)
    return losses
