"""Training step (LoRA fine-tuning by default) of transformers' Qwen3, GLM-4.5 or HunYuan at 8B attention geometry: eager vs stock
torch.compile vs torch.compile with the pass, in default mode and under CUDA graphs (``mode="reduce-overhead"``).

The model: ``Qwen3ForCausalLM``, hidden 4096, 32 query / 8 kv heads of 128, ``--layers`` layers
(default 2), bf16, base weights frozen, peft-style LoRA adapters (rank 16) on q/k/v trained with
AdamW. The projection family cannot fuse this (its weights are frozen); the per-tensor family
``qk_norm_rope_backward`` fuses q and k of every layer (2 per layer). ``--model glm45``: the same
geometry as ``Glm4MoeForCausalLM`` (GLM-4.5: ``use_qk_norm``, partial rotary on half of each head,
dense MLPs); ``--model hunyuan``: ``HunYuanDenseV1ForCausalLM`` (RoPE, then the per-head norm).
``--autocast``: the model in fp32, each step under ``torch.autocast("cuda", torch.bfloat16)`` (the Hugging
Face Trainer's ``bf16=True``). ``--train full``: every weight trained, no adapters (the projection family
``qkv_rope_qk_norm`` then fuses each layer's projection and backward, one count per layer).

Per variant: gradients of the first step against eager's (max over the trained parameters of
max|g - g_eager| / max|g_eager|), then the median of ``--steps`` timed steps (forward + backward +
AdamW), then the two compiled variants of each mode timed again in alternating rounds (the ratio
quoted). Usage: ``python benchmarks/bench_training.py --out DIR [--model qwen3|glm45|hunyuan] [--train lora|full]
[--autocast] [--batch 2 --seq 2048]`` (the session 14 figures were taken under its former name, bench_training_lora.py).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time

import torch
from torch import nn
from transformers import Qwen3Config, Qwen3ForCausalLM

import fusion_pass
from bench_common import result_header
from training_step import make_train_step

FAMILY = "qk_norm_rope_backward"

# Every variant compiles afresh: a warm FX graph / AOT autograd cache would serve a graph without
# running the pass (its counts then read 0).
torch._inductor.config.fx_graph_cache = False
torch._functorch.config.enable_autograd_cache = False


class LoRALinear(nn.Module):
    """peft's LoRA ``Linear`` forward: frozen base + ``lora_B(lora_A(dropout(x))) * scaling``."""

    def __init__(self, base: nn.Linear, rank: int = 16):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, device=base.weight.device, dtype=base.weight.dtype)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, device=base.weight.device,
                                dtype=base.weight.dtype)
        nn.init.normal_(self.lora_B.weight, std=0.02)
        self.dropout = nn.Identity()
        self.scaling = 2.0

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(self.dropout(x))) * self.scaling


def build(layers: int, family: str = "qwen3", dtype: torch.dtype = torch.bfloat16, lora: bool = True) -> nn.Module:
    torch.manual_seed(0)
    geometry = dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=128, num_hidden_layers=layers, vocab_size=32000, max_position_embeddings=8192,
                    use_cache=False)
    if family == "glm45":
        from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

        model = Glm4MoeForCausalLM(Glm4MoeConfig(**geometry, partial_rotary_factor=0.5, use_qk_norm=True,
                                                 first_k_dense_replace=layers))
    elif family == "hunyuan":
        from transformers import HunYuanDenseV1Config, HunYuanDenseV1ForCausalLM

        model = HunYuanDenseV1ForCausalLM(HunYuanDenseV1Config(**geometry, attention_bias=False))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**geometry))
    model = model.to("cuda", dtype)
    if not lora:
        return model.train()
    model.requires_grad_(False)
    for layer in model.model.layers:
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(layer.self_attn, name, LoRALinear(getattr(layer.self_attn, name)))
        attention = layer.self_attn
        for norm in ((attention.query_layernorm, attention.key_layernorm) if family == "hunyuan"
                     else (attention.q_norm, attention.k_norm)):
            norm.weight.requires_grad_(True)
    return model.train()


def step_fn(fn, model, ids, autocast: bool):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    return make_train_step(fn, optimizer, ids, autocast)


def time_steps(step, n: int) -> list[float]:
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--model", choices=("qwen3", "glm45", "hunyuan"), default="qwen3")
    p.add_argument("--autocast", action="store_true")
    p.add_argument("--train", choices=("lora", "full"), default="lora")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_training.py times on a CUDA GPU; none here, nothing to do.")
        return
    base = build(args.layers, args.model, torch.float32 if args.autocast else torch.bfloat16, args.train == "lora")
    ids = torch.randint(0, 32000, (args.batch, args.seq), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    result = dict(**result_header("training"), layers=args.layers,
                  batch=args.batch, seq=args.seq, model=args.model, autocast=args.autocast, train=args.train,
                  variants={})
    reference_grads = None
    kept = {}
    for variant, mode in (("eager", None), ("stock", "default"), ("pass", "default"),
                          ("stock", "reduce-overhead"), ("pass", "reduce-overhead")):
        torch._dynamo.reset()
        fusion_pass.reset_report()
        fusion_pass.uninstall()
        model = copy.deepcopy(base)
        fn = model
        if variant != "eager":
            options = fusion_pass.options() if variant == "pass" else {}
            if mode == "reduce-overhead":  # what mode="reduce-overhead" sets (mode and options exclude each other)
                options = {**options, "triton.cudagraphs": True}
            fn = torch.compile(model, options=options or None)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.autocast):
            loss = fn(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {n: q.grad.detach().float().clone() for n, q in model.named_parameters() if q.grad is not None}
        entry = dict(mode=mode, loss=loss.item(), matches=fusion_pass.match_counts(),
                     near_misses=fusion_pass.report() if variant == "pass" else None)
        if reference_grads is None:
            reference_grads = grads
        else:
            entry["grad_rel_err_vs_eager"] = max(
                ((g - reference_grads[n]).abs().max() / reference_grads[n].abs().max().clamp_min(1e-30)).item()
                for n, g in grads.items())
        model.zero_grad(set_to_none=True)
        step = step_fn(fn, model, ids, args.autocast)
        for _ in range(3):
            step()
        times = time_steps(step, args.steps)
        entry["ms_median"] = statistics.median(times)
        entry["ms"] = times
        key = f"{variant}_{mode}" if mode else variant
        result["variants"][key] = entry
        print(key, {k: v for k, v in entry.items() if k != "ms"}, flush=True)
        if variant != "eager":
            kept[key] = step
    for mode in ("default", "reduce-overhead"):
        rounds = {"stock": [], "pass": []}
        for _ in range(6):
            for variant in ("stock", "pass"):
                rounds[variant].append(statistics.median(time_steps(kept[f"{variant}_{mode}"], 3)))
        result[f"interleaved_{mode}"] = dict(
            stock_ms=statistics.median(rounds["stock"]), pass_ms=statistics.median(rounds["pass"]),
            pass_over_stock=statistics.median(rounds["pass"]) / statistics.median(rounds["stock"]))
        print(mode, result[f"interleaved_{mode}"], flush=True)
    os.makedirs(args.out, exist_ok=True)
    name = f"training-{args.train}" + ("" if args.model == "qwen3" else f"-{args.model}") + (
        "-autocast" if args.autocast else "")
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
