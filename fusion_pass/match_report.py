"""Match reporting: what was fused, why near-misses were left alone, and contained faults.

Every replacement increments ``torch._dynamo.utils.counters["fusion_pass"][family]``.
Patterns that found the right structure but refused it (an unsupported head_dim or dtype, a
norm → RoPE without a cache write) record a near-miss with the reason, so that a user can see
why a layer was not fused without reading Inductor's debug logs. A fault inside a family
(``transaction``) is an internal error: the family was skipped on that graph, which was left as
it was; each one also increments ``counters["fusion_pass"]["internal_errors"]``.
"""

from __future__ import annotations

import collections
import dataclasses

from torch._dynamo.utils import counters

from . import families

COUNTER_KEY = "fusion_pass"
INTERNAL_ERRORS_KEY = "internal_errors"


@dataclasses.dataclass(frozen=True)
class NearMiss:
    family: str
    reason: str


@dataclasses.dataclass(frozen=True)
class InternalError:
    """A fault contained inside ``family``: the exception's type and first message line, and where
    it was raised (``file:line in function`` in this package's code)."""

    family: str
    error_type: str
    message: str
    where: str


_near_misses: collections.Counter[NearMiss] = collections.Counter()
_internal_errors: collections.Counter[InternalError] = collections.Counter()
_staged: list[list[NearMiss]] = []


class Staged:
    """While active, near-misses are held back; ``commit()`` records them. A family that faults is
    reported by its internal error alone, not by what it said before the fault."""

    def __init__(self) -> None:
        self.near_misses: list[NearMiss] = []

    def __enter__(self) -> "Staged":
        _staged.append(self.near_misses)
        return self

    def __exit__(self, *exc) -> None:
        _staged.remove(self.near_misses)

    def commit(self) -> None:
        for miss in self.near_misses:
            _record(miss)
        self.near_misses = []


def _record(miss: NearMiss) -> None:
    if _staged:
        _staged[-1].append(miss)
    else:
        _near_misses[miss] += 1


def record_match(family: str, count: int = 1) -> None:
    if count:
        counters[COUNTER_KEY][family] += count


def record_near_miss(family: str, reason: str) -> None:
    """Remember that ``family``'s structure was seen but not fused, and why."""
    _record(NearMiss(family, reason))


def record_internal_error(family: str, error_type: str, message: str, where: str) -> None:
    _internal_errors[InternalError(family, error_type, message, where)] += 1
    counters[COUNTER_KEY][INTERNAL_ERRORS_KEY] += 1


def match_counts() -> dict[str, int]:
    """Fusions per family since the last ``reset()`` (families with none are left out)."""
    return {name: n for name, n in counters[COUNTER_KEY].items() if name in families.NAMES and n}


def near_misses() -> dict[NearMiss, int]:
    return dict(_near_misses)


def internal_errors() -> dict[InternalError, int]:
    """Faults contained since the last ``reset()``, with how often each occurred."""
    return dict(_internal_errors)


def reset() -> None:
    """Forget all counts, near-misses and internal errors (``torch._dynamo.reset()`` does not clear ours)."""
    counters[COUNTER_KEY].clear()
    _near_misses.clear()
    _internal_errors.clear()


def report() -> str:
    """A short human-readable account of what was fused, what was left alone and what faulted.

    Example::

        fusion_pass: 2 fusions applied
          qk_norm_rope_cache: 2 (per-head RMSNorm(q, k) -> RoPE -> K/V cache write)
        near-misses (structure found, not fused):
          qk_norm_rope_cache: head_dim 96 is not a power of two (the kernel serves powers of two in [16, 512]) (x2)
        internal errors (the family skipped on that graph, the graph left as it was):
          qk_norm_rope_backward: KeyError: 'val' (at patterns/qk_norm_rope_backward.py:301 in _find_region)
    """
    counts = match_counts()
    total = sum(counts.values())
    lines = [f"fusion_pass: {total} fusion{'s' if total != 1 else ''} applied"]
    for name in families.NAMES:
        if counts.get(name):
            lines.append(f"  {name}: {counts[name]} ({families.family(name).description})")
    if not total and not _near_misses and not _internal_errors:
        lines.append("  (nothing matched: is fusion_pass installed, the device type enabled, "
                     "and the FX graph cache cold? see README 'Troubleshooting')")
    if _near_misses:
        lines.append("near-misses (structure found, not fused):")
        for miss, n in sorted(_near_misses.items(), key=lambda kv: (kv[0].family, kv[0].reason)):
            lines.append(f"  {miss.family}: {miss.reason}" + (f" (x{n})" if n > 1 else ""))
    if _internal_errors:
        lines.append("internal errors (the family skipped on that graph, the graph left as it was):")
        for error, n in sorted(_internal_errors.items(), key=lambda kv: dataclasses.astuple(kv[0])):
            message = f": {error.message}" if error.message else ""
            lines.append(f"  {error.family}: {error.error_type}{message} (at {error.where})" + (f" (x{n})" if n > 1 else ""))
    return "\n".join(lines)
