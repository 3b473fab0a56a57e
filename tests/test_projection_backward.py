"""The projection GEMMs of the training backward (kernels/projection_backward.py) against float64.

CPU: the Triton kernels run under the interpreter (TRITON_INTERPRET=1, set before triton is
imported) on small shapes, pointer and TMA variants, split and direct grad_input, with and
without bias. GPU (skipped without CUDA): the routes at suite-B shapes, and the two-stream route
bit-equal to the one-stream route, also inside CUDA-graph capture.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from fusion_pass.kernels import projection_backward as pb  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}


def rel_err(a, ref):
    """max |a - ref| / max |ref|."""
    a, ref = a.double(), ref.double()
    return ((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def inputs(M, N, K, dtype, seed=0, device=DEV):
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(M, N, generator=gen).to(dtype).to(device)
    x = torch.randn(M, K, generator=gen).to(dtype).to(device)
    w = (torch.randn(N, K, generator=gen) * 0.05).to(dtype).to(device)
    return g, x, w


GI_CONFIGS = {
    "pointer_split": pb.GradInputConfig(16, 16, 32, 4, 2, programs_per_sm=4.0),
    "pointer_direct": pb.GradInputConfig(64, 32, 64, 4, 2, programs_per_sm=0.01),
    "tma_split": pb.GradInputConfig(16, 16, 32, 4, 2, programs_per_sm=4.0, tma=True),
    "tma_direct": pb.GradInputConfig(64, 32, 64, 4, 2, programs_per_sm=0.01, tma=True),
}
GW_CONFIGS = {
    "pointer": pb.GradWeightConfig(16, 32, 32, 4, 2),
    "tma": pb.GradWeightConfig(16, 32, 32, 4, 2, tma=True, programs_per_sm=2),
    "tma_flatten": pb.GradWeightConfig(16, 32, 32, 4, 2, tma=True, programs_per_sm=1, flatten=True),
    "tma_two_store_slices": pb.GradWeightConfig(16, 32, 64, 4, 2, tma=True, programs_per_sm=1, flatten=True,
                                                store_slices=2),
}


@pytest.mark.parametrize("M,N,K,dtype", [
    (20, 96, 80, torch.float32),  # partial m-, n- and k-tiles
    (37, 160, 304, torch.bfloat16),
    (130, 96, 72, torch.float16),
    (5, 64, 64, torch.bfloat16),
    (5, 72, 64, torch.bfloat16),  # split configs: 3 splits, the last one partial (8 of 32 columns)
])
@pytest.mark.parametrize("gi_name", list(GI_CONFIGS))
def test_grad_input_matches_float64(M, N, K, dtype, gi_name):
    g, _, w = inputs(M, N, K, dtype)
    got = pb.grad_input_partials([g], [w], GI_CONFIGS[gi_name])
    assert got.dtype == dtype and got.shape == (M, K)
    assert rel_err(got, g.double() @ w.double()) <= TOL[dtype]


@pytest.mark.parametrize("M,N,K,dtype", [(20, 96, 80, torch.float32), (37, 160, 304, torch.bfloat16),
                                         (130, 96, 72, torch.float16)])
@pytest.mark.parametrize("gw_name", list(GW_CONFIGS))
def test_grad_weight_matches_float64(M, N, K, dtype, gw_name):
    g, x, _ = inputs(M, N, K, dtype, seed=1)
    gw = pb.grad_weight(g, x, GW_CONFIGS[gw_name])
    assert gw.dtype == dtype and gw.shape == (N, K)
    assert rel_err(gw, g.double().t() @ x.double()) <= TOL[dtype]


def test_split_sum_is_deterministic_and_equal_to_one_split():
    """Fixed-order sums: the same bits every call; a split changes bits only by fp32 order."""
    g, _, w = inputs(5, 72, 64, torch.float32, seed=2)
    cfg = GI_CONFIGS["pointer_split"]
    split, n_per_split = pb._split(72, 2, cfg, pb.sm_count(g))
    # really split (2 SMs under the interpreter: 3 splits of 32; 132 on an H200: 5 of 16), the
    # last split partial
    assert split > 1 and 72 % n_per_split and (split - 1) * n_per_split < 72 < split * n_per_split
    a, b = pb.grad_input_partials([g], [w], cfg), pb.grad_input_partials([g], [w], cfg)
    assert torch.equal(a, b)
    assert rel_err(a, pb.grad_input_partials([g], [w], GI_CONFIGS["pointer_direct"])) < 1e-6


def test_tma_eligibility_and_pointer_fallback():
    """A column slice whose base is not 16-byte aligned cannot take a TMA descriptor: the pointer
    kernel runs, with the same result."""
    g, x, w = inputs(24, 164, 64, torch.float32, seed=4)  # row stride 656 B: 16-byte multiple
    aligned, misaligned = g[:, 32:128], g[:, 33:129]
    assert pb._tma_ok(aligned, x) and not pb._tma_ok(misaligned, x)
    assert not pb._tma_ok(g.t().contiguous().t())  # column-major
    for gv in (aligned, misaligned):
        ws = w[:96]
        gh = pb.grad_input_partials([gv], [ws], GI_CONFIGS["tma_split"])
        gw = pb.grad_weight(gv, x, GW_CONFIGS["tma"])
        assert rel_err(gh, gv.double() @ ws.double()) < 2e-6
        assert rel_err(gw, gv.double().t() @ x.double()) < 2e-6


@pytest.mark.parametrize("strategy", ["torch", "streams", "triton", "auto"])
def test_separate_projections_accumulate_grad_input(strategy):
    gen = torch.Generator().manual_seed(5)
    M, K = 12, 64
    x = torch.randn(M, K, generator=gen).to(DEV)
    ws = [torch.randn(n, K, generator=gen).to(DEV) * 0.1 for n in (128, 64, 64)]
    gs = [torch.randn(M, n, generator=gen).to(DEV) for n in (128, 64, 64)]
    gh, gws, gbs = pb.separate_projections_backward(gs, x, ws, need_bias_grad=True, strategy=strategy)
    assert rel_err(gh, sum(g.double() @ w.double() for g, w in zip(gs, ws))) < 2e-6
    for g, gw, gb in zip(gs, gws, gbs):
        assert rel_err(gw, g.double().t() @ x.double()) < 2e-6
        assert rel_err(gb, g.double().sum(0)) < 2e-6


@pytest.mark.parametrize("strategy", ["torch", "streams", "triton"])
def test_fused_projection_flags(strategy):
    g, x, w = inputs(20, 96, 80, torch.float32, seed=2)
    gh, gw, gb = pb.qkv_projection_backward(g, x, w, strategy=strategy)
    assert gb is None
    assert rel_err(gh, g.double() @ w.double()) < 2e-6 and rel_err(gw, g.double().t() @ x.double()) < 2e-6
    only_h = pb.qkv_projection_backward(g, x, w, need_weight_grad=False, strategy=strategy)
    only_w = pb.qkv_projection_backward(g, x, w, need_hidden_grad=False, strategy=strategy)
    assert only_h[1] is None and torch.equal(only_h[0], gh)
    assert only_w[0] is None and torch.equal(only_w[1], gw)


@pytest.mark.parametrize("strategy", ["torch", "triton"])
def test_bad_arguments_name_themselves(strategy):
    g, x, w = inputs(8, 64, 32, torch.float32)
    with pytest.raises(ValueError, match="strategy"):
        pb.qkv_projection_backward(g, x, w, strategy="fused")
    with pytest.raises(ValueError, match="one weight per grad"):
        pb.separate_projections_backward([g], x, [w, w], strategy=strategy)
    bad = {
        r"weights\[0\]: expected \[N = 64, K = 32\]": ([g], x, [w[:32]]),  # fewer rows than grad's columns
        r"weights\[1\]: expected \[N = 32, K = 32\]": ([g, g[:, :32]], x, [w, w[:32, :16]]),  # another K
        r"grads\[1\]: expected \[M = 8, N\]": ([g, g[:5]], x, [w, w]),
        r"grads\[0\]: expected a 2-D": ([g[None]], x, [w]),
        r"weights\[0\]: expected hidden's dtype": ([g], x, [w.bfloat16()]),
        r"hidden: expected a 2-D": ([g], x[None], [w]),
    }
    for message, (grads, hidden, weights) in bad.items():
        with pytest.raises(ValueError, match=message):
            pb.separate_projections_backward(grads, hidden, weights, strategy=strategy)


def test_triton_route_hands_empty_and_float64_operands_to_cublas():
    g, x, w = inputs(8, 64, 32, torch.float64)
    gh, gw, _ = pb.qkv_projection_backward(g, x, w, strategy="triton")
    assert torch.equal(gh, g @ w) and torch.equal(gw, g.t() @ x)
    e = torch.empty(0, 64, dtype=torch.bfloat16, device=DEV)
    gh, gw, gb = pb.qkv_projection_backward(e, torch.empty(0, 32, dtype=torch.bfloat16, device=DEV),
                                            w.bfloat16(), need_bias_grad=True, strategy="triton")
    assert gh.shape == (0, 32) and torch.count_nonzero(gw) == 0 and torch.count_nonzero(gb) == 0


def test_gemm_configs_table():
    """Every row of the table is a valid tile set (powers of two the kernels need) that fits the
    shared-memory budget for 2- and 4-byte elements, the bf16 rows as swept, and the ragged-M
    rows where the sweep put them."""
    for M in (1, 16, 128, 131, 200, 256, 293, 512, 586, 1024, 8192):
        for es in (2, 4):
            gi, gw = pb.gemm_configs(M, es)
            for b in (gi.block_m, gi.block_n, gi.block_k, gw.block_m, gw.block_n, gw.block_k):
                assert b >= 16 and b & (b - 1) == 0
            assert gw.tma and gi.programs_per_sm > 0 and gi.num_stages >= 2 and gw.num_stages >= 2
            assert pb._shared_bytes(gi, es) <= pb.SHARED_MEMORY_BUDGET
            assert pb._shared_bytes(gw, es) <= pb.SHARED_MEMORY_BUDGET
    assert pb.gemm_configs(128)[1] == pb.GradWeightConfig(64, 128, 256, 8, 3, True, 1, True)  # swept, kept
    assert pb.gemm_configs(128, 4)[1].block_k == 128  # fp32: the same tile would need 416 KB
    assert pb.gemm_configs(131)[0].block_k == 256 and not pb.gemm_configs(131)[0].tma
    assert pb.gemm_configs(16)[0].tma  # the 131 row is for M just past 128 only
    assert pb.gemm_configs(512)[1].block_k == 256 and pb.gemm_configs(586)[1].block_k == 128


# ---------------------------------------------------------------------------------------------
# GPU: suite-B shapes (N = 6144, K = 4096)
# ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("M,dtype", [(M, torch.bfloat16) for M in (128, 131, 256, 512, 586, 2048)]
                         + [(M, dt) for M in (128, 131, 512, 586) for dt in (torch.float16, torch.float32)])
@pytest.mark.parametrize("bias", [False, True])
def test_gpu_triton_route_at_suite_shapes(M, dtype, bias):
    """Every row of ``gemm_configs`` the suite reaches, in each dtype (with a bias the route once
    took another kernel variant, which was wrong on the H200: the test that caught it; fp32 once
    asked for more shared memory than an SM has)."""
    g, x, w = inputs(M, 6144, 4096, dtype, seed=M, device="cuda")
    gh, gw, gb = pb.qkv_projection_backward(g, x, w, need_bias_grad=bias, strategy="triton")
    th, tw, tb = pb.qkv_projection_backward(g, x, w, need_bias_grad=bias, strategy="torch")
    ref_h, ref_w = g.double() @ w.double(), g.double().t() @ x.double()
    # the same order of error as cuBLAS's (both round an fp32 accumulation once)
    floor = {torch.bfloat16: 4e-3, torch.float16: 5e-4, torch.float32: 1e-5}[dtype]
    assert rel_err(gh, ref_h) <= max(2 * rel_err(th, ref_h), floor)
    assert rel_err(gw, ref_w) <= max(2 * rel_err(tw, ref_w), floor)
    if bias:
        assert rel_err(gb, tb) < 8e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_triton_route_separate_projections():
    """HunYuanDenseV1's q/k/v weights: one fp32 workspace, one fixed-order sum for grad_hidden."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(131, 4096, generator=gen).bfloat16().cuda()
    ws = [(torch.randn(n, 4096, generator=gen) * 0.02).bfloat16().cuda() for n in (4096, 1024, 1024)]
    gs = [torch.randn(131, n, generator=gen).bfloat16().cuda() for n in (4096, 1024, 1024)]
    gh, gws, _ = pb.separate_projections_backward(gs, x, ws, strategy="triton")
    th, tws, _ = pb.separate_projections_backward(gs, x, ws, strategy="torch")
    ref = sum(g.double() @ w.double() for g, w in zip(gs, ws))
    assert rel_err(gh, ref) <= max(2 * rel_err(th, ref), 4e-3)
    for g, gw, tw in zip(gs, gws, tws):
        ref_w = g.double().t() @ x.double()
        assert rel_err(gw, ref_w) <= max(2 * rel_err(tw, ref_w), 4e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_two_streams_bit_equal_also_in_a_cuda_graph():
    g, x, w = inputs(128, 6144, 4096, torch.bfloat16, seed=7, device="cuda")
    ref = pb.qkv_projection_backward(g, x, w, need_bias_grad=True, strategy="torch")
    eager = pb.qkv_projection_backward(g, x, w, need_bias_grad=True, strategy="streams")
    assert all(torch.equal(a, b) for a, b in zip(ref, eager))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graphs asks
        pb.qkv_projection_backward(g, x, w, need_bias_grad=True, strategy="streams")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = pb.qkv_projection_backward(g, x, w, need_bias_grad=True, strategy="streams")
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(ref, captured))
