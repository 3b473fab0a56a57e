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

import pytest
import torch.multiprocessing as mp

from distributed_steps import run_rank

pytestmark = pytest.mark.slow


def _spawn(world: int, scenarios: list[str], tmp_path) -> dict[str, list[dict]]:
    """Run ``scenarios`` on ``world`` spawned ranks (one process start for all): {scenario: [rank results]}.
    Each test spawns once (a module fixture would run once per xdist worker)."""
    mp.spawn(run_rank, args=(world, str(tmp_path / "rendezvous"), scenarios, str(tmp_path)), nprocs=world)
    out = {}
    for scenario in scenarios:
        out[scenario] = []
        for rank in range(world):
            with open(os.path.join(tmp_path, f"{scenario}.rank{rank}.json")) as f:
                out[scenario].append(json.load(f))
    return out


def _check_fsdp2(result: dict) -> None:
    """FSDP2 (``fully_shard`` per decoder layer, then each layer compiled, or the whole model, whose
    graph breaks at FSDP2's hooks): the projection family fuses each layer's graph (the weights are
    all-gathered before the layer runs, so the graph sees whole projections) and its backward runs
    for both layers (a graph compiled once may serve both: 1 or 2 matches); FSDP2's all-gathers and
    reduce-scatters run in the same order as without the pass; gradient shards as without it."""
    assert result["fused"].keys() == {"qkv_rope_qk_norm"} and result["fused"]["qkv_rope_qk_norm"] in (1, 2), result
    assert result["ops"] == {"fusion_pass.qkv_rope_qk_norm_backward.default": 2}, result
    assert result["near_misses"] == 0
    assert result["collectives"] == result["collectives_unfused"] and result["collectives"], result
    assert result["max_grad_err"] < 1e-5, result


def _check_tp_training(result: dict, matches: int) -> None:
    """Column-wise q/k/v projections: each rank normalizes and rotates its own 2 query and 1 key/value
    heads; the per-tensor family fuses q and k of both layers (4 calls; ``matches`` graphs' worth),
    the backward's collectives run in the same order as without the pass, gradient shards as without it."""
    assert result["fused"] == {"qk_norm_rope_backward": matches}, result
    assert result["ops"] == {"fusion_pass.qk_norm_rope_backward.default": 4}, result
    assert result["near_misses"] == 0
    assert result["collectives"] == result["collectives_unfused"] and result["collectives"], result
    assert result["max_grad_err"] < 1e-5, result


def _check_tp_inference(result: dict) -> None:
    """bf16 prefill then a decode step with a StaticCache holding the rank's key/value head: both layers
    fused in both graphs, logits and cache as the parallel run without the pass within bf16 rounding,
    the same collectives in order."""
    assert result["fused"] == {"qk_norm_rope_cache": 4}, result
    assert result["cache_kv_heads"] == 1, result
    assert result["near_misses"] == 0
    assert result["collectives"] == result["collectives_unfused"] and result["collectives"], result
    assert result["max_logit_err"] <= 8 * 2.0 ** -8 * result["logit_scale"], result
    assert result["max_cache_err"] < 6e-2, result


def test_fsdp2_and_tensor_parallelism_fuse_on_every_rank(tmp_path):
    """2 ranks: FSDP2 (per-block compile of HunYuanDenseV1, whole-model compile of Qwen3),
    tensor-parallel training (Qwen3) and tensor-parallel StaticCache inference (HunYuan: RoPE, then
    the norm), each checked per rank as its ``_check_*`` says. One model per parallelism, both orders
    in each stage: what sharding changes does not depend on the order, which the sweep
    (``test_model_families``) covers for both models in both stages."""
    results = _spawn(2, ["fsdp2_block:hunyuan", "fsdp2_whole:qwen3", "tp:qwen3", "tp_infer:hunyuan"], tmp_path)
    for scenario, per_rank in results.items():
        for result in per_rank:
            if scenario.startswith("fsdp2"):
                _check_fsdp2(result)
            elif scenario.startswith("tp_infer"):
                _check_tp_inference(result)
            else:
                _check_tp_training(result, matches=4)


def test_fsdp2_with_tensor_parallelism_2d_fuses_each_ranks_heads(tmp_path):
    """A 2 x 2 mesh, 4 ranks: tensor parallelism inside FSDP2 (the 2-D combination). Each rank fuses q
    and k of its heads as under tensor parallelism alone (one graph serves both layers: 2 matches)."""
    for result in _spawn(4, ["fsdp2_tp:qwen3"], tmp_path)["fsdp2_tp:qwen3"]:
        _check_tp_training(result, matches=2)
