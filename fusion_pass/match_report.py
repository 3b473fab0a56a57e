"""Match reporting: what was fused, and why near-misses were left alone.

Every replacement increments ``torch._dynamo.utils.counters["fusion_pass"][family]``.
Patterns that found the right structure but refused it (an unsupported head_dim or dtype, a
norm → RoPE without a cache write) record a near-miss with the reason, so that a user can see
why a layer was not fused without reading Inductor's debug logs.
"""

from __future__ import annotations

import collections
import dataclasses

from torch._dynamo.utils import counters

from . import families

COUNTER_KEY = "fusion_pass"


@dataclasses.dataclass(frozen=True)
class NearMiss:
    family: str
    reason: str


_near_misses: collections.Counter[NearMiss] = collections.Counter()


def record_match(family: str, count: int = 1) -> None:
    if count:
        counters[COUNTER_KEY][family] += count


def record_near_miss(family: str, reason: str) -> None:
    """Remember that ``family``'s structure was seen but not fused, and why."""
    _near_misses[NearMiss(family, reason)] += 1


def match_counts() -> dict[str, int]:
    """Matches per family since the last ``reset()``."""
    return dict(counters[COUNTER_KEY])


def near_misses() -> dict[NearMiss, int]:
    return dict(_near_misses)


def reset() -> None:
    """Forget all counts and near-misses (``torch._dynamo.reset()`` does not clear ours)."""
    counters[COUNTER_KEY].clear()
    _near_misses.clear()


def report() -> str:
    """A short human-readable account of what was fused and what was left alone.

    Example::

        fusion_pass: 2 fusions applied
          qk_norm_rope_cache: 2 (per-head RMSNorm(q, k) -> RoPE -> K/V cache write)
        near-misses (structure found, not fused):
          qk_norm_rope_cache: head_dim 96 is not a power of two (the kernel serves powers of two in [16, 512]) (x2)
    """
    counts = match_counts()
    total = sum(counts.values())
    lines = [f"fusion_pass: {total} fusion{'s' if total != 1 else ''} applied"]
    for name in families.NAMES:
        if counts.get(name):
            lines.append(f"  {name}: {counts[name]} ({families.family(name).description})")
    if not total and not _near_misses:
        lines.append("  (nothing matched: is fusion_pass installed, the device type enabled, "
                     "and the FX graph cache cold? see README 'Troubleshooting')")
    if _near_misses:
        lines.append("near-misses (structure found, not fused):")
        for miss, n in sorted(_near_misses.items(), key=lambda kv: (kv[0].family, kv[0].reason)):
            lines.append(f"  {miss.family}: {miss.reason}" + (f" (x{n})" if n > 1 else ""))
    return "\n".join(lines)
