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
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import copy
import dataclasses
import datetime
import inspect
import json
import math
import os
import platform
import shutil
import statistics
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
import triton.testing  # noqa: E402

import fusion_pass  # noqa: E402
from bench_common import log, result_stem  # noqa: E402
from training_step import make_train_step  # noqa: E402

DTYPE = torch.bfloat16
DEVICE = "cuda"  # a module global so that a CPU dry run of the CUDA path can swap it
BF16_EPS = 2.0**-8
FWD_FAMILY, TRAIN_FAMILY = "qk_norm_rope_cache", "qkv_rope_qk_norm"
VARIANTS = ("eager", "stock_compile", "fusion_pass")
CACHE_HEADROOM = 256  # max_cache_len = prefill length + this
TRAIN_LR = 1e-4
BWD_OP = "fusion_pass.qkv_rope_qk_norm_backward.default"

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

SHARE_METHOD = (
    "fused op(s) alone at the case's geometry: N calls captured in one CUDA graph, replayed between CUDA events "
    "(median per call; GPU time only, no host overhead, inputs L2-warm), times the layer count, over the pass "
    "variant's step time. Inference: also the unfused region (Qwen3RMSNorm per head -> apply_rotary_pos_emb -> "
    "index_copy_) under stock torch.compile timed the same way; predicted saving = layers x (region stock - op). "
    "Training: the backward op (it includes the two q/k/v projection GEMMs; the region's forward is Inductor's own "
    "code in the pass variant, as in stock compile, and is not counted); 'excl. GEMMs' subtracts FLOP-equal "
    "cuBLAS GEMMs timed the same way."
)


@dataclasses.dataclass
class Geometry:
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:800]


@contextlib.contextmanager
def recorded(rec: dict, key: str):
    """Run the block; on failure store the error under rec['errors'][key] and go on."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - a benchmark records failures, it does not stop
        rec.setdefault("errors", {})[key] = error_text(e)
        log(f"    {key}: FAILED {error_text(e)[:400]}")
        tb = traceback.format_exc()
        rec.setdefault("tracebacks", {})[key] = tb[-3000:]
        if torch.cuda.is_available():
            try:  # a sticky CUDA error would raise here too: leave it to the next case to report
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            except Exception as e2:  # noqa: BLE001
                rec["errors"][key + "_cleanup"] = error_text(e2)


# ---------------------------------------------------------------------------------------------
# Models and the StaticCache
# ---------------------------------------------------------------------------------------------


def perturb_norms(model: torch.nn.Module) -> None:
    """RMSNorm weights of ones would hide a weight applied twice or not at all."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.copy_((1 + 0.1 * torch.randn(p.shape, generator=g)).to(p.dtype))


def build_model(cls, config, device: str, dtype: torch.dtype):
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(config)
    model = model.to(device=device, dtype=dtype)
    perturb_norms(model)
    return model


def qwen3_config(g: Geometry, max_positions: int):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=g.vocab, hidden_size=g.hidden, intermediate_size=g.intermediate, num_hidden_layers=g.layers,
        num_attention_heads=g.q_heads, num_key_value_heads=g.kv_heads, head_dim=g.head_dim,
        max_position_embeddings=max_positions, tie_word_embeddings=False, use_cache=True,
        attn_implementation="sdpa",
    )


def gemma4_config(g: Geometry, max_positions: int):
    """Gemma4 text layers as the 31B model pairs them: a sliding layer (head_dim 256) and a full one
    (head_dim 512, partial "proportional" rotary), q/k normed per head; the geometry's heads and hidden
    size; no per-layer input embeddings (the 31B model has none). The window (the 31B model's is 1024)
    is set past the cases' contexts: a sliding cache that is full is written by a roll or a cat, which
    the pass does not fuse (a reported near-miss), and these cases measure both layers' fused kernel."""
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(
        vocab_size=g.vocab, hidden_size=g.hidden, intermediate_size=g.intermediate, num_hidden_layers=g.layers,
        num_attention_heads=g.q_heads, num_key_value_heads=g.kv_heads, head_dim=256, global_head_dim=512,
        layer_types=["sliding_attention", "full_attention"] * (g.layers // 2) + ["sliding_attention"] * (g.layers % 2),
        sliding_window=4096, hidden_size_per_layer_input=0, max_position_embeddings=max_positions,
        tie_word_embeddings=False, use_cache=True, attn_implementation="sdpa",
    )


def glm4moe_config(g: Geometry, max_positions: int):
    """GLM-4.5's attention (q/k normed per head, partial rotary factor 0.5) at the geometry's heads;
    every layer takes the dense MLP (``first_k_dense_replace``): the prologue is the same in MoE layers."""
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(
        vocab_size=g.vocab, hidden_size=g.hidden, intermediate_size=g.intermediate, num_hidden_layers=g.layers,
        num_attention_heads=g.q_heads, num_key_value_heads=g.kv_heads, head_dim=g.head_dim,
        max_position_embeddings=max_positions, use_qk_norm=True, first_k_dense_replace=g.layers,
        tie_word_embeddings=False, use_cache=True, attn_implementation="sdpa",
    )


def use_glm_interleaved_rope(on: bool) -> None:
    """Swap transformers' GLM ``apply_rotary_pos_emb`` (interleaved pairs) into ``modeling_glm4_moe``
    (``glminterleaved_*`` cases), or put GLM-4.5's own back."""
    from transformers.models.glm import modeling_glm
    from transformers.models.glm4_moe import modeling_glm4_moe

    own = getattr(modeling_glm4_moe, "_own_apply_rotary_pos_emb", modeling_glm4_moe.apply_rotary_pos_emb)
    modeling_glm4_moe._own_apply_rotary_pos_emb = own
    modeling_glm4_moe.apply_rotary_pos_emb = modeling_glm.apply_rotary_pos_emb if on else own


def hunyuan_config(g: Geometry, max_positions: int):
    from transformers import HunYuanDenseV1Config

    return HunYuanDenseV1Config(
        vocab_size=g.vocab, hidden_size=g.hidden, intermediate_size=g.intermediate, num_hidden_layers=g.layers,
        num_attention_heads=g.q_heads, num_key_value_heads=g.kv_heads, head_dim=g.head_dim,
        max_position_embeddings=max_positions, attention_bias=False, tie_word_embeddings=False,
        use_cache=False, attn_implementation="sdpa",
    )


def cache_kwarg_name(model) -> str:
    """transformers >= 5 names the cache argument ``cache`` (``past_key_values`` is deprecated there)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def new_static_cache(config, max_cache_len: int, batch: int, device: str, dtype: torch.dtype):
    """A StaticCache allocated eagerly (outside any compiled region, so its tensors get static addresses)."""
    from transformers import StaticCache

    cache = StaticCache(config=config, max_cache_len=max_cache_len)
    # Gemma4's layers differ in head_dim: their caches are allocated by the eager prefill instead.
    if hasattr(cache, "early_initialization") and not config.model_type.startswith("gemma4"):
        cache.early_initialization(batch, config.num_key_value_heads, config.head_dim, dtype, torch.device(device))
    return cache


def set_cache_length(cache, length: int) -> None:
    """StaticLayer (transformers >= 5) writes at its ``cumulative_length``, not at cache_position."""
    for layer in getattr(cache, "layers", []):
        counter = getattr(layer, "cumulative_length", None)
        if isinstance(counter, torch.Tensor):
            counter.fill_(length)
        if isinstance(getattr(layer, "cumulative_length_int", None), int):  # sliding layers keep both
            layer.cumulative_length_int = length


def lm_kwargs(model, cache, input_ids: torch.Tensor, start: int) -> dict:
    batch, seq = input_ids.shape
    position = torch.arange(start, start + seq, device=input_ids.device)
    return {"input_ids": input_ids, cache_kwarg_name(model): cache, "cache_position": position,
            "position_ids": position[None].expand(batch, -1).contiguous(), "use_cache": True}


def make_lm_step(fn, cache, kwargs: dict, start: int, cudagraphs: bool):
    """One forward call that (re)writes the cache rows [start, start + S): returns the logits."""

    def step():
        set_cache_length(cache, start)
        if cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        return fn(**kwargs).logits

    return step


def compile_variant(model, variant: str, device: str, cudagraphs: bool):
    torch._dynamo.reset()
    fusion_pass.reset_report()
    if variant == "eager":
        return model
    if variant == "stock_compile":
        return torch.compile(model, dynamic=False, mode="reduce-overhead" if cudagraphs else None)
    options = dict(fusion_pass.options(devices=(device,)))
    if cudagraphs:  # torch.compile takes mode or options, not both: merge what the mode sets
        options.update(torch._inductor.list_mode_options("reduce-overhead"))
    return torch.compile(model, dynamic=False, options=options)


def cudagraph_skips() -> int:
    return int(torch._dynamo.utils.counters["inductor"].get("cudagraph_skips", 0))


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


def bench_ms(fn, rep_ms: int) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))


def interleaved(r: dict, steps: dict, rounds: int, calls: int) -> None:
    """The compiled variants taking turns (``bench_forward.interleaved_timing``): per variant the
    median ms per step in ``r["interleaved_ms"]``, and in ``r["interleaved_speedup"]`` the paired
    speed-up stock / pass, median and quartiles over the rounds."""
    from bench_forward import interleaved_timing

    medians, r["interleaved_speedup"] = interleaved_timing(steps, "stock_compile", "fusion_pass", rounds, calls)
    r["interleaved_ms"] = {k: v / 1e3 for k, v in medians.items()}
    log(f"    interleaved: {r['interleaved_ms']}, speed-up stock / pass {r['interleaved_speedup']}")


def gpu_time_us(fn, calls: int = 20, trials: int = 15) -> tuple[float, str]:
    """Median GPU time of one fn() call: `calls` calls captured in one CUDA graph, replayed between CUDA
    events. Falls back to a plain loop between events (host overhead included when host-bound)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    method = "cuda_graph_replay"
    graph = None
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        run = graph.replay
    except Exception as e:  # noqa: BLE001
        method = f"event_loop (graph capture failed: {type(e).__name__})"
        graph = None
        torch.cuda.synchronize()

        def run():
            for _ in range(calls):
                fn()

        run()
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(times), method


# ---------------------------------------------------------------------------------------------
# CUDA: inference cases (Qwen3 prefill, decode under CUDA graphs)
# ---------------------------------------------------------------------------------------------


def numerics_verdict(err: float, stock_err: float | None, floor: float) -> tuple[float, bool]:
    tol = max(2 * stock_err, floor) if stock_err is not None else floor
    return tol, err <= tol


def run_inference_case(name: str, kind: str, batch: int, seq: int, model, config, g: Geometry, rep_ms: int) -> dict:
    device = DEVICE
    decode = kind in ("decode", "decode_default")
    cudagraphs = kind == "decode"
    cache_len = seq + CACHE_HEADROOM
    r: dict = dict(case=name, model=type(model).__name__, kind=kind, B=batch, S=1 if decode else seq,
                   context=seq if decode else 0, cache_len=cache_len, cudagraphs=cudagraphs,
                   expected_family=FWD_FAMILY, expected_matches=g.layers, variants={})
    gen = torch.Generator(device=device).manual_seed(batch * 10_000 + seq)
    prompt = torch.randint(0, g.vocab, (batch, seq), device=device, generator=gen)
    cache = new_static_cache(config, cache_len, batch, device, DTYPE)
    with torch.no_grad():
        prefill_kwargs = lm_kwargs(model, cache, prompt, 0)
        prefill = make_lm_step(model, cache, prefill_kwargs, 0, False)
        ref_logits = prefill().float()  # also fills the cache with the eager prefill (and initializes it)
        if decode:
            token = torch.randint(0, g.vocab, (batch, 1), device=device, generator=gen)
            kwargs, start = lm_kwargs(model, cache, token, seq), seq
            ref_logits = make_lm_step(model, cache, kwargs, start, False)().float()
        else:
            kwargs, start = prefill_kwargs, 0
    scale = ref_logits.abs().max().item()
    r["eager_logits_absmax"] = scale
    floor = 4 * BF16_EPS * scale
    stock_err = None

    kept: dict = {}
    for variant in VARIANTS:
        v: dict = {}
        r["variants"][variant] = v
        log(f"  [{name}] {variant} ...")
        with recorded(v, "variant"):
            skips0 = cudagraph_skips()
            torch.cuda.reset_peak_memory_stats()
            graphs = cudagraphs and variant != "eager"
            fn = compile_variant(model, variant, device, graphs)
            step = make_lm_step(fn, cache, kwargs, start, graphs)
            with torch.no_grad():
                t0 = time.perf_counter()
                out = step().float()
                synchronize()
                if variant != "eager":
                    v["first_call_s"] = time.perf_counter() - t0
                if graphs:  # cudagraph trees: warm-up run, then recording, then replays
                    t0 = time.perf_counter()
                    step()
                    step()
                    synchronize()
                    v["graph_record_s"] = time.perf_counter() - t0
                    out = step().float()  # a replayed graph's output
                    synchronize()
                v["match_counts"] = fusion_pass.match_counts()
                v["cudagraph_skips"] = cudagraph_skips() - skips0
                if variant != "eager":
                    err = max_abs_err(out, ref_logits)
                    v["max_abs_err_vs_eager"] = err
                    v["rel_err_vs_eager"] = err / max(scale, 1e-30)
                    if variant == "stock_compile":
                        stock_err = err
                    v["tolerance"], v["numerics_ok"] = numerics_verdict(
                        err, stock_err if variant == "fusion_pass" else None, floor)
                    if variant == "stock_compile":
                        v["numerics_ok"] = True  # stock compile is the yardstick of compile-vs-eager rounding
                if variant == "fusion_pass":
                    v["fused"] = v["match_counts"].get(FWD_FAMILY, 0) >= g.layers
                    if not v["fused"]:
                        v["report"] = fusion_pass.report()[:3000]
                        log(f"    WARNING: the pass matched {v['match_counts']} (< {g.layers} layers): timing the "
                            "unfused compile anyway")
                    if not v["numerics_ok"]:
                        log(f"    WARNING: logits differ from eager by {v['max_abs_err_vs_eager']:.4g} "
                            f"(tolerance {v['tolerance']:.4g})")
                if graphs and v["cudagraph_skips"]:
                    log(f"    WARNING: {v['cudagraph_skips']} cudagraph skip(s): not replayed as a CUDA graph")
                del out
                v["ms"] = bench_ms(step, rep_ms)
            v["peak_mem_GiB"] = torch.cuda.max_memory_allocated() / 2**30
            log(f"    {variant}: {v['ms']:.3f} ms" + (f", first call {v['first_call_s']:.1f} s" if "first_call_s" in v
                                                       else "")
                + (f", matches {v['match_counts']}" if variant != "eager" else "")
                + (f", err {v['max_abs_err_vs_eager']:.3g}" if "max_abs_err_vs_eager" in v else ""))
        if not cudagraphs and variant != "eager":
            kept[variant] = step  # timed again below, taking turns with the other variant
        fn = step = None
        if cudagraphs or variant == "eager":
            torch._dynamo.reset()
        torch.cuda.empty_cache()
    if kept:
        with recorded(r, "interleaved"), torch.no_grad():
            interleaved(r, kept, rounds=60, calls=10)
    kept = None
    torch._dynamo.reset()

    if r["model"] != "Qwen3ForCausalLM":  # the region below is Qwen3's, at Qwen3's geometry
        finish_case(r, g)
        return r
    with recorded(r, "fused_region"):
        r["fused_region"] = inference_region_times(batch, 1 if decode else seq, start, cache_len, g,
                                                   config.rms_norm_eps)
    finish_case(r, g)
    return r


class PrologueRegion(torch.nn.Module):
    """The region qk_norm_rope_cache replaces, as Qwen3Attention and StaticLayer.update write it."""

    def __init__(self, head_dim: int, eps: float) -> None:
        super().__init__()
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

        self.q_norm = Qwen3RMSNorm(head_dim, eps=eps)
        self.k_norm = Qwen3RMSNorm(head_dim, eps=eps)

    def forward(self, q, k, v, cos, sin, k_cache, v_cache, cache_position):
        from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

        # q [B, S, Hq, D], k / v [B, S, Hkv, D]: views of the projection outputs
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(k).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k_cache.index_copy_(2, cache_position, k)
        v_cache.index_copy_(2, cache_position, v.transpose(1, 2))
        return q, k


def rope_tables(batch: int, seq: int, start: int, head_dim: int, device: str):
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    pos = torch.arange(start, start + seq, device=device).float()
    emb = torch.cat([pos[:, None] * inv_freq] * 2, dim=-1)[None].expand(batch, seq, head_dim)
    return emb.cos().to(DTYPE).contiguous(), emb.sin().to(DTYPE).contiguous()


def inference_region_times(batch, seq, start, cache_len, g: Geometry, eps: float) -> dict:
    device = DEVICE
    gen = torch.Generator(device=device).manual_seed(7)

    def rnd(*shape):
        return torch.randn(*shape, device=device, generator=gen).to(DTYPE)

    q_proj, k_proj, v_proj = rnd(batch, seq, g.q_heads, g.head_dim), rnd(batch, seq, g.kv_heads, g.head_dim), \
        rnd(batch, seq, g.kv_heads, g.head_dim)
    cos, sin = rope_tables(batch, seq, start, g.head_dim, device)
    k_cache = torch.zeros(batch, g.kv_heads, cache_len, g.head_dim, device=device, dtype=DTYPE)
    v_cache = torch.zeros_like(k_cache)
    position = torch.arange(start, start + seq, device=device)
    region = PrologueRegion(g.head_dim, eps).to(device=device, dtype=DTYPE)
    perturb_norms(region)
    qw, kw = region.q_norm.weight.detach(), region.k_norm.weight.detach()
    out: dict = {"method": SHARE_METHOD}
    with torch.no_grad():
        def op():
            return torch.ops.fusion_pass.qk_norm_rope_cache(
                q_proj.transpose(1, 2), k_proj.transpose(1, 2), v_proj.transpose(1, 2), qw, kw, cos, sin,
                k_cache, v_cache, position, eps, eps)

        q_op, k_op = op()
        ref_q, ref_k = region(q_proj, k_proj, v_proj, cos, sin, k_cache.clone(), v_cache.clone(), position)
        out["op_vs_region_max_abs_err"] = max(max_abs_err(q_op, ref_q), max_abs_err(k_op, ref_k))
        out["op_us_per_layer"], out["op_timing"] = gpu_time_us(op)
        try:
            torch._dynamo.reset()
            compiled = torch.compile(region, dynamic=False)
            compiled(q_proj, k_proj, v_proj, cos, sin, k_cache, v_cache, position)
            out["region_stock_compile_us_per_layer"], out["region_timing"] = gpu_time_us(
                lambda: compiled(q_proj, k_proj, v_proj, cos, sin, k_cache, v_cache, position))
        except Exception as e:  # noqa: BLE001
            out["region_stock_compile_error"] = error_text(e)
        finally:
            torch._dynamo.reset()
    log(f"    fused region alone: op {out['op_us_per_layer']:.1f} us/layer, stock-compiled region "
        f"{out.get('region_stock_compile_us_per_layer', float('nan')):.1f} us/layer")
    return out


# ---------------------------------------------------------------------------------------------
# CUDA: training case (HunYuanDenseV1)
# ---------------------------------------------------------------------------------------------


def grad_errors(model, ref_grads: dict) -> tuple[float, str]:
    worst, worst_name = 0.0, ""
    for n, p in model.named_parameters():
        ref = ref_grads.get(n)
        if ref is None and p.grad is None:
            continue
        if ref is None or p.grad is None:
            return math.inf, f"{n} (gradient missing in one of the two)"
        err = max_abs_err(p.grad, ref) / max(ref.float().abs().max().item(), 1e-30)
        if err > worst:
            worst, worst_name = err, n
    return worst, worst_name


def run_train_case(name: str, batch: int, seq: int, g: Geometry, steps: int, warmup: int) -> dict:
    from transformers import HunYuanDenseV1ForCausalLM

    device = DEVICE
    r: dict = dict(case=name, model="HunYuanDenseV1ForCausalLM", kind="train", B=batch, S=seq, cudagraphs=False,
                   expected_family=TRAIN_FAMILY, expected_matches=g.layers, optimizer=f"AdamW(lr={TRAIN_LR}), eager",
                   timed_steps=steps, warmup_steps=warmup, variants={})
    config = hunyuan_config(g, max(4096, seq))
    model = build_model(HunYuanDenseV1ForCausalLM, config, device, DTYPE).train()
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    gen = torch.Generator(device=device).manual_seed(3)
    ids = torch.randint(0, g.vocab, (batch, seq), device=device, generator=gen)
    ref_loss, ref_grads, stock = None, None, {}
    kept: dict = {}

    for variant in VARIANTS:
        v: dict = {}
        r["variants"][variant] = v
        log(f"  [{name}] {variant} ...")
        with recorded(v, "variant"):
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(init[n])
            model.zero_grad(set_to_none=True)
            optimizer = torch.optim.AdamW(model.parameters(), lr=TRAIN_LR)
            torch.cuda.reset_peak_memory_stats()
            fn = compile_variant(model, variant, device, False)
            step = make_train_step(fn, optimizer, ids)

            t0 = time.perf_counter()
            loss = fn(input_ids=ids, labels=ids).loss
            loss.backward()
            synchronize()
            if variant != "eager":
                v["first_step_s"] = time.perf_counter() - t0  # forward + backward, compiles included
            v["loss"] = loss.item()
            v["match_counts"] = fusion_pass.match_counts()
            if variant == "eager":
                ref_loss = v["loss"]
                ref_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
            elif ref_loss is None:
                v["numerics_ok"] = None
                v["numerics_note"] = "not checked: the eager variant failed"
            else:
                v["loss_abs_err_vs_eager"] = abs(v["loss"] - ref_loss)
                v["grad_rel_err_vs_eager"], v["worst_grad"] = grad_errors(model, ref_grads)
                if variant == "stock_compile":
                    stock = dict(loss=v["loss_abs_err_vs_eager"], grad=v["grad_rel_err_vs_eager"])
                    v["numerics_ok"] = True  # the yardstick
                else:
                    loss_tol = max(2 * stock["loss"], 1e-2 * abs(ref_loss)) if stock else 1e-2 * abs(ref_loss)
                    grad_tol = max(2 * stock["grad"], 2e-2) if stock else 5e-2
                    v["tolerance"] = dict(loss=loss_tol, grad=grad_tol)
                    v["numerics_ok"] = (v["loss_abs_err_vs_eager"] <= loss_tol
                                        and v["grad_rel_err_vs_eager"] <= grad_tol)
                    v["fused"] = v["match_counts"].get(TRAIN_FAMILY, 0) >= g.layers
                    if not v["fused"]:
                        v["report"] = fusion_pass.report()[:3000]
                        log(f"    WARNING: the pass matched {v['match_counts']} (< {g.layers} layers): timing the "
                            "unfused compile anyway")
                    if not v["numerics_ok"]:
                        log(f"    WARNING: loss err {v['loss_abs_err_vs_eager']:.3g}, grad rel err "
                            f"{v['grad_rel_err_vs_eager']:.3g} ({v['worst_grad']}) above {v['tolerance']}")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del loss
            for _ in range(warmup):
                step()
            synchronize()
            times = []
            for _ in range(steps):
                synchronize()
                t0 = time.perf_counter()
                step()
                synchronize()
                times.append((time.perf_counter() - t0) * 1e3)
            v["step_times_ms"] = times
            v["ms"] = statistics.median(times)
            v["peak_mem_GiB"] = torch.cuda.max_memory_allocated() / 2**30
            log(f"    {variant}: {v['ms']:.2f} ms/step (median of {steps})"
                + (f", first step {v['first_step_s']:.1f} s" if "first_step_s" in v else "")
                + (f", matches {v['match_counts']}, loss err {fmt(v.get('loss_abs_err_vs_eager'), '.2g')}, grad rel "
                   f"err {fmt(v.get('grad_rel_err_vs_eager'), '.2g')}" if variant != "eager" else f", loss {v['loss']:.4f}"))
        if variant != "eager":
            kept[variant] = step  # timed again below, taking turns with the other variant
        fn = step = optimizer = None
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
    if len(kept) == 2:
        with recorded(r, "interleaved"):
            interleaved(r, kept, rounds=12, calls=2)
    kept = None
    torch._dynamo.reset()

    del ref_grads, init, model
    torch.cuda.empty_cache()
    with recorded(r, "fused_region"):
        r["fused_region"] = training_region_times(batch, seq, g, config.rms_norm_eps)
    finish_case(r, g)
    return r


def training_region_times(batch, seq, g: Geometry, eps: float) -> dict:
    device = DEVICE
    gen = torch.Generator(device=device).manual_seed(11)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, generator=gen) * scale).to(DTYPE)

    q_size, kv_size = g.q_heads * g.head_dim, g.kv_heads * g.head_dim
    hidden = rnd(batch, seq, g.hidden)
    weights = [rnd(n, g.hidden, scale=g.hidden ** -0.5) for n in (q_size, kv_size, kv_size)]
    qw, kw = 1 + rnd(g.head_dim, scale=0.1), 1 + rnd(g.head_dim, scale=0.1)
    cos, sin = rope_tables(1, seq, 0, g.head_dim, device)  # HF's rotary module: [1, S, D] for shared positions
    out: dict = {"method": SHARE_METHOD}
    with torch.no_grad():
        def fwd():  # only to produce the saved tensors the backward op reads
            return torch.ops.fusion_pass.qkv_rope_qk_norm(hidden, weights, [], qw, kw, cos, sin, g.q_heads,
                                                          g.kv_heads, eps, eps)

        _, _, _, q_rstd, k_rstd, saved = fwd()
        q_pre = saved[0].view(batch, seq, g.q_heads, g.head_dim)
        k_pre = saved[1].view(batch, seq, g.kv_heads, g.head_dim)
        grad_q = rnd(batch, g.q_heads, seq, g.head_dim)
        grad_k, grad_v = rnd(batch, g.kv_heads, seq, g.head_dim), rnd(batch, g.kv_heads, seq, g.head_dim)

        def bwd():
            return torch.ops.fusion_pass.qkv_rope_qk_norm_backward(
                grad_q, grad_k, grad_v, q_pre, k_pre, q_rstd, k_rstd, cos, sin, qw, kw, hidden, weights,
                False, True, True, True, False)

        out["backward_op_us_per_layer"], out["backward_op_timing"] = gpu_time_us(bwd)
        hidden2d = hidden.view(batch * seq, g.hidden)
        w_cat = torch.cat(weights, dim=0)
        grad_cat = rnd(batch * seq, q_size + 2 * kv_size)
        out["backward_gemms_us_per_layer"], _ = gpu_time_us(lambda: (grad_cat @ w_cat, grad_cat.t() @ hidden2d))
    out["non_gemm_us_per_layer"] = max(0.0, out["backward_op_us_per_layer"] - out["backward_gemms_us_per_layer"])
    log(f"    fused backward op alone per layer: {out['backward_op_us_per_layer']:.1f} us (GEMMs "
        f"{out['backward_gemms_us_per_layer']:.1f})")
    return out


def finish_case(r: dict, g: Geometry) -> None:
    """Speed-ups and the fused-region shares from the figures already in r."""
    v = r["variants"]
    eager, stock, ours = (v.get(k, {}).get("ms") for k in VARIANTS)
    r["speedup_pass_over_stock"] = stock / ours if stock and ours else None
    r["speedup_pass_over_eager"] = eager / ours if eager and ours else None
    r["speedup_stock_over_eager"] = eager / stock if eager and stock else None
    ours_v = v.get("fusion_pass", {})
    r["fused"] = ours_v.get("fused")
    r["numerics_ok"] = ours_v.get("numerics_ok")
    fr = r.get("fused_region")
    if not fr:
        return
    L = g.layers
    if r["kind"] == "train":
        per_layer = fr["backward_op_us_per_layer"]
        fr["fused_ops_ms_per_step"] = L * per_layer / 1e3
        fr["non_gemm_ms_per_step"] = L * fr["non_gemm_us_per_layer"] / 1e3
        if ours:
            fr["share_of_pass_step"] = fr["fused_ops_ms_per_step"] / ours
            fr["share_of_pass_step_excl_gemms"] = fr["non_gemm_ms_per_step"] / ours
    else:
        fr["fused_op_ms_per_step"] = L * fr["op_us_per_layer"] / 1e3
        if ours:
            fr["share_of_pass_step"] = fr["fused_op_ms_per_step"] / ours
        region = fr.get("region_stock_compile_us_per_layer")
        if region is not None:
            fr["region_stock_ms_per_step"] = L * region / 1e3
            fr["predicted_saving_ms"] = L * (region - fr["op_us_per_layer"]) / 1e3
            if stock:
                fr["region_share_of_stock_step"] = fr["region_stock_ms_per_step"] / stock
        if stock and ours:
            fr["measured_saving_ms"] = stock - ours


# ---------------------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------------------


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


def machine_info() -> dict:
    info = dict(python=platform.python_version(), platform=platform.platform(), cpu=platform.processor() or None,
                cpu_count=os.cpu_count(), torch=torch.__version__, triton=triton.__version__,
                transformers=transformers.__version__, cuda=torch.version.cuda)
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=torch.cuda.get_device_name(), gpu_capability=".".join(map(str, torch.cuda.get_device_capability())),
                    gpu_memory_GiB=props.total_memory / 2**30, gpu_count=torch.cuda.device_count())
    return info


# ---------------------------------------------------------------------------------------------
# CUDA driver
# ---------------------------------------------------------------------------------------------


def run_cuda(args, g: Geometry) -> int:
    os.makedirs(args.out, exist_ok=True)
    torch._inductor.config.force_disable_caches = True  # the pass must run (and count) on every compile
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    date = datetime.date.today().isoformat()
    selected = [c.strip() for c in args.cases.split(",")] if args.cases else list(CASES)
    unknown = [c for c in selected if c not in CASES]
    if unknown:
        log(f"unknown case(s) {unknown}; known: {list(CASES)}")
        return 2
    rep_ms = 40 if args.quick else 100
    steps, warmup = (5, 2) if args.quick else (10, 3)
    result = dict(
        suite="end-to-end", date=date, **machine_info(), geometry=dataclasses.asdict(g), quick=args.quick,
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


# ---------------------------------------------------------------------------------------------
# Without CUDA: CPU numerics checks on tiny configs
# ---------------------------------------------------------------------------------------------

TINY = Geometry(layers=2, hidden=64, q_heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=128)


class OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops that run (compiled graphs call the custom ops through the dispatcher)."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] = self.counts.get(str(func), 0) + 1
        return func(*args, **(kwargs or {}))


def run_sequence(fn, model, config, prompt, cache_len: int, decode_tokens: list | None, steps: int):
    """Prefill then `steps` greedy decode steps (or the given tokens) on a fresh StaticCache."""
    batch, seq = prompt.shape
    cache = new_static_cache(config, cache_len, batch, "cpu", DTYPE)
    logits, tokens = [], []
    with torch.no_grad():
        out = make_lm_step(fn, cache, lm_kwargs(model, cache, prompt, 0), 0, False)().clone()
        logits.append(out)
        for i in range(steps):
            token = decode_tokens[i] if decode_tokens is not None else out[:, -1:].argmax(-1)
            tokens.append(token)
            out = make_lm_step(fn, cache, lm_kwargs(model, cache, token, seq + i), seq + i, False)().clone()
            logits.append(out)
    return logits, tokens, cache


def cpu_qwen3_check() -> dict:
    from transformers import Qwen3ForCausalLM

    g = TINY
    config = qwen3_config(g, 64)
    model = build_model(Qwen3ForCausalLM, config, "cpu", DTYPE).eval()
    batch, seq, cache_len, steps = 2, 7, 32, 2
    prompt = torch.randint(0, g.vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    r: dict = dict(check="qwen3_prefill_decode", B=batch, S=seq, cache_len=cache_len, decode_steps=steps)
    ref_logits, tokens, ref_cache = run_sequence(model, model, config, prompt, cache_len, None, steps)
    errs = {}
    for variant in ("stock_compile", "fusion_pass"):
        fn = compile_variant(model, variant, "cpu", False)
        t0 = time.perf_counter()
        logits, _, cache = run_sequence(fn, model, config, prompt, cache_len, tokens, steps)
        r[f"{variant}_s"] = time.perf_counter() - t0
        errs[variant] = [max_abs_err(o, ref) for o, ref in zip(logits, ref_logits)]
        if variant == "fusion_pass":
            r["match_counts"] = fusion_pass.match_counts()
            written = seq + steps
            r["cache_written_max_abs_err"] = max(
                max_abs_err(getattr(a, n)[:, :, :written], getattr(b, n)[:, :, :written])
                for a, b in zip(cache.layers, ref_cache.layers) for n in ("keys", "values"))
            r["cache_unwritten_untouched"] = all(
                torch.equal(getattr(a, n)[:, :, written:], getattr(b, n)[:, :, written:])
                for a, b in zip(cache.layers, ref_cache.layers) for n in ("keys", "values"))
        torch._dynamo.reset()
    scales = [ref.float().abs().max().item() for ref in ref_logits]
    tols = [max(2 * s, 4 * BF16_EPS * scale) for s, scale in zip(errs["stock_compile"], scales)]
    r.update(stock_max_abs_err=errs["stock_compile"], pass_max_abs_err=errs["fusion_pass"], tolerance=tols)
    expected = 2 * g.layers  # one prefill graph + one decode graph, each with every layer fused
    r["fused"] = r["match_counts"].get(FWD_FAMILY, 0) == expected
    r["ok"] = (r["fused"] and all(e <= t for e, t in zip(errs["fusion_pass"], tols))
               and r["cache_written_max_abs_err"] <= 6e-2 and r["cache_unwritten_untouched"])
    log(f"  Qwen3 prefill B{batch} S{seq} + {steps} decode steps (bf16, {g.layers} layers): matches "
        f"{r['match_counts']} (expected {expected}); max |logits - eager| per call: pass "
        f"{[f'{e:.3g}' for e in errs['fusion_pass']]}, stock {[f'{e:.3g}' for e in errs['stock_compile']]}, "
        f"tolerance {[f'{t:.3g}' for t in tols]}; cache rows written max err {r['cache_written_max_abs_err']:.3g}, "
        f"unwritten rows untouched {r['cache_unwritten_untouched']}: {'OK' if r['ok'] else 'FAILED'}")
    return r


def cpu_hunyuan_check() -> dict:
    from transformers import HunYuanDenseV1ForCausalLM

    g = TINY
    config = hunyuan_config(g, 256)
    torch.manual_seed(0)
    model = HunYuanDenseV1ForCausalLM(config).train()  # fp32: gradients must match eager to ~1e-5
    perturb_norms(model)
    reference = copy.deepcopy(model)
    batch, seq = 2, 16
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, g.vocab, (batch, seq), generator=gen) for _ in range(2)]
    r: dict = dict(check="hunyuan_dense_v1_train_step", B=batch, S=seq, dtype="float32")
    fn = compile_variant(model, "fusion_pass", "cpu", False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    t0 = time.perf_counter()
    loss = fn(input_ids=ids[0], labels=ids[0]).loss
    with OpCounter() as ops:
        loss.backward()
    r["compile_and_step_s"] = time.perf_counter() - t0
    ref_loss = reference(input_ids=ids[0], labels=ids[0]).loss
    ref_loss.backward()
    r["match_counts"] = fusion_pass.match_counts()
    r["backward_op_calls"] = ops.counts.get(BWD_OP, 0)
    r["loss_abs_err"] = abs(loss.item() - ref_loss.item())
    r["grad_rel_err"], r["worst_grad"] = grad_errors(model, {n: p.grad for n, p in reference.named_parameters()
                                                             if p.grad is not None})
    for opt in (optimizer, ref_optimizer):
        opt.step()
        opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        loss2, ref_loss2 = fn(input_ids=ids[1], labels=ids[1]).loss, reference(input_ids=ids[1], labels=ids[1]).loss
    r["loss_after_adamw_abs_err"] = abs(loss2.item() - ref_loss2.item())
    torch._dynamo.reset()
    r["fused"] = r["match_counts"].get(TRAIN_FAMILY, 0) == g.layers
    r["ok"] = (r["fused"] and r["backward_op_calls"] == g.layers and r["loss_abs_err"] <= 1e-5 * abs(ref_loss.item())
               + 1e-6 and r["grad_rel_err"] < 1e-4 and r["loss_after_adamw_abs_err"] <= 1e-4 * abs(ref_loss2.item()))
    log(f"  HunYuanDenseV1 training step B{batch} S{seq} (fp32, {g.layers} layers): matches {r['match_counts']} "
        f"(expected {g.layers}), backward op ran {r['backward_op_calls']}x; |loss - eager| {r['loss_abs_err']:.2g}, "
        f"max grad rel err {r['grad_rel_err']:.2g} ({r['worst_grad']}), |loss after AdamW - eager| "
        f"{r['loss_after_adamw_abs_err']:.2g}: {'OK' if r['ok'] else 'FAILED'}")
    return r


def run_cpu(args) -> int:
    log("bench_end_to_end.py needs CUDA for timings (no CUDA device here); running the CPU numerics checks "
        f"instead: tiny configs, fused ops under the Triton interpreter (TRITON_INTERPRET="
        f"{os.environ.get('TRITON_INTERPRET')}), torch {torch.__version__}, transformers {transformers.__version__}.")
    torch._inductor.config.force_disable_caches = True
    start = time.perf_counter()
    ok = True
    for check in (cpu_qwen3_check, cpu_hunyuan_check):
        fusion_pass.reset_report()
        torch._dynamo.reset()
        try:
            ok = check()["ok"] and ok
        except Exception as e:  # noqa: BLE001
            log(f"  {check.__name__}: FAILED {error_text(e)}")
            traceback.print_exc()
            ok = False
    log(f"CPU checks {'passed' if ok else 'FAILED'} in {time.perf_counter() - start:.0f} s (no timings, nothing "
        "written).")
    return 0 if ok else 1


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
