"""The Triton kernels compile for Hopper (sm_90) with Triton's real compiler, on a CPU-only machine.

The CPU tests run the kernels in Triton's interpreter, which accepts code the compiler rejects
(e.g. a variable whose shape differs between the branches of an ``if``: an H200 run once failed
that way after every CPU test had passed). Here ``tests/sm90_compile_check.py`` compiles each
launched variant to PTX and sm_90a machine code (Triton's bundled ptxas) and reports properties
that the H200 measurements rest on:

- no ``fma.rn.bf16`` under Triton's default options, FMA contraction on, as Inductor compiles
  user-defined kernels (a rounded product contracted with an add rounds once where eager rounds
  twice; the kernels add such products through ``rounding.round_sum``), checked against a control
  kernel that adds them plainly and must show such FMAs;
- no register spills; the forward kernel without shared-memory barriers (v5: cos/sin loaded in
  the head tiles' layout; compiled with device asserts, as Inductor compiles it, the one barrier
  that ends its cache-position assert) and within 80 registers (>= 6 resident 4-warp programs per SM).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@functools.lru_cache(maxsize=1)
def report() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, os.path.join(HERE, "sm90_compile_check.py")], capture_output=True,
                          text=True, env=env, timeout=600, cwd=HERE)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


VARIANTS = [
    "forward_bf16_d128", "forward_bf16_d128_from_positions", "forward_bf16_d128_norm_fp32_weight",
    "forward_bf16_d128_norm_fp32_one_plus_weight", "forward_bf16_d128_norm_no_weight", "forward_bf16_d128_rope_first",
    "forward_bf16_d128_norm_fp32_weight_f32_weights", "forward_bf16_d128_partial_rotary_64", "forward_bf16_d128_interleaved",
    "forward_bf16_d128_interleaved_rope_first",
    "forward_bf16_d128_autocast_fp32_outputs", "forward_bf16_d128_autocast_one_plus_weight",
    "backward_elementwise_bf16_d128",
    "backward_elementwise_bf16_d128_with_grads", "backward_finish_w1_cs1", "backward_finish_w1_cs0",
    "backward_finish_w0_cs1",
    # as Inductor's generated code defines them (the source of the kernel and its helpers)
    "forward_bf16_d128_as_inductor_emits_it", "forward_bf16_d128_from_positions_as_inductor_emits_it",
    "forward_bf16_d128_floats_as_constants",
    "forward_graph_bf16_d128", "forward_graph_bf16_d128_streaming", "forward_graph_bf16_d128_streaming_from_positions",
    "forward_graph_bf16_d512", "forward_graph_bf16_d512_streaming",
    "backward_elementwise_bf16_d128_with_grads_as_inductor_emits_it",
    "backward_rows_bf16_d128_with_grads_as_inductor_emits_it", "backward_finish_w1_cs1_as_inductor_emits_it",
    # the graph entries (every scalar a constexpr), as Inductor emits them
    "backward_graph_elementwise_bf16_d128_with_grads", "backward_graph_rows_bf16_d128_with_grads",
    "backward_graph_finish_w1_cs1",
    "backward_graph_elementwise_bf16_d128_with_grads_norm_first", "backward_graph_rows_bf16_d128_with_grads_norm_first",
    # the per-tensor training family: fp32 norm forms and autocast's fp32 operands
    "backward_graph_rows_one_tensor_norm_style1", "backward_graph_rows_one_tensor_norm_style2",
    "backward_graph_rows_one_tensor_autocast", "backward_graph_rows_one_tensor_partial_rotary",
    "backward_graph_elementwise_partial_rotary",
]


@pytest.mark.parametrize("variant", VARIANTS)
def test_compiles_without_bf16_fma_or_spills(variant):
    r = report()[variant]
    assert r["ok"], r.get("error")
    assert r["fma_bf16"] == 0, r
    # Partial rotary under contraction (how Inductor compiles user kernels): ptxas keeps one
    # 8-byte value on the stack (72 registers; none with contraction off, Triton 3.7, 2026-12-01).
    assert r["spill_bytes"] <= (8 if variant == "forward_bf16_d128_partial_rotary_64" else 0), r


def test_contraction_control_shows_the_fmas_round_sum_prevents():
    r = report()["control_rope_sum_without_round_sum"]
    assert r["ok"], r.get("error")
    assert r["fma_bf16"] > 0, r


@pytest.mark.parametrize("variant,assert_barriers", [("forward_bf16_d128", 0), ("forward_graph_bf16_d128", 1),
                                                     ("forward_graph_bf16_d128_streaming", 1)])
def test_forward_kernel_has_no_layout_conversion_barriers_and_few_registers(variant, assert_barriers):
    """No shared-memory layout conversion. Compiled as Inductor compiles it (device asserts on),
    the kernel has exactly one barrier: Triton ends a ``tl.device_assert`` with one, and the
    cache-position assert sits in the k/v programs only."""
    r = report()[variant]
    assert r["barriers"] == assert_barriers, r
    assert 0 < r["registers"] <= 80, r


def test_streaming_tile_issues_every_block_load_before_its_first_store():
    """The streaming tile's program loads its 4 blocks (two half tiles each) before it stores
    anything: a load cannot move above a store (the pointers may alias), so a loop that stores
    each block before loading the next keeps one block per program in flight. That costs
    registers, not more than 80 (6 resident 4-warp programs per SM), with or without cos/sin
    computed from positions."""
    for variant in ("forward_graph_bf16_d128_streaming", "forward_graph_bf16_d128_streaming_from_positions"):
        r = report()[variant]
        assert r["evict_first_loads_before_first_store"] == 8, r
        assert 0 < r["registers"] <= 80, r


@pytest.mark.parametrize("variant,default_build", [("forward_bf16_d128_interleaved", "forward_bf16_d128"),
                                                   ("forward_bf16_d128_interleaved_rope_first", "forward_bf16_d128"),
                                                   ("forward_graph_bf16_d128_streaming_interleaved",
                                                    "forward_graph_bf16_d128_streaming")])
def test_interleaved_rows_go_through_no_shared_memory(variant, default_build):
    """Interleaved pairs: the rows stay in their load layout (each pair's partner exchanged in a
    lane's registers) and the per-feature tables load straight into it, so the build has no
    more barriers than the default one. Earlier builds converted the rows (14 barriers, 1.10x
    the default build on the H200) or half tables doubled in registers (6, RoPE first 14: 1.05x
    and 1.18x); ``benchmarks/NOTES-forward.md``."""
    r, default = report()[variant], report()[default_build]
    assert r["ok"], r.get("error")
    assert r["barriers"] <= default["barriers"], (r, default)
    assert r["spill_bytes"] <= 8, r


@pytest.mark.parametrize("suffix", ["", "_rope_first", "_partial_rotary_64", "_rope_first_partial_rotary_64",
                                    "_one_plus_weight"])
def test_interleaved_streaming_builds_keep_five_programs_per_sm(suffix):
    """At most 96 registers a lane (five 4-warp programs per SM; the default streaming build takes
    80): a weight held in registers across the blocks' RoPE took 108-115 and ran the RoPE-first
    builds 5-8 % slower on the H200 (``benchmarks/NOTES-forward.md``, session 18)."""
    r = report()[f"forward_graph_bf16_d128_streaming_interleaved{suffix}"]
    assert r["ok"], r.get("error")
    assert 0 < r["registers"] <= 96 and r["spill_bytes"] == 0, r


@pytest.mark.parametrize("variant", ["forward_graph_bf16_d128_streaming_partial_rotary_64",
                                     "forward_graph_bf16_d128_streaming_partial_rotary_64_one_plus_weight",
                                     "forward_graph_bf16_d128_streaming_interleaved_partial_rotary_64",
                                     "forward_graph_bf16_d128_streaming_interleaved_rope_first_partial_rotary_64"])
def test_partial_rotary_selects_packed_pairs(variant):
    """Partial rotary picks each feature's RoPE or pass-through value on packed bf16 pairs
    (``rounding.select_rounded``): no per-element 16-bit select but the one that builds the mask in
    each program kind. A ``tl.where`` there compiled to 128 of them, unpacking and repacking every
    pair (+33 % instructions; 1.05-1.06x the default build on the H200, ``benchmarks/NOTES-forward.md``)."""
    r = report()[variant]
    assert r["ok"], r.get("error")
    assert r["half_selects"] <= 4, r
    # ptxas keeps one 4-byte value of the non-interleaved build on the stack (one store and one
    # load a lane, at 80 registers; Triton 3.7, 2026-12-03).
    assert 0 < r["registers"] <= 96 and r["spill_bytes"] <= 4, r


def test_interleaved_partial_norm_first_keeps_six_programs_per_sm():
    """Interleaved partial rotary with the norm first loads the weight rows per block: held across
    the blocks beside the select mask they took 89 registers (five 4-warp programs per SM instead of
    six) and ran 1.055-1.070x the default build on the H200, against 1.039-1.046x loaded per block
    (``benchmarks/NOTES-forward.md``, session 19)."""
    r = report()["forward_graph_bf16_d128_streaming_interleaved_partial_rotary_64"]
    assert r["ok"], r.get("error")
    assert 0 < r["registers"] <= 80 and r["spill_bytes"] == 0, r
