"""Near-misses of the forward family: a per-head norm -> RoPE (or RoPE -> norm) that no fusion
consumed, reported with the reason it was left (no matching cache write, an fp32 model, a norm over
the whole projection width). These patterns only report; the graph is not changed. Whatever per-head
norm beside a RoPE is left after them (a combination not registered, a spelling not recognized) is
reported by ``report_unmatched_prologues`` with the structure it has.
"""

from __future__ import annotations

import functools
import itertools

import torch
from torch._inductor.pattern_matcher import Match, PatternMatcherPass, gen_pattern, register_graph_pattern

from fusion_pass import config as fusion_config
from fusion_pass import match_report
from fusion_pass.kernels.qk_norm_rope_cache_reference import partial_rope_reference, rms_norm_reference, rope_reference
from fusion_pass.matching import EPS_EXAMPLE, is_new_pattern, match_value, trace_as_post_grad, trace_canonical
from fusion_pass.pattern_cache import inputs_signature, traced_pattern
from fusion_pass.patterns.norm_forms import NORM_FORMS, NormForm


_NO_CACHE_WRITE = "per-head RMSNorm -> RoPE without a matching K/V cache write (left unfused)"
_ROPE_FIRST_NO_CACHE_WRITE = "RoPE -> per-head RMSNorm without a matching K/V cache write (left unfused)"
_FP32_MODEL = ("per-head RMSNorm -> RoPE in float32: the fused kernel takes bf16 or fp16 models (left to "
               "Inductor)")
_PARTIAL_NO_CACHE_WRITE = ("per-head RMSNorm -> partial RoPE without a matching K/V cache write (partial rotary is "
                           "fused on [B, S, H, D] rows, norm first, with a dense, paged or flat cache; left unfused)")
_FULL_WIDTH_NORM = ("RMSNorm over the whole projection width, then heads -> RoPE (e.g. OLMo2): not a per-head norm, "
                    "which the kernel computes (left unfused; under head-sharded tensor parallelism its variance "
                    "would need an all-reduce)")
_UNMATCHED = ("per-head RMSNorm {order} left unfused: no registered combination of the fusion matches this "
              "computation as written (docs/fusions.md lists the combinations and spellings)")
#: Node meta key: the whole fusion matched here and was refused, with a reason already reported.
REFUSED = "fusion_pass_qk_norm_rope_cache_refused"

aten = torch.ops.aten
#: A RoPE's sign flip: the ``neg`` of ``rotate_half``, or the subtraction of ``x1 * cos - x2 * sin``.
_SIGN_FLIPS = frozenset((aten.neg.default, aten.sub.Tensor))
#: A search for the RoPE beside a norm stops at another norm's statistic, and at ops whose name
#: has a word (between underscores) ending in "mm" (``mm``, ``bmm``, ``_int_mm``, ``_scaled_mm``)
#: or one of these words (attention, convolutions, linear layers), or that are not ATen ops (flex
#: attention and other higher-order ops): past them lies other work.
_BARRIER_WORDS = frozenset(("attention", "convolution", "conv1d", "conv2d", "conv3d", "linear"))


def _is_barrier(node: torch.fx.Node) -> bool:
    if node.target in (aten.rsqrt.default, aten.sqrt.default):
        return True
    if isinstance(node.target, torch._ops.OpOverload):
        words = node.target._schema.name.split("::")[-1].split("_")
        return any(word.endswith("mm") or word in _BARRIER_WORDS for word in words)
    return isinstance(node.target, torch._ops.OperatorBase)  # higher-order ops; getitem and the like pass


def _has_rotation(nodes: list[torch.fx.Node]) -> bool:
    """The nodes hold a RoPE: a sum or difference of two products both among them (``x * cos +
    rotate_half(x) * sin``, ``x1 * cos - x2 * sin``, whatever the rotation's spelling: a roll
    traces as a permuting index), or a sign flip beside halves put back together."""
    region = set(nodes)
    for node in region:
        if (node.target in (aten.add.Tensor, aten.sub.Tensor) and len(node.args) == 2
                and all(arg in region and arg.target is aten.mul.Tensor for arg in node.args)):
            return True
    targets = {n.target for n in region}
    return bool(targets & _SIGN_FLIPS) and aten.cat.default in targets  # halves put back (stack traces as cat)


def _near(start: torch.fx.Node, forward: bool, depth: int) -> list[torch.fx.Node]:
    """Nodes within ``depth`` steps of ``start`` along users (``forward``) or arguments, not past
    a barrier (``_is_barrier``)."""
    seen, frontier = {start}, [start]
    for _ in range(depth):
        step = []
        for node in frontier:
            nxt = node.users if forward else node.all_input_nodes
            for n in nxt:
                if n not in seen and n.op == "call_function":
                    seen.add(n)
                    if not _is_barrier(n):
                        step.append(n)
        frontier = step
    return [n for n in seen if n is not start]


def _per_head_statistic_input(stat: torch.fx.Node) -> torch.fx.Node | None:
    """``x`` where ``stat`` is ``rsqrt`` (or ``sqrt``) of ``mean(x ** 2, -1) + eps`` over a head
    axis: x has 4 dims, or 3 from a view that split its last dim into heads; else None."""
    add = stat.args[0] if stat.args else None
    if not isinstance(add, torch.fx.Node) or add.target is not aten.add.Tensor:
        return None
    mean = add.args[0]
    if (not isinstance(mean, torch.fx.Node) or mean.target is not aten.mean.dim or len(mean.args) < 2
            or not isinstance(mean.args[1], (list, tuple)) or list(mean.args[1]) != [-1]):
        return None
    square = mean.args[0]
    if not isinstance(square, torch.fx.Node) or square.target is not aten.pow.Tensor_Scalar:
        return None
    x = square.args[0]
    while isinstance(x, torch.fx.Node) and x.target is torch.ops.prims.convert_element_type.default:
        x = x.args[0]
    val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dim() not in (3, 4):
        return None
    if val.dim() == 3:
        view = x
        while view.op == "call_function" and view.target is torch.ops.prims.convert_element_type.default:
            view = view.args[0]
        source = view.args[0].meta.get("val") if view.op == "call_function" and view.args and isinstance(
            view.args[0], torch.fx.Node) else None
        if view.target not in (aten.reshape.default, aten.view.default) or not isinstance(source, torch.Tensor) \
                or source.shape[-1] == val.shape[-1]:
            return None
    return x


def report_unmatched_prologues(graph: torch.fx.Graph, family: str) -> int:
    """Report, under ``family``, each per-head RMSNorm statistic still in ``graph`` with a RoPE
    just after its norm or just before it, that no fusion took and no near-miss pattern reported,
    with the order found (norm -> RoPE, or RoPE -> norm). Inference graphs only: a training
    graph's forward keeps its norms by design (the training families report theirs), and where
    Inductor does not say which graph it is, nothing is reported. Returns the number reported."""
    from fusion_pass.passes import graph_is_inference  # passes imports the families, which import this

    if not graph_is_inference():
        return 0
    outputs = {n for out in graph.find_nodes(op="output") for n in out.all_input_nodes}
    reported = 0
    for stat in [*graph.find_nodes(op="call_function", target=aten.rsqrt.default),
                 *graph.find_nodes(op="call_function", target=aten.sqrt.default)]:
        x = _per_head_statistic_input(stat)
        if x is None or stat.meta.get(REFUSED) or stat in outputs or stat.args[0] in outputs:
            continue
        if not fusion_config.device_allowed(x.meta["val"].device):
            continue
        rope_after, rope_before = _has_rotation(_near(stat, True, 14)), _has_rotation([x, *_near(x, False, 8)])
        if not (rope_after or rope_before):
            continue
        order = "-> RoPE" if rope_after else "after a RoPE"
        match_report.record_near_miss(family, _UNMATCHED.format(order=order))
        stat.meta[REFUSED] = True
        reported += 1
    return reported


@functools.lru_cache(maxsize=None)
def near_miss_pass(family: str) -> PatternMatcherPass:
    """A pass whose patterns only report, under ``family``'s name: one hit per norm -> RoPE left
    in the graph after the fusion ran."""
    near_misses = PatternMatcherPass(pass_name="fusion_pass_qk_norm_rope_cache_near_misses")

    def report(reason):
        def report_only(match: Match, *args, **kwargs) -> None:
            if not any(node.meta.get(REFUSED) for node in match.nodes):
                match_report.record_near_miss(family, reason)
                for node in match.nodes:  # once: two forms can trace to one graph (fp32: Qwen3's, AFMoE's)
                    node.meta[REFUSED] = True

        return report_only

    def register(name: str, search, example: list, reason: str, trace=trace_canonical, allowed=None) -> None:
        """Trace ``search`` on ``example`` (or load it from the pattern cache) and report ``reason``
        wherever it matches a graph of an enabled device."""
        pattern = traced_pattern(f"qk_norm_rope_cache_near_miss_{name}",
                                 functools.partial(gen_pattern, search, example, trace, {"eps": EPS_EXAMPLE}),
                                 inputs_signature(example))
        if not is_new_pattern(near_misses, pattern):
            return
        register_graph_pattern(
            pattern, pass_dict=near_misses,
            extra_check=allowed or (lambda match: fusion_config.device_allowed(match_value(match, "x").device)),
        )(report(reason))

    def norm_rope(norm: NormForm, norm_before_transpose, rope=rope_reference):
        def search(x, weight, cos, sin, eps):
            x = norm.fn(x, weight, eps)
            return rope(x.transpose(1, 2) if norm_before_transpose else x, cos, sin)

        if norm.weighted:
            return search
        return lambda x, cos, sin, eps: search(x, None, cos, sin, eps)

    # The norm on [B, S, H, D] before the transpose, on a contiguous [B, H, S, D], and (for the
    # forms whose graph then has a copy) on the transposed view of [B, S, H, D].
    # An fp32 model traces the same norm without its casts: matched apart, to say why it is left.
    placements = ((True, False), (False, False), (False, True))
    for (name, norm), (norm_before_transpose, strided), dtype in itertools.product(
            NORM_FORMS.items(), placements, (torch.bfloat16, torch.float32)):
        if strided and not norm.copies_strided_input:
            continue
        t = functools.partial(torch.empty, dtype=dtype)
        example = [t(2, 8, 4, 16), t(16), t(2, 1, 8, 16), t(2, 1, 8, 16)]
        if not norm_before_transpose:
            example[0] = t(2, 8, 4, 16).transpose(1, 2) if strided else t(2, 4, 8, 16)
        if not norm.weighted:
            del example[1]
        def allowed(match, fp32=dtype == torch.float32):
            x = match_value(match, "x")
            return fusion_config.device_allowed(x.device) and (x.dtype == torch.float32) == fp32

        register(f"{name}_{int(norm_before_transpose)}_{int(strided)}_{str(dtype)[6:]}",
                 norm_rope(norm, norm_before_transpose), example,
                 _FP32_MODEL if dtype == torch.float32 else _NO_CACHE_WRITE, allowed=allowed)

    # One norm over the projection's width, then the head view and RoPE (Olmo2Attention, whose norm is
    # AFMoE's form; Qwen3's form too). The view's sizes are the example's: ints are wildcards in patterns.
    def full_width_norm_rope(norm: NormForm):
        def search(x, weight, cos, sin, eps):
            return rope_reference(norm.fn(x, weight, eps).view(2, 8, 4, 16).transpose(1, 2), cos, sin)

        return search

    t = functools.partial(torch.empty, dtype=torch.bfloat16)
    example = [t(2, 8, 64), t(64), t(2, 1, 8, 16), t(2, 1, 8, 16)]
    for name in ("qwen3", "afmoe"):
        register(f"full_width_{name}", full_width_norm_rope(NORM_FORMS[name]), example, _FULL_WIDTH_NORM,
                 trace=trace_as_post_grad)

    # Partial rotary (GLM-4.5, Qwen3-Next, Qwen3.5) left unfused: on flattened tokens [T, H, D]
    # (vLLM's layout, not registered), or on Hugging Face's rows without a cache write the fusion
    # takes. The slice bounds are ints, wildcards in a pattern: any rotary_dim matches.
    t = functools.partial(torch.empty, dtype=torch.bfloat16)
    for (name, norm), tokens in itertools.product(NORM_FORMS.items(), (False, True)):
        example = ([t(8, 4, 16), t(16), t(8, 1, 8), t(8, 1, 8)] if tokens
                   else [t(2, 8, 4, 16), t(16), t(2, 1, 8, 8), t(2, 1, 8, 8)])
        if not norm.weighted:
            del example[1]
        register(f"partial_{name}_{int(tokens)}", norm_rope(norm, not tokens, partial_rope_reference), example,
                 _PARTIAL_NO_CACHE_WRITE)

    # HunYuan's order: RoPE on [B, H, S, D], then the (Qwen3-form) norm.
    def rope_norm(x, weight, cos, sin, eps):
        return rms_norm_reference(rope_reference(x, cos, sin), weight, eps)

    t = functools.partial(torch.empty, dtype=torch.bfloat16)
    example = [t(2, 4, 8, 16), t(16), t(2, 1, 8, 16), t(2, 1, 8, 16)]
    register("rope_first", rope_norm, example, _ROPE_FIRST_NO_CACHE_WRITE)
    return near_misses

