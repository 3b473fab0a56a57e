"""Host cost of launching our kernels, and the device timeline of one small-M backward op call.

    python benchmarks/diagnose_launch_overhead.py --out DIR

1. A Triton kernel with the elementwise pass's argument count (14 tensors, 42 ints): host us per
   launch through ``kernel[grid](...)``, through the compiled handle's ``run`` (binder skipped) and
   through the package's ``CachedLauncher`` (kernels/triton_launch.py).
2. torch.profiler of the backward op at M = 128 and 512: each device kernel's duration, in order.
Writes DIR/diagnose-launch-overhead.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import bench_backward as bb  # noqa: E402
from diagnose_device_time import host_us  # noqa: E402

import fusion_pass.kernels  # noqa: E402,F401  (registers the ops)
from fusion_pass.kernels.triton_launch import CachedLauncher  # noqa: E402


@triton.jit
def _many_args_kernel(p0_ptr, p1_ptr, p2_ptr, p3_ptr, p4_ptr, p5_ptr, p6_ptr, p7_ptr, p8_ptr, p9_ptr, p10_ptr,
                      p11_ptr, p12_ptr, p13_ptr,
                      i0, i1, i2, i3, i4, i5, i6, i7, i8, i9, i10, i11, i12, i13, i14, i15, i16, i17, i18,
                      i19, i20, i21, i22, i23, i24, i25, i26, i27, i28, i29, i30, i31, i32, i33, i34, i35, i36,
                      i37, i38, i39, i40, i41, C0: tl.constexpr, C1: tl.constexpr):
    pass


def launch_costs():
    ptrs = [torch.empty(64, device="cuda") for _ in range(14)]
    ints = [4096 * (i + 1) for i in range(42)]
    normal = host_us(lambda: _many_args_kernel[(128,)](*ptrs, *ints, C0=1, C1=2))
    k = _many_args_kernel[(128,)](*ptrs, *ints, C0=1, C1=2)
    dev = torch.cuda.current_device()

    def direct():
        stream = torch.cuda.current_stream(dev).cuda_stream
        k.run(128, 1, 1, stream, k.function, k.packed_metadata, None, None, None, *ptrs, *ints, 1, 2)

    direct_us = host_us(direct)
    # kernels/triton_launch.py: the package's launcher (its key + the handle's run).
    launcher = CachedLauncher(_many_args_kernel)
    cached_args = (*ptrs, *ints)
    launcher.launch((128,), cached_args, dict(C0=1, C1=2), {})
    cached_us = host_us(lambda: launcher.launch((128,), cached_args, dict(C0=1, C1=2), {}))
    res = dict(launch_56_args_us=normal, direct_run_56_args_us=direct_us, cached_launcher_56_args_us=cached_us,
               torch_empty_us=host_us(lambda: torch.empty((256, 128), device="cuda")))
    print("host us: " + ", ".join(f"{k} {v:.1f}" for k, v in res.items()), flush=True)
    return res


def op_host_ab():
    """Host us per call of the backward op (M = 128) and the forward decode op, with the cached
    launcher on and off, in this process (the lent machines' host speed differs ~2x between
    calls, so only a same-process A/B compares the two)."""
    from fusion_pass.kernels import triton_launch

    t = bb.make_inputs(128, 1, "cuda")

    def backward():
        return torch.ops.fusion_pass.qkv_rope_qk_norm_backward(
            t["gq"], t["gk"], t["gv"], t["q"], t["k"], t["rq"], t["rk"], t["cos"], t["sin"], t["wq"], t["wk"],
            t["hidden"], [t["W"]], False, True, True, True, True)

    B, HQ, HKV, D, L = 8, 64, 4, 128, 2048  # a suite F decode case (Qwen3-Coder-480B heads)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    q, k, v = torch.randn(B, HQ, 1, D, **bf), torch.randn(B, HKV, 1, D, **bf), torch.randn(B, HKV, 1, D, **bf)
    wq, wk, cos, sin = torch.randn(D, **bf), torch.randn(D, **bf), torch.randn(B, 1, D, **bf), torch.randn(B, 1, D, **bf)
    kc, vc = torch.zeros(B, HKV, L, D, **bf), torch.zeros(B, HKV, L, D, **bf)
    pos = torch.tensor([100], device="cuda")

    def forward():
        return torch.ops.fusion_pass.qk_norm_rope_cache(q, k, v, wq, wk, cos, sin, kc, vc, pos, 1e-6, 1e-6)

    res = {}
    for rnd in range(2):  # twice, alternating, so a slow spell of the host shows as a disagreement
        for enabled in (True, False):
            triton_launch.ENABLED = enabled
            tag = "cached" if enabled else "normal"
            res.setdefault(f"backward_op_M128_{tag}_us", []).append(host_us(backward, 300))
            res.setdefault(f"forward_decode_op_{tag}_us", []).append(host_us(forward, 300))
    triton_launch.ENABLED = True
    print("op host us (cached launcher vs Triton's normal launch): "
          + ", ".join(f"{k} {[round(x, 1) for x in v]}" for k, v in res.items()), flush=True)
    return res


def timeline(S, B):
    t = bb.make_inputs(S, B, "cuda")

    def op():
        return torch.ops.fusion_pass.qkv_rope_qk_norm_backward(
            t["gq"], t["gk"], t["gv"], t["q"], t["k"], t["rq"], t["rk"], t["cos"], t["sin"], t["wq"], t["wk"],
            t["hidden"], [t["W"]], False, True, True, True, True)

    for _ in range(3):
        op()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            op()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per_call = len(events) // 5
    last = events[-per_call:]
    rows = [dict(name=e.name[:80], us=e.device_time) for e in last]
    print(f"S={S} B={B}: " + "; ".join(f"{r['name'][:40]} {r['us']:.1f}" for r in rows), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               date=datetime.date.today().isoformat())
    res["launch"] = launch_costs()
    res["op_host_ab"] = op_host_ab()
    res["timeline"] = {f"S{S}_B{B}": timeline(S, B) for S, B in ((128, 1), (512, 1), (2048, 2))}
    (out / "diagnose-launch-overhead.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
