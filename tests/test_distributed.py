"""The pass under FSDP2 and tensor parallelism, 2 ranks on the gloo backend (CPU), spawned processes.

Each scenario (``distributed_steps.py``) runs a tiny transformers model in parallel, compiled without
and then with the pass, on every rank. Per rank: every attention region fused (per-head norms need no
communication when heads are sharded), our ops called, the collectives the same calls as without the
pass, and gradients / logits as the same parallel run without the pass.
"""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch.multiprocessing as mp

from distributed_steps import run_rank

WORLD = 2
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(scenario: str, tmp_path) -> list[dict]:
    mp.spawn(run_rank, args=(WORLD, _free_port(), scenario, str(tmp_path)), nprocs=WORLD)
    results = []
    for rank in range(WORLD):
        with open(os.path.join(tmp_path, f"rank{rank}.json")) as f:
            results.append(json.load(f))
    return results


def test_fsdp2_per_block_compile_fuses_every_layer_on_every_rank(tmp_path):
    """FSDP2 (``fully_shard`` per decoder layer, each layer compiled): the projection family fuses
    each layer's graph (the weights are all-gathered before the layer runs, so the graph sees whole
    projections) and its backward runs for both layers; FSDP2's all-gathers and reduce-scatters are
    the same calls as without the pass; gradient shards as without it."""
    for result in _run("fsdp2_train", tmp_path):
        assert result["fused"] == {"qkv_rope_qk_norm": 2}, result
        assert result["ops"] == {"fusion_pass.qkv_rope_qk_norm_backward.default": 2}, result
        assert result["near_misses"] == 0
        assert result["collectives"] == result["collectives_unfused"], result
        assert result["max_grad_err"] < 1e-5, result


@pytest.mark.parametrize("family", ["qwen3", "hunyuan"])
def test_tensor_parallel_training_fuses_each_ranks_heads(family, tmp_path):
    """Column-wise q/k/v projections: each rank normalizes and rotates its own 2 query and 1 key/value
    heads; the per-tensor family fuses q and k of both layers on every rank, the functional collectives
    of the backward are the same calls as without the pass, gradient shards as without it."""
    for result in _run("tp_train" if family == "qwen3" else "hunyuan_tp_train", tmp_path):
        assert result["fused"] == {"qk_norm_rope_backward": 4}, result
        assert result["ops"] == {"fusion_pass.qk_norm_rope_backward.default": 4}, result
        assert result["near_misses"] == 0
        assert result["collectives"] == result["collectives_unfused"] and result["collectives"], result
        assert result["max_grad_err"] < 1e-5, result


def test_tensor_parallel_inference_writes_each_ranks_cache(tmp_path):
    """bf16 prefill then a decode step with a StaticCache holding the rank's key/value head: both
    layers fused in both graphs on every rank, logits and cache as the parallel run without the pass
    within stock compile's bf16 rounding."""
    for result in _run("tp_infer", tmp_path):
        assert result["fused"] == {"qk_norm_rope_cache": 4}, result
        assert result["cache_kv_heads"] == 1, result
        assert result["near_misses"] == 0
        assert result["collectives"] == result["collectives_unfused"] and result["collectives"], result
        assert result["max_logit_err"] <= 8 * 2.0 ** -8 * result["logit_scale"], result
        assert result["max_cache_err"] < 6e-2, result
