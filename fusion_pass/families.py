"""The fusion families, listed once.

Each family is a pattern module ``fusion_pass.patterns.<name>`` that declares:

- ``FAMILY``: a ``Family``, its one-line description and the Inductor stage it runs in;
- ``REWRITES``: the ``fusion_pass.rewrites.Rewrite`` objects run on a graph before matching, in
  order (undone, where they carry an undo, after it);
- ``register(pass_dict)``: traces and registers its patterns;
- optionally ``apply(graph, pass_dict)``: the matching, where it is more than running the
  registered patterns (``pass_dict.apply``), and ``applies_to(graph)``: a cheap look that skips a
  graph before anything is registered.

``passes`` runs every family the same way, as a transaction (``transaction``). Configuration,
installation, the passes and the report read ``NAMES`` and the modules' ``FAMILY``; nothing else
lists the families.
"""

from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType

#: Every family, in the order their passes run within a stage (``qk_norm_rope_backward`` takes
#: what ``qkv_rope_qk_norm`` leaves).
NAMES = ("qk_norm_rope_cache", "qkv_rope_qk_norm", "qk_norm_rope_backward")

#: Inductor's stages: post-grad graphs (inference and the forward of training) and joint graphs
#: (training; only there can a fusion change gradient formulas).
STAGES = ("post_grad", "joint")


@dataclasses.dataclass(frozen=True)
class Family:
    """What a pattern module declares about its family.

    Attributes:
        name: the module's name under ``fusion_pass.patterns`` (what ``report()`` and
            ``match_counts()`` call the family).
        description: one line, shown by ``report()``.
        stage: ``"post_grad"`` (run from ``post_grad_custom_pre_pass``) or ``"joint"`` (from
            ``joint_custom_pre_pass``).
    """

    name: str
    description: str
    stage: str

    def __post_init__(self) -> None:
        if self.name not in NAMES:
            raise ValueError(f"name: expected one of {NAMES} (fusion_pass.families.NAMES), got {self.name!r}")
        if self.stage not in STAGES:
            raise ValueError(f"stage: expected one of {STAGES}, got {self.stage!r}")


def pattern_module(name: str) -> ModuleType:
    """``fusion_pass.patterns.<name>`` (importing it registers the custom ops it replaces with)."""
    if name not in NAMES:
        raise ValueError(f"name: expected one of {NAMES}, got {name!r}")
    return importlib.import_module(f"fusion_pass.patterns.{name}")


def family(name: str) -> Family:
    """The ``Family`` that the pattern module ``name`` declares."""
    return pattern_module(name).FAMILY


def names_in_stage(stage: str) -> tuple[str, ...]:
    """The families of ``stage`` (``STAGES``), in pass order."""
    if stage not in STAGES:
        raise ValueError(f"stage: expected one of {STAGES}, got {stage!r}")
    return tuple(name for name in NAMES if family(name).stage == stage)


def load_all() -> None:
    """Import every pattern module, so that every custom op they call is registered (a graph
    compiled earlier and loaded from Inductor's cache calls them)."""
    for name in NAMES:
        pattern_module(name)
