"""Every model family the pinned transformers ships compiles with the pass, forward and training.

The families are transformers' own (``model_families.families()``: its causal-LM auto mapping, plus
the text decoders of its image-text-to-text models), each a tiny random model. For each, in strict
mode (a fault of ours raises; ``family_sweep``): a bf16 StaticCache prefill and one decode step, and
an fp32 training step (``loss.backward()``). Asserted:

- no exception where eager and stock compile run (``STOCK_FAILS``: both we and stock fail; the test
  checks stock's failure, then xfails; ``NOT_BUILT``: the tiny model cannot run at all, checked);
- the fusions are exactly ``FUSED``'s (pass family -> count; one count per layer and graph for the
  inference family, per layer for the projection family, per tensor and layer for the per-tensor one);
  every other family gets none, and its graphs leave both hooks as they came, node for node: its
  compile is stock Inductor's;
- where something fused, every output, cache, loss and gradient is within
  max(2 x stock compile's error, ``TOLERANCE``) of eager (relative to the tensor's largest value).

On CPU the graphs go through Inductor's passes without code generation (``graph_backend``); on the H200
the families ``FUSED`` names run through the whole of Inductor with the Triton kernels (``-m gpu``).
``family_table()`` is the table in docs/fusions.md.
"""

from __future__ import annotations

import os

import pytest
import torch

from family_sweep import eager, quiet, stage, stock_failure
from model_families import ModelFamily, families

STAGES = ("inference", "training")
FORWARD, PROJECTION, PER_TENSOR = "qk_norm_rope_cache", "qkv_rope_qk_norm", "qk_norm_rope_backward"

#: family -> (inference fusions, training fusions); every family not named fuses nothing. Counts with one
#: layer of each kind the family has: the inference family once per attention layer in the prefill and
#: the decode graph, the projection family once per layer, the per-tensor family once per tensor (q, k).
FUSED: dict[str, tuple[dict[str, int], dict[str, int]]] = {
    "afmoe": ({FORWARD: 2}, {PER_TENSOR: 2}),  # RoPE in its sliding layers only
    "apertus": ({FORWARD: 2}, {PER_TENSOR: 2}),
    "apertus1p5_text": ({FORWARD: 2}, {PER_TENSOR: 2}),
    "beam": ({}, {PER_TENSOR: 2}),
    "doge": ({}, {PROJECTION: 1}),
    "dots1": ({FORWARD: 2}, {PROJECTION: 1}),
    "exaone4": ({FORWARD: 2}, {PER_TENSOR: 2}),
    "exaone_moe": ({FORWARD: 2}, {PER_TENSOR: 2}),
    "flint": ({FORWARD: 2}, {PROJECTION: 1}),
    "gemma3": ({FORWARD: 4}, {PER_TENSOR: 4}),
    "gemma3_text": ({FORWARD: 4}, {PER_TENSOR: 4}),
    "gemma3n_text": ({FORWARD: 4}, {PER_TENSOR: 4}),
    "gemma4": ({FORWARD: 4}, {PER_TENSOR: 4}),
    "gemma4_text": ({FORWARD: 4}, {PER_TENSOR: 4}),
    "gemma4_unified": ({FORWARD: 4}, {PER_TENSOR: 4}),
    "gemma4_unified_text": ({FORWARD: 4}, {PER_TENSOR: 4}),
    "hunyuan_v1_dense": ({FORWARD: 2}, {PROJECTION: 1}),
    "hunyuan_v1_moe": ({FORWARD: 2}, {PROJECTION: 1}),
    "hunyuan_vl_text": ({}, {PROJECTION: 1}),  # RoPE over 4 MRoPE axes, then the norm: training only
    "hy_v3": ({FORWARD: 4}, {PER_TENSOR: 4}),
    "kolibri1": ({FORWARD: 2}, {PER_TENSOR: 2}),
    "kolibri1_1": ({}, {PER_TENSOR: 2}),
    "laguna": ({FORWARD: 4}, {PER_TENSOR: 4}),
    "lara_mini": ({FORWARD: 2}, {PROJECTION: 1}),
    "lfm2": ({FORWARD: 2}, {PROJECTION: 1}),
    "lfm2_moe": ({FORWARD: 2}, {PROJECTION: 1}),
    "lfm3": ({}, {PER_TENSOR: 4}),
    "mellum": ({FORWARD: 2}, {PROJECTION: 1}),
    "minimax_m3_vl_text": ({FORWARD: 2}, {}),
    "molmo2_text": ({FORWARD: 2}, {PROJECTION: 1}),
    "moss_transcribe_diarize": ({}, {PROJECTION: 1}),
    "muse_glimmer_text": ({}, {PER_TENSOR: 1}),  # one of q, k (weight-free norms); why not both: not looked into
    "muse_spark_text": ({}, {PER_TENSOR: 1}),  # likewise
    "param2moe": ({FORWARD: 2}, {}),
    "qwen3": ({FORWARD: 2}, {PROJECTION: 1}),
    "qwen3_5": ({FORWARD: 2}, {PER_TENSOR: 2}),
    "qwen3_5_moe": ({FORWARD: 2}, {PER_TENSOR: 2}),
    "qwen3_5_moe_text": ({FORWARD: 2}, {PER_TENSOR: 2}),
    "qwen3_5_text": ({FORWARD: 2}, {PER_TENSOR: 2}),
    "qwen3_moe": ({FORWARD: 2}, {PROJECTION: 1}),
    "qwen3_next": ({FORWARD: 2}, {PER_TENSOR: 2}),
    "qwen3_vl_moe_text": ({FORWARD: 2}, {PROJECTION: 1}),
    "qwen3_vl_text": ({FORWARD: 2}, {PROJECTION: 1}),
    "qwen4_exp": ({FORWARD: 2}, {}),
    "qwen4_exp_text": ({FORWARD: 2}, {}),
    "sarvam_moe": ({FORWARD: 2}, {}),
}

#: (family, stage) -> the near-miss a family with per-head norms and RoPE gets where that stage fuses
#: nothing (reported by ``fusion_pass.report()``; the test checks it is).
NEAR_MISSES: dict[tuple[str, str], str] = {
    # the norm and RoPE are found, the cache write after them is not one the family takes (beam: its
    # sliding-window layers; lfm3, muse_glimmer_text: which write it is was not looked into)
    ("beam", "inference"): "without a matching K/V cache write",
    ("lfm3", "inference"): "without a matching K/V cache write",
    ("muse_glimmer_text", "inference"): "without a matching K/V cache write",
    # no static cache (``_can_compile_fullgraph`` is off): a forward without a cache has no write to fuse
    ("doge", "inference"): "without a matching K/V cache write",
    ("kolibri1_1", "inference"): "without a matching K/V cache write",
    ("moss_transcribe_diarize", "inference"): "without a matching K/V cache write",
    # two gradients flow into the region's backward (the normalized or rotated tensor has a second
    # reader; which one, per family, was not looked into): the per-tensor family leaves it to Inductor
    ("minimax_m3_vl_text", "training"): "could not be delimited (2 incoming gradients)",
    ("param2moe", "training"): "could not be delimited (2 incoming gradients)",
    ("sarvam_moe", "training"): "could not be delimited (2 incoming gradients)",
    ("qwen4_exp", "training"): "could not be delimited (2 incoming gradients)",
    ("qwen4_exp_text", "training"): "could not be delimited (2 incoming gradients)",
}

#: (family, stage) -> what stock compile (the same backend, no pass) raises too, where eager runs.
STOCK_FAILS: dict[tuple[str, str], str] = {}

#: (family, stage) -> (exception, message) eager raises on the tiny model: nothing to compile (checked).
NOT_BUILT: dict[tuple[str, str], tuple[type[BaseException], str]] = {
    **{(family, stage): failure for family, failure in {
        "gemma3n": (ImportError, ""),  # its vision tower is a timm model; timm is not a test dependency
        "gemma4_assistant": (Exception, "validate_architecture"),  # drafts for a main model: its config
        "gemma4_unified_assistant": (ValueError, "shared_kv_states cannot be None"),  # needs the main model's
        "idefics": (ValueError, "pixel_values"),  # needs an image
        "musicgen": (ValueError, "Multiple valid text configs"),
        "musicgen_melody": (ValueError, "Multiple valid text configs"),
        "pi0": (Exception, "parameters after TINY"),  # its action expert keeps its own sizes: 3B parameters
        "pi05": (Exception, "parameters after TINY"),
        "udop": (ValueError, "Bbox is required"),  # needs a layout
    }.items() for stage in STAGES},
    ("git", "training"): (ValueError, "Expected input batch_size"),  # its loss expects image tokens
    ("reformer", "inference"): (RuntimeError, "mixed dtype"),  # bf16: its LSH layers keep fp32
    ("xlnet", "inference"): (RuntimeError, "expected scalar type Float but found BFloat16"),
}

#: relative error against eager that always passes: bf16 inference, fp32 training
TOLERANCE = {"inference": 2.0 ** -6, "training": 1e-4}


def _id(family: ModelFamily) -> str:
    return family.model_type


def check_family(family: ModelFamily, stage_name: str, device: str = "cpu") -> None:
    training = stage_name == "training"
    expected = FUSED.get(family.model_type, ({}, {}))[training]
    with quiet():
        if (family.model_type, stage_name) in NOT_BUILT:
            error, text = NOT_BUILT[family.model_type, stage_name]
            with pytest.raises(error, match=text):
                eager(family, training, device)
            pytest.xfail(f"the tiny {family.model_type} does not run in eager ({error.__name__}: {text})")
        if (family.model_type, stage_name) in STOCK_FAILS:
            failure = stock_failure(family, training, device)
            assert failure is not None and STOCK_FAILS[family.model_type, stage_name] in str(failure), failure
            pytest.xfail(f"stock compile fails too: {failure}")
        result = stage(family, training, device, TOLERANCE[stage_name], compare=bool(expected))
    assert result.fusions == expected, result
    near_miss = NEAR_MISSES.get((family.model_type, stage_name))
    assert near_miss is None or any(near_miss in reason for reason in result.near_misses), result.near_misses
    if not expected:
        assert result.unchanged, "a family that fused nothing changed a graph"
        return
    over = {n: e for n, e in result.errors.items() if e > TOLERANCE[stage_name]}
    if over:  # then stock ran too: each is bounded by twice stock's own error
        over = {n: (e, result.stock_errors[n]) for n, e in over.items() if e > 2 * result.stock_errors[n]}
    assert not over, f"(ours, stock's) error against eager: {over}"


@pytest.mark.slow
@pytest.mark.parametrize("stage_name", STAGES)
@pytest.mark.parametrize("family", families(), ids=_id)
def test_family_compiles_with_the_pass(family, stage_name):
    check_family(family, stage_name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("stage_name", STAGES)
@pytest.mark.parametrize("family", [f for f in families() if f.model_type in FUSED], ids=_id)
def test_fused_family_on_cuda_with_the_kernels(family, stage_name):
    check_family(family, stage_name, "cuda")


def test_the_tables_name_installed_families_only():
    names = {f.model_type for f in families()}
    assert set(FUSED) <= names
    assert {f for f, _ in (*NOT_BUILT, *STOCK_FAILS, *NEAR_MISSES)} <= names


def family_table() -> str:
    """Markdown: every family, its class, what each stage gets."""

    def cell(model_type: str, stage_name: str) -> str:
        if (model_type, stage_name) in NOT_BUILT:
            return "not run: the tiny model fails in eager"
        if (model_type, stage_name) in STOCK_FAILS:
            return "stock compile fails too"
        fused = FUSED.get(model_type, ({}, {}))[stage_name == "training"]
        if fused:
            return ", ".join(f"`{k}` x{v}" for k, v in sorted(fused.items()))
        near_miss = NEAR_MISSES.get((model_type, stage_name))
        return f"near-miss: {near_miss}" if near_miss else "unchanged"

    lines = ["| family | class | inference (prefill + decode) | training step |", "|---|---|---|---|"]
    for f in families():
        lines.append(f"| {f.model_type} | `{f.class_name}` | {cell(f.model_type, 'inference')} | "
                     f"{cell(f.model_type, 'training')} |")
    return "\n".join(lines)


def test_the_doc_lists_every_family():
    doc = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "fusions.md")
    with open(doc) as f:
        assert family_table() in f.read(), "docs/fusions.md's family table is stale; regenerate it:\n" + family_table()
