"""``bench_end_to_end.py`` without CUDA: numerics checks of its models on tiny configs, the fused ops
run under the Triton interpreter (no timings, nothing written)."""

from __future__ import annotations

import copy
import os
import time
import traceback

import torch
import transformers

import fusion_pass
from bench_common import error_text, log
from end_to_end_models import (
    BF16_EPS, BWD_OP, DTYPE, FWD_FAMILY, TRAIN_FAMILY, Geometry, build_model, compile_variant, grad_errors, hunyuan_config,
    lm_kwargs, make_lm_step, max_abs_err, new_static_cache, perturb_norms, qwen3_config)


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
