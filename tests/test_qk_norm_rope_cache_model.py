"""The forward fusion on whole models: Hugging Face Qwen3, HunYuanDenseV1 (RoPE before the norm),
Gemma3 (``1 + weight`` norm after the transpose) and Glm4Moe (GLM-4.5: partial rotary) with a StaticCache, in-place cache updates
in the generated code, and no extra recompilation."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import fusion_pass
from compile_capture import compile_forward, fused_count
from qwen3_style import Qwen3StylePrologue, make_inputs

BF16_EPS = 2.0**-8
HERE = os.path.dirname(os.path.abspath(__file__))


def test_generated_code_writes_the_caches_in_place():
    """A full copy of the cache is the classic silent failure: no cache-sized buffer may exist."""
    cache_len = 37  # an unusual size, so its shape cannot be confused with another buffer's
    model = Qwen3StylePrologue().to(torch.bfloat16)
    inputs = make_inputs(cache_len=cache_len)
    cache_shape = tuple(inputs[3].shape)
    compiled, _ = compile_forward(model, inductor=True)
    with torch.no_grad():
        _, codes = run_and_get_code(compiled, *inputs)
    code = "\n".join(codes)
    assert fused_count() == 1
    assert "torch.ops.fusion_pass.qk_norm_rope_cache.default(" in code
    allocations = [line for line in code.splitlines() if "empty_strided" in line or "empty(" in line]
    assert allocations, "no allocation found: the inspection no longer sees the wrapper code"
    assert not [line for line in allocations if str(cache_shape) in line], "a cache-sized buffer was allocated"
    assert "copy_(" not in code and "clone(" not in code


def _tiny_model(family: str):
    """A 2-layer bf16 Hugging Face model of ``family``: (config, model)."""
    import transformers

    geometry = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    if family == "qwen3":
        config = transformers.Qwen3Config(**geometry)
        model = transformers.Qwen3ForCausalLM(config)
    elif family == "glm4_moe":  # q_norm/k_norm (use_qk_norm), partial rotary (factor 0.5: 16 of 32 rotated)
        # head_dim 32: the op's partial rotary_dim is a multiple of 16. first_k_dense_replace=2:
        # both layers take the dense MLP (the attention prologue is the same in MoE layers).
        config = transformers.Glm4MoeConfig(**dict(geometry, head_dim=32), use_qk_norm=True, first_k_dense_replace=2)
        model = transformers.Glm4MoeForCausalLM(config)
    else:
        raise ValueError(f"family: expected qwen3 or glm4_moe, got {family!r}")
    model = model.to(torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # neutral weights would hide a weight applied twice or not at all
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    return config, model


def _prefill_and_decode(forward, config, input_ids, cache_len, decode_steps=2):
    return _prefill_and_decode_on(forward, config, input_ids, cache_len, decode_steps)


# Through the whole of Inductor's CPU code generation; every family with a per-head norm also runs through its
# passes in tests/test_model_families.py. GLM-4-MoE turns its q/k norm on (use_qk_norm), as its checkpoints do.
@pytest.mark.parametrize("family", ["qwen3", "glm4_moe"])
def test_hf_static_cache_prefill_then_decode(family):
    config, model = _tiny_model(family)
    batch, seq, cache_len, steps = 2, 7, 32, 2
    input_ids = torch.randint(0, config.vocab_size, (batch, seq))
    ref_logits, ref_cache = _prefill_and_decode(model, config, input_ids, cache_len, steps)

    torch._dynamo.reset()
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    stock_logits, _ = _prefill_and_decode(torch.compile(model), config, input_ids, cache_len, steps)
    stock_graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before

    torch._dynamo.reset()
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled, _ = compile_forward(model, inductor=True)
    logits, cache = _prefill_and_decode(compiled, config, input_ids, cache_len, steps)
    fused_graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before

    # 2 layers x (prefill graph + decode graph); the pass adds no recompilation.
    assert fused_count() == 2 * config.num_hidden_layers
    assert fused_graphs == stock_graphs
    # Logits: the fused region is bit-exact to eager (tests of the block); the rest of the
    # compiled model rounds like stock Inductor. Allow what stock compile itself differs by.
    for out, stock, ref in zip(logits, stock_logits, ref_logits):
        stock_err = (stock.float() - ref.float()).abs().max().item()
        err = (out.float() - ref.float()).abs().max().item()
        assert err <= max(2 * stock_err, 4 * BF16_EPS * ref.float().abs().max().item()), (err, stock_err)
    written = seq + steps
    for layer, ref_layer in zip(cache.layers, ref_cache.layers):
        for got, want in ((layer.keys, ref_layer.keys), (layer.values, ref_layer.values)):
            # Every row written, within bf16 rounding of the compiled projections...
            torch.testing.assert_close(got[:, :, :written], want[:, :, :written], rtol=2e-2, atol=6e-2)
            assert got[:, :, :written].abs().amin(dim=-1).gt(0).any()
            # ...and every row not written untouched.
            assert torch.equal(got[:, :, written:], want[:, :, written:])


def _gemma4_model():
    """A 2-layer bf16 Gemma4: a sliding layer (head_dim 64) and a full one at Gemma4's own 512, with its
    partial "proportional" rotary (512 x 0.25): (config, model, attention layers, of which with the prologue)."""
    import transformers

    config = transformers.Gemma4TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                           head_dim=64, global_head_dim=512,
                                           layer_types=["sliding_attention", "full_attention"], sliding_window=16)
    model, layers = transformers.Gemma4ForCausalLM(config), (2, 2)
    model = model.to(torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # away from the initial values, which could hide a weight applied twice
                p.add_(0.1 * torch.randn_like(p))
    return config, model, *layers


@pytest.mark.slow
def test_hf_gemma4_prefill_then_decode():
    """Gemma4 (RoPE before the transpose, a sliding layer and a full one) through the whole of Inductor's
    CPU code generation: every attention layer with the prologue fused in the prefill and the decode graph (Gemma4's full
    layer at its own head_dim 512), logits within bf16 rounding of eager (or of stock compile's drift),
    the cache rows written as eager writes them and no other row touched."""
    config, model, attention_layers, prologue_layers = _gemma4_model()
    batch, seq, cache_len, steps = 2, 7, 32, 1
    input_ids = torch.randint(0, config.vocab_size, (batch, seq))
    ref_logits, ref_cache = _prefill_and_decode(model, config, input_ids, cache_len, steps)
    torch._dynamo.reset()
    compiled, _ = compile_forward(model, inductor=True)
    logits, cache = _prefill_and_decode(compiled, config, input_ids, cache_len, steps)
    assert fused_count() == 2 * prologue_layers
    errors = [(out.float() - ref.float()).abs().max().item() for out, ref in zip(logits, ref_logits)]
    bounds = [8 * BF16_EPS * ref.float().abs().max().item() for ref in ref_logits]  # as the GPU test allows
    if any(err > bound for err, bound in zip(errors, bounds)):
        # Drift beyond that (Gemma4's 512-wide full layer, whose cache rows the pass writes closer to
        # eager's than stock compile does): within twice what stock compile drifts on this model, and
        # never past 4x the bound.
        torch._dynamo.reset()
        stock_logits, _ = _prefill_and_decode(torch.compile(model.forward), config, input_ids, cache_len, steps)
        stock = max((s.float() - r.float()).abs().max().item() for s, r in zip(stock_logits, ref_logits))
        assert all(err <= max(bound, min(2 * stock, 4 * bound)) for err, bound in zip(errors, bounds)), (errors, stock)
    written = seq + steps
    checked = 0
    for layer, ref_layer in zip(cache.layers, ref_cache.layers):
        if getattr(ref_layer, "keys", None) is None:  # a linear-attention layer's state
            continue
        checked += 1
        for got, want in ((layer.keys, ref_layer.keys), (layer.values, ref_layer.values)):
            torch.testing.assert_close(got[:, :, :written], want[:, :, :written], rtol=2e-2, atol=6e-2)
            assert torch.equal(got[:, :, written:], want[:, :, written:])
    assert checked == attention_layers


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_hf_qwen3_whole_pass():
    """On CUDA the default devices apply: the fused Triton kernel in prefill and decode graphs."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=256, hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, head_dim=128, max_position_embeddings=256,
    )
    model = Qwen3ForCausalLM(config).to(torch.bfloat16).cuda().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    batch, seq, cache_len, steps = 2, 33, 128, 3
    input_ids = torch.randint(0, config.vocab_size, (batch, seq), device="cuda")
    ref_logits, ref_cache = _prefill_and_decode_on(model, config, input_ids, cache_len, steps)
    torch._dynamo.reset()
    fusion_pass.install()  # default devices: CUDA only
    compiled = torch.compile(model)
    logits, cache = _prefill_and_decode_on(compiled, config, input_ids, cache_len, steps)
    assert fusion_pass.match_counts().get("qk_norm_rope_cache", 0) >= 2 * config.num_hidden_layers
    for out, ref in zip(logits, ref_logits):
        torch.testing.assert_close(out.float(), ref.float(), rtol=5e-2, atol=1e-1)
    written = seq + steps
    for layer, ref_layer in zip(cache.layers, ref_cache.layers):
        torch.testing.assert_close(layer.keys[:, :, :written], ref_layer.keys[:, :, :written], rtol=2e-2, atol=6e-2)
        assert torch.equal(layer.keys[:, :, written:], ref_layer.keys[:, :, written:])
        assert torch.equal(layer.values[:, :, written:], ref_layer.values[:, :, written:])


def _run_decode_check(*flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-X", "faulthandler", os.path.join(HERE, "cudagraph_decode_check.py"), *flags]
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=270, cwd=HERE)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"cudagraph_decode_check.py {' '.join(flags)} ran past 270 s:\n{(e.stderr or b'')[-2000:]!r}")


def _crashed_compiling(done: subprocess.CompletedProcess) -> bool:
    """Killed by a signal (a segfault: rc -11) after the eager reference, i.e. inside torch.compile."""
    return done.returncode < 0 and "compiling" in done.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_hf_qwen3_decode_under_cuda_graphs():
    """``mode="reduce-overhead"`` as a server runs it (tests/cudagraph_decode_check.py, in its own
    process): decode steps replayed as CUDA graphs, every layer fused, logits as close to eager
    as a bf16 compile gets, the cache rows written in place and nothing else touched.

    If the process is killed by a signal while compiling or replaying, the same check runs
    without the pass: torch 2.11's Inductor crashed under CUDA graphs on a tiny Qwen3 whose
    StaticCache was created inside the compiled prefill, with or without the pass
    (results/2026-11-29-h200-cudagraph-crash.log). A crash by the same signal in stock compile
    is an expected failure of Inductor; any other failure (an exception, a crash of ours only,
    wrong numbers) fails."""
    done = _run_decode_check()
    if done.returncode != 0:
        stock = _run_decode_check("--stock") if _crashed_compiling(done) else None
        if stock is not None and _crashed_compiling(stock) and stock.returncode == done.returncode:
            pytest.xfail(f"stock torch.compile dies the same way (signal {-stock.returncode}): an Inductor crash "
                         f"under CUDA graphs, not the pass's. Tail: {done.stderr[-1500:]}")
        pytest.fail(f"rc {done.returncode} with the pass{'' if stock is None else f', {stock.returncode} without'}:\n"
                    f"{done.stdout[-1000:]}\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["fused"] == 2, result  # both layers' decode graph
    assert result["cudagraph_skips"] == 0, result
    assert result["max_logit_err"] <= max(0.1, 8 * BF16_EPS * result["logit_scale"]), result
    assert result["cache_rows_close"] and result["cache_rest_untouched"], result


def _prefill_and_decode_on(forward, config, input_ids, cache_len, decode_steps):
    """``_prefill_and_decode`` with positions on the inputs' device."""
    from transformers import StaticCache

    batch, seq = input_ids.shape
    device = input_ids.device
    cache = StaticCache(config=config, max_cache_len=cache_len)
    logits = []
    with torch.no_grad():
        position = torch.arange(seq, device=device)
        out = forward(input_ids=input_ids, past_key_values=cache, cache_position=position,
                      position_ids=position[None].expand(batch, -1), use_cache=True)
        logits.append(out.logits.clone())
        token = out.logits[:, -1:].argmax(-1)
        for step in range(decode_steps):
            position = torch.tensor([seq + step], device=device)
            out = forward(input_ids=token, past_key_values=cache, cache_position=position,
                          position_ids=position[None].expand(batch, -1), use_cache=True)
            logits.append(out.logits.clone())
            token = out.logits[:, -1:].argmax(-1)
    return logits, cache


def test_hf_olmo2_full_width_norm_is_reported_not_fused():
    """transformers' Olmo2ForCausalLM normalizes q and k over the whole projection width before the
    head view: not the per-head norm the kernel computes. Left unfused, every q and k of both graphs
    (prefill, decode) reported with that reason, no fused op in either graph."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Olmo2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      eos_token_id=None, pad_token_id=None, bos_token_id=None)
    model = transformers.Olmo2ForCausalLM(config).to(torch.bfloat16).eval()
    compiled, capture = compile_forward(model)
    _prefill_and_decode(compiled, config, torch.randint(0, config.vocab_size, (2, 7)), 32, 1)
    assert fused_count() == 0
    reasons = {m.reason.split(":")[0]: n for m, n in fusion_pass.near_misses().items()}
    assert reasons == {"RMSNorm over the whole projection width, then heads -> RoPE (e.g. OLMo2)": 8}, reasons
    assert len(capture.after) == 2 and not any("fusion_pass" in graph for graph in capture.after)
