"""Suite F's report: suite means, the markdown table and the plot over the bytes floor."""

from __future__ import annotations

import math

from bench_common import log

TIME_KEYS = ["floor_us", "eager_us", "stock_compile_us", "stock_compile_graph_us", "fusion_pass_us",
             "fusion_pass_graph_us", "op_us", "op_graph_us", "positions_op_us"]


def suite_means(cases: list[dict]) -> dict:
    means = {}
    for key in TIME_KEYS:
        values = [c.get(key) for c in cases]
        if values and all(v is not None for v in values):
            means[key] = sum(values) / len(values)
    return means


def fmt(v, digits=2) -> str:
    return "—" if v is None else (f"{v:.{digits}f}" if isinstance(v, float) else str(v))


def markdown(result: dict) -> str:
    lines = [
        f"# Suite F forward on {result['gpu']} ({result['date']})",
        "",
        f"torch {result['torch']}, triton {result['triton']}; device copy {result['copy_TBps']:.2f} TB/s; "
        "times in µs (median; `graph` = CUDA-graph replay); stock torch.compile columns from "
        f"{result.get('stock_compile_source', 'this run')}.",
        "",
        "| S | C | B | floor | eager | stock | stock graph | fusion_pass | fusion_pass graph | op | op graph "
        "| positions op | op graph / floor | max ulp | fused |",
        "|" + "---|" * 15,
    ]
    for c in result["cases"]:
        ratio = c["op_graph_us"] / c["floor_us"] if c.get("op_graph_us") else None
        lines.append("| " + " | ".join([
            str(c["S"]), str(c["C"]), str(c["B"]), *(fmt(c.get(k)) for k in TIME_KEYS),
            fmt(ratio, 2), fmt(c.get("max_ulp"), 0), fmt(c.get("fused")),
        ]) + " |")
    m = result["means"]
    lines.append("| **mean** | | | " + " | ".join(fmt(m.get(k)) for k in TIME_KEYS) + " | | | |")
    if result.get("sweep"):
        lines += ["", "Launcher sweep (CUDA-graph replay, the graph entry, q/k/v as Hugging Face's transposed views):",
                  "", "| S | C | B | cos/sin | tokens | heads | warps | blocks per program | group major "
                  "| µs | / floor | max ulp | default rule |", "|" + "---|" * 13]
        for row in result["sweep"]:
            lines.append(f"| {row['S']} | {row['C']} | {row['B']} | {row['cos_sin']} | {row.get('tokens_per_program')} "
                         f"| {row.get('heads_per_program')} | {row.get('num_warps')} | {row.get('blocks_per_program')} "
                         f"| {row.get('group_major', '')} "
                         f"| {fmt(row.get('graph_us'))} | {fmt(row.get('over_floor'), 2)} | {fmt(row.get('max_ulp'), 1)} | "
                         f"{'yes' if row.get('default') else ''} |")
    errors = [(c["S"], c["C"], c["B"], c["errors"]) for c in result["cases"] if c.get("errors")]
    if errors:
        lines += ["", "Failures:", ""] + [f"- ({s}, {cc}, {b}): {e}" for s, cc, b, e in errors]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plot")
        return
    cases = result["cases"]
    series = [("stock_compile_graph_us", "stock compile (graph)"), ("fusion_pass_graph_us", "fusion_pass (graph)"),
              ("op_graph_us", "op alone (graph)")]
    fig, ax = plt.subplots(figsize=(13, 5))
    width = 0.8 / len(series)
    for i, (key, label) in enumerate(series):
        values = [c[key] / c["floor_us"] if c.get(key) else math.nan for c in cases]
        ax.bar([j + (i - 1) * width for j in range(len(cases))], values, width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(1.1, color="gray", linewidth=0.8, linestyle="--", label="1.1x floor")
    ax.set_yscale("log")
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([f"S{c['S']}\nC{c['C']}\nB{c['B']}" for c in cases], fontsize=8)
    ax.set_ylabel("time / byte floor")
    ax.set_title(f"Suite F on {result['gpu']}: time over the bytes floor (copy {result['copy_TBps']:.2f} TB/s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"wrote {path}")
