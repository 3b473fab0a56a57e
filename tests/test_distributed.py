"""The pass under FSDP2 and tensor parallelism, 2 ranks (4 for the 2-D mesh) on the gloo backend (CPU),
spawned processes.

Each scenario (``distributed_steps.py``) runs a tiny transformers model in parallel, compiled without
and then with the pass, on every rank. Per rank: every attention region fused (per-head norms need no
communication when heads are sharded), our ops called, the same collectives in the same order as
without the pass, and gradients / logits as the same parallel run without the pass.
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


SCENARIOS = ("fsdp2_block:qwen3", "fsdp2_whole:qwen3", "fsdp2_block:hunyuan", "tp:qwen3", "tp:hunyuan",
             "tp_infer:qwen3", "tp_infer:hunyuan")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[dict]]:
    """Every scenario, run by one spawn of ``WORLD`` ranks: {scenario: [rank results]}."""
    out_dir = str(tmp_path_factory.mktemp("distributed"))
    mp.spawn(run_rank, args=(WORLD, _free_port(), list(SCENARIOS), out_dir), nprocs=WORLD)
    out = {}
    for scenario in SCENARIOS:
        out[scenario] = []
        for rank in range(WORLD):
            with open(os.path.join(out_dir, f"{scenario}.rank{rank}.json")) as f:
                out[scenario].append(json.load(f))
    return out


@pytest.mark.parametrize("scenario", ["fsdp2_block:qwen3", "fsdp2_whole:qwen3", "fsdp2_block:hunyuan"])
def test_fsdp2_fuses_every_layer_on_every_rank(scenario, results):
    """FSDP2 (``fully_shard`` per decoder layer, then each layer compiled, or the whole model, whose
    graph breaks at FSDP2's hooks): the projection family fuses each layer's graph (the weights are
    all-gathered before the layer runs, so the graph sees whole projections) and its backward runs
    for both layers (a graph compiled once may serve both: 1 or 2 matches); FSDP2's all-gathers and
    reduce-scatters run in the same order as without the pass; gradient shards as without it."""
    for result in results[scenario]:
        assert result["fused"].keys() == {"qkv_rope_qk_norm"} and result["fused"]["qkv_rope_qk_norm"] in (1, 2), result
        assert result["ops"] == {"fusion_pass.qkv_rope_qk_norm_backward.default": 2}, result
        assert result["near_misses"] == 0
        assert result["collectives"] == result["collectives_unfused"] and result["collectives"], result
        assert result["max_grad_err"] < 1e-5, result


@pytest.mark.parametrize("scenario", ["tp:qwen3", "tp:hunyuan"])
def test_tensor_parallel_training_fuses_each_ranks_heads(scenario, results):
    """Column-wise q/k/v projections: each rank normalizes and rotates its own 2 query and 1 key/value
    heads; the per-tensor family fuses q and k of both layers on every rank, the functional collectives
    of the backward run in the same order as without the pass, gradient shards as without it."""
    for result in results[scenario]:
        assert result["fused"] == {"qk_norm_rope_backward": 4}, result
        assert result["ops"] == {"fusion_pass.qk_norm_rope_backward.default": 4}, result
        assert result["near_misses"] == 0
        assert result["collectives"] == result["collectives_unfused"] and result["collectives"], result
        assert result["max_grad_err"] < 1e-5, result


def test_fsdp2_with_tensor_parallelism_2d_fuses_each_ranks_heads(tmp_path):
    """A 2 x 2 mesh, 4 ranks: tensor parallelism inside FSDP2 (the 2-D combination). Each rank fuses q
    and k of its heads (the per-tensor family; one graph serves both layers: 2 matches, 4 calls), the
    same collectives in order as without the pass, gradient shards as without it."""
    mp.spawn(run_rank, args=(4, _free_port(), ["fsdp2_tp:qwen3"], str(tmp_path)), nprocs=4)
    for rank in range(4):
        with open(os.path.join(tmp_path, f"fsdp2_tp:qwen3.rank{rank}.json")) as f:
            result = json.load(f)
        assert result["fused"] == {"qk_norm_rope_backward": 2}, result
        assert result["ops"] == {"fusion_pass.qk_norm_rope_backward.default": 4}, result
        assert result["near_misses"] == 0
        assert result["collectives"] == result["collectives_unfused"] and result["collectives"], result
        assert result["max_grad_err"] < 1e-5, result


@pytest.mark.parametrize("scenario", ["tp_infer:qwen3", "tp_infer:hunyuan"])
def test_tensor_parallel_inference_writes_each_ranks_cache(scenario, results):
    """bf16 prefill then a decode step with a StaticCache holding the rank's key/value head (Qwen3's
    order, and HunYuan's RoPE then norm): both layers fused in both graphs on every rank, logits and
    cache as the parallel run without the pass within bf16 rounding, the same collectives in order."""
    for result in results[scenario]:
        assert result["fused"] == {"qk_norm_rope_cache": 4}, result
        assert result["cache_kv_heads"] == 1, result
        assert result["near_misses"] == 0
        assert result["collectives"] == result["collectives_unfused"] and result["collectives"], result
        assert result["max_logit_err"] <= 8 * 2.0 ** -8 * result["logit_scale"], result
        assert result["max_cache_err"] < 6e-2, result
