"""Compile with the fusion passes and capture the post-grad graph before and after them.

The matching tests compile through ``graph_only_backend`` (its docstring says what it runs and
what it saves): they check what the pass did to the graph and the numbers it gives. Tests of what
Inductor makes of the fused op (its wrapper code, in-place cache writes, output strides, whole
models) pass ``inductor=True``.
"""

from __future__ import annotations

import torch

import fusion_pass
from fusion_pass.graph_text import CapturingPass
from graph_backend import graph_only_backend


def compile_forward(model, devices=("cpu",), families=("qk_norm_rope_cache",), inductor=False, **compile_kwargs):
    """``torch.compile(model)`` with the forward fusion, returning (compiled, capture): through
    ``graph_only_backend``, or through Inductor itself when ``inductor``."""
    options = fusion_pass.options(devices=devices, families=families)
    capture = CapturingPass(options["post_grad_custom_pre_pass"])
    options["post_grad_custom_pre_pass"] = capture
    if inductor:
        return torch.compile(model, options=options, **compile_kwargs), capture
    return torch.compile(model, backend=graph_only_backend(options), **compile_kwargs), capture


def fused_count() -> int:
    return fusion_pass.match_counts().get("qk_norm_rope_cache", 0)


def eager(model, inputs):
    """Eager outputs on clones of ``inputs`` (the caches are mutated): (outputs, cloned inputs)."""
    cloned = [t.clone() for t in inputs]
    with torch.no_grad():
        return model(*cloned), cloned


def run_fused(model, inputs, **compile_kwargs):
    """``compile_forward`` then one no_grad call: (outputs, the CapturingPass of its graphs)."""
    compiled, capture = compile_forward(model, **compile_kwargs)
    with torch.no_grad():
        return compiled(*inputs), capture


# Stock Inductor keeps bf16 intermediates in fp32 where eager rounds them (unfused graphs).
UNFUSED_TOL = dict(rtol=2e-2, atol=5e-2)


def assert_left_unfused(model, inputs: list):
    """Compile ``model`` with the forward fusion and check it was left alone: no match counted, no
    fused op in the graph, q and the K cache ([3] of ``inputs``) as eager's within stock
    Inductor's own tolerance. Returns the CapturingPass (for report or graph checks)."""
    (q_ref, _), ref_inputs = eager(model, inputs)
    (q_out, _), capture = run_fused(model, inputs)
    assert fused_count() == 0
    assert "fusion_pass.qk_norm_rope" not in capture.after[0]
    torch.testing.assert_close(q_out, q_ref, **UNFUSED_TOL)
    torch.testing.assert_close(inputs[3], ref_inputs[3], **UNFUSED_TOL)
    return capture


def fused_once_and_bit_exact(model, inputs: list) -> str:
    """Compiled with the pass: one fusion, q and both caches (inputs 3 and 4) bit-identical to
    eager's. Returns the fused op's call line."""
    (q_ref, _), ref_inputs = eager(model, inputs)
    (q_out, _), capture = run_fused(model, inputs)
    assert fused_count() == 1
    assert torch.equal(q_out, q_ref)
    assert torch.equal(inputs[3], ref_inputs[3]) and torch.equal(inputs[4], ref_inputs[4])
    return fused_call(capture.after[0])


def fused_call(graph_text: str) -> str:
    """The one fused-op call line of a normalized graph text (asserts there is exactly one)."""
    calls = [line for line in graph_text.splitlines() if "fusion_pass.qk_norm_rope" in line]
    assert len(calls) == 1, calls
    return calls[0]
