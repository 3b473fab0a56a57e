"""End to end on Hugging Face model code: what fusion_pass changes in a whole model step.

    python benchmarks/bench_end_to_end.py --out DIR [--layers N] [--hidden 4096 --q-heads 32 --kv-heads 8
        --head-dim 128] [--intermediate I] [--vocab V] [--cases a,b,...] [--quick]

Models: transformers' ``Qwen3ForCausalLM`` and ``HunYuanDenseV1ForCausalLM``, built from a config with
random weights (nothing is downloaded), bf16, default geometry near an 8B model's attention (hidden 4096,
32 q heads, 8 kv heads, head_dim 128), ``--layers`` decoder layers (default 2), MLP intermediate
4 * hidden, vocab 32000 (both configurable), SDPA attention, RMSNorm weights 1 + 0.1 * N(0, 1).

Cases (on CUDA), each as eager / stock ``torch.compile`` / ``torch.compile`` with the pass
(``options=fusion_pass.options(devices=("cuda",))``), ``torch._dynamo.reset()`` before every variant,
``dynamic=False``, Inductor's caches disabled so the pass runs (and counts) on every compile:

* ``qwen3_prefill_B1_S2048``, ``qwen3_prefill_B8_S256``: one forward over the prompt into a
  ``StaticCache(config=..., max_cache_len=S + 256)`` (``use_cache=True``, explicit ``cache_position``
  and ``position_ids``), all logits. Family ``qk_norm_rope_cache``.
* ``qwen3_decode_B1_ctx2048_default``, ``qwen3_decode_B8_ctx256_default``: the decode step below in
  default mode (no CUDA graphs), as most servers run it and as every first step runs.
* ``qwen3_decode_B1_ctx2048``, ``qwen3_decode_B8_ctx256``: one decode step (S = 1) at position S of a
  cache holding the eager prefill, compiled with ``mode="reduce-overhead"`` (the pass variant: the same
  Inductor options, ``torch._inductor.list_mode_options("reduce-overhead")``, merged into the pass's
  options, because torch.compile takes ``mode`` or ``options``, not both), i.e. replayed as CUDA graphs;
  ``torch.compiler.cudagraph_mark_step_begin()`` before every call, cudagraph skips recorded.
* ``gemma4_prefill_B1_S2048``, ``gemma4_decode_B1_ctx2048_default``, ``gemma4_decode_B1_ctx2048``: the same
  three kinds on transformers' ``Gemma4ForCausalLM`` (``gemma4_config``: a sliding layer of head_dim 256 and
  a full layer of head_dim 512 with partial rotary, per pair of layers; RoPE on ``[B, S, H, D]`` before the
  transpose). No fused-region share (that measurement is Qwen3's region).
* ``glm4moe_*``: the same three kinds on transformers' ``Glm4MoeForCausalLM`` (GLM-4.5's attention:
  ``use_qk_norm``, partial rotary, half the features rotated; every layer with the dense MLP).
* ``glminterleaved_*``: the same model with transformers' GLM ``apply_rotary_pos_emb`` (interleaved
  pairs, partial) in place of GLM-4.5's, patched into ``modeling_glm4_moe`` for these cases only: no
  transformers model has interleaved RoPE after a per-head norm, this is its model-code measurement.
* ``hunyuan_train_B2_S2048``, ``hunyuan_train_B16_S256``: one training step of ``HunYuanDenseV1ForCausalLM`` (forward with
  ``labels``, ``loss.backward()``, ``torch.optim.AdamW.step()``, ``zero_grad``); the model is compiled,
  the optimizer runs eager in every variant. Family ``qkv_rope_qk_norm``.

The StaticCache of transformers >= 5 writes at its own ``cumulative_length`` counter, not at the
``cache_position`` argument; every timed call therefore first sets that counter back to the call's start
position (one ``fill_`` per layer, in every variant alike), so a repeated prefill or decode step rewrites
the same rows instead of running off the end of the cache.

Per case and variant, in this order:

1. correctness before timing: logits (inference) or loss and every parameter gradient (training) against
   eager. A compiled variant passes when its max |error| <= max(2 x stock compile's, a bf16 floor:
   4 * 2^-8 * max|eager logits|, 2e-2 relative for gradients, 1e-2 relative for the loss); a failure is
   flagged (``numerics_ok: false``, a WARNING) and the variant is still timed.
   ``fusion_pass.match_counts()`` per family is recorded; a pass variant with fewer matches than layers is
   flagged ``fused: false`` (timed anyway: a non-fusing run shows up as such, it is not hidden).
2. first-compile wall time: the first call (dynamo + Inductor + for CUDA graphs the warm-up run),
   synchronized; for training the first forward + backward. Inductor's FX graph cache is off, but Triton
   and Inductor kernel caches of the same process are warm for the variant compiled second (the pass),
   so its compile time is slightly favoured.
3. time: ``triton.testing.do_bench(step, return_mode="median")`` (L2 flushed between calls) for
   inference; for training the median of ~10 timed steps after warm-up steps, each between two
   ``torch.cuda.synchronize()``. Speed-up of the pass = stock compile time / pass time per case.
4. the share of the step that the fused regions account for, measured apart, at the case's geometry:
   the fused op (``torch.ops.fusion_pass.qk_norm_rope_cache``; for training the backward op
   ``qkv_rope_qk_norm_backward``: the region's forward is Inductor's code) alone, N calls captured in one
   CUDA graph and replayed between CUDA events (GPU time without host overhead; inputs stay L2-warm),
   times the layer count, over the pass variant's step time. For inference also the same region as the
   model writes it (Qwen3RMSNorm per head -> apply_rotary_pos_emb -> index_copy_ into the caches) under
   stock torch.compile, timed the same way: layers x (stock region - fused op) is the saving the pass can
   bring, to set against the measured stock - pass difference. The training backward op includes the
   two q/k/v projection GEMMs (which stock compile runs as well); the script times FLOP-equal GEMMs
   alone and also reports the share without them.

Writes DIR/<date>-<gpu>-end-to-end.json (versions, machine, every figure, errors; rewritten after every
case), .md (table) and .png (speed-up over stock compile per case; skipped with a note without
matplotlib). Every case and every variant runs in try/except: a failure is recorded in the JSON, never
dropped.

Without CUDA: says that timings need CUDA, then runs CPU numerics checks on tiny configs (the fused ops
under the Triton interpreter): Qwen3 prefill + 2 decode steps compiled with the pass
(``devices=("cpu",)``) vs eager (and vs stock compile's own error), and one HunYuanDenseV1 training step
(fp32) whose loss, gradients and post-AdamW loss must equal eager's. Exit status 1 if a check fails.

This script selects the cases and writes the results; beside it, ``end_to_end_cases.py`` (one inference
case, one training step), ``end_to_end_models.py`` (configs, the StaticCache, the variants),
``end_to_end_regions.py`` (the fused regions alone), ``end_to_end_report.py``
(markdown, plot, machine) and ``end_to_end_cpu_checks.py`` (the CPU path).
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
import traceback

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (fusion_pass imports it)
else:
    # A fresh kernel cache per run: first-compile times do not depend on earlier runs on the machine.
    _cache_root = tempfile.mkdtemp(prefix="bench_e2e_cache_")
    atexit.register(shutil.rmtree, _cache_root, True)
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(_cache_root, "triton"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_cache_root, "inductor"))

import transformers  # noqa: E402
import triton  # noqa: E402

from bench_common import error_text, log, result_header, result_stem  # noqa: E402
from end_to_end_cases import CACHE_HEADROOM, DEVICE, run_inference_case, run_train_case  # noqa: E402
from end_to_end_cpu_checks import run_cpu  # noqa: E402
from end_to_end_models import (  # noqa: E402
    DTYPE, Geometry, build_model, gemma4_config, glm4moe_config, qwen3_config, use_glm_interleaved_rope)
from end_to_end_regions import SHARE_METHOD  # noqa: E402
from end_to_end_report import fmt, markdown, plot  # noqa: E402


# name -> (kind, batch, seq); decode cases decode one token after a prefill of `seq` tokens, replayed
# as CUDA graphs ("decode") or in default mode ("decode_default": how most servers without graph
# capture, and every first step, run).
CASES = {
    "qwen3_prefill_B1_S2048": ("prefill", 1, 2048),
    "qwen3_prefill_B8_S256": ("prefill", 8, 256),
    "qwen3_decode_B1_ctx2048": ("decode", 1, 2048),
    "qwen3_decode_B8_ctx256": ("decode", 8, 256),
    "qwen3_decode_B1_ctx2048_default": ("decode_default", 1, 2048),
    "qwen3_decode_B8_ctx256_default": ("decode_default", 8, 256),
    "gemma4_prefill_B1_S2048": ("prefill", 1, 2048),
    "gemma4_decode_B1_ctx2048_default": ("decode_default", 1, 2048),
    "gemma4_decode_B1_ctx2048": ("decode", 1, 2048),
    "glm4moe_prefill_B1_S2048": ("prefill", 1, 2048),
    "glm4moe_decode_B1_ctx2048_default": ("decode_default", 1, 2048),
    "glm4moe_decode_B1_ctx2048": ("decode", 1, 2048),
    "glminterleaved_prefill_B1_S2048": ("prefill", 1, 2048),
    "glminterleaved_decode_B1_ctx2048_default": ("decode_default", 1, 2048),
    "glminterleaved_decode_B1_ctx2048": ("decode", 1, 2048),
    "hunyuan_train_B2_S2048": ("train", 2, 2048),
    "hunyuan_train_B16_S256": ("train", 16, 256),
}


def run_cuda(args, g: Geometry) -> int:
    """Every selected case, one model built at a time; the JSON and markdown rewritten after each."""
    os.makedirs(args.out, exist_ok=True)
    torch._inductor.config.force_disable_caches = True  # the pass must run (and count) on every compile
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    selected = [c.strip() for c in args.cases.split(",")] if args.cases else list(CASES)
    unknown = [c for c in selected if c not in CASES]
    if unknown:
        log(f"unknown case(s) {unknown}; known: {list(CASES)}")
        return 2
    rep_ms = 40 if args.quick else 100
    steps, warmup = (5, 2) if args.quick else (10, 3)
    result = dict(
        **result_header("end-to-end"), geometry=dataclasses.asdict(g), quick=args.quick,
        do_bench_rep_ms=rep_ms, inductor_caches="force_disable_caches=True; fresh TRITON_CACHE_DIR / "
        "TORCHINDUCTOR_CACHE_DIR per run unless set", share_method=SHARE_METHOD,
        cases_not_selected=[c for c in CASES if c not in selected], cases=[],
    )
    base = result_stem(args.out, "end-to-end")
    log(f"{result.get('gpu')}: torch {torch.__version__}, triton {triton.__version__}, transformers "
        f"{transformers.__version__}; geometry {dataclasses.asdict(g)}")

    def save() -> None:  # after every case: a run cut short keeps what it measured
        with open(base + ".json", "w") as f:
            json.dump(result, f, indent=1, default=str)
        with open(base + ".md", "w") as f:
            f.write(markdown(result))

    start = time.perf_counter()
    built = None  # (model family, model, config): one inference model at a time
    for name in selected:
        kind, batch, seq = CASES[name]
        family = name.split("_")[0]
        t0 = time.perf_counter()
        log(f"case {name} ({kind}, B={batch}, S={seq})")
        try:
            if built is not None and built[0] != family:
                built = None
                torch.cuda.empty_cache()
            if kind == "train":
                r = run_train_case(name, batch, seq, g, steps, warmup)
            else:
                if built is None:
                    positions = max(4096, max(s for _, _, s in CASES.values()) + CACHE_HEADROOM)
                    use_glm_interleaved_rope(family == "glminterleaved")
                    if family == "gemma4":
                        from transformers import Gemma4ForCausalLM as cls

                        config = gemma4_config(g, positions)
                    elif family in ("glm4moe", "glminterleaved"):
                        from transformers import Glm4MoeForCausalLM as cls

                        config = glm4moe_config(g, positions)
                    else:
                        from transformers import Qwen3ForCausalLM as cls

                        config = qwen3_config(g, positions)
                    built = (family, build_model(cls, config, DEVICE, DTYPE).eval(), config)
                r = run_inference_case(name, kind, batch, seq, built[1], built[2], g, rep_ms)
        except Exception as e:  # noqa: BLE001 - the case is recorded as failed, the run goes on
            r = dict(case=name, kind=kind, B=batch, S=seq, errors={"case": error_text(e)},
                     tracebacks={"case": traceback.format_exc()[-3000:]})
            log(f"    CASE FAILED: {error_text(e)[:500]}")
            try:
                torch._dynamo.reset()
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            except Exception as e2:  # noqa: BLE001 - a sticky CUDA error: later cases will record it too
                r["errors"]["cleanup"] = error_text(e2)
        r["wall_s"] = time.perf_counter() - t0
        result["cases"].append(r)
        sp = r.get("speedup_pass_over_stock")
        log(f"  => {name}: speed-up over stock compile {fmt(sp, '.3f')}, fused {fmt(r.get('fused'))}, numerics "
            f"{fmt(r.get('numerics_ok'))}, share {fmt((r.get('fused_region') or {}).get('share_of_pass_step'), '.1%')} "
            f"({r['wall_s']:.0f} s)")
        save()
    result["total_s"] = time.perf_counter() - start
    wrote = [base + ".json", base + ".md"]
    if plot(result, base + ".png"):
        wrote.append(base + ".png")
    else:
        result["png"] = "skipped: matplotlib not installed"
    save()
    log(markdown(result))
    log("wrote " + ", ".join(wrote) + f" (total {result['total_s']:.0f} s)")
    return 0



def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for the JSON / markdown / PNG results")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=None, help="MLP width (default 4 * hidden)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--cases", default=None, help=f"comma-separated subset of {list(CASES)} (default all)")
    p.add_argument("--quick", action="store_true", help="shorter timing (do_bench rep 40 ms, 5 training steps)")
    args = p.parse_args()
    g = Geometry(layers=args.layers, hidden=args.hidden, q_heads=args.q_heads, kv_heads=args.kv_heads,
                 head_dim=args.head_dim, intermediate=args.intermediate or 4 * args.hidden, vocab=args.vocab)
    if not torch.cuda.is_available():
        return run_cpu(args)
    return run_cuda(args, g)


if __name__ == "__main__":
    sys.exit(main())
