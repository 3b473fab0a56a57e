"""The table of forward combinations in docs/fusions.md is the registered variants, not a memory of them."""

from __future__ import annotations

import os

from fusion_pass.patterns import qk_norm_rope_cache

FUSIONS_DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "fusions.md")
NORMS = {
    "qwen3": "Qwen3 (`weight * n.to(dtype)`)",
    "gemma3": "Gemma3, Qwen3-Next, Qwen3.5 (`n * (1 + weight)` in fp32)",
    "torch_rms_norm": "`nn.RMSNorm` / `F.rms_norm`",
    "gemma3n": "Gemma3n, Gemma4 (`pow(ms, -0.5)`)",
    "afmoe": "AFMoE (`(weight * n).to(dtype)`)",
    "torch_rms_norm_no_weight": "`nn.RMSNorm(elementwise_affine=False)`",
    "pow_no_weight": "weight-free `pow(ms, -0.5)`",
}
COLUMNS = ("norm -> RoPE", "RoPE before the transpose", "partial rotary", "interleaved", "partial interleaved",
           "RoPE -> norm", "RoPE -> norm, partial", "RoPE -> norm, interleaved")


def column(v) -> str:
    rotation = ("partial interleaved" if v.partial_rope and v.interleaved else "partial rotary" if v.partial_rope
                else "interleaved" if v.interleaved else "")
    if v.rope_first:
        return "RoPE -> norm" + (", " + rotation.split()[0] if rotation else "")
    if v.rope_before_transpose:
        assert not rotation, v  # not registered: the table needs a column first
        return "RoPE before the transpose"
    return rotation or "norm -> RoPE"


def coverage_table() -> str:
    """Markdown: for each norm form and ordering/RoPE variant, the cache writes registered."""
    cells: dict[tuple[str, str], set[str]] = {}
    for v in qk_norm_rope_cache.VARIANTS:
        cells.setdefault((v.norm, column(v)), set()).add(v.cache)
    lines = ["| norm form | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for norm, label in NORMS.items():
        row = [", ".join(c for c in ("dense", "paged", "flat") if c in cells.get((norm, col), ())) or "—"
               for col in COLUMNS]
        lines.append(f"| {label} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def test_every_norm_form_and_combination_is_listed():
    assert {v.norm for v in qk_norm_rope_cache.VARIANTS} == set(NORMS)
    assert {column(v) for v in qk_norm_rope_cache.VARIANTS} == set(COLUMNS)


def test_the_doc_lists_the_registered_combinations():
    with open(FUSIONS_DOC) as f:
        doc = f.read()
    assert coverage_table() in doc, "docs/fusions.md's coverage table is stale; regenerate it:\n" + coverage_table()
