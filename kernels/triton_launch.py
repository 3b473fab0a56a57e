"""Launch a ``@triton.jit`` kernel through its compiled handle once its specialization is known.

Why: ``kernel[grid](*args)`` re-derives the kernel's specialization from every argument on every
call (Triton's binder, its cache key, launch metadata) before the C launcher runs. On the H200's
host that costs 40 us for a launch with the elementwise backward kernel's 56 arguments, of which
the compiled handle's ``run`` is 14 us (``benchmarks/diagnose_launch_overhead.py``,
``results/2026-11-29-h200-launch-overhead.json``). At small B*S the backward is host-bound, so
that difference is time the GPU waits.

How it stays exact: Triton compiles one binary per specialization of the arguments: each int's
type and whether it equals 1 or is a multiple of 16, each tensor's dtype and whether its address
is a multiple of 16, the constexprs and the launch options. The cache here is keyed by the ints'
exact *values* (so every property Triton derives from them is fixed), each tensor's dtype and
address modulo 16, the constexprs and the options. A key seen for the first time launches through
``kernel[grid](...)`` (which compiles, or finds Triton's cached binary) and keeps the handle it
returns; later calls with that key call the handle's ``run``.

Every launch takes Triton's normal path under the interpreter (the CPU CI: no compiled handles),
on ROCm, with launch hooks installed (profilers that read launch metadata), with ``ENABLED``
False, or when Triton's handle has no ``run`` of the expected form (another Triton version).
What a cached launch skips besides the binder: Triton's check that the kernel's global
constants did not change since it compiled, its pre-run hooks, and later changes of the
``knobs.runtime`` debug / instrumentation / stage-inspection settings (they take effect for new
keys only). None of these are used by this package's kernels.
"""

from __future__ import annotations

import inspect
import operator

import torch
import triton
import triton.language

from .triton_device import interpreting

MAX_CACHED_LAUNCHES = 1024  # per kernel; distinct (shapes, strides, alignment) keys before a reset
ENABLED = True  # False: every launch takes Triton's normal path (debugging; A/B host timings)
# ROCm's backend also specializes tensors on their size (buffer ops under 2 GB), which the key
# does not hold: there every launch takes the normal path.
_NOT_CUDA = torch.version.hip is not None


_RUNTIME_KNOBS = getattr(getattr(triton, "knobs", None), "runtime", None)


def _hook_set(hook) -> bool:
    # Triton 3.4+ keeps launch hooks in a HookChain (never None; set when it holds calls); older
    # versions in a plain attribute that is None when unset.
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else hook is not None


def _launch_hooks_installed() -> bool:
    """A profiler (e.g. proton) reads launch metadata through these hooks: take the normal path."""
    runtime = _RUNTIME_KNOBS
    return runtime is not None and (_hook_set(getattr(runtime, "launch_enter_hook", None))
                                    or _hook_set(getattr(runtime, "launch_exit_hook", None)))


class CachedLauncher:
    """``launch(grid, args, constexprs, options)`` = ``kernel[grid](*args, **constexprs, **options)``.

    Args (of the constructor):
        kernel: a ``@triton.jit`` function whose tensor parameters are named ``*_ptr`` and whose
            constexpr parameters all follow the runtime ones (checked here, so a kernel that breaks
            the convention fails at import, not with wrong arguments at launch).
    """

    def __init__(self, kernel: triton.runtime.jit.JITFunction):
        # The Python signature, not Triton's parsed one: the interpreter's kernel object has none.
        params = list(inspect.signature(kernel.fn).parameters.values())
        constexpr = [_is_constexpr(p.annotation) for p in params]
        runtime = [p.name for p, c in zip(params, constexpr) if not c]
        self.constexpr_names = tuple(p.name for p, c in zip(params, constexpr) if c)
        if [p.name for p in params[: len(runtime)]] != runtime:
            raise ValueError(f"CachedLauncher: kernel {kernel.fn.__name__}: constexpr parameters must follow "
                             "the runtime ones")
        self.kernel = kernel
        self.arg_names = tuple(runtime)
        self.num_args = len(runtime)
        self.tensor_positions = tuple(i for i, name in enumerate(runtime) if name.endswith("_ptr"))
        scalar_positions = tuple(i for i, name in enumerate(runtime) if not name.endswith("_ptr"))
        self._tensors = _getter(self.tensor_positions)
        self._scalars = _getter(scalar_positions)
        self._handles: dict = {}
        self.fast_launches = 0  # launches that took the cached handle (tests check it moves)

    def key(self, device: int, args: tuple, constexpr_values: tuple, options: tuple) -> tuple:
        """What decides the binary (and its handle): the device, the scalars' values, each
        tensor's dtype and address mod 16, the constexprs and the options."""
        tensors = self._tensors(args)
        scalars = self._scalars(args)
        # Types too: 1, 1.0 and True are equal dict keys but three binaries (constexpr 1, fp32, u1).
        return (device, scalars, tuple(map(type, scalars)), tuple([(t.dtype, t.data_ptr() & 15) for t in tensors]),
                constexpr_values, options)

    def launch(self, grid: tuple[int, ...], args: tuple, constexprs: dict, options: dict) -> None:
        """``kernel[grid](*args, **constexprs, **options)`` on the current device and stream.

        Args:
            grid: 1 to 3 program counts.
            args: the runtime arguments in signature order (tensors at the ``*_ptr`` parameters).
            constexprs: every constexpr parameter by name.
            options: launch options (``num_warps``, compiler flags).
        """
        if len(args) != self.num_args:
            raise TypeError(f"{self.kernel.fn.__name__}: expected {self.num_args} runtime arguments, got {len(args)}")
        if not ENABLED or _NOT_CUDA or interpreting() or _launch_hooks_installed():
            self._check_types(args)
            self.kernel[grid](*args, **constexprs, **options)
            return
        device = torch.cuda.current_device()
        constexpr_values = tuple([constexprs[name] for name in self.constexpr_names])
        try:
            key = self.key(device, args, constexpr_values, tuple(options.items()))
        except AttributeError:  # a non-tensor at a *_ptr parameter: say which
            self._check_types(args)
            raise
        handle = self._handles.get(key)
        if handle is None:
            self._check_types(args)
            handle = self.kernel[grid](*args, **constexprs, **options)
            if callable(getattr(handle, "run", None)) and hasattr(handle, "function"):
                if len(self._handles) >= MAX_CACHED_LAUNCHES:
                    self._handles.clear()
                self._handles[key] = handle
            return
        self.fast_launches += 1
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        handle.run(grid[0], g1, g2, torch._C._cuda_getCurrentRawStream(device), handle.function,
                   handle.packed_metadata, None, None, None, *args, *constexpr_values)

    def _check_types(self, args: tuple) -> None:
        for i, a in enumerate(args):
            is_tensor = isinstance(a, torch.Tensor)
            if is_tensor != (i in self.tensor_positions) or isinstance(a, bool):
                name = self.arg_names[i]
                raise TypeError(f"{self.kernel.fn.__name__}: argument {name}: expected "
                                f"{'a tensor' if i in self.tensor_positions else 'an int or float'}, "
                                f"got {type(a).__name__}")


def _is_constexpr(annotation) -> bool:
    # ``x: tl.constexpr``, or the string "tl.constexpr" under ``from __future__ import annotations``.
    if isinstance(annotation, str):
        return annotation.split(".")[-1] == "constexpr"
    return annotation is triton.language.constexpr


def _getter(positions: tuple[int, ...]):
    """A callable returning ``tuple(args[i] for i in positions)`` (C speed: operator.itemgetter)."""
    if not positions:
        return lambda args: ()
    if len(positions) == 1:
        i = positions[0]
        return lambda args: (args[i],)
    return operator.itemgetter(*positions)
