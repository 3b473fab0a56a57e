"""The cases of ``bench_end_to_end.py`` on CUDA: one inference case (prefill or decode, default mode or
CUDA graphs) and one training step, each as eager / stock compile / compile + the pass, numerics
first, then timing, then the fused regions' share (``finish_case``)."""

from __future__ import annotations

import contextlib
import statistics
import time
import traceback

import torch

import fusion_pass
from bench_common import bench, error_text, interleaved_timing, log, synchronize
from end_to_end_models import (
    BF16_EPS, DTYPE, FWD_FAMILY, TRAIN_FAMILY, VARIANTS, Geometry, build_model, compile_variant, cudagraph_skips,
    grad_errors, hunyuan_config, lm_kwargs, make_lm_step, max_abs_err, new_static_cache)
from end_to_end_regions import inference_region_times, training_region_times
from end_to_end_report import fmt
from training_step import make_train_step

DEVICE = "cuda"
CACHE_HEADROOM = 256  # max_cache_len = prefill length + this
TRAIN_LR = 1e-4


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
# Timing
# ---------------------------------------------------------------------------------------------


def interleaved(r: dict, steps: dict, rounds: int, calls: int) -> None:
    """The compiled variants taking turns (``bench_common.interleaved_timing``): per variant the
    median ms per step in ``r["interleaved_ms"]``, and in ``r["interleaved_speedup"]`` the paired
    speed-up stock / pass, median and quartiles over the rounds."""
    medians, r["interleaved_speedup"] = interleaved_timing(steps, "stock_compile", "fusion_pass", rounds, calls)
    r["interleaved_ms"] = {k: v / 1e3 for k, v in medians.items()}
    log(f"    interleaved: {r['interleaved_ms']}, speed-up stock / pass {r['interleaved_speedup']}")


# ---------------------------------------------------------------------------------------------
# CUDA: inference cases (Qwen3 prefill, decode under CUDA graphs)
# ---------------------------------------------------------------------------------------------


def record_fused(v: dict, family: str, layers: int) -> None:
    """v["fused"]: the pass matched ``family`` in every layer; if not, the report is kept (timed anyway)."""
    v["fused"] = v["match_counts"].get(family, 0) >= layers
    if not v["fused"]:
        v["report"] = fusion_pass.report()[:3000]
        log(f"    WARNING: the pass matched {v['match_counts']} (< {layers} layers): timing the unfused compile anyway")


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
                    record_fused(v, FWD_FAMILY, g.layers)
                    if not v["numerics_ok"]:
                        log(f"    WARNING: logits differ from eager by {v['max_abs_err_vs_eager']:.4g} "
                            f"(tolerance {v['tolerance']:.4g})")
                if graphs and v["cudagraph_skips"]:
                    log(f"    WARNING: {v['cudagraph_skips']} cudagraph skip(s): not replayed as a CUDA graph")
                del out
                v["ms"] = bench(step, rep_ms) / 1e3
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


# ---------------------------------------------------------------------------------------------
# CUDA: training case (HunYuanDenseV1)
# ---------------------------------------------------------------------------------------------


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
                    record_fused(v, TRAIN_FAMILY, g.layers)
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
