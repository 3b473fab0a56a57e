"""The forward op at each head_dim it serves, against the memory floor of the same bytes.

    python benchmarks/bench_forward_head_dims.py --out DIR

Geometries (prefill, B 1, S 2048, bf16, a dense cache of 4096 rows, cos/sin tables precomputed):
Qwen3-8B (32 query / 8 kv heads of 128), Gemma4's sliding layers (32 / 16 of 256) and its
full-attention layers (32 / 4 of 512). Per geometry: ``torch.ops.fusion_pass.qk_norm_rope_cache``
replayed as a CUDA graph (``bench_common.bench_graph``, median), the floor (bytes read and written
/ a 1 GiB device copy's bandwidth, measured in the same process), and their ratio; the op's outputs
are checked against the reference first (q_out, k_out within 3 bf16 ulps of the row scale, written
cache rows bit-equal). Bytes: read q, k, v and the cos/sin rows, write q_out, k_out and the k and v
cache rows. Writes DIR/forward-head-dims.json.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

import fusion_pass  # noqa: F401  (registers torch.ops.fusion_pass.*)
from bench_common import bench_graph, copy_bandwidth_tbps, result_header
from fusion_pass.kernels.qk_norm_rope_cache_reference import qk_norm_rope_cache_reference

GEOMETRIES = {"qwen3_8b_d128": (32, 8, 128), "gemma4_sliding_d256": (32, 16, 256), "gemma4_full_d512": (32, 4, 512)}
SEQ, CACHE_LEN = 2048, 4096


def inputs(q_heads: int, kv_heads: int, head_dim: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(head_dim)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)

    angles = torch.rand(1, SEQ, head_dim // 2, generator=g, device="cuda") * 6.28
    angles = torch.cat((angles, angles), -1)
    return dict(q=randn(1, SEQ, q_heads, head_dim).transpose(1, 2), k=randn(1, SEQ, kv_heads, head_dim).transpose(1, 2),
                v=randn(1, SEQ, kv_heads, head_dim).transpose(1, 2), q_weight=1 + randn(head_dim, scale=0.1),
                k_weight=1 + randn(head_dim, scale=0.1), cos=angles.cos().to(torch.bfloat16),
                sin=angles.sin().to(torch.bfloat16), k_cache=randn(1, kv_heads, CACHE_LEN, head_dim),
                v_cache=randn(1, kv_heads, CACHE_LEN, head_dim), cache_position=torch.arange(SEQ, device="cuda"),
                q_eps=1e-6, k_eps=1e-6)


def check(args: dict) -> None:
    ref = {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in args.items()}
    q_out, k_out = torch.ops.fusion_pass.qk_norm_rope_cache(**args)
    q_ref, k_ref = qk_norm_rope_cache_reference(**{n: (t.clone() if isinstance(t, torch.Tensor) else t)
                                                   for n, t in ref.items()})
    for out, expected in ((q_out, q_ref), (k_out, k_ref)):
        scale = expected.float().abs().amax(-1, keepdim=True)
        ulp = torch.exp2(torch.floor(torch.log2(scale)) - 7)
        assert ((out.float() - expected.float()).abs() <= 3 * ulp).all()
    # Rows [0, S) written (cache_position is arange(S)), the rest untouched.
    for cache, before, rows in ((args["k_cache"], ref["k_cache"], k_out), (args["v_cache"], ref["v_cache"], ref["v"])):
        assert torch.equal(cache[:, :, :SEQ], rows) and torch.equal(cache[:, :, SEQ:], before[:, :, SEQ:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    out_dir = parser.parse_args().out
    if not torch.cuda.is_available():
        print("bench_forward_head_dims.py times on a CUDA GPU; none here, nothing to do.")
        return
    tbps = copy_bandwidth_tbps()
    result = dict(**result_header("forward-head-dims"), seq=SEQ, copy_TBps=tbps, cases={})
    for name, (q_heads, kv_heads, head_dim) in GEOMETRIES.items():
        args = inputs(q_heads, kv_heads, head_dim)
        check(args)
        elements = SEQ * head_dim * (2 * q_heads + 5 * kv_heads + 2)
        floor_us = elements * 2 / (tbps * 1e12) * 1e6
        op_us = bench_graph(lambda: torch.ops.fusion_pass.qk_norm_rope_cache(**args))
        result["cases"][name] = dict(q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, bytes=elements * 2,
                                     floor_us=floor_us, op_us=op_us, op_over_floor=op_us / floor_us)
        print(name, result["cases"][name], flush=True)
    base = result["cases"]["qwen3_8b_d128"]["op_over_floor"]
    for case in result["cases"].values():
        case["over_floor_vs_d128"] = case["op_over_floor"] / base
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "forward-head-dims.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
