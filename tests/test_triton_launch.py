"""kernels/triton_launch.py: the cached-handle launcher gives what ``kernel[grid](...)`` gives.

CPU: the launcher's cache key captures everything Triton specializes a tensor argument on (the
check runs Triton's own ``native_specialize_impl``), the convention checks, and launches under
the interpreter. GPU: the cached handle's launches (the fast path) write the same bits as
Triton's normal path, also for a misaligned view and for scalars Triton specializes (1, multiples
of 16), and the backward and forward ops really take that path.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from fusion_pass.kernels import qk_norm_rope_cache_triton as forward_kernels
from fusion_pass.kernels import qkv_rope_qk_norm_backward_triton as kb
from fusion_pass.kernels.triton_device import interpreting
from fusion_pass.kernels.triton_launch import CachedLauncher

needs_triton_device = pytest.mark.skipif(
    not (torch.cuda.is_available() or interpreting()), reason="needs CUDA or TRITON_INTERPRET=1"
)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the cached handle exists on CUDA only")


@triton.jit
def _scaled_copy_kernel(src_ptr, dst_ptr, n, src_stride, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(src_ptr + offs * src_stride, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst_ptr + offs, (x * scale).to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _constexpr_first_kernel(BLOCK: tl.constexpr, x_ptr):
    pass


def _copy_args(src, dst, stride, scale=2.0):
    n = dst.numel()
    return (triton.cdiv(n, 64),), (src, dst, n, stride, scale), dict(BLOCK=64), dict(num_warps=1)


def test_launcher_reads_the_signature_convention():
    launcher = CachedLauncher(_scaled_copy_kernel)
    assert launcher.arg_names == ("src_ptr", "dst_ptr", "n", "src_stride", "scale")
    assert launcher.tensor_positions == (0, 1)
    assert launcher.constexpr_names == ("BLOCK",)
    with pytest.raises(ValueError, match="constexpr parameters must follow"):
        CachedLauncher(_constexpr_first_kernel)


def test_key_tells_apart_scalars_triton_compiles_differently():
    """1, 1.0 and True are equal as dict keys, but Triton compiles a constexpr 1, an fp32 and a
    u1 for them; 16 and 17 differ in divisibility. Each must be its own key."""
    launcher = CachedLauncher(_scaled_copy_kernel)
    x = torch.zeros(8)
    keys = {launcher.key(0, (x, x, n, 1, 2.0), (64,), ()) for n in (1, 1.0, True, 16, 17)}
    assert len(keys) == 5
    assert launcher.key(0, (x, x, 8, 1, 2.0), (64,), ()) != launcher.key(0, (x[1:], x, 8, 1, 2.0), (64,), ())


def test_key_covers_what_triton_specializes_a_tensor_on():
    """Triton's specialization of a tensor argument must be a function of (dtype, address mod
    16), the two facts the launcher keys tensors by; ints are keyed by value, so whatever Triton
    derives from them is fixed. Run with Triton's own specializer over tensors that differ in
    shape, strides, offset and dtype."""
    native = pytest.importorskip("triton._C.libtriton").native_specialize_impl
    from triton.backends.compiler import BaseBackend

    seen: dict = {}
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.int32):
        base = torch.zeros(4096, dtype=dtype)
        views = [base, base[1:], base[8:], base[16:], base.view(64, 64), base.view(64, 64).t(),
                 base.view(64, 64)[:, 1:], base[:1], base.view(64, 64)[::2]]
        for t in views:
            key = (t.dtype, t.data_ptr() & 15)
            spec = native(BaseBackend, t, False, True, True)  # not const, specialize, on alignment
            assert seen.setdefault(key, spec) == spec, (key, spec, seen[key])
    # and each (dtype, alignment) pair is one specialization of its own
    assert len({v for v in seen.values()}) == len(seen)


def test_launch_hooks_send_launches_down_the_normal_path():
    """With a launch hook set (a profiler reading launch metadata) the handle is not used."""
    from fusion_pass.kernels import triton_launch

    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime.launch_enter_hook, "add"):
        pytest.skip("this Triton has no launch-hook chain")
    assert not triton_launch._launch_hooks_installed()
    hook = lambda metadata: None  # noqa: E731
    runtime.launch_enter_hook.add(hook)
    try:
        assert triton_launch._launch_hooks_installed()
    finally:
        runtime.launch_enter_hook.remove(hook)
    assert not triton_launch._launch_hooks_installed()


@needs_triton_device
def test_launch_matches_the_normal_launch():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    launcher = CachedLauncher(_scaled_copy_kernel)
    src = torch.randn(1000, device=dev, dtype=torch.float32).to(torch.bfloat16)
    for stride, scale in ((1, 2.0), (1, 3.0), (2, 2.0), (16, 0.5), (1, 2.0)):
        n = (src.numel() - 1) // stride + 1
        want = torch.empty(n, device=dev, dtype=torch.bfloat16)
        got = torch.empty_like(want)
        grid, args, constexprs, options = _copy_args(src, want, stride, scale)
        _scaled_copy_kernel[grid](*args, **constexprs, **options)
        launcher.launch(grid, (src, got, n, stride, scale), constexprs, options)
        assert torch.equal(got, want)


@needs_triton_device
def test_launch_names_an_argument_of_the_wrong_kind():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    launcher = CachedLauncher(_scaled_copy_kernel)
    x = torch.zeros(8, device=dev)
    with pytest.raises(TypeError, match="dst_ptr: expected a tensor, got int"):
        launcher.launch((1,), (x, 5, 8, 1, 1.0), dict(BLOCK=8), dict(num_warps=1))
    with pytest.raises(TypeError, match="n: expected an int or float, got Tensor"):
        launcher.launch((1,), (x, x, x, 1, 1.0), dict(BLOCK=8), dict(num_warps=1))
    with pytest.raises(TypeError, match="expected 5 runtime arguments, got 4"):
        launcher.launch((1,), (x, x, 8, 1), dict(BLOCK=8), dict(num_warps=1))


@needs_cuda
def test_cached_handle_launches_write_the_normal_launchs_bits():
    """Second and later calls with one key take the handle; a misaligned source (address not a
    multiple of 16), a stride of 1 (a constant to Triton) or a multiple of 16 are other keys."""
    launcher = CachedLauncher(_scaled_copy_kernel)
    base = torch.randn(4099, device="cuda").to(torch.bfloat16)
    cases = [(base, 1), (base[1:], 1), (base[8:], 1), (base, 16), (base, 3), (base[1:], 16)]
    for src, stride in cases * 3:  # three rounds: the 2nd and 3rd take cached handles
        n = (src.numel() - 1) // stride + 1
        want = torch.empty(n, device="cuda", dtype=torch.bfloat16)
        got = torch.full_like(want, float("nan"))
        grid, args, constexprs, options = _copy_args(src, want, stride)
        _scaled_copy_kernel[grid](*args, **constexprs, **options)
        launcher.launch(grid, (src, got, n, stride, 2.0), constexprs, options)
        torch.cuda.synchronize()
        assert torch.equal(got, want), (src.data_ptr() & 15, stride)
    assert len(launcher._handles) == len(cases)
    assert launcher.fast_launches == 2 * len(cases)


def _elementwise_inputs(S, B, HQ=4, HKV=2, D=128, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=g).to(dtype)

    qkv = rnd(B, S, (HQ + 2 * HKV) * D)
    q = qkv[..., : HQ * D].view(B, S, HQ, D)
    k = qkv[..., HQ * D: (HQ + HKV) * D].view(B, S, HKV, D)
    grad_q, grad_k, grad_v = rnd(B, HQ, S, D), rnd(B, HKV, S, D), rnd(B, HKV, S, D)
    q_rstd = torch.rand(B, HQ, S, device="cuda", generator=g) + 0.5
    k_rstd = torch.rand(B, HKV, S, device="cuda", generator=g) + 0.5
    return (grad_q, grad_k, grad_v, q, k, q_rstd, k_rstd, rnd(1, S, D), rnd(1, S, D), rnd(D), rnd(D))


@needs_cuda
@pytest.mark.parametrize("S,B", [(128, 1), (256, 4)])  # head tiles (M < 512), token rows (M >= 512)
def test_backward_elementwise_bits_through_cached_handles(S, B, monkeypatch):
    """Fresh launchers: the first call launches through Triton's normal path, the next ones
    through the cached handles; every call writes the same bits."""
    for name in ("_TILES_LAUNCHER", "_ROWS_LAUNCHER", "_FINISH_LAUNCHER"):
        monkeypatch.setattr(kb, name, CachedLauncher(getattr(kb, name).kernel))
    args = _elementwise_inputs(S, B)
    HQ, HKV, D = args[0].shape[1], args[1].shape[1], args[0].shape[3]
    results = []
    for _ in range(3):
        grad_qkv = torch.full((B * S, (HQ + 2 * HKV) * D), float("nan"), device="cuda", dtype=torch.bfloat16)
        parts = grad_qkv.split([HQ * D, HKV * D, HKV * D], dim=1)
        grads = kb.qk_norm_rope_backward_triton(*args, *parts, True, True)
        torch.cuda.synchronize()
        results.append((grad_qkv, *grads))
    for later in results[1:]:
        for a, b in zip(results[0], later):
            assert torch.equal(a, b)
    assert not torch.isnan(results[0][0]).any()
    fast = kb._TILES_LAUNCHER.fast_launches + kb._ROWS_LAUNCHER.fast_launches
    assert fast == 2, "the 2nd and 3rd call take the elementwise kernel's cached handle"
    assert kb._FINISH_LAUNCHER.fast_launches == 2


@needs_cuda
def test_forward_kernel_takes_the_cached_handle(monkeypatch):
    """The decode kernel: same bits from the normal launch and the cached handle."""
    launcher = CachedLauncher(forward_kernels._qk_norm_rope_cache_kernel)
    monkeypatch.setattr(forward_kernels, "_CACHE_KERNEL_LAUNCHER", launcher)
    B, HQ, HKV, D, L = 2, 8, 2, 128, 64
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=g).to(torch.bfloat16)

    q, k, v = rnd(B, HQ, 1, D), rnd(B, HKV, 1, D), rnd(B, HKV, 1, D)
    wq, wk, cos, sin = rnd(D), rnd(D), rnd(B, 1, D), rnd(B, 1, D)
    pos = torch.tensor([3, 17], device="cuda")
    outs = []
    for _ in range(3):
        k_cache, v_cache = torch.zeros(B, HKV, L, D, device="cuda", dtype=torch.bfloat16), \
            torch.zeros(B, HKV, L, D, device="cuda", dtype=torch.bfloat16)
        q_out, k_out = torch.empty_like(q), torch.empty_like(k)
        forward_kernels.qk_norm_rope_cache_triton(q, k, v, wq, wk, cos, sin, k_cache, v_cache, pos, 1e-6, 1e-6,
                                                  q_out, k_out)
        torch.cuda.synchronize()
        outs.append((q_out, k_out, k_cache, v_cache))
    for later in outs[1:]:
        for a, b in zip(outs[0], later):
            assert torch.equal(a, b)
    assert launcher.fast_launches == 2


@needs_cuda
def test_cached_launch_goes_to_the_current_stream_inside_graph_capture():
    """A cached launch inside CUDA-graph capture on a side stream is captured (a launch on
    another stream would fail the capture or be missing from the replay)."""
    launcher = CachedLauncher(_scaled_copy_kernel)
    src = torch.randn(1000, device="cuda").to(torch.bfloat16)
    want, got = torch.empty_like(src), torch.empty_like(src)
    grid, args, constexprs, options = _copy_args(src, want, 1)
    _scaled_copy_kernel[grid](*args, **constexprs, **options)
    launcher.launch(grid, (src, got, src.numel(), 1, 2.0), constexprs, options)  # caches the handle
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        launcher.launch(grid, (src, got, src.numel(), 1, 2.0), constexprs, options)
    assert launcher.fast_launches == 1
    got.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)


@needs_cuda
def test_cached_handle_is_not_used_while_a_launch_hook_is_set():
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime.launch_enter_hook, "add"):
        pytest.skip("this Triton has no launch-hook chain")
    launcher = CachedLauncher(_scaled_copy_kernel)
    src = torch.randn(256, device="cuda").to(torch.bfloat16)
    got = torch.empty_like(src)
    grid, _, constexprs, options = _copy_args(src, got, 1)
    seen = []
    hook = lambda metadata: seen.append(1)  # noqa: E731
    launcher.launch(grid, (src, got, src.numel(), 1, 2.0), constexprs, options)
    runtime.launch_enter_hook.add(hook)
    try:
        launcher.launch(grid, (src, got, src.numel(), 1, 2.0), constexprs, options)
    finally:
        runtime.launch_enter_hook.remove(hook)
    torch.cuda.synchronize()
    assert launcher.fast_launches == 0 and seen
