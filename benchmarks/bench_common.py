"""What every benchmark suite shares: logging, timing, failure recording and result file names.

Timing, one variant at a time: ``bench`` (``triton.testing.do_bench``, median, L2 flushed between
runs), ``bench_graph`` (``do_bench_cudagraph``), ``host_us`` (host time per call). Side by side:
``interleaved_samples`` / ``paired_ratio`` / ``interleaved_timing`` (variants taking turns in
rounds; the ratio of two variants over paired rounds, which the lent host's slow spells move much
less than either time). Floors: ``copy_bandwidth_tbps``. Results: ``result_header`` opens every
suite's JSON the same way (suite, date, machine, versions, tree), ``result_stem`` names its files by
date and GPU.
"""

from __future__ import annotations

import datetime
import inspect
import os
import platform
import re
import subprocess
import statistics
import time

import torch
import triton
import triton.testing

REP_MS = 60


def log(*args) -> None:
    print(*args, flush=True)


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bench(fn, rep_ms: int = REP_MS) -> float:
    """Median µs of ``fn`` by ``triton.testing.do_bench`` (L2 flushed between runs)."""
    return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")) * 1e3


def bench_graph(fn, rep_ms: int = REP_MS) -> float:
    """Median µs of ``fn`` replayed as a CUDA graph (``triton.testing.do_bench_cudagraph``)."""
    params = inspect.signature(triton.testing.do_bench_cudagraph).parameters
    if "return_mode" in params:
        ms = triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")
    elif "quantiles" in params:
        ms = triton.testing.do_bench_cudagraph(fn, rep=rep_ms, quantiles=[0.5])
        ms = ms[0] if isinstance(ms, (list, tuple)) else ms
    else:
        ms = triton.testing.do_bench_cudagraph(fn, rep=rep_ms)
    return float(ms) * 1e3


def host_us(fn, calls: int = 30, samples: int = 5) -> float:
    """Least of ``samples`` samples of the host time per call, ``calls`` calls each with no
    synchronization inside a sample (the lent host has slow spells)."""
    times = []
    for _ in range(samples):
        synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
        synchronize()
    return min(times)


def interleaved_samples(steps: dict, rounds: int = 15, calls: int = 20) -> dict:
    """Per variant, the list over ``rounds`` of the wall time per call (µs) of ``calls``
    back-to-back calls (one synchronization per round, no L2 flush), the variants taking turns
    within every round: what a loop without CUDA graphs sees, host time included. The order is
    reversed every other round (A B, B A, ...), so a drift within a round weighs on each variant
    alike; round i of two variants is a pair. Taking turns spreads the lent host's slow spells
    over every variant; one ``do_bench`` per variant, one after the other, moved by up to 1.7x
    in the same process, and its L2 flush lets a host-bound call run ahead."""
    times: dict = {k: [] for k in steps}
    for step in steps.values():
        step()
    names = list(steps)
    for i in range(rounds):
        for k in (names if i % 2 == 0 else names[::-1]):
            synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                steps[k]()
            synchronize()
            times[k].append((time.perf_counter() - t0) / calls * 1e6)
    return times


def paired_ratio(samples: dict, num: str, den: str) -> dict:
    """Median and quartiles over rounds of ``samples[num][i] / samples[den][i]`` (the rounds of
    ``interleaved_samples``): the ratio of two variants measured side by side."""
    ratios = sorted(a / b for a, b in zip(samples[num], samples[den]))
    q1, median, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return dict(median=median, q1=q1, q3=q3, rounds=len(ratios))


def interleaved_timing(steps: dict, num: str, den: str, rounds: int = 15, calls: int = 20) -> tuple[dict, dict]:
    """``interleaved_samples`` summarized: (per variant the median µs per call, the
    ``paired_ratio`` of ``num`` over ``den``)."""
    samples = interleaved_samples(steps, rounds, calls)
    return {k: statistics.median(v) for k, v in samples.items()}, paired_ratio(samples, num, den)


def copy_bandwidth_tbps(dtype: torch.dtype = torch.bfloat16) -> float:
    """The device's copy bandwidth (TB/s, bytes read + written) on a 1 GiB ``copy_``."""
    n = 1 << 29
    src = torch.empty(n, dtype=dtype, device="cuda").normal_()
    dst = torch.empty_like(src)
    us = bench(lambda: dst.copy_(src))
    moved = 2 * src.numel() * src.element_size()
    del src, dst
    torch.cuda.empty_cache()
    return moved / (us * 1e-6) / 1e12


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:800]


def attempt(results: dict, key: str, fn):
    """Run fn, store its value under key; on failure store None and the error (the run goes on)."""
    try:
        results[key] = fn()
    except Exception as e:  # noqa: BLE001 - a benchmark records failures, it does not stop
        results[key] = None
        results.setdefault("errors", {})[key] = f"{type(e).__name__}: {e}"[:500]
        log(f"    {key}: FAILED {type(e).__name__}: {str(e)[:300]}")
    return results[key]


def gpu_slug() -> str:
    """The GPU's model in lower case for file names ("h100", "h200"; "cpu" without CUDA)."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name()
    model = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", name)
    return (model.group(1) if model else re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")).lower()


def result_stem(out_dir: str, suite: str) -> str:
    """``out_dir/<date>-<gpu>-<suite>``: where a suite writes its .json/.md/.png."""
    return os.path.join(str(out_dir), f"{datetime.date.today().isoformat()}-{gpu_slug()}-{suite}")



def tree_revision() -> str | None:
    """The commit this tree is at (``TREE`` in the environment first: the lent machine's copy has no git)."""
    if os.environ.get("TREE"):
        return os.environ["TREE"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def result_header(suite: str) -> dict:
    """The first keys of every suite's result JSON: suite, date, tree, the machine and the versions
    (gpu is None without CUDA; transformers None where it is not installed). Per case figures go
    under ``cases``, their means under ``means``."""
    try:
        import transformers

        transformers_version = transformers.__version__
    except ImportError:
        transformers_version = None
    info = dict(suite=suite, date=datetime.date.today().isoformat(), tree=tree_revision(), gpu=None,
                torch=torch.__version__, triton=triton.__version__, transformers=transformers_version,
                cuda=torch.version.cuda, python=platform.python_version(), cpu_count=os.cpu_count())
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=torch.cuda.get_device_name(), gpu_capability=".".join(map(str, torch.cuda.get_device_capability())),
                    gpu_memory_GiB=round(props.total_memory / 2**30, 1), gpu_count=torch.cuda.device_count())
    return info
