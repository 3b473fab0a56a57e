"""The graph passes that Inductor calls: one for post-grad (inference) graphs, one for joint graphs.

Each pass owns one ``PatternMatcherPass`` per fusion family so that it can count matches per
family exactly (``PatternMatcherPass.apply`` returns how many replacements it made). Patterns
are traced lazily, on the first graph a pass sees, so that ``import fusion_pass`` stays cheap.

Both classes are ``CustomGraphPass`` objects with a ``uuid()`` that hashes this package's
sources and the active configuration: Inductor's FX graph cache stays on, and a change to a
pattern, a kernel or the configuration can never serve a stale graph (pytorch#136883).
"""

from __future__ import annotations

import contextvars
import functools
from typing import Any, Callable

import torch
from torch._dynamo.utils import counters
from torch._inductor import custom_graph_pass
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.pattern_matcher import PatternMatcherPass
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from . import config as fusion_config
from . import match_report
from .families import pattern_module
from .rewrites import rewritten
from .source_hash import source_hash
from .transaction import apply_contained


@functools.lru_cache(maxsize=None)
def _family_pass(family: str) -> PatternMatcherPass:
    """The family's patterns, traced and registered once per process.

    Registration happens lazily, from inside the first compile that needs it. Like Inductor's
    own ``init_once_fakemode``, trace outside that compile's tracing context (its ShapeEnv must
    not collect the patterns' symbols), under a fresh FakeTensorMode, with inference mode off
    (training patterns trace a backward) and without counting the traces as compile activity.
    """
    pass_dict = PatternMatcherPass(pass_name=f"fusion_pass_{family}")
    saved_counters = counters["inductor"].copy()
    with torch._guards.tracing(None), unset_fake_temporarily(), FakeTensorMode(), torch.inference_mode(False):
        pattern_module(family).register(pass_dict)
    counters["inductor"] = saved_counters
    return pass_dict


def _apply_family(family: str, graph: torch.fx.Graph, strict: bool) -> int:
    """Number of replacements, the family applied as a transaction (``transaction``): the graph
    rewritten by the family's ``REWRITES``, matched (its ``apply``, or its registered patterns
    first to last), the rewrites undone where no fusion used them. ``applies_to(graph)`` may say
    that a graph cannot match: then nothing is registered or snapshot either (registering the
    training family costs seconds, and inference graphs pass its hook too)."""
    module = pattern_module(family)

    def applies() -> bool:
        return not hasattr(module, "applies_to") or module.applies_to(graph)

    def apply() -> int:
        pass_dict = _family_pass(family)
        with rewritten(graph, module.REWRITES):
            return module.apply(graph, pass_dict) if hasattr(module, "apply") else pass_dict.apply(graph)

    return apply_contained(family, graph, applies, apply, strict)


#: Whether the graph the pass is running on is an inference graph (Inductor's ``is_inference``);
#: None outside a pass, or where Inductor does not say.
_GRAPH_IS_INFERENCE: contextvars.ContextVar[bool | None] = contextvars.ContextVar("fusion_pass_is_inference",
                                                                                 default=None)


def graph_is_inference() -> bool | None:
    """Inside a pass: whether its graph is an inference graph (not a training graph's forward);
    None when Inductor did not say."""
    return _GRAPH_IS_INFERENCE.get()


# Inductor passes ``is_inference`` to a post-grad pass of this kind, which ours hands on to a
# user's inference-aware pass; a torch without the class has no such passes to hand it to.
_InferenceAwarePass = getattr(custom_graph_pass, "CustomInferenceAwareGraphPass", CustomGraphPass)


def graph_passes(hook_value: Any) -> tuple:
    """The passes an Inductor hook value holds: None, one pass, or a list or tuple of passes."""
    if hook_value is None:
        return ()
    return tuple(hook_value) if isinstance(hook_value, (list, tuple)) else (hook_value,)


class FusionGraphPass(_InferenceAwarePass):
    """Applies the enabled families of one stage, then the passes that were installed before us.

    Args:
        stage: ``"post_grad"`` (forward/inference families) or ``"joint"`` (training families).
        families: the families this pass applies, in order.
        config: devices and enabled families; active while the pass runs, part of its uuid.
        previous: what occupied the same Inductor hook: None, the user's pass, or a list of
            passes (inference-aware ones included); they keep running, after ours, in order.
    """

    def __init__(
        self,
        stage: str,
        families: tuple[str, ...],
        config: fusion_config.FusionConfig,
        previous: Callable | None = None,
    ) -> None:
        if stage not in ("post_grad", "joint"):
            raise ValueError(f"stage: expected 'post_grad' or 'joint', got {stage!r}")
        self.stage = stage
        self.families = families
        self.config = config
        self.previous = previous

    def __call__(self, graph: torch.fx.Graph, is_inference: bool | None = None) -> None:
        token = _GRAPH_IS_INFERENCE.set(is_inference)
        try:
            self._apply_families(graph)
        finally:
            _GRAPH_IS_INFERENCE.reset(token)
        for previous in graph_passes(self.previous):
            # As Inductor calls the passes of the hook: post-grad inference-aware ones get is_inference.
            if (self.stage == "post_grad" and _InferenceAwarePass is not CustomGraphPass
                    and isinstance(previous, _InferenceAwarePass)):
                previous(graph, is_inference=bool(is_inference))
            else:
                previous(graph)

    def _apply_families(self, graph: torch.fx.Graph) -> None:
        with fusion_config.using(self.config):
            strict = self.config.is_strict()
            for family in self.families:
                if family in self.config.families:
                    match_report.record_match(family, _apply_family(family, graph, strict))

    def uuid(self) -> Any:
        previous_uuid = []
        for previous in graph_passes(self.previous):
            if not isinstance(previous, CustomGraphPass):
                return None  # a bare callable disables Inductor's caching anyway
            previous_uuid.append(previous.uuid())
            if previous_uuid[-1] is None:
                return None
        return (
            "fusion_pass",
            self.stage,
            self.families,
            source_hash(),
            repr(self.config),
            torch.__version__,
            tuple(previous_uuid),
        )


def is_ours(graph_pass: object) -> bool:
    return isinstance(graph_pass, FusionGraphPass)
