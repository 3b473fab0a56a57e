"""Host time per launch of a user-defined Triton kernel that Inductor's wrapper launches.

What a kernel node of the graph costs the host in default mode, by the kind and number of its
arguments and by launcher (Triton's, or Inductor's static launcher that its own kernels use), so
that the fused kernels' signatures can be held to a measured budget. Each setting runs in a fresh
process (the static launcher for user kernels is read from the environment by Inductor's
compile workers). A compiled function launches the kernel R times; the cost per launch is the
slope between R = 1 and R = 16 of the host time per call (least of 7 samples of 200 calls,
no synchronization inside a sample), so Dynamo's guards and the wrapper's fixed cost cancel.

    python benchmarks/diagnostics/bench_launch_host.py --out DIR      # CUDA only; writes launch-host.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

#: (name, tensor arguments, int arguments, of the tensors passed as permuted views)
SHAPES = [
    ("2 tensors + 1 int (an Inductor pointwise kernel)", 2, 1, 0),
    ("14 tensors + 1 int", 14, 1, 0),
    ("2 tensors + 45 ints", 2, 45, 0),
    ("14 tensors + 45 ints (the forward kernel's eager signature)", 14, 45, 0),
    ("14 tensors (5 views) + 45 ints", 14, 45, 5),
    ("14 tensors + 12 ints", 14, 12, 0),
    ("12 tensors + 9 ints (the forward graph kernel, Qwen3)", 12, 9, 0),
]
REPEATS = (1, 16)


def kernel_source(tensors: int, ints: int) -> str:
    """A kernel adding 1 to the first tensor's 128 elements; every other argument is read, so
    none is dead (Triton passes them all regardless)."""
    ptrs = [f"p{i}" for i in range(tensors)]
    nums = [f"n{i}" for i in range(ints)]
    body = ["    offs = tl.arange(0, 128)",
            "    acc = tl.load(p0 + offs)"]
    body += [f"    acc += tl.load({p} + offs * 0) * 0" for p in ptrs[1:]]
    body.append("    s = " + " + ".join(nums))
    body.append("    tl.store(p0 + offs, acc + 1 + s * 0)")
    return ("import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
            f"def probe_kernel({', '.join(ptrs + nums)}):\n" + "\n".join(body) + "\n")


def load_kernel(tensors: int, ints: int):
    path = os.path.join(tempfile.mkdtemp(), f"probe_{tensors}_{ints}.py")
    with open(path, "w") as f:
        f.write(kernel_source(tensors, ints))
    spec = importlib.util.spec_from_file_location(f"probe_{tensors}_{ints}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.probe_kernel


def measure_in_this_process() -> dict:
    import torch
    from bench_common import host_us

    results = {}
    for name, tensors, ints, views in SHAPES:
        kernel = load_kernel(tensors, ints)
        base = [torch.zeros(4, 128, device="cuda") for _ in range(tensors)]
        numbers = [3 + 2 * i for i in range(ints)]  # odd, > 1: not specialized as constants
        per_r = {}
        for repeats in REPEATS:
            def launch_all(*ts, _kernel=kernel, _repeats=repeats, _views=views):
                args = [t[:, 1:] if i >= tensors - _views else t for i, t in enumerate(ts)]
                for _ in range(_repeats):
                    _kernel[(1,)](*args, *numbers)

            torch._dynamo.reset()
            compiled = torch.compile(launch_all, fullgraph=True)
            compiled(*base)
            per_r[repeats] = host_us(lambda: compiled(*base), calls=200, samples=7)
        slope = (per_r[REPEATS[1]] - per_r[REPEATS[0]]) / (REPEATS[1] - REPEATS[0])
        results[name] = {"host_us_per_call": per_r, "host_us_per_launch": round(slope, 2)}
        print(f"  {name}: {slope:.2f} us per launch ({per_r})", flush=True)
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure_in_this_process()))
        return 0
    import torch
    import triton
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "date": time.strftime("%Y-%m-%d"), "method": __doc__.split("\n\n")[1].replace("\n", " ")}
    for launcher, env in (("triton launcher", "0"), ("static launcher", "1")):
        print(launcher, flush=True)
        done = subprocess.run([sys.executable, __file__, "--out", args.out, "--child"], capture_output=True, text=True,
                              env={**os.environ, "TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS": env})
        sys.stdout.write("\n".join(line for line in done.stdout.splitlines() if line.startswith("  ")) + "\n")
        if done.returncode != 0:
            print(done.stderr[-3000:])
            return 1
        result[launcher] = json.loads(done.stdout.strip().splitlines()[-1])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "launch-host.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
