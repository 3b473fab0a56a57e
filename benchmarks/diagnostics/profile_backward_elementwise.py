"""Launch the backward elementwise pass a few times for a profiler (Nsight Compute) to read.

    ncu --clock-control none --kernel-name regex:bwd --launch-skip 1 --launch-count 1 \
        python benchmarks/diagnostics/profile_backward_elementwise.py --S 128 --B 64 --grads both

Builds suite B inputs (diagnose_device_time.backward_inputs) and calls the elementwise pass
``--calls`` times with the chosen optional gradients: ``both`` (norm weights and cos/sin, what
suite B asks for), ``weights`` (a training step whose cos/sin need no grad) or ``none``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # diagnose_device_time beside this file

from diagnose_device_time import BHKV, BHQ, D, backward_inputs  # noqa: E402
from fusion_pass.kernels import qkv_rope_qk_norm_backward_triton as bwd  # noqa: E402

GRADS = {"both": (True, True), "weights": (True, False), "none": (False, False)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--S", type=int, default=128)
    parser.add_argument("--B", type=int, default=64)
    parser.add_argument("--grads", choices=list(GRADS), default="both")
    parser.add_argument("--calls", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("profile_backward_elementwise.py launches GPU kernels; no CUDA device here.")
        return 0
    t = backward_inputs(args.S, args.B)
    nq, nk = BHQ * D, BHKV * D
    gq = t["grad_qkv"]
    need_w, need_cs = GRADS[args.grads]
    for _ in range(args.calls):
        bwd.qk_norm_rope_backward_triton(
            t["gq"], t["gk"], t["gv"], t["q"], t["k"], t["rq"], t["rk"], t["cos"], t["sin"], t["wq"], t["wk"],
            gq[:, :nq], gq[:, nq: nq + nk], gq[:, nq + nk:], need_w, need_cs)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
