"""Decode steps of a Hugging Face Qwen3 under CUDA graphs, compiled with or without the pass.

    python tests/cudagraph_decode_check.py [--stock]

Run in its own process by ``test_qk_norm_rope_cache_model.py::test_gpu_hf_qwen3_decode_under_cuda_graphs``
(an Inductor crash under CUDA graphs is a segfault, which would end a pytest session). The
recipe is a server's, and the one ``benchmarks/bench_end_to_end.py`` times on the H200: a
2-layer Qwen3 at Qwen3-8B attention geometry, a StaticCache allocated eagerly (static
addresses, outside any compiled region), the prompt prefilled eagerly, then decode steps of
one token compiled with ``mode="reduce-overhead"`` options and ``dynamic=False``, a
``cudagraph_mark_step_begin()`` before every step. The same steps run eagerly on a copy of the
cache as the reference (same tokens: teacher forcing). Prints one JSON line: the fusions
counted, CUDA-graph skips, the largest logit difference from eager and eager's own scale, and
whether the written cache rows match eager's within bf16 rounding and the rest is untouched.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import torch

# The benchmark's StaticCache helpers: this check replays its decode recipe. bench_end_to_end is
# imported first: it sets its environment (fresh kernel caches; the interpreter without CUDA)
# before Triton is imported.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench_end_to_end  # noqa: E402,F401
from end_to_end_models import cache_kwarg_name, new_static_cache, set_cache_length  # noqa: E402

import fusion_pass  # noqa: E402

BATCH, CONTEXT, STEPS = 8, 256, 3


def decode(forward, cache, tokens: torch.Tensor, graphs: bool, cache_name: str) -> list[torch.Tensor]:
    """Decode ``tokens`` [B, STEPS] one at a time from position CONTEXT; the logits of each step."""
    logits = []
    with torch.no_grad():
        for step in range(tokens.shape[1]):
            position = torch.tensor([CONTEXT + step], device="cuda")
            set_cache_length(cache, CONTEXT + step)
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()
            out = forward(input_ids=tokens[:, step: step + 1], cache_position=position,
                          position_ids=position[None].expand(tokens.shape[0], -1), use_cache=True,
                          **{cache_name: cache})
            logits.append(out.logits.float().clone())
    return logits


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stock", action="store_true", help="compile without the pass (the control)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("cudagraph_decode_check.py needs CUDA", file=sys.stderr)
        return 2
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=32000, hidden_size=4096, intermediate_size=16384, num_hidden_layers=2,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=512)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16).cuda().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # neutral weights would hide a weight applied twice or not at all
                p.copy_(1 + 0.1 * torch.randn_like(p))
    cache = new_static_cache(config, CONTEXT + 16, BATCH, "cuda", torch.bfloat16)
    prompt = torch.randint(0, config.vocab_size, (BATCH, CONTEXT), device="cuda")
    tokens = torch.randint(0, config.vocab_size, (BATCH, STEPS), device="cuda")
    cache_name = cache_kwarg_name(model)
    with torch.no_grad():
        position = torch.arange(CONTEXT, device="cuda")
        model(input_ids=prompt, cache_position=position, position_ids=position[None].expand(BATCH, -1),
              use_cache=True, **{cache_name: cache})
    ref_cache = copy.deepcopy(cache)
    ref_logits = decode(model, ref_cache, tokens, False, cache_name)

    # A warm FX graph cache would load the compiled decode graph without running the pass.
    torch._inductor.config.force_disable_caches = True
    print("eager reference done; compiling", flush=True)
    options = {} if args.stock else dict(fusion_pass.options(devices=("cuda",)))
    options.update(torch._inductor.list_mode_options("reduce-overhead"))
    compiled = torch.compile(model, dynamic=False, options=options)
    skips_before = int(torch._dynamo.utils.counters["inductor"].get("cudagraph_skips", 0))
    decode(compiled, cache, tokens, True, cache_name)  # warm-up and recording
    logits = decode(compiled, cache, tokens, True, cache_name)  # replays, rewriting the same rows
    torch.cuda.synchronize()

    written = slice(CONTEXT, CONTEXT + STEPS)
    rows_close, rest_untouched = True, True
    for layer, ref_layer in zip(cache.layers, ref_cache.layers):
        for got, want in ((layer.keys, ref_layer.keys), (layer.values, ref_layer.values)):
            rows_close &= bool(torch.allclose(got[:, :, written].float(), want[:, :, written].float(),
                                              rtol=2e-2, atol=6e-2))
            rest_untouched &= bool(torch.equal(got[:, :, :CONTEXT], want[:, :, :CONTEXT]))
            rest_untouched &= bool(torch.equal(got[:, :, CONTEXT + STEPS:], want[:, :, CONTEXT + STEPS:]))
    print(json.dumps(dict(
        variant="stock" if args.stock else "fusion_pass",
        fused=fusion_pass.match_counts().get("qk_norm_rope_cache", 0),
        cudagraph_skips=int(torch._dynamo.utils.counters["inductor"].get("cudagraph_skips", 0)) - skips_before,
        max_logit_err=max((a - b).abs().max().item() for a, b in zip(logits, ref_logits)),
        logit_scale=max(b.abs().max().item() for b in ref_logits),
        cache_rows_close=rows_close, cache_rest_untouched=rest_untouched,
    )))
    return 0


if __name__ == "__main__":
    sys.exit(main())
