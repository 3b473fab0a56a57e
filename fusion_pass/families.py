"""The fusion families: name, one-line description, graph stage and pattern module of each."""

from __future__ import annotations

import importlib
from types import ModuleType

DESCRIPTIONS = {
    "qk_norm_rope_cache": "per-head RMSNorm(q, k) -> RoPE -> K/V cache write, one Triton kernel",
    "qkv_rope_qk_norm": "QKV projection -> RoPE -> per-head RMSNorm, fused forward and backward",
}

#: Module under ``fusion_pass.patterns`` that registers each family's patterns.
PATTERN_MODULES = {
    "qk_norm_rope_cache": "qk_norm_rope_cache",
    "qkv_rope_qk_norm": "qkv_rope_qk_norm",
}


def pattern_module(family: str) -> ModuleType:
    """Import the pattern module of ``family``; it exposes ``register(pass_dict)``."""
    return importlib.import_module(f"fusion_pass.patterns.{PATTERN_MODULES[family]}")
