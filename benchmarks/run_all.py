"""The one benchmark command: kernel suites F and B, then the end-to-end model steps.

    python benchmarks/run_all.py --out DIR [--quick] [--layers N] [--skip forward,backward,end_to_end]

Runs, one after the other, each in its own process (a crash or a CUDA error in one suite cannot
poison the next), with their per-case progress lines passed through:

0. ``bench_compiled.py``  suites F and B as compiled code runs them: stock vs the pass, default mode
   and CUDA graphs, host time per call;
1. ``bench_forward.py``   suite F (13 cases): floor, eager, stock compile, compile + pass, op alone,
   with and without CUDA-graph replay;
2. ``bench_backward.py``  suite B (16 cases): floor, two cuBLAS GEMMs, eager, stock compile, ours;
3. ``bench_end_to_end.py`` Hugging Face Qwen3 prefill / decode (StaticCache; decode in default mode and under CUDA graphs)
   and a HunYuanDenseV1 training step, eager / stock compile / compile + pass, first-compile times
   and the share of each step the fused regions account for.

Each writes its JSON / markdown / PNG into DIR; this script then writes DIR/<date>-summary.md, the
suites' markdown tables one after the other, with the exit status of each suite. Without CUDA every
script says that timings need a GPU (bench_end_to_end.py runs its CPU numerics checks instead); the
exit status is non-zero if any of them failed.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SUITES = {
    "compiled": "bench_compiled.py",
    "forward": "bench_forward.py",
    "backward": "bench_backward.py",
    "end_to_end": "bench_end_to_end.py",
}


def suite_command(name: str, args) -> list[str]:
    cmd = [sys.executable, os.path.join(HERE, SUITES[name]), "--out", args.out]
    if name == "compiled":
        cmd += ["--cases", "quick"] if args.quick else []
    elif name == "forward":
        cmd += ["--no-sweep"] + (["--cases", "quick"] if args.quick else [])
    elif name == "backward":
        cmd += ["--cases", "quick"] if args.quick else []
    else:
        cmd += ["--layers", str(args.layers)] + (["--quick"] if args.quick else [])
    return cmd


def newest_markdown(out: str, pattern: str) -> str | None:
    paths = sorted(glob.glob(os.path.join(out, pattern)), key=os.path.getmtime)
    return paths[-1] if paths else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for every suite's results")
    parser.add_argument("--quick", action="store_true", help="fewer kernel cases, shorter end-to-end timing")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the end-to-end models")
    parser.add_argument("--skip", default="", help=f"comma-separated subset of {list(SUITES)} to leave out")
    args = parser.parse_args()
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    unknown = skip - set(SUITES)
    if unknown:
        print(f"--skip: unknown suite(s) {sorted(unknown)}; known: {list(SUITES)}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    status = {}
    for name in SUITES:
        if name in skip:
            continue
        cmd = suite_command(name, args)
        print(f"=== {name}: {' '.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        status[name] = subprocess.call(cmd)
        print(f"=== {name}: exit {status[name]} after {time.perf_counter() - t0:.0f} s", flush=True)

    date = datetime.date.today().isoformat()
    parts = [f"# fusion_pass benchmarks, {date}", ""]
    parts += [f"- {name}: exit status {code}" for name, code in status.items()] + [""]
    for name, pattern in (("compiled", "*-compiled.md"), ("forward", "*-forward.md"), ("backward", "*-backward.md"),
                          ("end_to_end", "*-end-to-end.md")):
        path = newest_markdown(args.out, pattern) if name in status else None
        if path:
            with open(path) as f:
                parts += [f.read().rstrip(), ""]
    summary = os.path.join(args.out, f"{date}-summary.md")
    with open(summary, "w") as f:
        f.write("\n".join(parts) + "\n")
    print(f"wrote {summary}", flush=True)
    return 0 if all(code == 0 for code in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
