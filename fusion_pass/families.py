"""The fusion families: one-line description and pattern module of each."""

from __future__ import annotations

import importlib
from types import ModuleType

DESCRIPTIONS = {
    "qk_norm_rope_cache": "per-head RMSNorm(q, k) -> RoPE -> K/V cache write, one Triton kernel",
    "qkv_rope_qk_norm": "QKV projection -> RoPE -> per-head RMSNorm, fused forward and backward",
    "qk_norm_rope_backward": "per-head RMSNorm <-> RoPE of q or k in training, its backward one Triton pass "
                             "(one count per tensor)",
}

def pattern_module(family: str) -> ModuleType:
    """Import ``fusion_pass.patterns.<family>``; it exposes ``register(pass_dict)`` (and may
    expose ``apply(graph, pass_dict)`` to wrap the matching)."""
    return importlib.import_module(f"fusion_pass.patterns.{family}")
