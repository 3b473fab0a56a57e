"""What one rank runs in ``test_distributed.py``: tiny transformers models under FSDP2 or tensor
parallelism, compiled without and then with the pass, on the gloo backend (CPU).

``run_rank(rank, world, port, scenarios, out_dir)`` is the ``torch.multiprocessing.spawn`` target; it
runs each scenario in turn (one process start for all) and writes ``out_dir/<scenario>.rank<r>.json``
with what the test asserts on:

* ``fused``: ``fusion_pass.match_counts()`` of the compile with the pass (graphs compiled on this rank);
* ``ops``: fusion_pass op calls while the backward ran (training);
* ``collectives`` / ``collectives_unfused``: the ``_c10d_functional`` and ``c10d`` ops that ran, in
  order, in the same region (the backward; prefill + decode, run a second time: compiling under the
  logger's dispatch mode would not compile), with and without the pass (the pass must not add, drop
  or reorder one);
* ``max_grad_err`` (training) / ``max_logit_err`` and ``logit_scale`` (inference): against the same
  parallel run without the pass, this rank's local shards.

A scenario is ``<parallelism>:<model>``, the model ``qwen3`` (transformers' Qwen3) or ``hunyuan``
(HunYuanDenseV1: RoPE, then the norm), the parallelism one of:

* ``fsdp2_block`` / ``fsdp2_whole``: fp32, ``fully_shard`` per decoder layer and the model, then each
  layer compiled (``layer.compile``) or the whole model; one training step.
* ``tp``: fp32, ``parallelize_module`` with q/k/v and MLP up projections column-wise, o_proj and
  down_proj row-wise (each rank holds half of the heads), the model compiled; one training step.
* ``tp_infer``: the same plan on a bf16 model, a ``StaticCache`` (its layers sized from the rank's own
  key/value heads on first use), prefill then one decode step.
* ``fsdp2_tp``: 4 ranks, a 2 x 2 mesh: the ``tp`` plan on the "tp" dimension, then ``fully_shard`` per
  layer and the model on the "dp" one, the model compiled; one training step.
"""

from __future__ import annotations

import json
import os

import torch
import torch._functorch.config
import torch._inductor.config
import torch.distributed as dist

GEOMETRY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                num_hidden_layers=2, vocab_size=128, max_position_embeddings=256)


def _op_log():
    """An ``OpCounter`` that also keeps the collectives (``c10d`` and ``_c10d_functional`` ops) in the
    order they ran."""
    from qkv_rope_qk_norm_models import OpCounter

    class CollectiveLog(OpCounter):
        def __init__(self):
            super().__init__()
            self.collectives: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "c10d" in str(func):
                self.collectives.append(str(func))
            return super().__torch_dispatch__(func, types, args, kwargs)

    return CollectiveLog()


def _fusion_calls(counts: dict) -> dict:
    return {op: n for op, n in counts.items() if op.startswith("fusion_pass.")}


def _model(family: str, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import HunYuanDenseV1Config, HunYuanDenseV1ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)  # the same weights on every rank
    if family == "hunyuan":
        model = HunYuanDenseV1ForCausalLM(HunYuanDenseV1Config(**GEOMETRY, use_cache=False, attention_bias=False))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**GEOMETRY, use_cache=False))
    with torch.no_grad():  # neutral norm weights would hide a weight applied twice or not at all
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return model.to(dtype)


def _tensor_parallel(model: torch.nn.Module, mesh) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for layer in model.model.layers:
        parallelize_module(layer.self_attn, mesh, {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(),
                                                   "v_proj": ColwiseParallel(), "o_proj": RowwiseParallel()})
        parallelize_module(layer.mlp, mesh, {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(),
                                             "down_proj": RowwiseParallel()})


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _train_step(model, compile_model, ids):
    """One compiled forward, then the backward under ``_op_log``: (op counts, collectives in order)."""
    loss = compile_model(model)(input_ids=ids, labels=ids).loss
    with _op_log() as ops:
        loss.backward()
    return dict(ops.counts), ops.collectives


def _training(parallelism: str, family: str, mesh, rank: int) -> dict:
    import fusion_pass
    from qkv_rope_qk_norm_models import joint_pass_backend

    def build() -> torch.nn.Module:  # twice: FSDP2 modules cannot be deep-copied
        model = _model(family, torch.float32)
        if parallelism == "fsdp2_tp":
            _tensor_parallel(model, mesh["tp"])
        elif parallelism == "tp":
            _tensor_parallel(model, mesh)
        if parallelism.startswith("fsdp2"):
            from torch.distributed.fsdp import fully_shard

            data = mesh["dp"] if parallelism == "fsdp2_tp" else mesh
            for layer in model.model.layers:
                fully_shard(layer, mesh=data)
            fully_shard(model, mesh=data)
        return model

    def compile_model(m):
        if parallelism == "fsdp2_block":  # FSDP2's recipe: one compile per transformer block
            for layer in m.model.layers:
                layer.compile(backend=joint_pass_backend())
            return m
        return torch.compile(m, backend=joint_pass_backend())

    model, unfused = build(), build()
    # A batch per data-parallel rank; the ranks of a tensor-parallel group share theirs.
    data_rank = {"tp": 0, "fsdp2_tp": mesh["dp"].get_local_rank() if parallelism == "fsdp2_tp" else 0}.get(parallelism, rank)
    ids = torch.randint(0, GEOMETRY["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1 + data_rank))
    _, unfused_collectives = _train_step(unfused, compile_model, ids)
    torch._dynamo.reset()
    fusion_pass.install(devices="cpu")
    counts, collectives = _train_step(model, compile_model, ids)
    errors = []
    for (name, p), (_, q) in zip(model.named_parameters(), unfused.named_parameters()):
        got, want = _local(p.grad), _local(q.grad)
        errors.append(((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item())
    return dict(fused=fusion_pass.match_counts(), near_misses=len(fusion_pass.near_misses()), ops=_fusion_calls(counts),
                collectives=collectives, collectives_unfused=unfused_collectives, max_grad_err=max(errors))


def _inference(family: str, mesh) -> dict:
    from graph_backend import graph_only_backend
    from test_qk_norm_rope_cache_model import _prefill_and_decode

    import fusion_pass

    model = _model(family, torch.bfloat16).eval()
    model.config.use_cache = True
    _tensor_parallel(model, mesh)
    ids = torch.randint(0, GEOMETRY["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(3))

    def counted_run(forward):  # compiled by a first run: compiling under a dispatch mode would not compile
        _prefill_and_decode(forward, model.config, ids, 32, 1)
        with _op_log() as ops:
            logits, cache = _prefill_and_decode(forward, model.config, ids, 32, 1)
        return logits, cache, ops.collectives

    # Inductor's passes without its code generation (graph_backend): the fusion and the collectives
    # are the graph's; C++ code generation on every rank is what made this test the suite's slowest.
    ref_logits, ref_cache, unfused_collectives = counted_run(torch.compile(model, backend=graph_only_backend()))
    torch._dynamo.reset()
    fusion_pass.install(devices="cpu", families="qk_norm_rope_cache")
    logits, cache, collectives = counted_run(torch.compile(model, backend=graph_only_backend()))
    errors = [(a.float() - b.float()).abs().max().item() for a, b in zip(logits, ref_logits)]
    cache_errors = [(a.float() - b.float()).abs().max().item()
                    for layer, ref in zip(cache.layers, ref_cache.layers)
                    for a, b in ((layer.keys, ref.keys), (layer.values, ref.values))]
    return dict(fused=fusion_pass.match_counts(), near_misses=len(fusion_pass.near_misses()),
                collectives=collectives, collectives_unfused=unfused_collectives, max_logit_err=max(errors),
                logit_scale=max(t.float().abs().max().item() for t in ref_logits), max_cache_err=max(cache_errors),
                cache_kv_heads=cache.layers[0].keys.shape[1])


def run_rank(rank: int, world: int, rendezvous: str, scenarios: list[str], out_dir: str) -> None:
    """``rendezvous``: a file path no other group uses (``init_method="file://..."``: no port to race for)."""
    os.environ["TRITON_INTERPRET"] = "1"
    # As conftest.py does in the test process: a warm FX graph / AOT autograd cache would serve a
    # compiled graph without running the pass (its counts would read 0).
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        import fusion_pass
        from torch.distributed.device_mesh import init_device_mesh

        if world == 4:  # FSDP2 x TP
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        else:
            mesh = init_device_mesh("cpu", (world,))
        for scenario in scenarios:
            parallelism, family = scenario.split(":")
            fusion_pass.uninstall()  # the unfused run of each scenario comes first
            fusion_pass.reset_report()
            torch._dynamo.reset()
            result = (_inference(family, mesh) if parallelism == "tp_infer"
                      else _training(parallelism, family, mesh, rank))
            with open(os.path.join(out_dir, f"{scenario}.rank{rank}.json"), "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()
