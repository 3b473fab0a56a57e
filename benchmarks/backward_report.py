"""Suite B's report: the markdown table and the plot over the floor."""

from __future__ import annotations

from bench_common import log


def _ratio(a, b):
    return a / b if a is not None and b else None


# (header, value of a case row); the mean row takes the same from the suite means.
COLUMNS = [
    ("floor", lambda r: r.get("floor_us")),
    ("2 cuBLAS GEMMs", lambda r: r.get("gemms_us")),
    ("2 GEMMs graph", lambda r: r.get("gemms_graph_us")),
    ("eager", lambda r: r.get("eager_us")),
    ("stock compile", lambda r: r.get("stock_compile_us")),
    ("stock graph", lambda r: r.get("stock_compile_graph_us")),
    ("ours", lambda r: r.get("fusion_pass_us")),
    ("ours graph", lambda r: r.get("fusion_pass_graph_us")),
    ("ours / GEMMs", lambda r: _ratio(r.get("fusion_pass_us"), r.get("gemms_us"))),
    ("ours / GEMMs, graph", lambda r: _ratio(r.get("fusion_pass_graph_us"), r.get("gemms_graph_us"))),
    ("ours graph / floor", lambda r: _ratio(r.get("fusion_pass_graph_us"), r.get("floor_us"))),
    ("SOL score", lambda r: r.get("sol_score")),
    ("SOL score, graph", lambda r: r.get("sol_score_graph")),
    ("kernels", lambda r: r.get("kernels_us")),
    ("host", lambda r: r.get("host_us")),
    ("elementwise", lambda r: r.get("elementwise_us")),
    ("elementwise graph", lambda r: r.get("elementwise_graph_us")),
    ("our GEMMs", lambda r: r.get("gemm_us")),
]


def _cell(header, v):
    if v is None:
        return "-"
    return f"{v:.3f}" if "/" in header or "score" in header else f"{v:.1f}"


def write_markdown(path, summary):
    """The suite's table: one row per case, then the means (ratios of the means, scores' mean)."""
    repeats = summary["cases"][0].get("repeats_us") if summary["cases"] else None
    lines = [f"# Suite B backward, {summary['gpu']} ({summary['date']})", "",
             f"torch {summary['torch']}, triton {summary['triton']}; ceilings: copy {summary['copy_TBps']:.2f} TB/s, "
             f"bf16 matmul {summary['mm_TFLOPs']:.0f} TFLOP/s; stock compile columns from "
             f"{summary.get('stock_compile_source', 'this run')}. Times in µs: do_bench median (host launch cost "
             "included where the GPU waits for it); `graph` = the same calls replayed as a CUDA graph "
             "(device time). SOL score = 1 / (1 + (T - floor) / (T_stock - floor)), same mode.", "",
             "`ours` is the backward op as the compiled training graph calls it; `kernels` the same kernels "
             "through the Python entry point; `host` the op's host time per call. "
             + (f"`ours`, `kernels`, `host` and `2 cuBLAS GEMMs`: the least of {len(next(iter(repeats.values())))} "
                "do_bench medians taken in turn; every other do_bench column one median."
                if repeats else "Every do_bench column: one median."), "",
             "| S | B | M | " + " | ".join(h for h, _ in COLUMNS) + " | rel err |",
             "|" + "---|" * (len(COLUMNS) + 4)]
    for r in summary["cases"]:
        lines.append(f"| {r['S']} | {r['B']} | {r['M']} | "
                     + " | ".join(_cell(h, get(r)) for h, get in COLUMNS) + f" | {r['rel_err']:.1e} |")
    lines.append("| **mean** | | | " + " | ".join(_cell(h, get(summary["means"])) for h, get in COLUMNS) + " | |")
    path.write_text("\n".join(lines) + "\n")


def write_plot(path, rows):
    """Time over the floor per case, default mode and graph replay side by side; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not installed: no PNG written")
        return False
    labels = [f"{r['S']}x{r['B']}" for r in rows]
    panels = [("default mode", [("2 cuBLAS GEMMs", "gemms_us"), ("stock compile", "stock_compile_us"),
                                ("ours", "fusion_pass_us")]),
              ("CUDA-graph replay", [("2 cuBLAS GEMMs", "gemms_graph_us"), ("stock compile", "stock_compile_graph_us"),
                                     ("ours", "fusion_pass_graph_us")])]
    fig, axes = plt.subplots(1, 2, figsize=(16, 4.5), sharey=True)
    for ax, (mode, series) in zip(axes, panels):
        width = 0.8 / len(series)
        for i, (name, key) in enumerate(series):
            ys = [r[key] / r["floor_us"] if r.get(key) is not None else 0 for r in rows]
            ax.bar([x + i * width for x in range(len(rows))], ys, width, label=name)
        ax.axhline(1.0, color="k", lw=0.8, ls="--", label="floor")
        ax.set_xticks([x + width for x in range(len(rows))], labels, rotation=45, ha="right")
        ax.set_xlabel("S x B")
        ax.set_title(f"Suite B backward, {mode} (lower is better)")
        ax.legend()
    axes[0].set_ylabel("time / floor")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
