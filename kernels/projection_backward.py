"""The projection GEMMs of the training backward (a linear layer ``y = x @ W.T (+ b)``).

    grad_input  = G @ W          G [M, N] (grad of y), W [N, K]  ->  [M, K]
    grad_weight = G.T @ X        X [M, K] (the layer's input)    ->  [N, K]
    grad_bias   = G.sum(0)                                        ->  [N]

``qkv_projection_backward`` (one fused QKV weight) and ``separate_projections_backward`` (q/k/v
weights; grad_input accumulates over them without an extra pass) route to one of:

- ``"torch"`` (what ``"auto"`` picks today): two cuBLAS calls. Measured against everything below
  on the H200 and never beaten by more than ~2-4 us at M <= 586 (benchmarks/NOTES-backward.md).
- ``"streams"``: the same cuBLAS calls, grad_weight on a side stream concurrent with grad_input.
  Graph replay, N = 6144, K = 4096: M = 128 45.6 -> 42.9 us, M = 512 87.9 -> 79.1, no gain from
  M = 586 up; it adds ~30-40 us of host time per call (stream switches, events), so it only pays
  inside a CUDA graph.
- ``"triton"``: the Triton kernels of this module, tiles from ``gemm_configs(M)``; empty operands
  and dtypes other than bf16/fp16/fp32 take the cuBLAS route.

The Triton kernels, shaped for a short M (``y`` of a few hundred tokens, where both products are
bound by W read and grad_weight written, 2 * N * K elements):

``_grad_input_kernel`` / ``_grad_input_tma_kernel`` (split-N)::

    program (m-tile, k-tile, split s):            # m fastest: siblings share W tiles in L2
        acc[BLOCK_M, BLOCK_K] = sum over n in split s of G[m-tile, n] @ W[n, k-tile]
        -> grad_input directly when SPLIT == 1, else fp32 partials [SPLIT, M, K] that
           ``_sum_splits_kernel`` adds in split order (deterministic: no atomics)

A K = 4096 layer has few output tiles (64 at M = 128 with 64 x 128 tiles), so the reduction over
N is split until the grid has ``programs_per_sm`` programs per SM.

``_grad_weight_kernel`` (pointer loads) / ``_grad_weight_tma_kernel`` (persistent)::

    program p, tiles p, p + P, ...:
        acc[BLOCK_N, BLOCK_K] = sum over m of G[m, n-tile].T @ X[m, k-tile]
        grad_weight[n-tile, k-tile] = acc            # TMA store: overlaps the next tile's loads

grad_bias (when asked) is ``G.sum(0)`` in torch on every route.

Both accumulate in fp32 and round once to the model dtype, as cuBLAS does. The TMA variants need
16-byte aligned bases and row strides (``_tma_ok``); otherwise the pointer kernels run. Tiles come
from ``gemm_configs(M)``, a table from the H200 sweep (``benchmarks/sweep_projection_gemms.py``);
M is a runtime argument, so a new M picks a row of the table, not a new compile.

Measured (H200, graph replay, N = 6144, K = 4096; cuBLAS in brackets), best tiles per M:
grad_input 20.6 (17.9) at M = 128, 26.1 (23.8) at 256, 37.5 (40.9) at 512, 60.2 (46.9) at 586;
grad_weight 19.9 (22.6), 29.9 (32.3), 45.4 (48.2), 54.0 (56.2). A few us either way: not enough to
hide the elementwise pass (~11-14 us at these M), which is what beating two cuBLAS calls would take.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from .rounding import round_to
from .triton_device import sm_count, triton_applicable

try:  # host-side TMA descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None


def _precision(dtype: torch.dtype) -> str:
    """fp32 layers get true fp32 products (as cuBLAS by default), not TF32."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _grad_input_kernel(
    g_ptr, g_sm, g_sn,  # G [M, N]
    w_ptr, w_sn, w_sk,  # W [N, K]
    out_ptr, out_ss, out_sm, out_sk,  # grad_input [M, K] (SPLIT == 1) or fp32 partials [SPLIT, M, K]
    M, N, K, n_per_split, m_tiles,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = pid % m_tiles
    pid_k = pid // m_tiles
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    k_mask = offs_k < K
    n_start = pid_s * n_per_split
    n_end = tl.minimum(n_start + n_per_split, N)
    offs_n = n_start + tl.arange(0, BLOCK_N)
    # 64-bit offsets: a [N, K] weight passes 2**31 elements at N = K = 46341.
    g_ptrs = g_ptr + offs_m.to(tl.int64)[:, None] * g_sm + offs_n.to(tl.int64)[None, :] * g_sn
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * w_sn + offs_k.to(tl.int64)[None, :] * w_sk
    acc = tl.full([BLOCK_M, BLOCK_K], 0.0, tl.float32)
    for n0 in tl.range(n_start, n_end, BLOCK_N, num_stages=NUM_STAGES):
        n_mask = (n0 + tl.arange(0, BLOCK_N)) < n_end
        g = tl.load(g_ptrs, mask=m_mask[:, None] & n_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if UPCAST:  # the interpreter's half-precision dot
            g = g.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(g, w, acc, input_precision=PRECISION)
        g_ptrs += BLOCK_N * g_sn
        w_ptrs += BLOCK_N * w_sn
    out = out_ptr + pid_s.to(tl.int64) * out_ss + offs_m.to(tl.int64)[:, None] * out_sm \
        + offs_k.to(tl.int64)[None, :] * out_sk
    # round_to: the interpreter's own fp32 -> bf16 cast truncates (a no-op for fp32 partials)
    tl.store(out, round_to(acc, out_ptr.dtype.element_ty, UPCAST), mask=m_mask[:, None] & k_mask[None, :])


@triton.jit
def _sum_splits_kernel(p_ptr, out_ptr, SPLIT, L, BLOCK: tl.constexpr, INTERPRETED: tl.constexpr):
    """out[j] = sum over s of p[s, j] for s = 0, 1, ... in order (fp32), rounded once."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < L
    ptrs = p_ptr + offs
    acc = tl.load(ptrs, mask=mask, other=0.0)
    for _ in range(1, SPLIT):
        ptrs += L  # pointer steps: s * L would be 32-bit
        acc += tl.load(ptrs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, round_to(acc, out_ptr.dtype.element_ty, INTERPRETED), mask=mask)


@triton.jit
def _grad_weight_kernel(
    g_ptr, g_sm, g_sn,  # G [M, N]
    x_ptr, x_sm, x_sk,  # X [M, K]
    gw_ptr, gw_sn, gw_sk,  # grad_weight [N, K]
    M, N, K, k_tiles,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_n = pid // k_tiles
    pid_k = pid % k_tiles
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    k_mask = offs_k < K
    offs_m = tl.arange(0, BLOCK_M)
    g_ptrs = g_ptr + offs_m.to(tl.int64)[:, None] * g_sm + offs_n.to(tl.int64)[None, :] * g_sn
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * x_sm + offs_k.to(tl.int64)[None, :] * x_sk
    acc = tl.full([BLOCK_N, BLOCK_K], 0.0, tl.float32)
    for m0 in tl.range(0, M, BLOCK_M, num_stages=NUM_STAGES):
        m_in = (m0 + offs_m) < M
        g = tl.load(g_ptrs, mask=m_in[:, None] & n_mask[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=m_in[:, None] & k_mask[None, :], other=0.0)
        if UPCAST:
            g = g.to(tl.float32)
            x = x.to(tl.float32)
        acc = tl.dot(tl.trans(g), x, acc, input_precision=PRECISION)
        g_ptrs += BLOCK_M * g_sm
        x_ptrs += BLOCK_M * x_sm
    out = gw_ptr + offs_n.to(tl.int64)[:, None] * gw_sn + offs_k.to(tl.int64)[None, :] * gw_sk
    tl.store(out, round_to(acc, gw_ptr.dtype.element_ty, UPCAST), mask=n_mask[:, None] & k_mask[None, :])


@triton.jit
def _grad_weight_tma_kernel(
    g_desc,  # G [M, N], blocks [BLOCK_M, BLOCK_N]
    x_desc,  # X [M, K], blocks [BLOCK_M, BLOCK_K]
    gw_desc,  # grad_weight [N, K], blocks [BLOCK_N, BLOCK_K // STORE_SLICES]
    M, N, K, num_programs,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    STORE_SLICES: tl.constexpr, INTERPRETED: tl.constexpr, PRECISION: tl.constexpr,
):
    """Persistent: program p owns output tiles p, p + P, ...; TMA loads (out-of-range rows read
    as zeros) and an asynchronous TMA store, so one tile's store overlaps the next tile's loads
    and MMAs (a write-bound kernel at small M)."""
    # plain arithmetic, not tl.cdiv: a jit library function breaks the interpreter when triton
    # was imported before TRITON_INTERPRET=1 was set (see kernels/qkv_rope_qk_norm_backward_triton._sum)
    k_tiles = (K + BLOCK_K - 1) // BLOCK_K
    total = (N + BLOCK_N - 1) // BLOCK_N * k_tiles
    m_steps = (M + BLOCK_M - 1) // BLOCK_M
    for tile in tl.range(tl.program_id(0), total, num_programs, flatten=FLATTEN,
                         warp_specialize=WARP_SPECIALIZE):
        n0 = (tile // k_tiles) * BLOCK_N
        k0 = (tile % k_tiles) * BLOCK_K
        acc = tl.full([BLOCK_N, BLOCK_K], 0.0, tl.float32)
        for i in range(m_steps):
            g = g_desc.load([i * BLOCK_M, n0])
            x = x_desc.load([i * BLOCK_M, k0])
            if INTERPRETED:
                g = g.to(tl.float32)
                x = x.to(tl.float32)
            acc = tl.dot(tl.trans(g), x, acc, input_precision=PRECISION)
        out = round_to(acc, gw_desc.dtype, INTERPRETED).to(gw_desc.dtype)
        if STORE_SLICES == 2:  # two half-width stores: half the staging buffer, room for a load stage
            lo, hi = out.reshape(BLOCK_N, 2, BLOCK_K // 2).permute(0, 2, 1).split()
            gw_desc.store([n0, k0], lo)
            gw_desc.store([n0, k0 + BLOCK_K // 2], hi)
        else:
            gw_desc.store([n0, k0], out)


@triton.jit
def _grad_input_tma_kernel(
    g_desc,  # G [M, N], blocks [BLOCK_M, BLOCK_N]
    w_desc,  # W [N, K], blocks [BLOCK_N, BLOCK_K]
    out_ptr, out_ss, out_sm, out_sk,  # grad_input [M, K] (SPLIT == 1) or fp32 partials [SPLIT, M, K]
    M, K, n_per_split, m_tiles,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr, INTERPRETED: tl.constexpr, PRECISION: tl.constexpr,
):
    """``_grad_input_kernel`` with TMA loads. A split covers whole BLOCK_N steps and ends at the
    next split's start, so only the last split reads past N, where TMA returns zeros."""
    pid = tl.program_id(0)
    pid_s = tl.program_id(1)
    m0 = (pid % m_tiles) * BLOCK_M
    k0 = (pid // m_tiles) * BLOCK_K
    n_start = pid_s * n_per_split
    acc = tl.full([BLOCK_M, BLOCK_K], 0.0, tl.float32)
    for n0 in tl.range(n_start, n_start + n_per_split, BLOCK_N, num_stages=NUM_STAGES):
        g = g_desc.load([m0, n0])
        w = w_desc.load([n0, k0])
        if INTERPRETED:
            g = g.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(g, w, acc, input_precision=PRECISION)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    out = out_ptr + pid_s.to(tl.int64) * out_ss + offs_m.to(tl.int64)[:, None] * out_sm \
        + offs_k.to(tl.int64)[None, :] * out_sk
    tl.store(out, round_to(acc, out_ptr.dtype.element_ty, INTERPRETED),
             mask=(offs_m < M)[:, None] & (offs_k < K)[None, :])


@dataclasses.dataclass(frozen=True)
class GradInputConfig:
    """Tiles of ``_grad_input_kernel``; ``programs_per_sm`` sets the split of the N reduction."""
    block_m: int = 64
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    programs_per_sm: float = 2.0
    tma: bool = False


@dataclasses.dataclass(frozen=True)
class GradWeightConfig:
    """Tiles of ``_grad_weight_kernel``."""
    block_m: int = 32
    block_n: int = 128
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    tma: bool = False  # persistent TMA kernel (programs_per_sm programs per SM)
    programs_per_sm: int = 1
    flatten: bool = False
    warp_specialize: bool = False  # producer/consumer warps (a probe: benchmarks/probe_grad_weight_overlap.py)
    store_slices: int = 1  # 1 or 2 TMA stores per output tile (2: half the epilogue's shared memory)


def gemm_configs(M: int, element_size: int = 2) -> tuple[GradInputConfig, GradWeightConfig]:
    """The tiles for ``M`` tokens: the fastest of the H200 sweep (bf16, N = 6144, K = 4096, session 5
    of 2026-11-29, ``results/2026-11-29-h200-sweep-projection-gemms-2.json``) per range of M.

    grad_input: 64 x 128 output tiles split to 2 programs / SM up to M = 256; 128-row tiles (one
    program / SM, no split at M = 512: 128 tiles) above; an M just past 128 (131) did best with a
    256-wide K tile and pointer loads. grad_weight: the persistent TMA kernel, 64 x 256 K-tiles
    when M is a multiple of 64 (no ragged last step), else 32-row steps. Wider elements (fp32)
    get fewer pipeline stages, then narrower K tiles, until the tiles fit in shared memory
    (``_fit_shared_memory``; fp32 was not swept).
    """
    if 128 < M <= 144:
        gi = GradInputConfig(128, 64, 256, 8, 3, 1.0, False)
    elif M <= 256:
        gi = GradInputConfig(64, 64, 128, 4, 4, 2.0, True)
    elif M <= 512:
        gi = GradInputConfig(128, 64, 128, 8, 4, 1.0, True)
    else:
        gi = GradInputConfig(128, 64, 256, 8, 3, 2.0, True)
    if M % 64 == 0:
        gw = GradWeightConfig(64, 128, 256, 8, 3, True, 1, True)
    else:
        gw = GradWeightConfig(32, 128, 128, 4, 4, True, 2, True)
    return _fit_shared_memory(gi, element_size), _fit_shared_memory(gw, element_size)


# Bytes of shared memory per program the table may plan for: H100/H200 allow 227 KB per block; the
# largest swept config (bf16 grad_W, 64 x 128 x 256, 3 stages) estimates 208 KB here, ncu: 213 KB.
SHARED_MEMORY_BUDGET = 220 * 1024


def _shared_bytes(cfg, element_size: int) -> int:
    """Pipelined loads (num_stages copies of both operand tiles), plus grad_weight's TMA store tile."""
    if isinstance(cfg, GradInputConfig):
        return cfg.num_stages * (cfg.block_m * cfg.block_n + cfg.block_n * cfg.block_k) * element_size
    store = cfg.block_n * cfg.block_k // cfg.store_slices if cfg.tma else 0
    return (cfg.num_stages * (cfg.block_m * cfg.block_n + cfg.block_m * cfg.block_k) + store) * element_size


def _fit_shared_memory(cfg, element_size: int):
    """``cfg`` with fewer stages (down to 2), then halved K tiles, until ``_shared_bytes`` fits."""
    while _shared_bytes(cfg, element_size) > SHARED_MEMORY_BUDGET:
        if cfg.num_stages > 2:
            cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
        elif cfg.block_k > 32:
            cfg = dataclasses.replace(cfg, block_k=cfg.block_k // 2)
        else:
            break
    return cfg


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """Host TMA descriptors need a 16-byte aligned base, unit last stride and 16-byte row strides."""
    if TensorDescriptor is None:
        return False
    for t in tensors:
        es = t.element_size()
        if t.dim() != 2 or t.stride(1) != 1 or (t.stride(0) * es) % 16 or t.data_ptr() % 16:
            return False
    return True


def _split(N: int, tiles: int, cfg: GradInputConfig, sms: int) -> tuple[int, int]:
    """(SPLIT, n_per_split): enough splits of the N reduction for ~programs_per_sm programs per SM,
    each split a whole number of BLOCK_N steps."""
    want = max(1, round(cfg.programs_per_sm * sms / tiles))
    steps = triton.cdiv(N, cfg.block_n)
    want = min(want, steps)
    n_per_split = triton.cdiv(steps, want) * cfg.block_n
    return triton.cdiv(N, n_per_split), n_per_split


def grad_input_partials(grads: list[torch.Tensor], weights: list[torch.Tensor],
                        cfg: GradInputConfig | None = None) -> torch.Tensor:
    """sum_i grads[i] @ weights[i] -> [M, K] in the grads' dtype.

    grads[i]: [M, N_i] (any strides), weights[i]: [N_i, K]. All the splits of all the products go
    to one fp32 workspace that one launch sums in a fixed order, so separate q/k/v projections
    accumulate their grad_input without an extra pass and without atomics.
    """
    M = grads[0].shape[0]
    K = weights[0].shape[1]
    dev, dtype = grads[0].device, grads[0].dtype
    cfg = cfg or gemm_configs(M, grads[0].element_size())[0]
    sms = sm_count(grads[0])
    m_tiles = triton.cdiv(M, cfg.block_m)
    k_tiles = triton.cdiv(K, cfg.block_k)
    plans = [_split(g.shape[1], m_tiles * k_tiles, cfg, sms) for g in grads]
    total = sum(s for s, _ in plans)
    out = torch.empty((M, K), device=dev, dtype=dtype)
    direct = total == 1
    part = out if direct else torch.empty((total, M, K), device=dev, dtype=torch.float32)
    part_strides = (0, K, 1) if direct else (M * K, K, 1)
    offset = 0
    for g, w, (split, n_per_split) in zip(grads, weights, plans):
        view = part if offset == 0 else part[offset:]
        if cfg.tma and _tma_ok(g, w):
            _grad_input_tma_kernel[(m_tiles * k_tiles, split)](
                TensorDescriptor.from_tensor(g, [cfg.block_m, cfg.block_n]),
                TensorDescriptor.from_tensor(w, [cfg.block_n, cfg.block_k]),
                view, *part_strides,
                M, K, n_per_split, m_tiles,
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                NUM_STAGES=cfg.num_stages, INTERPRETED=not g.is_cuda, PRECISION=_precision(dtype),
                num_warps=cfg.num_warps,
            )
        else:
            _grad_input_kernel[(m_tiles * k_tiles, split)](
                g, g.stride(0), g.stride(1), w, w.stride(0), w.stride(1),
                view, *part_strides,
                M, g.shape[1], K, n_per_split, m_tiles,
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                NUM_STAGES=cfg.num_stages, UPCAST=not g.is_cuda, PRECISION=_precision(dtype),
                num_warps=cfg.num_warps,
            )
        offset += split
    if not direct:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(M * K, block),)](part, out, total, M * K, BLOCK=block,
                                                           INTERPRETED=not out.is_cuda, num_warps=4)
    return out


def grad_weight(grad: torch.Tensor, x: torch.Tensor, cfg: GradWeightConfig | None = None) -> torch.Tensor:
    """grad.T @ x -> [N, K] for grad [M, N], x [M, K] (any strides)."""
    out = torch.empty((grad.shape[1], x.shape[1]), device=grad.device, dtype=grad.dtype)
    grad_weight_into(grad, x, out, cfg)
    return out


def grad_weight_into(grad: torch.Tensor, x: torch.Tensor, out: torch.Tensor,
                     cfg: GradWeightConfig | None = None) -> None:
    """``grad_weight`` into preallocated ``out`` [N, K] (for a launch on a side stream, whose
    outputs the caller allocates on its own stream)."""
    M, N = grad.shape
    K = x.shape[1]
    cfg = cfg or gemm_configs(M, grad.element_size())[1]
    k_tiles = triton.cdiv(K, cfg.block_k)
    if cfg.tma and _tma_ok(grad, x, out):
        total = triton.cdiv(N, cfg.block_n) * k_tiles
        programs = min(total, cfg.programs_per_sm * sm_count(grad))
        _grad_weight_tma_kernel[(programs,)](
            TensorDescriptor.from_tensor(grad, [cfg.block_m, cfg.block_n]),
            TensorDescriptor.from_tensor(x, [cfg.block_m, cfg.block_k]),
            TensorDescriptor.from_tensor(out, [cfg.block_n, cfg.block_k // cfg.store_slices]),
            M, N, K, programs,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            FLATTEN=cfg.flatten, WARP_SPECIALIZE=cfg.warp_specialize,
            STORE_SLICES=cfg.store_slices, INTERPRETED=not grad.is_cuda,
            PRECISION=_precision(grad.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        return
    _grad_weight_kernel[(triton.cdiv(N, cfg.block_n) * k_tiles,)](
        grad, grad.stride(0), grad.stride(1), x, x.stride(0), x.stride(1),
        out, out.stride(0), out.stride(1),
        M, N, K, k_tiles,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        NUM_STAGES=cfg.num_stages, UPCAST=not grad.is_cuda, PRECISION=_precision(grad.dtype),
        num_warps=cfg.num_warps,
    )


# ----------------------------------------------------------------------------------------------
# Routing
# ----------------------------------------------------------------------------------------------
STRATEGIES = ("auto", "torch", "streams", "triton")
AUTO_STRATEGY = "torch"  # what "auto" runs (module docstring: why)
TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_projection_args(fn: str, grads, hidden, weights) -> None:
    """2-D operands on one device in one dtype, grads[i] [M, N_i], weights[i] [N_i, K], hidden
    [M, K]; a ValueError names the first argument that does not fit."""
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2:
        raise ValueError(f"{fn}: hidden: expected a 2-D [M, K] tensor, got "
                         f"{tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__}")
    M, K = hidden.shape
    for i, (g, w) in enumerate(zip(grads, weights)):
        for name, t in ((f"grads[{i}]", g), (f"weights[{i}]", w)):
            if t.dim() != 2:
                raise ValueError(f"{fn}: {name}: expected a 2-D tensor, got shape {tuple(t.shape)}")
            if t.dtype != hidden.dtype or t.device != hidden.device:
                raise ValueError(f"{fn}: {name}: expected hidden's dtype {hidden.dtype} on {hidden.device}, "
                                 f"got {t.dtype} on {t.device}")
        if g.shape[0] != M:
            raise ValueError(f"{fn}: grads[{i}]: expected [M = {M}, N], got {tuple(g.shape)}")
        if tuple(w.shape) != (g.shape[1], K):
            raise ValueError(f"{fn}: weights[{i}]: expected [N = {g.shape[1]}, K = {K}], got {tuple(w.shape)}")


def qkv_projection_backward(
    grad_qkv: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    need_hidden_grad: bool = True,
    need_weight_grad: bool = True,
    need_bias_grad: bool = False,
    strategy: str = "auto",
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(grad_hidden [M, K], grad_weight [N, K], grad_bias [N]) of ``qkv = hidden @ W.T (+ b)``, None
    where not requested. grad_qkv [M, N] and hidden [M, K] any strides, weight [N, K].
    strategy: one of ``STRATEGIES`` (module docstring); "auto" is ``AUTO_STRATEGY``.
    (Argument errors name ``grads[0]`` for grad_qkv and ``weights[0]`` for weight.)"""
    gh, gws, gbs = separate_projections_backward([grad_qkv], hidden, [weight], need_hidden_grad, need_weight_grad,
                                                 need_bias_grad, strategy)
    return gh, gws[0], gbs[0]


def separate_projections_backward(
    grads: list[torch.Tensor],
    hidden: torch.Tensor,
    weights: list[torch.Tensor],
    need_hidden_grad: bool = True,
    need_weight_grad: bool = True,
    need_bias_grad: bool = False,
    strategy: str = "auto",
) -> tuple[torch.Tensor | None, list[torch.Tensor | None], list[torch.Tensor | None]]:
    """Separate projections ``y_i = hidden @ W_i.T``: grad_hidden = sum_i grads[i] @ W_i [M, K]
    (accumulated without an extra pass), and per projection grad_W_i = grads[i].T @ hidden
    [N_i, K] and grad_b_i = grads[i].sum(0) [N_i]. grads[i]: [M, N_i]; hidden: [M, K]."""
    if len(grads) != len(weights) or not grads:
        raise ValueError(f"separate_projections_backward: grads and weights: one weight per grad, at least one; "
                         f"got {len(grads)} and {len(weights)}")
    if strategy not in STRATEGIES:
        raise ValueError(f"separate_projections_backward: strategy: expected one of {STRATEGIES}, got {strategy!r}")
    _check_projection_args("separate_projections_backward", grads, hidden, weights)
    if strategy == "auto":
        strategy = AUTO_STRATEGY
    empty = min(hidden.shape[0], hidden.shape[1], *(g.shape[1] for g in grads)) == 0
    if strategy == "triton" and triton_applicable(hidden) and hidden.dtype in TRITON_DTYPES and not empty:
        return _triton_backward(grads, hidden, weights, need_hidden_grad, need_weight_grad, need_bias_grad)
    return _cublas_backward(grads, hidden, weights, need_hidden_grad, need_weight_grad, need_bias_grad,
                            two_streams=strategy == "streams")


def _triton_backward(grads, hidden, weights, need_hidden_grad, need_weight_grad, need_bias_grad):
    """The Triton kernels (non-empty operands in a dtype of ``TRITON_DTYPES``; others take cuBLAS)."""
    gi_cfg, gw_cfg = gemm_configs(hidden.shape[0], hidden.element_size())
    gh = grad_input_partials(grads, weights, gi_cfg) if need_hidden_grad else None
    # The bias sum stays in torch: a pointer-kernel variant that summed it alongside the MMA
    # returned a wrong grad_weight on the H200 with 64 x 128 x 256 tiles and 8 warps (Triton 3.6,
    # session 5), and it is one read of G.
    gws = [grad_weight(g, hidden, gw_cfg) if need_weight_grad else None for g in grads]
    gbs = [g.sum(0) if need_bias_grad else None for g in grads]
    return gh, gws, gbs


@functools.lru_cache(maxsize=None)
def _side_stream(device_index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=device_index)


def _cublas_backward(grads, hidden, weights, need_hidden_grad, need_weight_grad, need_bias_grad, two_streams):
    """cuBLAS: grad_hidden = grads[0] @ W_0, then ``addmm_`` per further projection (one rounding
    per add, as autograd accumulates); grad_W_i = grads[i].T @ hidden; grad_b_i = grads[i].sum(0).

    two_streams (CUDA only): the weight and bias gradients run on a side stream. Every output is
    allocated on the caller's stream before the fork and the caller's stream waits for the side
    stream before returning, so the caching allocator sees single-stream lifetimes and the
    fork/join is legal inside CUDA-graph capture.
    """
    M, K = hidden.shape
    dev, dtype = hidden.device, hidden.dtype
    gh = torch.empty((M, K), device=dev, dtype=dtype) if need_hidden_grad else None
    gws = [torch.empty((w.shape[0], K), device=dev, dtype=dtype) if need_weight_grad else None for w in weights]
    gbs = [torch.empty((w.shape[0],), device=dev, dtype=dtype) if need_bias_grad else None for w in weights]

    def weight_side():
        for g, gw, gb in zip(grads, gws, gbs):
            if gw is not None:
                torch.mm(g.t(), hidden, out=gw)
            if gb is not None:
                torch.sum(g, 0, out=gb)

    side = None
    if two_streams and hidden.is_cuda and need_hidden_grad and (need_weight_grad or need_bias_grad):
        main = torch.cuda.current_stream(dev)
        side = _side_stream(dev.index)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            weight_side()
    else:
        weight_side()
    if gh is not None:
        torch.mm(grads[0], weights[0], out=gh)
        for g, w in zip(grads[1:], weights[1:]):
            gh.addmm_(g, w)
    if side is not None:
        main.wait_stream(side)
    return gh, gws, gbs
