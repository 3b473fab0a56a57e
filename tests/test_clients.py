"""The pass under the clients that compile for the user: transformers' ``generate()`` with a static
cache (it compiles the forward by itself), ``Trainer(torch_compile=True)`` full fine-tuning, and the
Trainer over a peft LoRA model. Each must fuse and track eager. The clients compile with Inductor's
passes without code generation (``graph_backend``, by name), the way they would with Inductor.
"""

from __future__ import annotations

import copy

import pytest
import torch

import fusion_pass
from graph_backend import BACKEND_NAME

GEOMETRY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                num_hidden_layers=2, vocab_size=128, max_position_embeddings=64)


def _qwen3(dtype=torch.float32):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**GEOMETRY, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return model.to(dtype)


def test_generate_with_a_static_cache_fuses_and_gives_eager_tokens():
    from transformers import CompileConfig

    model = _qwen3(torch.bfloat16).eval()
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(1))
    greedy = dict(max_new_tokens=5, do_sample=False, cache_implementation="static", pad_token_id=0)
    eager = model.generate(ids, disable_compile=True, **greedy)
    fusion_pass.install(devices="cpu")
    compile_config = CompileConfig(backend=BACKEND_NAME, fullgraph=False)
    compile_config._compile_all_devices = True  # generate() compiles on accelerators only by default
    compiled = model.generate(ids, compile_config=compile_config, **greedy)
    assert fusion_pass.match_counts() == {"qk_norm_rope_cache": 2}, fusion_pass.report()  # the decode graph's layers
    assert torch.equal(compiled, eager)


def _dataset(n: int = 8):
    g = torch.Generator().manual_seed(2)
    return [{"input_ids": (ids := torch.randint(3, 128, (12,), generator=g)), "labels": ids.clone()} for _ in range(n)]


#: A backend name the Trainer accepts (it checks names against accelerate's list); the test points it
#: at ``graph_backend`` for the Trainer's own ``torch.compile`` call.
TRAINER_BACKEND = "aot_eager"


def _train(model, tmp_path, compile_it: bool) -> list[float]:
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, learning_rate=1e-3,
                             logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=0,
                             torch_compile=compile_it, torch_compile_backend=TRAINER_BACKEND if compile_it else None,
                             dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=_dataset())
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.parametrize("adapters", [False, True], ids=["full", "peft_lora"])
def test_trainer_with_torch_compile_fuses_and_tracks_eager(adapters, tmp_path, monkeypatch):
    """``Trainer(torch_compile=True)``: every q and k of every layer fused in the training graph, the
    logged losses of three AdamW steps as eager's. Over peft's LoRA the base model is frozen and the
    per-tensor family takes the regions (the projections carry the adapters)."""
    model = _qwen3()
    if adapters:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                           target_modules=["q_proj", "k_proj", "v_proj"]))
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1)
    reference = copy.deepcopy(model)
    eager = _train(reference, tmp_path / "eager", compile_it=False)
    from torch._dynamo.backends import registry

    registry.lookup_backend(TRAINER_BACKEND)  # loads the registry before the entry is replaced
    monkeypatch.setitem(registry._COMPILER_FNS, TRAINER_BACKEND, registry.lookup_backend(BACKEND_NAME))
    fusion_pass.install(devices="cpu")
    compiled = _train(model, tmp_path / "compiled", compile_it=True)
    counts = fusion_pass.match_counts()
    expected = {"qk_norm_rope_backward": 4} if adapters else {"qkv_rope_qk_norm": 2}
    assert counts == expected, fusion_pass.report()
    assert len(compiled) == len(eager) == 3
    assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(compiled, eager)), (compiled, eager)
