"""Putting the passes into Inductor's hooks, taking them out, and scoped options.

Forward (inference) fusions run from ``post_grad_custom_pre_pass``: the functional post-grad
graph, before Inductor's own pattern passes and re-inplacing. Training fusions run from
``joint_custom_pre_pass``: only the joint graph can change gradient formulas (the reason
PyTorch's own SDPA fusion matches there), before Inductor's joint-graph patterns (``pad_mm``
would pad the projection matmuls first); forward-only graphs pass through it too.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch._inductor.config as inductor_config

from . import config as fusion_config
from . import families as fusion_families
from .versions import check_torch_version
from .passes import FusionGraphPass, graph_passes, is_ours

#: Inductor's hook for each stage. Training runs in the pre-pass: Inductor's own joint-graph
#: patterns that follow (``pad_mm`` pads the projection matmuls whose sizes are not multiples of
#: 8, whenever its benchmark says so) would otherwise hide the region from the patterns.
FORWARD_HOOK = "post_grad_custom_pre_pass"
TRAINING_HOOK = "joint_custom_pre_pass"
_HOOKS = {FORWARD_HOOK: "post_grad", TRAINING_HOOK: "joint"}


def _without_ours(hook_value: Any) -> Any:
    """The hook value with our passes replaced by what they wrap (a list stays a list)."""
    if is_ours(hook_value):
        return hook_value.previous
    if isinstance(hook_value, (list, tuple)):
        kept = [p for value in hook_value for p in (graph_passes(value.previous) if is_ours(value) else (value,))]
        return type(hook_value)(kept)
    return hook_value


def _compose(hook: str, current: Any, config: fusion_config.FusionConfig) -> FusionGraphPass:
    stage = _HOOKS[hook]
    # Re-installing: never stack our pass on itself. The user's passes (one, or a list) run after ours.
    return FusionGraphPass(stage, fusion_families.names_in_stage(stage), config, previous=_without_ours(current))


def install(devices: Iterable[str] | str = ("cuda",), families: Iterable[str] | str | None = None,
            strict: bool | None = None) -> None:
    """Install the fusion passes into Inductor's hooks, as the calling thread sees them.

    Every later ``torch.compile`` (Inductor backend) in this thread rewrites matching subgraphs.
    torch 2.13 keeps Inductor's configuration per thread (a context variable): a compile in
    another thread sees the passes only if that thread calls ``install`` too, or compiles with
    ``options()``; ``installed()`` tells, per thread. Custom passes the user had in the same hook
    (one, or a list) keep running after ours; ``uninstall()`` leaves them there. Calling
    ``install`` again replaces the configuration (passes are never stacked twice).

    Args:
        devices: device types whose graphs are rewritten. By default only ``("cuda",)``,
            where the Triton kernels run; ``("cuda", "cpu")`` also rewrites CPU graphs, whose
            fused ops run their PyTorch references (or Triton under ``TRITON_INTERPRET=1``); a single
            name (``"cpu"``) is one device type.
        families: fusion families to apply (default: all, see ``fusion_pass.FAMILIES``).
        strict: a fault inside a family is contained by default: that family leaves the graph as it
            was, the compile goes on as stock Inductor's, and ``report()`` lists the internal error.
            ``strict=True`` re-raises it instead; None (the default) follows ``FUSION_PASS_STRICT=1``.

    Raises:
        fusion_pass.UnsupportedTorchVersion: torch is older than 2.11 (``fusion_pass.SUPPORTED_TORCH``).

    Example::

        import torch, fusion_pass
        fusion_pass.install()
        model = torch.compile(model)
        ...
        print(fusion_pass.report())
    """
    check_torch_version()
    config = fusion_config.FusionConfig.make(devices, families, strict)
    for hook in _HOOKS:
        setattr(inductor_config, hook, _compose(hook, getattr(inductor_config, hook), config))


def uninstall() -> None:
    """Take our passes out of Inductor's hooks, leaving the user's passes in them (those there
    before ``install()`` and those set since); a no-op if not installed."""
    for hook in _HOOKS:
        current = getattr(inductor_config, hook)
        if any(is_ours(p) for p in graph_passes(current)):
            setattr(inductor_config, hook, _without_ours(current))


def _our_pass(hook: str) -> FusionGraphPass | None:
    """Our pass in ``hook`` as the calling thread sees it, or None."""
    return next((p for p in graph_passes(getattr(inductor_config, hook)) if is_ours(p)), None)


def installed_families() -> tuple[str, ...]:
    """The families that compiles in the calling thread run: enabled by ``install()`` and with our
    pass still in their stage's hook (a hook that was set again since, by the user or by
    ``inductor_config.patch`` ending, runs none of them)."""
    running = set()
    for hook, stage in _HOOKS.items():
        ours = _our_pass(hook)
        if ours is not None:
            running |= {name for name in fusion_families.names_in_stage(stage) if name in ours.config.families}
    return tuple(name for name in fusion_families.NAMES if name in running)


def installed(family: str | None = None) -> bool:
    """Whether ``install()`` is in effect for compiles in the calling thread (see ``install``).

    Args:
        family: ask about one family (``fusion_pass.FAMILIES``): whether it runs.

    Returns:
        With ``family``: whether that family runs. Without: whether every family that ``install()``
        enabled runs, i.e. our pass is in each hook that one of them needs; False when none is
        installed, or when a hook lost our pass since (e.g. ``install()`` inside
        ``inductor_config.patch(post_grad_custom_pre_pass=None)``, whose end put the hook back).
    """
    if family is not None:
        if family not in fusion_families.NAMES:
            raise ValueError(f"family: expected one of {fusion_families.NAMES}, got {family!r}")
        return family in installed_families()
    ours = [p for p in (_our_pass(hook) for hook in _HOOKS) if p is not None]
    if not ours:
        return False
    enabled = set().union(*(p.config.families for p in ours))
    return enabled <= set(installed_families())


def options(devices: Iterable[str] | str = ("cuda",), families: Iterable[str] | str | None = None,
            strict: bool | None = None) -> dict[str, Any]:
    """Inductor options for scoped use: ``torch.compile(model, options=fusion_pass.options())``.

    The global hooks are left untouched; passes already installed there keep running after
    ours inside this compile.

    Args:
        devices, families, strict: as for ``install`` (which also says what torch versions it accepts).

    Returns:
        ``{"post_grad_custom_pre_pass": ..., "joint_custom_pre_pass": ...}``
    """
    check_torch_version()
    config = fusion_config.FusionConfig.make(devices, families, strict)
    return {hook: _compose(hook, getattr(inductor_config, hook), config) for hook in _HOOKS}
