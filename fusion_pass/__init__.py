"""torch.compile fusions for the attention prologue of modern LLMs.

Usage::

    import torch, fusion_pass
    fusion_pass.install()                 # or torch.compile(model, options=fusion_pass.options())
    model = torch.compile(model)          # Hugging Face model code, unchanged
    ...
    print(fusion_pass.report())

Importing this package registers the ``torch.ops.fusion_pass.*`` custom ops, which compiled
graphs (also those loaded from Inductor's cache) call.
"""

from . import families as _families
from .config import ALL_FAMILIES as FAMILIES
from .install import install, installed, installed_families, options, uninstall
from .match_report import internal_errors, match_counts, near_misses, report
from .match_report import reset as reset_report
from .versions import SUPPORTED_RANGE as SUPPORTED_TORCH
from .versions import UnsupportedTorchVersion

_families.load_all()  # registers torch.ops.fusion_pass.*: the ops each family's replacements call

__all__ = [
    "FAMILIES",
    "SUPPORTED_TORCH",
    "UnsupportedTorchVersion",
    "install",
    "installed",
    "installed_families",
    "internal_errors",
    "match_counts",
    "near_misses",
    "options",
    "report",
    "reset_report",
    "uninstall",
]
