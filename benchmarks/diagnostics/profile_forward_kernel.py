"""One launch of each forward tile worth a hardware profile, for ``ncu`` to attach to.

    ncu --clock-control none -k regex:'qk_norm_rope|copy' python benchmarks/diagnostics/profile_forward_kernel.py S,C,B ...

Per case: the graph entry of the forward kernel with the rule's tile (cos/sin from tables and from
positions), each ``--tile`` given as JSON overrides, and a ``copy_`` of the case's bytes, each run
twice (the first launch compiles). q/k/v are laid out as Hugging Face's transposed views. Without
CUDA: says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the suites
from forward_workload import DTYPE, EPS, HEAD_DIM, ROPE_THETA, QKNormRopeCache, case_bytes, make_inputs  # noqa: E402
from fusion_pass.kernels import qk_norm_rope_cache_triton as kernel
from fusion_pass.kernels import qk_norm_rope_cache_reference as cache_reference


def launches(seq: int, cached: int, batch: int, tiles: list[dict]) -> None:
    module = QKNormRopeCache(HEAD_DIM, EPS, ROPE_THETA, DTYPE, "cuda")
    qw, kw = module.q_norm_weight.detach(), module.k_norm_weight.detach()
    x = make_inputs(seq, cached, batch)
    for name in ("query", "key", "value"):
        x[name] = x[name].transpose(1, 2).contiguous().transpose(1, 2)
    cos, sin = cache_reference.rope_cos_sin_reference(x["position_ids"], module.inv_freq, 1.0, DTYPE)
    q_out, k_out = torch.empty_like(x["query"]), torch.empty_like(x["key"])
    for tile in tiles:
        for tables in (True, False):
            rope = {} if tables else dict(from_positions=kernel.RotaryFromPositions(x["position_ids"], module.inv_freq))
            call = kernel.cache_kernel_call(
                x["query"], x["key"], x["value"], qw, kw, cos if tables else None, sin if tables else None,
                x["key_cache"], x["value_cache"], x["cache_position"], EPS, EPS, q_out, k_out, **rope, tile=tile,
                in_graph=True)
            print(f"S{seq} C{cached} B{batch} {'tables' if tables else 'positions'} tile {tile or 'rule'}", flush=True)
            for _ in range(2):
                call.run(device_asserts=True)
    src = torch.randn(case_bytes(seq, batch) // 4, device="cuda").to(DTYPE)
    dst = torch.empty_like(src)
    print(f"S{seq} C{cached} B{batch} copy of the same bytes", flush=True)
    for _ in range(2):
        dst.copy_(src)
    torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="+", help="S,C,B")
    parser.add_argument("--tile", action="append", default=[], help="JSON tile overrides (repeatable)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to profile")
        return
    tiles = [{}] + [json.loads(t) for t in args.tile]
    for case in args.cases:
        seq, cached, batch = (int(v) for v in case.split(","))
        launches(seq, cached, batch, tiles)


if __name__ == "__main__":
    main()
