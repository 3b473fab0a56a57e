"""The benchmarks' own definitions, on CPU: the workloads they time and the tables they write.

A benchmark checks its numerics before it times anything, but only on a GPU. What a CPU can check
is here, cheaply: suite F's eager module (WORKLOADS.md F written out) against the op's reference and
its cache writes, suite B's eager backward (the "eager" and "stock compile" columns) against float64
autograd, and both suites' markdown on a result with every optional figure missing, the shape a
failed or partial GPU run leaves.
"""

from __future__ import annotations

import os
import pathlib
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import backward_report  # noqa: E402
import backward_workload  # noqa: E402
import forward_report  # noqa: E402
import forward_workload  # noqa: E402

from fusion_pass.kernels.qk_norm_rope_cache_reference import (  # noqa: E402
    qk_norm_rope_cache_reference,
    rms_norm_reference,
    rope_cos_sin_reference,
    rope_ulp_error,
)

TINY_B = backward_workload.Geometry(q_heads=4, kv_heads=2, head_dim=16, hidden=32)


def test_forward_module_is_the_reference_and_writes_only_its_rows(monkeypatch):
    """QKNormRopeCache (the eager column) equals the op's reference within 1 bf16 ulp of the RoPE
    terms, writes k_out / value into the rows at cache_position and leaves the others as filled."""
    for name, value in dict(DEVICE="cpu", Q_HEADS=4, KV_HEADS=2, CACHE_LEN=16).items():
        monkeypatch.setattr(forward_workload, name, value)
    seq, cached, batch = 3, 5, 2
    module = forward_workload.QKNormRopeCache(forward_workload.HEAD_DIM, forward_workload.EPS,
                                              forward_workload.ROPE_THETA, forward_workload.DTYPE, "cpu")
    x = forward_workload.make_inputs(seq, cached, batch)
    with torch.no_grad():
        q_out, k_out = module(x["query"], x["key"], x["value"], x["position_ids"], x["key_cache"],
                              x["value_cache"], x["cache_position"])
    forward_workload.check_caches(x, k_out, cached, seq)
    cos, sin = rope_cos_sin_reference(x["position_ids"], module.inv_freq, 1.0, forward_workload.DTYPE)
    qw, kw, eps = module.q_norm_weight.detach(), module.k_norm_weight.detach(), forward_workload.EPS
    dummy = torch.empty(batch, 2, 1, forward_workload.HEAD_DIM, dtype=forward_workload.DTYPE)
    skip = torch.full_like(x["cache_position"], -1)  # the reference's cache writes all skipped
    q_ref, k_ref = qk_norm_rope_cache_reference(x["query"], x["key"], x["value"], qw, kw, cos, sin, dummy,
                                                dummy.clone(), skip, eps, eps)
    assert rope_ulp_error(q_out, q_ref, rms_norm_reference(x["query"], qw, eps), cos, sin) <= 1.0
    assert rope_ulp_error(k_out, k_ref, rms_norm_reference(x["key"], kw, eps), cos, sin) <= 1.0
    assert forward_workload.ulp_error(q_out, k_out, x, module, cos, sin) <= 1.0


def test_forward_bytes_match_the_anchors_convention():
    """59408 bytes for S = 1, B = 1: WORKLOADS.md F's ``bytes`` field."""
    assert forward_workload.case_bytes(1, 1) == 59408


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_backward_eager_is_autograd(dtype, bound):
    """eager_backward from the workload's inputs (pre-norm values, rstd) gives autograd's gradients of
    the forward: the float64 reference ``reference64`` differentiates with torch.autograd."""
    t = backward_workload.make_inputs(5, 2, "cpu", TINY_B, dtype=dtype)
    err, errs = backward_workload.rel_err(backward_workload.eager_backward(*backward_workload.workload_args(t)),
                                          backward_workload.reference64(t))
    assert err <= bound, errs


def test_backward_bytes_count_every_tensor_once():
    g = TINY_B
    M, D = 10, g.head_dim
    expected = (M * g.qkv + M * (g.q_heads + g.kv_heads) * (D + 1) + 2 * M * D  # grads in, q/k, rstd, cos/sin
                + g.qkv * g.hidden + 2 * D + M * g.hidden                       # W, norm weights, hidden
                + M * g.hidden + g.qkv * g.hidden + 2 * M * D + 2 * D) * 2      # the gradients out
    assert backward_workload.bytes_moved(5, 2, g) == expected


def test_backward_sol_score():
    import bench_backward

    assert bench_backward.sol_score(10.0, 10.0, 10.0) is None  # stock at the floor: no score
    assert bench_backward.sol_score(10.0, 30.0, 10.0) == 1.0
    assert bench_backward.sol_score(30.0, 30.0, 10.0) == 0.5
    assert bench_backward.sol_score(None, 30.0, 10.0) is None


def test_reports_of_a_partial_run(tmp_path: pathlib.Path):
    """A run whose optional figures all failed still writes both suites' tables."""
    header = dict(gpu="GPU", date="2026-12-07", torch="t", triton="x", copy_TBps=3.0)
    f_case = dict(S=1, C=0, B=1, floor_us=1.0, errors={"fusion_pass": "RuntimeError: boom"})
    forward = forward_report.markdown(dict(header, cases=[f_case], means=forward_report.suite_means([f_case])))
    assert "| 1 | 0 | 1 | 1.00 |" in forward and "RuntimeError: boom" in forward
    b_case = dict(S=5, B=2, M=10, floor_us=1.0, gemms_us=2.0, fusion_pass_us=2.2, rel_err=1e-3)
    backward_report.write_markdown(tmp_path / "b.md", dict(header, mm_TFLOPs=500.0, cases=[b_case],
                                                          means=dict(floor_us=1.0, gemms_us=2.0, fusion_pass_us=2.2)))
    table = (tmp_path / "b.md").read_text()
    assert "| 5 | 2 | 10 | 1.0 | 2.0 | - |" in table and "| 1.100 |" in table
