"""Configuration of the fusion passes: which device types get rewritten and which fusions run.

The active configuration is part of every pass's ``uuid()``, so changing it invalidates
Inductor's FX graph cache instead of serving a graph compiled under other settings.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterable, Iterator

import torch

from .families import NAMES as ALL_FAMILIES
from .transaction import strict_from_env


@dataclasses.dataclass(frozen=True)
class FusionConfig:
    """What the installed passes rewrite.

    Attributes:
        devices: device types (``"cuda"``, ``"cpu"``) whose graphs are rewritten. On CUDA the
            fused ops run Triton kernels; on CPU they run their PyTorch references (or the
            Triton kernels under ``TRITON_INTERPRET=1``).
        families: fusion families to apply; the default is all of them.
        strict: re-raise a fault inside a family instead of containing it (``transaction``); None:
            as the environment says when the pass runs (``FUSION_PASS_STRICT=1``).
    """

    devices: tuple[str, ...] = ("cuda",)
    families: tuple[str, ...] = ALL_FAMILIES
    strict: bool | None = None

    def __post_init__(self) -> None:
        for device in self.devices:
            if not isinstance(device, str) or device not in ("cuda", "cpu", "xpu"):
                raise ValueError(f"devices: expected device type names such as 'cuda' or 'cpu', got {device!r}")
        for family in self.families:
            if family not in ALL_FAMILIES:
                raise ValueError(f"families: unknown fusion family {family!r}; known: {ALL_FAMILIES}")
        if self.strict not in (None, True, False):
            raise ValueError(f"strict: expected True, False or None, got {self.strict!r}")

    def is_strict(self) -> bool:
        """Whether a family's fault is re-raised (``strict``, or the environment when it is None)."""
        return strict_from_env() if self.strict is None else self.strict

    @classmethod
    def make(cls, devices: Iterable[str] | str = ("cuda",), families: Iterable[str] | str | None = None,
             strict: bool | None = None) -> "FusionConfig":
        """``devices`` and ``families`` as names or iterables of names (``"cpu"`` is ``("cpu",)``)."""
        def names(value):
            return (value,) if isinstance(value, str) else tuple(value)

        return cls(devices=names(devices), families=ALL_FAMILIES if families is None else names(families),
                   strict=strict)


_active = FusionConfig()


def active() -> FusionConfig:
    """The configuration of the pass that is running now (patterns' checks read it)."""
    return _active


@contextlib.contextmanager
def using(config: FusionConfig) -> Iterator[None]:
    """Make ``config`` the active configuration while a pass runs."""
    global _active
    saved, _active = _active, config
    try:
        yield
    finally:
        _active = saved


def device_allowed(device: torch.device) -> bool:
    """True when graphs on ``device`` may be rewritten under the active configuration."""
    return device.type in _active.devices
