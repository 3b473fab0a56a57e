"""Where the Triton kernels of this package run, and how many SMs they size their grids for.

CUDA, or the CPU under the Triton interpreter (``TRITON_INTERPRET=1``, the CI machines), where a
pretend SM count of 2 keeps the grids, and so the interpreter's time, small.
"""

from __future__ import annotations

import functools
import os

import torch

INTERPRETER_SMS = 2


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_applicable(t: torch.Tensor) -> bool:
    """True where the kernels can run on ``t``'s device: CUDA, or CPU under the interpreter."""
    return t.is_cuda or (t.device.type == "cpu" and interpreting())


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int | None) -> int:
    if device_index is None:
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(t: torch.Tensor) -> int:
    """SMs of ``t``'s CUDA device (``INTERPRETER_SMS`` on the CPU)."""
    return _sm_count(t.device.index if t.is_cuda else None)


#: Device types whose compiled graphs get the Triton kernels as graph nodes (``TritonCall.in_graph``),
#: launched by Inductor. CPU Inductor cannot launch Triton kernels: CPU graphs call the ops, which run
#: the PyTorch references (or the kernels under the interpreter). Tests add "cpu" to trace the
#: in-graph form on CPU tensors and run it eagerly under the interpreter.
IN_GRAPH_DEVICE_TYPES = ("cuda",)


def kernels_in_graph(t: torch.Tensor) -> bool:
    """True when a graph on ``t``'s device takes the Triton kernels as nodes (see ``IN_GRAPH_DEVICE_TYPES``)."""
    return t.device.type in IN_GRAPH_DEVICE_TYPES
