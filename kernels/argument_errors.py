"""The error every op raises for an argument that breaks its contract, and the q/k head checks the
ops share.

Each message reads ``fusion_pass.<op>: <argument>: expected <what>, got <what came>``.
"""

from __future__ import annotations

from typing import Callable, NoReturn

import torch

from .rounding import SUPPORTED_DTYPES


class ArgumentError(ValueError):
    """An argument that breaks one of the ops' contracts. ``str()`` names the op; ``reason`` is the
    rest, which names the argument and what was expected (a refused match reports it as its
    near-miss)."""

    def __init__(self, op: str, reason: str) -> None:
        super().__init__(f"fusion_pass.{op}: {reason}")
        self.op, self.reason = op, reason


def failure(op: str) -> Callable[[str, str, object], NoReturn]:
    """``fail(name, expected, got)`` raising ``ArgumentError`` for ``op``."""

    def fail(name: str, expected: str, got: object) -> NoReturn:
        raise ArgumentError(op, f"{name}: expected {expected}, got {got}")

    return fail


def check_q_k_heads(fail: Callable[[str, str, object], NoReturn], q: torch.Tensor, k: torch.Tensor,
                    heads_first: bool) -> tuple[int, int, int, int, int]:
    """q's dtype and even head_dim, k's shape against q's, and GQA head counts, for 4-D q and k laid
    out ``[B, H, S, D]`` (``heads_first``) or ``[B, S, H, D]``. Returns (B, S, Hq, Hkv, D)."""
    if heads_first:
        batch, q_heads, seq, head_dim = q.shape
    else:
        batch, seq, q_heads, head_dim = q.shape
    if q.dtype not in SUPPORTED_DTYPES:
        fail("q", f"dtype in {SUPPORTED_DTYPES}", q.dtype)
    if head_dim % 2:
        fail("q", "an even head_dim (RoPE rotates halves)", head_dim)
    seq_axis, head_axis = (2, 1) if heads_first else (1, 2)
    if k.dim() != 4 or k.shape[0] != batch or k.shape[seq_axis] != seq or k.shape[3] != head_dim:
        layout = f"B={batch}, Hkv, S={seq}" if heads_first else f"B={batch}, S={seq}, Hkv"
        fail("k", f"shape [{layout}, D={head_dim}]", f"shape {tuple(k.shape)}")
    kv_heads = k.shape[head_axis]
    if kv_heads == 0 or q_heads % kv_heads:
        fail("k", f"a head count dividing q's {q_heads} heads (GQA)", kv_heads)
    return batch, seq, q_heads, kv_heads, head_dim
