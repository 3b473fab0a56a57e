"""One Triton launch, described once: run now (eager callers), or put into the graph for Inductor.

unfused (what the package did before): a Python op per call, checking its arguments and
launching through its own launcher; Inductor's wrapper only called the op.

fused into Inductor::

    call = TritonCall(kernel, grid, kwargs, num_warps)   # built from (fake) tensors at trace time
    outputs = call.in_graph(written=["out_ptr", "cache_ptr"])
    # -> triton_kernel_wrapper_functional(kernel_idx, ..., kwargs, tensors_to_clone=written)

Inductor lowers that functional Triton HOP to a user-defined Triton kernel: its generated wrapper
launches the kernel itself (``_kernel_0.run(buf0, arg1_1, 128, ..., stream=stream0)``), no Python
op runs per call, and its re-inplacing pass drops the clones of written graph inputs (a cache is
updated in place). The grid and every int argument may be SymInts (dynamic shapes): they become
expressions of the graph's sizes. Tensors must reach the kernel with the strides read here:
tracing records the FakeTensors' strides on the node (``eager_input_vals``) and Inductor's
lowering requires exactly those strides, copying an input that it laid out otherwise.

The compile options Triton takes from a launch (``enable_fp_fusion``) do not reach a user-defined
kernel through Inductor, so kernels that must round as eager does cannot rely on them: see
``rounding.round_sum``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import torch
import triton
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table, triton_kernel_wrapper_functional


@functools.lru_cache(maxsize=None)
def _with_num_warps(kernel: triton.runtime.JITFunction, num_warps: int):
    """``kernel`` wrapped in a one-config autotuner: how Inductor learns a user kernel's
    ``num_warps`` (it reads them from the autotuner's configs; a one-config autotuner never
    benchmarks)."""
    return triton.autotune(configs=[triton.Config({}, num_warps=num_warps)], key=[])(kernel)


def side_table_index(kernel: triton.runtime.JITFunction, num_warps: int) -> int:
    """The ``kernel_idx`` of the functional Triton HOP that launches ``kernel`` with ``num_warps``."""
    return kernel_side_table.add_kernel(_with_num_warps(kernel, num_warps))


@dataclasses.dataclass(frozen=True)
class TritonCall:
    """A launch of ``kernel`` over ``grid`` with every argument named in ``kwargs``.

    Attributes:
        kernel: the ``@triton.jit`` function.
        grid: up to three program counts (ints or SymInts).
        kwargs: every parameter of ``kernel`` by name: tensors, ints (or SymInts), floats, bools
            and the constexprs.
        num_warps: warps per program.
    """

    kernel: Any
    grid: tuple
    kwargs: dict[str, Any]
    num_warps: int

    def run(self, device_asserts: bool = False) -> None:
        """Launch now (eager tensors; CUDA, or CPU under ``TRITON_INTERPRET=1``).

        ``device_asserts``: compile the kernel's ``tl.device_assert`` checks in, as Inductor
        compiles kernels by default (Triton's ``debug`` with ``assert_indirect_indexing``, and
        without Triton's integer-overflow checks, which ``debug`` would also turn on).
        """
        options = dict(debug=True, sanitize_overflow=False) if device_asserts else {}
        self.kernel[tuple(self.grid)](**self.kwargs, num_warps=self.num_warps, **options)

    def in_graph(self, written: Sequence[str]) -> dict[str, torch.Tensor]:
        """Record the launch as Inductor's functional Triton HOP (call while tracing a replacement).

        Args:
            written: names of the tensor arguments the kernel writes; their written versions are
                returned, keyed by name.
        """
        for name in written:
            if not isinstance(self.kwargs.get(name), torch.Tensor):
                raise ValueError(f"written: {name!r} is not a tensor argument of {self.kernel.__name__}")
        grid = tuple(self.grid) + (1,) * (3 - len(self.grid))
        return triton_kernel_wrapper_functional(
            kernel_idx=side_table_index(self.kernel, self.num_warps),
            constant_args_idx=kernel_side_table.add_constant_args({}),
            grid=[grid],
            tma_descriptor_metadata={},
            kwargs=dict(self.kwargs),
            tensors_to_clone=list(written),
        )


def named_args(kernel, *args: Any, **constexprs: Any) -> dict[str, Any]:
    """``kernel``'s positional ``args`` and keyword ``constexprs`` as one dict by parameter name.

    Raises ``ValueError`` when the arguments do not cover the kernel's parameters exactly.
    """
    names = list(kernel.arg_names)  # a JITFunction's, or the interpreter's InterpretedFunction's
    if len(args) + len(constexprs) != len(names):
        raise ValueError(f"{kernel.__name__}: expected {len(names)} arguments, got {len(args)} + {len(constexprs)}")
    kwargs = dict(zip(names, args))
    for name, value in constexprs.items():
        if name in kwargs or name not in names:
            raise ValueError(f"{kernel.__name__}: {name!r} is not a remaining parameter")
        kwargs[name] = value
    return kwargs
