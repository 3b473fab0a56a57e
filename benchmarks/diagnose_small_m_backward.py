"""Where the small-M training backward spends its time (suite B layer: 32/8 heads, D 128, hidden 4096).

    python benchmarks/diagnose_small_m_backward.py --out DIR

1. GEMM routes of ``qkv_projection_backward``: "torch" (two cuBLAS calls in a row) against
   "streams" (grad_W on a side stream, concurrent with grad_hidden), and cuBLAS grad_hidden with
   the Triton grad_weight kernel on the side stream; CUDA-graph replay and do_bench, per M.
2. Host cost of one call (no graph): the elementwise launcher, the whole backward op, and a bare
   Triton launch, as host microseconds per call with the GPU kept ahead; plus a cProfile of the
   elementwise launcher at M = 128 (top entries by own time).

Writes DIR/diagnose-small-m-backward.json and prints a summary.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import pathlib
import pstats
import sys

import torch
import triton

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import bench_backward as bb  # noqa: E402
from diagnose_device_time import bench_us, graph_us, host_us  # noqa: E402

from fusion_pass.kernels import projection_backward as pb  # noqa: E402
from fusion_pass.kernels import qkv_rope_qk_norm_backward_triton as kb  # noqa: E402


@triton.jit
def _empty_kernel(x_ptr, n):
    pass


def gemm_routes(Ms):
    W = torch.randn(bb.QKV, bb.HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
    side = torch.cuda.Stream()
    rows = []
    for M in Ms:
        G = torch.randn(M, bb.QKV, device="cuda", dtype=torch.bfloat16)
        X = torch.randn(M, bb.HIDDEN, device="cuda", dtype=torch.bfloat16)
        ref = pb.qkv_projection_backward(G, X, W, strategy="torch")
        got = pb.qkv_projection_backward(G, X, W, strategy="streams")
        same = all(torch.equal(a, b) for a, b in zip(ref[:2], got[:2]))

        def cublas_gi_triton_gw():
            gw = torch.empty(bb.QKV, bb.HIDDEN, device=G.device, dtype=torch.bfloat16)
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                pb.grad_weight_into(G, X, gw, pb.GradWeightConfig(16, 128, 128, 4, 4))
            gh = torch.mm(G, W)
            main.wait_stream(side)
            return gh, gw

        row = dict(M=M, streams_bit_equal_torch=same)
        for name, fn in (("torch", lambda: pb.qkv_projection_backward(G, X, W, strategy="torch")),
                         ("streams", lambda: pb.qkv_projection_backward(G, X, W, strategy="streams")),
                         ("streams_triton_gw", cublas_gi_triton_gw)):
            row[f"{name}_graph_us"] = graph_us(fn)
            row[f"{name}_us"] = bench_us(fn)
        print(f"M={M:5d}  graph: torch {row['torch_graph_us']:7.1f}  streams {row['streams_graph_us']:7.1f}  "
              f"cuBLAS gh || Triton gW {row['streams_triton_gw_graph_us']:7.1f}   do_bench: torch "
              f"{row['torch_us']:7.1f} streams {row['streams_us']:7.1f}  bit-equal {same}", flush=True)
        rows.append(row)
        del G, X, ref, got
    return rows


def host_costs():
    t = bb.make_inputs(128, 1, "cuda")
    B, S = 1, 128
    M = B * S
    nq, nk = bb.HQ * bb.D, bb.HKV * bb.D
    grad_qkv = torch.empty(M, bb.QKV, device="cuda", dtype=torch.bfloat16)

    def elementwise():
        return kb.qk_norm_rope_backward_triton(
            t["gq"], t["gk"], t["gv"], t["q"], t["k"], t["rq"], t["rk"], t["cos"], t["sin"], t["wq"], t["wk"],
            grad_qkv[:, :nq], grad_qkv[:, nq:nq + nk], grad_qkv[:, nq + nk:],
            need_weight_grad=True, need_cos_sin_grad=True)

    hidden = t["hidden"]
    rq, rk = t["rq"], t["rk"]

    def op():
        return torch.ops.fusion_pass.qkv_rope_qk_norm_backward(
            t["gq"], t["gk"], t["gv"], t["q"], t["k"], rq, rk, t["cos"], t["sin"], t["wq"], t["wk"], hidden,
            [t["W"]], False, True, True, True, True)

    x = torch.empty(16, device="cuda")
    res = dict(
        empty_triton_launch_us=host_us(lambda: _empty_kernel[(1,)](x, 16)),
        elementwise_us=host_us(elementwise),
        gemms_torch_us=host_us(lambda: pb.qkv_projection_backward(grad_qkv, hidden.view(M, -1), t["W"],
                                                                  strategy="torch")),
        gemms_streams_us=host_us(lambda: pb.qkv_projection_backward(grad_qkv, hidden.view(M, -1), t["W"],
                                                                    strategy="streams")),
        whole_op_us=host_us(op),
    )
    print("host us per call: " + ", ".join(f"{k} {v:.1f}" for k, v in res.items()), flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        elementwise()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    res["profile_elementwise"] = s.getvalue()
    print(s.getvalue()[:6000], flush=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--m", default="128,131,256,512,586,1571,2048,2164,4096,8192")
    ap.add_argument("--skip-host", action="store_true")
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import fusion_pass.kernels  # noqa: F401  (registers the ops)
    result = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  date=datetime.date.today().isoformat())
    result["host"] = host_costs() if not args.skip_host else None
    result["gemm_routes"] = gemm_routes([int(m) for m in args.m.split(",")])
    (out / "diagnose-small-m-backward.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
