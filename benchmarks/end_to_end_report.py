"""The report of ``bench_end_to_end.py``: its markdown table and its plot."""

from __future__ import annotations

import math

from bench_common import log
from end_to_end_models import VARIANTS


def fmt(x, spec=".3f") -> str:
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        return format(x, spec)
    return str(x)


def paired_text(p) -> str:
    return f"{p['median']:.3f}x [{p['q1']:.3f}, {p['q3']:.3f}], {p['rounds']} rounds" if p else "—"


def markdown(result: dict) -> str:
    g = result["geometry"]
    lines = [
        f"# End to end on Hugging Face models, {result.get('gpu', 'no GPU')} ({result['date']})", "",
        f"torch {result['torch']}, triton {result['triton']}, transformers {result['transformers']}. "
        f"{g['layers']} layers, hidden {g['hidden']}, {g['q_heads']} q / {g['kv_heads']} kv heads, head_dim "
        f"{g['head_dim']}, intermediate {g['intermediate']}, vocab {g['vocab']}, bf16, random weights. "
        "Times in ms: inference `do_bench` median (L2 flushed; the `qwen3_decode_*` cases replayed as CUDA graphs "
        "for both compiled variants, eager without; the `*_default` ones and prefill in default mode), training "
        "median of timed steps (forward + backward + AdamW). Interleaved (default-mode cases and training): stock and "
        "pass take turns, A B then B A, each round timing back-to-back steps; the speed-up is stock / pass per "
        "round, so the lent host's slow spells, which move either time by up to 1.7x, mostly cancel.", "",
        "| case | eager | stock compile | + fusion_pass | speed-up vs stock | interleaved speed-up: median "
        "[quartiles] of paired rounds | vs eager | first compile s (stock / pass) "
        "| matches | fused | numerics | fused regions, share of step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["cases"]:
        v = r.get("variants", {})
        e, s, p = (v.get(k, {}) for k in VARIANTS)
        compile_s = " / ".join(fmt(x.get("first_call_s", x.get("first_step_s")), ".1f") for x in (s, p))
        fr = r.get("fused_region") or {}
        if r.get("kind") == "train":
            share = (f"{fmt(fr.get('share_of_pass_step'), '.1%')} (excl. GEMMs "
                     f"{fmt(fr.get('share_of_pass_step_excl_gemms'), '.1%')})")
        else:
            share = fmt(fr.get("share_of_pass_step"), ".1%")
            if fr.get("predicted_saving_ms") is not None:
                share += (f"; stock region {fmt(fr.get('region_share_of_stock_step'), '.1%')}, predicted saving "
                          f"{fmt(fr.get('predicted_saving_ms'), '.3f')} ms, measured {fmt(fr.get('measured_saving_ms'), '.3f')}")
        lines.append("| " + " | ".join([
            r["case"], fmt(e.get("ms")), fmt(s.get("ms")), fmt(p.get("ms")),
            fmt(r.get("speedup_pass_over_stock"), ".3f") + "x" if r.get("speedup_pass_over_stock") else "—",
            paired_text(r.get("interleaved_speedup")),
            fmt(r.get("speedup_pass_over_eager"), ".2f") + "x" if r.get("speedup_pass_over_eager") else "—",
            compile_s, fmt(p.get("match_counts")), fmt(p.get("fused")), fmt(p.get("numerics_ok")), share,
        ]) + " |")
    lines += ["", f"Fused-region share, method: {result['share_method']}", "",
              "Numerics: inference = max |logits - eager| (tolerance max(2 x stock compile's, 4 x 2^-8 x max|eager|)); "
              "training = |loss - eager| and max over parameters of max|grad - eager| / max|eager grad|.", ""]
    lines += ["| case | stock err | pass err | pass tolerance | cudagraph skips (stock / pass) | peak GiB (stock / pass) |",
              "|---|---|---|---|---|---|"]
    for r in result["cases"]:
        v = r.get("variants", {})
        s, p = v.get("stock_compile", {}), v.get("fusion_pass", {})
        if r.get("kind") == "train":
            se = f"loss {fmt(s.get('loss_abs_err_vs_eager'), '.2g')}, grad {fmt(s.get('grad_rel_err_vs_eager'), '.2g')}"
            pe = f"loss {fmt(p.get('loss_abs_err_vs_eager'), '.2g')}, grad {fmt(p.get('grad_rel_err_vs_eager'), '.2g')}"
            tol = p.get("tolerance") or {}
            te = f"loss {fmt(tol.get('loss'), '.2g')}, grad {fmt(tol.get('grad'), '.2g')}"
        else:
            se, pe, te = (fmt(s.get("max_abs_err_vs_eager"), ".3g"), fmt(p.get("max_abs_err_vs_eager"), ".3g"),
                          fmt(p.get("tolerance"), ".3g"))
        lines.append(f"| {r['case']} | {se} | {pe} | {te} | {fmt(s.get('cudagraph_skips'))} / "
                     f"{fmt(p.get('cudagraph_skips'))} | {fmt(s.get('peak_mem_GiB'), '.1f')} / "
                     f"{fmt(p.get('peak_mem_GiB'), '.1f')} |")
    failures = []
    for r in result["cases"]:
        for key, msg in (r.get("errors") or {}).items():
            failures.append(f"- {r['case']} / {key}: {msg}")
        for name, v in (r.get("variants") or {}).items():
            for key, msg in (v.get("errors") or {}).items():
                failures.append(f"- {r['case']} / {name}: {msg}")
    if result.get("cases_not_selected"):
        lines += ["", "Not selected (--cases): " + ", ".join(result["cases_not_selected"])]
    if failures:
        lines += ["", "Failures:", ""] + failures
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no PNG written")
        return False
    cases = result["cases"]
    values = [r.get("speedup_pass_over_stock") or math.nan for r in cases]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    # green: fused, numerics ok and faster than stock; orange: slower than stock; red: not fused or wrong.
    colors = ["tab:red" if not (r.get("fused") and r.get("numerics_ok")) else
              "tab:green" if (v or 0) >= 1.0 else "tab:orange" for r, v in zip(cases, values)]
    bars = ax.bar(range(len(cases)), values, color=colors)
    for bar, val, r in zip(bars, values, cases):
        label = "failed" if math.isnan(val) else f"{val:.3f}x" + ("" if r.get("fused") else "\n(not fused)")
        ax.text(bar.get_x() + bar.get_width() / 2, 1.0 if math.isnan(val) else val, label, ha="center",
                va="bottom", fontsize=8)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlim(-0.6, len(cases) - 0.4)
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([r["case"].replace("_", "\n", 1) for r in cases], fontsize=8)
    ax.set_ylabel("stock torch.compile time / fusion_pass time")
    g = result["geometry"]
    ax.set_title(f"fusion_pass end to end on {result.get('gpu', 'no GPU')}: speed-up over stock compile "
                 f"({g['layers']} layers, hidden {g['hidden']})", fontsize=10)
    finite = [x for x in values if not math.isnan(x)]
    if finite:
        ax.set_ylim(min(0.9, min(finite) - 0.05), max(1.1, max(finite) + 0.05))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
