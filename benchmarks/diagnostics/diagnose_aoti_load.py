"""Does AOTInductor's package loader work at all on this machine? (issue 14's export item)

The decode-step package test exits with SIGSEGV (-11) in ``aoti_load_package`` with and without
the pass on the lent H200. This runs the same compile → package → load → run on models with no
fusion_pass involvement, from the simplest up, each in its own process with ``faulthandler`` on,
and prints one line per model: exit code, the stage reached, the Python frames of a crash.

    python benchmarks/diagnostics/diagnose_aoti_load.py --out DIR     # writes DIR/diagnose-aoti-load.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r'''
import faulthandler, sys, torch
faulthandler.enable()
model_name, device, path = sys.argv[1:4]

class Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)
    def forward(self, x):
        return self.lin(x).relu()

class CacheWrite(torch.nn.Module):  # a buffer written in place, as a StaticCache update is
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)
        self.register_buffer("cache", torch.zeros(16, 64))
    def forward(self, x, pos):
        self.cache.index_copy_(0, pos, self.lin(x))
        return self.cache.sum(0)

model = dict(linear=Linear, cache_write=CacheWrite)[model_name]().to(device)
args = (torch.randn(1, 64, device=device),) + ((torch.tensor([3], device=device),) if model_name == "cache_write" else ())
with torch.no_grad():
    program = torch.export.export(model, args, strict=False)
    print("stage: exported", flush=True)
    pkg = torch._inductor.aoti_compile_and_package(program, package_path=path)
    print("stage: packaged", flush=True)
    loaded = torch._inductor.aoti_load_package(pkg)
    print("stage: loaded", flush=True)
    out = loaded(*args)
    torch.cuda.synchronize() if device == "cuda" else None
    print("stage: ran", float(out.float().abs().sum()), flush=True)
'''


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--devices", default="cpu,cuda", help="comma-separated devices of the plain models")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import torch

    results = dict(torch=torch.__version__, cases={})
    for model in ("linear", "cache_write"):
        for device in args.devices.split(","):
            path = os.path.join(args.out, f"aoti-{model}-{device}.pt2")
            proc = subprocess.run([sys.executable, "-c", CHILD, model, device, path], capture_output=True, text=True,
                                  timeout=240)
            stages = [line for line in proc.stdout.splitlines() if line.startswith("stage:")]
            results["cases"][f"{model}/{device}"] = dict(exit=proc.returncode, stages=stages,
                                                         stderr_tail=proc.stderr[-1500:])
            print(f"{model}/{device}: exit {proc.returncode}, last stage {stages[-1] if stages else None}", flush=True)
            if os.path.exists(path):
                os.remove(path)
    # the failing test's own decode step, without the pass, with the Python frames of a crash
    tests = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests")
    path = os.path.join(args.out, "aoti-decode-stock.pt2")
    proc = subprocess.run([sys.executable, "-X", "faulthandler", os.path.join(tests, "aoti_decode_check.py"), "cuda",
                           "stock", path], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=tests + os.pathsep + os.environ.get("PYTHONPATH", "")))
    results["cases"]["decode_step/cuda (tests/aoti_decode_check.py, stock)"] = dict(
        exit=proc.returncode, stdout_tail=proc.stdout[-500:], stderr_tail=proc.stderr[-3000:])
    print(f"decode_step/cuda: exit {proc.returncode}", flush=True)
    with open(os.path.join(args.out, "diagnose-aoti-load.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
