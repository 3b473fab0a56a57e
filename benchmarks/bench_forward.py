"""Suite F on one GPU: QK RMSNorm -> RoPE -> KV-cache write (Qwen3-Coder-480B attention prologue).

    python benchmarks/bench_forward.py --out DIR [--cases all|quick] [--skip-compile] [--no-sweep]

Per case (S, C, B) of WORKLOADS.md section F (Hq 96, Hkv 8, D 128, L 262144, bf16):

* floor_us: bytes that must move / measured device copy bandwidth. Bytes = read q, k, v +
  write q_out, k_out and the S new rows of each cache + 16 bytes of positions per token
  (position_ids and cache_position, int64): the convention of the anchors' ``bytes`` field
  (59408 for S = 1, B = 1). Compute is negligible (~10 flop per element).
* eager_us: the nn.Module below, which is WORKLOADS F written out (cos/sin from inv_freq and
  position_ids inside, norm on query [B, 96, S, 128], ``key_cache[:, :, cache_position] = ...``).
* stock_compile_us / _graph_us: ``torch.compile(module)``; the graph variant replays it as a
  CUDA graph (``do_bench_cudagraph``).
* fusion_pass_us / _graph_us: ``torch.compile(module, options=fusion_pass.options())``;
  ``fused`` records whether the pass matched (timed either way).
* op_us / op_graph_us: ``torch.ops.fusion_pass.qk_norm_rope_cache`` alone, cos/sin precomputed.
* positions_op_us: ``qk_norm_rope_cache_from_positions_triton`` alone (cos/sin in the kernel).

Every case is checked before it is timed: op vs reference (q_out, k_out within 1 bf16 ulp at the
RoPE-term scale, written cache rows bit-equal to k_out / v, sampled unwritten rows untouched),
and both compiled modules vs eager. Timing: ``triton.testing.do_bench(..., return_mode="median")``
(flushes L2 between runs) and ``do_bench_cudagraph``. Writes DIR/<date>-<gpu>-forward.{json,md,png}.

Without CUDA it says so and exits 0 (``tests/test_benchmark_workloads.py`` checks the workload on
CPU). The workload lives in ``forward_workload.py``, the tile sweep in ``forward_sweep.py``, the tables in ``forward_report.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import triton

import fusion_pass
from bench_common import (
    attempt, bench, bench_graph, copy_bandwidth_tbps, log, result_header, result_stem,
    synchronize)
from forward_report import TIME_KEYS, markdown, plot, suite_means
from forward_sweep import sweep
from forward_workload import (
    DEVICE, DTYPE, EPS, HEAD_DIM, KV_HEADS, ROPE_THETA, QKNormRopeCache, case_bytes, check_caches, empty_cache,
    make_inputs, ulp_error)
from fusion_pass.kernels import qk_norm_rope_cache_reference as cache_reference
from fusion_pass.kernels import qk_norm_rope_cache_triton as kernel
from fusion_pass.kernels.qk_norm_rope_cache_reference import (
    qk_norm_rope_cache_reference, rms_norm_reference)

CASES = [(1, 0, 1), (1, 2048, 4), (128, 0, 1), (128, 0, 2), (128, 0, 8), (256, 128, 1), (256, 1024, 8),
         (293, 131, 1), (512, 256, 2), (541, 0, 1), (1024, 512, 1), (2048, 0, 1), (4096, 2048, 1)]
QUICK_CASES = [(1, 2048, 4), (128, 0, 8), (293, 131, 1), (4096, 2048, 1)]


def run_case(seq: int, cached: int, batch: int, copy_tbps: float, skip_compile: bool, print_report: bool,
             skip_stock: bool = False) -> dict:
    r: dict = dict(S=seq, C=cached, B=batch, bytes=case_bytes(seq, batch))
    r["floor_us"] = r["bytes"] / (copy_tbps * 1e12) * 1e6
    module = QKNormRopeCache(HEAD_DIM, EPS, ROPE_THETA, DTYPE, DEVICE)
    x = make_inputs(seq, cached, batch)
    args = (x["query"], x["key"], x["value"], x["position_ids"], x["key_cache"], x["value_cache"], x["cache_position"])
    cos, sin = cache_reference.rope_cos_sin_reference(x["position_ids"], module.inv_freq, 1.0, DTYPE)
    qw, kw = module.q_norm_weight.detach(), module.k_norm_weight.detach()

    with torch.no_grad():
        # ---- correctness of the op (cos/sin tensors) against the reference, then timing
        def op():
            return torch.ops.fusion_pass.qk_norm_rope_cache(
                x["query"], x["key"], x["value"], qw, kw, cos, sin, x["key_cache"], x["value_cache"],
                x["cache_position"], EPS, EPS)

        q_out, k_out = op()
        check_caches(x, k_out, cached, seq)
        # The reference on a cache-free call (its cache writes go to a 1-row dummy, all skipped).
        skip = torch.full_like(x["cache_position"], -1)
        dummy = torch.empty(batch, KV_HEADS, 1, HEAD_DIM, dtype=DTYPE, device=DEVICE)
        q_ref, k_ref = qk_norm_rope_cache_reference(
            x["query"], x["key"], x["value"], qw, kw, cos, sin, dummy, dummy.clone(), skip, EPS, EPS)
        r["max_ulp"] = max(
            cache_reference.rope_ulp_error(q_out, q_ref, rms_norm_reference(x["query"], qw, EPS), cos, sin),
            cache_reference.rope_ulp_error(k_out, k_ref, rms_norm_reference(x["key"], kw, EPS), cos, sin),
        )
        if r["max_ulp"] > 1.0:
            log(f"    WARNING: op differs from the reference by {r['max_ulp']} bf16 ulps (> 1)")
        del q_ref, k_ref

        q_pos, k_pos = torch.empty_like(x["query"]), torch.empty_like(x["key"])

        def positions_op():
            kernel.qk_norm_rope_cache_from_positions_triton(
                x["query"], x["key"], x["value"], qw, kw, x["position_ids"], module.inv_freq, 1.0,
                x["key_cache"], x["value_cache"], x["cache_position"], EPS, EPS, q_pos, k_pos)

        positions_op()
        check_caches(x, k_pos, cached, seq)
        r["positions_max_ulp"] = ulp_error(q_pos, k_pos, x, module, cos, sin)

        # ---- eager module: reference values for the compiled ones
        q_eager, k_eager = module(*args)
        check_caches(x, k_eager, cached, seq)
        r["eager_vs_reference_ulp"] = ulp_error(q_eager, k_eager, x, module, cos, sin)

        attempt(r, "eager_us", lambda: bench(lambda: module(*args)))
        attempt(r, "op_us", lambda: bench(op))
        attempt(r, "op_graph_us", lambda: bench_graph(op))
        attempt(r, "positions_op_us", lambda: bench(positions_op))

        if not skip_compile:
            def compiled(options):
                torch._dynamo.reset()
                fn = torch.compile(module, dynamic=False, options=options)
                t0 = time.perf_counter()
                q_c, k_c = fn(*args)
                synchronize()
                log(f"    compiled in {time.perf_counter() - t0:.1f} s")
                check_caches(x, k_c, cached, seq)
                ulps = cache_reference.rope_ulp_error(q_c, q_eager, rms_norm_reference(x["query"], qw, EPS), cos, sin)
                ulps = max(ulps, cache_reference.rope_ulp_error(k_c, k_eager, rms_norm_reference(x["key"], kw, EPS), cos, sin))
                return (lambda: fn(*args)), ulps

            def stock():
                fn, r["stock_vs_eager_ulp"] = compiled(None)
                r["stock_compile_us"] = bench(fn)
                r["stock_compile_graph_us"] = bench_graph(fn)

            def with_pass():
                fusion_pass.reset_report()
                fn, r["fusion_pass_vs_eager_ulp"] = compiled(fusion_pass.options(devices=(DEVICE,)))
                r["fused"] = fusion_pass.match_counts().get("qk_norm_rope_cache", 0) > 0
                if print_report:
                    log(fusion_pass.report())
                if not r["fused"]:
                    log("    WARNING: fusion_pass did not match; timing the unfused compile anyway")
                elif r["fusion_pass_vs_eager_ulp"] > 1.0:
                    log(f"    WARNING: fused compile differs from eager by {r['fusion_pass_vs_eager_ulp']} ulps (> 1)")
                r["fusion_pass_us"] = bench(fn)
                r["fusion_pass_graph_us"] = bench_graph(fn)

            if not skip_stock:
                attempt(r, "stock", stock)
            attempt(r, "fusion_pass", with_pass)
            r.pop("stock", None)
            r.pop("fusion_pass", None)
            torch._dynamo.reset()
    del x, module
    empty_cache()
    return r

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for the JSON / markdown / PNG results")
    parser.add_argument("--cases", choices=["all", "quick"], default="all")
    parser.add_argument("--skip-compile", action="store_true", help="time only eager and the kernels")
    parser.add_argument("--no-sweep", action="store_true", help="skip the launcher tile sweep")
    parser.add_argument("--sweep-only", action="store_true", help="run only the launcher tile sweep")
    parser.add_argument("--stock-from", default=None,
                        help="take the stock torch.compile columns from this earlier result JSON (same GPU, torch "
                             "and triton: stock Inductor does not depend on this project) instead of compiling them")
    args = parser.parse_args()

    if not torch.cuda.is_available():
        log("bench_forward.py times on a CUDA GPU; none here, nothing to do (tests/test_benchmark_workloads.py "
            "checks its workload on CPU).")
        return

    os.makedirs(args.out, exist_ok=True)
    torch._inductor.config.force_disable_caches = True  # the pass must run (and count) on every compile
    start = time.perf_counter()
    copy_tbps = copy_bandwidth_tbps()
    log(f"{torch.cuda.get_device_name()}: copy {copy_tbps:.3f} TB/s; torch {torch.__version__}, triton {triton.__version__}")
    stock_from = None
    if args.stock_from:
        with open(args.stock_from) as f:
            earlier = json.load(f)
        if (earlier.get("torch"), earlier.get("triton")) != (torch.__version__, triton.__version__):
            raise SystemExit(f"--stock-from {args.stock_from}: measured with torch {earlier.get('torch')} / triton "
                             f"{earlier.get('triton')}, not this run's {torch.__version__} / {triton.__version__}")
        stock_from = {(c["S"], c["C"], c["B"]): c for c in earlier["cases"]}
        log(f"stock torch.compile columns taken from {args.stock_from} ({earlier.get('date')})")
    cases = []
    for i, (seq, cached, batch) in enumerate([] if args.sweep_only else CASES if args.cases == "all" else QUICK_CASES):
        t0 = time.perf_counter()
        log(f"case S={seq} C={cached} B={batch}")
        try:
            r = run_case(seq, cached, batch, copy_tbps, args.skip_compile, print_report=(i == 0),
                         skip_stock=stock_from is not None)
            if stock_from is not None:
                earlier = stock_from.get((seq, cached, batch), {})
                for key in ("stock_compile_us", "stock_compile_graph_us", "stock_vs_eager_ulp"):
                    r[key] = earlier.get(key)
        except Exception as e:  # noqa: BLE001 - a failed correctness check is recorded, not fatal
            r = dict(S=seq, C=cached, B=batch, bytes=case_bytes(seq, batch),
                     floor_us=case_bytes(seq, batch) / (copy_tbps * 1e12) * 1e6,
                     errors={"case": f"{type(e).__name__}: {e}"[:500]})
            log(f"    CASE FAILED: {type(e).__name__}: {e}")
            torch.cuda.empty_cache()
        cases.append(r)
        with open(result_stem(args.out, "forward") + ".partial.json", "w") as f:  # a run cut short keeps these
            json.dump(dict(copy_TBps=copy_tbps, cases=cases), f, indent=1)
        log("    " + ", ".join(f"{k}={r[k]:.2f}" for k in TIME_KEYS + ["max_ulp"] if isinstance(r.get(k), float))
            + f", fused={r.get('fused')} ({time.perf_counter() - t0:.0f} s)")
    result = dict(
        **result_header("F"), copy_TBps=copy_tbps, cases=cases, means=suite_means(cases),
        stock_compile_source=(f"{os.path.basename(args.stock_from)} (an earlier run, same GPU and versions)"
                              if args.stock_from else "this run"),
    )
    if not args.no_sweep:
        result["sweep"] = sweep(copy_tbps)
    base = result_stem(args.out, "forward")
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(markdown(result))
    log(f"wrote {base}.json, {base}.md")
    if cases:
        plot(result, base + ".png")
    log("suite means (µs): " + ", ".join(f"{k}={v:.1f}" for k, v in result["means"].items()))
    log(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
