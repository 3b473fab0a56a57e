"""Every model family the installed transformers ships, as a tiny random model.

The families come from transformers' own auto mappings, not from a hand list: every causal-LM
model type (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``) and the text decoders of its image-text-to-text
models (``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES``' text configs that have a base model), which
is where MRoPE lives (Qwen2-VL, Qwen3-VL: positions with distinct t/h/w axes). A family's tiny
config is derived from its default config: every size transformers' configs name is set small
(``TINY``), ``layer_types`` keeps one layer of each kind, and token ids stay inside the vocabulary.
What a family needs beyond that is in ``OVERRIDES``, with its reason.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import torch

#: The sizes a tiny model gets, by the config attribute names transformers uses for them. Set only
#: where the family's default config has the attribute (and it is no derived property). head_dim 64
#: with 4 heads of a 256-wide model: every family's own derivation (hidden / heads) agrees, and a
#: quarter of it (partial rotary: Qwen3-Next, Qwen3.5) is 16, the forward kernel's granule.
TINY = {
    # the decoder
    "hidden_size": 256, "n_embd": 256, "d_model": 256, "dim": 256, "embed_dim": 256, "word_embed_proj_dim": 256,
    "intermediate_size": 256, "ffn_dim": 256, "n_inner": 256, "ffn_hidden_size": 256, "decoder_ffn_dim": 256,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4, "decoder_attention_heads": 4,
    "num_key_value_heads": 2, "num_kv_heads": 2, "n_kv_heads": 2, "multi_query_group_num": 2,
    "head_dim": 64, "kv_channels": 64, "attention_head_dim": 64, "rotary_dim": 32,
    # one layer of each kind the family has (``_layer_picks``): a second identical layer costs compile time only
    "num_hidden_layers": 1, "n_layer": 1, "num_layers": 1, "n_layers": 1, "decoder_layers": 1, "num_encoder_layers": 1,
    "num_decoder_layers": 1,
    "vocab_size": 128, "max_position_embeddings": 64, "n_positions": 64, "n_ctx": 64, "seq_length": 64,
    "sliding_window": 8, "attention_chunk_size": 8,
    # mixtures of experts
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4, "num_experts_per_tok": 2,
    "moe_k": 2, "moe_topk": 2, "top_k": 2, "moe_intermediate_size": 64, "expert_intermediate_size": 64,
    "shared_expert_intermediate_size": 64, "n_shared_experts": 1, "num_shared_experts": 1, "n_group": 1,
    "topk_group": 1, "first_k_dense_replace": 0,  # (the one layer is a mixture of experts)
    # multi-head latent attention (its RoPE is qk_rope_head_dim wide)
    "q_lora_rank": 64, "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 32,
    # linear attention and state-space layers
    "linear_num_value_heads": 2, "linear_num_key_heads": 2, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
    # (an SSM's heads tile its inner width: mamba_n_heads * mamba_d_head = mamba_expand * hidden_size, Mamba2's
    # num_heads * head_dim = expand * hidden_size)
    "state_size": 8, "ssm_state_size": 8, "mamba_d_state": 8, "mamba_n_heads": 8, "mamba_d_head": 64,
    "mamba_d_ssm": 512, "expand": 1,
    "mamba_head_dim": 32, "mamba_n_groups": 1, "n_groups": 1, "mamba_expand": 2, "mamba_d_conv": 4, "conv_kernel": 4,
    "time_step_rank": 8, "mamba_dt_rank": 8,
    # sparse-attention indexers (DeepSeek-V3.2 DSA, GLM-DSA, Qwen4-Exp QSA): top-k below the sequence length
    # (index_num_heads: Kolibri's indexer heads share key head 0, of num_attention_heads / num_key_value_heads)
    "index_n_heads": 4, "index_head_dim": 32, "index_topk": 4, "index_kpool": 2, "index_num_heads": 2,
    "indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 64, "indexer_budget": 8,
    "indexer_compress_ratio": 4,
    # per-layer inputs, AltUp, LAuReL and KV sharing (Gemma 3n, Gemma 4); 0 where the default has it off stays 0
    "vocab_size_per_layer_input": 128, "hidden_size_per_layer_input": 16, "altup_num_inputs": 2, "laurel_rank": 8,
    "num_kv_shared_layers": 0,
    # vision towers of multimodal models (text-only inputs never run them, but they are built)
    "image_size": 32, "patch_size": 8, "num_channels": 3,
    # adapters from a vision or audio tower into the decoder (Dots 3): both ends are hidden_size wide
    "adapter_in_dim": 256, "adapter_input_size": 256, "adapter_out_dim": 256,
    # sizes some families name their own way
    "first_dense_intermediate_size": 256, "shared_intermediate_size": 64, "dim_ff": 256, "unpadded_vocab_size": 128,
    "linear_head_dim": 32, "linear_num_heads": 4, "encoder_hash_byte_group_vocab": 128, "base_channels": 32,
    "num_embeddings": 128, "hidden_size_global": 256, "ext_pw_out_channel": 256, "depthwise_separable_out_channel": 256,
    "nemo_conv_channels": 256, "num_blocks": 2,
    # token ids inside the vocabulary
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1, "sep_token_id": 3,
    "cls_token_id": 1, "mask_token_id": 3, "image_token_id": 120, "image_token_index": 120, "video_token_id": 121,
    "audio_token_id": 122,
}

#: family -> config attributes (of its text config) beyond ``TINY``, each with why.
OVERRIDES: dict[str, dict] = {
    # hybrids whose default has no attention layer among the tiny ones: transformers' mask creation then fails
    # (`get_mask_sizes` can only be called on Attention layers); one Mamba layer, one attention layer
    "bamba": {"attn_layer_indices": [1], "num_hidden_layers": 2},  # the default has no attention layer at all
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"], "num_hidden_layers": 2},  # likewise
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "num_hidden_layers": 2},  # attention every 8th from 4
    "recurrent_gemma": {"block_types": ["recurrent", "attention"], "num_hidden_layers": 2},  # (rec., rec., attn.)
    # the shared transformer block is tied across hybrid layers: with one, its tie pattern matches nothing
    "zamba": {"layers_block_type": ["linear_attention", "hybrid", "hybrid"], "num_hidden_layers": 3},
    # defaults that build no model: layer_types None (LFM2-MoE's layers read it), rope_parameters {} (Cohere
    # Compass reads a rope per layer type), and ZAYA's validator takes one expert per token only
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1, "num_hidden_layers": 2},  # + MoE
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                                                   "mrope_section": [12, 10, 10]}}},
    "zaya": {"num_experts_per_tok": 1},
    # DBRX's attention reads attn_config.rope_theta, which DbrxAttentionConfig does not declare, and clamps by
    # clip_qkv, None by default (torch.clamp: At least one of 'min' or 'max' must not be None); its sub-configs are
    # no text config, so TINY does not reach them
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "kv_n_heads": 2, "clip_qkv": 8.0},
             "ffn_config": {"ffn_hidden_size": 256, "moe_num_experts": 4, "moe_top_k": 2}},
    # Dory runs n_input_layers, then n_recurrent_layers (the rest, looped), then n_output_layers (8 and 8 by
    # default: with 2 layers the recurrent section is -14 long); one of each
    "dory": {"num_hidden_layers": 3, "n_input_layers": 1, "n_output_layers": 1},
    # BLT's forward makes a DynamicCache from BltConfig, which has no num_hidden_layers (its layers are in
    # encoder/global/decoder sub-configs): AttributeError; it runs without a cache
    "blt": {"use_cache": False},
    # Reformer's LM head needs is_decoder; its axial position embeddings tile max_position_embeddings, and in
    # training the sequence must be exactly that long: 8 = 2 x 4, the tests' sequence
    "reformer": {"is_decoder": True, "axial_pos_shape": [2, 4], "max_position_embeddings": 8,
                 "local_attn_chunk_length": 8, "lsh_attn_chunk_length": 8},
    # RWKV's weight init spreads its time-mix ratios over layer_id / (num_hidden_layers - 1): one layer divides by 0
    "rwkv": {"num_hidden_layers": 2},
    # X-MOD picks a language adapter per input: lang_ids, or the default language
    "xmod": {"default_language": "en_XX"},
    # Chameleon's model maps image tokens through vocabulary_map, None by default
    "chameleon": {"vocabulary_map": {"<image>": 120}},
    # HunYuan-VL's rotary embedding has no default MRoPE sections (the checkpoint names them, 4 axes)
    "hunyuan_vl_text": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                            "mrope_section": [8, 8, 8, 8]}},
}


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """A model type and the class a tiny model of it is built from (``base``: a text decoder without
    an LM head, from a multimodal model)."""

    model_type: str
    class_name: str
    base: bool = False


@functools.lru_cache(maxsize=None)
def families() -> tuple[ModelFamily, ...]:
    """Every causal-LM model type of the installed transformers, then the text decoders of its
    image-text-to-text models that are no causal-LM type themselves."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
        MODEL_MAPPING_NAMES,
    )

    out = [ModelFamily(t, c) for t, c in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items())]
    seen = {f.model_type for f in out}
    for model_type in sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES):
        try:
            text_type = CONFIG_MAPPING[model_type]().get_text_config().model_type
        except Exception:  # noqa: BLE001 - a config that cannot be made by default has no text decoder to take
            continue
        if text_type not in seen and text_type in MODEL_MAPPING_NAMES and text_type in CONFIG_MAPPING:
            seen.add(text_type)
            out.append(ModelFamily(text_type, MODEL_MAPPING_NAMES[text_type], base=True))
    return tuple(out)


_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


def _settable(config, key: str) -> bool:
    """``config`` has ``key`` (or the attribute ``attribute_map`` aliases it to) and it is no derived property."""
    key = getattr(type(config), "attribute_map", {}).get(key, key)
    return hasattr(config, key) and not isinstance(getattr(type(config), key, None), property)


def _layer_picks(config, per_layer: dict, layers: int) -> list:
    """The default's layers a tiny model keeps, in order: few layers that between them have every value of every
    per-layer list (``layer_types``, ``mlp_layer_types``, ``activation_sparsity_pattern``, ...) and every distinct
    ``per_layer_config`` override, at least ``layers`` of them. Greedy: each next layer is the one with the most
    values not yet had (the earliest of those), so sliding/full attention and dense/sparse MLPs take two layers, not
    one of each combination."""
    count = len(next(iter(per_layer.values())))
    overrides = config._heterogeneity_spec.per_layer_overrides if getattr(config, "is_heterogeneous", False) else {}
    columns = [[repr(v) for v in values] for values in per_layer.values()]
    columns.append([repr(sorted(overrides.get(i, {}).items())) for i in range(count)])
    features = [{(c, column[i]) for c, column in enumerate(columns)} for i in range(count)]
    missing, picks = set().union(*features), []
    while missing:
        best = max(range(count), key=lambda i: (len(features[i] & missing), -i))
        picks.append(best)
        missing -= features[best]
    picks += [i for i in range(count) if i not in picks][:max(0, layers - len(picks))]
    return sorted(picks)


def _layer_indices(value: list) -> bool:
    """``value`` is a list of layer indices (not of per-layer 0/1 flags, as Llama 4's no_rope_layers)."""
    return bool(value) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value) \
        and not set(value) <= {0, 1}


def _class_default(config, key: str):
    """The default the config class declares for ``key`` (``dataclasses.MISSING`` where it declares none)."""
    field = next((f for f in dataclasses.fields(type(config)) if f.name == key), None) \
        if dataclasses.is_dataclass(config) else None
    return dataclasses.MISSING if field is None else field.default


def _scaled(tiny, default, value):
    """A per-layer ``value`` (the global default is ``default``, its tiny size ``tiny``) scaled like the global size."""
    if isinstance(value, int) and not isinstance(value, bool) and isinstance(tiny, int) \
            and isinstance(default, int) and default > 0:
        return max(1, round(tiny * value / default))
    return value


def _layer_overrides(config, values: dict, default: dict) -> dict:
    """A layer's ``per_layer_config`` overrides ``default`` with every size scaled like the global one (a layer
    with twice the default's head_dim keeps twice the tiny head_dim), and an MLA layer whose head_dim is its whole
    query/key head (Dots 3's sliding layers) keeping that."""
    layer = {k: _scaled(values.get(k), getattr(config, k, None), v) for k, v in default.items()}

    def was(k):
        return default.get(k, getattr(config, k, None))

    def tiny(k):
        return layer.get(k, values.get(k, getattr(config, k, None)))

    if was("qk_nope_head_dim") and was("qk_rope_head_dim") \
            and was("head_dim") == was("qk_nope_head_dim") + was("qk_rope_head_dim"):
        layer["head_dim"] = tiny("qk_nope_head_dim") + tiny("qk_rope_head_dim")
    return layer


def _mrope_default(config) -> list | None:
    """The MRoPE sections the family's rotary embedding falls back to when ``rope_parameters`` names none
    (Qwen2-VL: ``rope_parameters.get("mrope_section", [16, 24, 24])``, sized for its 128-wide heads)."""
    import importlib
    import json
    import re

    try:
        source = inspect.getsource(importlib.import_module(type(config).__module__.replace(".configuration_", ".modeling_")))
    except Exception:  # noqa: BLE001 - no modeling module, no default
        return None
    found = re.search(r'rope_parameters\.get\(\s*"mrope_section",\s*(\[[\d,\s]+\])', source)
    return json.loads(found.group(1)) if found else None


def _rope_parameters(rope: dict, rotary_dim: int, mrope_default: list | None = None) -> dict:
    """``rope`` with its MRoPE sections (t, h, w) scaled to ``rotary_dim`` (they sum to half of it); a rope
    per layer type (Gemma 3, Gemma 4: {layer type: rope}) has each of its ropes scaled."""
    if rope and all(isinstance(v, dict) for v in rope.values()):
        return {k: _rope_parameters(v, rotary_dim, mrope_default) for k, v in rope.items()}
    rope = dict(rope)
    section = rope.get("mrope_section") or mrope_default
    if section:
        half = int(rotary_dim * rope.get("partial_rotary_factor", 1.0)) // 2
        scaled = [max(1, round(s * half / sum(section))) for s in section]
        scaled[-1] += half - sum(scaled)
        rope["mrope_section"] = scaled
    return rope


def _tiny_values(config, family_type: str | None = None) -> dict:
    """The constructor arguments that make ``config`` (one config, text or vision) tiny."""
    if getattr(config, "is_heterogeneous", False):  # read the global values of per-layer attributes (Gemma 4)
        config.allow_global_per_layer_attribute_access = True
    # a size the default has at 0 is a feature it has off (Gemma 4's per-layer inputs): it stays off
    values = {k: v for k, v in TINY.items() if _settable(config, k) and getattr(config, k) != 0}
    # No dropout: a compiled step draws other masks than eager's, which would hide every comparison.
    values.update({k: 0.0 for k, v in config.to_dict().items() if ("dropout" in k or k.endswith("pdrop"))
                   and isinstance(v, float) and _settable(config, k)})
    if _settable(config, "qk_rope_head_dim") and _settable(config, "head_dim"):
        # MLA: head_dim is the RoPE part (DeepSeek) or the whole query/key head (Mistral 4, with a partial rotary
        # factor), as in the default
        whole = config.head_dim == config.qk_rope_head_dim + (getattr(config, "qk_nope_head_dim", None) or 0)
        values["head_dim"] = TINY["qk_rope_head_dim"] + (TINY["qk_nope_head_dim"] if whole and config.head_dim
                                                         != config.qk_rope_head_dim else 0)
    if _settable(config, "kv_lora_rank") and "num_key_value_heads" in values:
        values["num_key_value_heads"] = values.get("num_attention_heads", TINY["num_attention_heads"])  # MLA: no GQA
    if family_type is not None:
        values.update(OVERRIDES.get(family_type, {}))
    layers = next((values[k] for k in _LAYER_COUNTS if k in values), 2)
    count = next((getattr(config, k) for k in _LAYER_COUNTS if _settable(config, k)), None)
    lists = {k: list(v) for k in config.to_dict() if isinstance(v := getattr(config, k, None), (list, tuple))
             and count and k not in values and _settable(config, k)}
    # lists of layer indices (Llama 4's moe_layers, Kolibri's kv_source_layers, Zamba2's hybrid_layer_ids) that
    # the config derives when they are None: None, so that it derives them for the tiny layers
    derived = {k for k, v in lists.items() if _layer_indices(v) and _class_default(config, k) is None}
    values.update(dict.fromkeys(derived))
    per_layer = {k: v for k, v in lists.items() if len(v) == count and k not in derived}
    heterogeneous = getattr(config, "is_heterogeneous", False) and "per_layer_config" not in values
    if per_layer or heterogeneous:
        picks = _layer_picks(config, per_layer or {"": [None] * count}, layers)
        values.update({k: [v[i] for i in picks] for k, v in per_layer.items()})
        for key in _LAYER_COUNTS:
            if key in values:
                values[key] = len(picks)
        if heterogeneous:
            overrides = config._heterogeneity_spec.per_layer_overrides
            values["per_layer_config"] = {new: _layer_overrides(config, values, overrides[old])
                                          for new, old in enumerate(picks) if overrides.get(old)}
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and _settable(config, "rope_parameters") and "rope_parameters" not in values:
        head_dim = values.get("head_dim") or getattr(config, "head_dim", None) or TINY["head_dim"]
        values["rope_parameters"] = _rope_parameters(rope, head_dim * getattr(config, "partial_rotary_factor", 1.0)
                                                     if "partial_rotary_factor" not in rope else head_dim,
                                                     _mrope_default(config))
    return values


def tiny_config(family: ModelFamily):
    """The family's default config with ``TINY`` sizes (in every sub-config: text, vision, audio) and
    its ``OVERRIDES`` (in its text config)."""
    from transformers import PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[family.model_type]
    default = config_class()
    text = default.get_text_config()
    if text is default:
        values = _tiny_values(default, family.model_type)
        for key, sub in vars(default).items():  # its own sub-configs: GIT's vision tower, BLT's patcher, DBRX's FFN
            if isinstance(sub, PretrainedConfig) and key not in values:
                values[key] = {**sub.to_dict(), **_tiny_values(sub)}
        return config_class(**values)
    arguments = {}
    for key, sub in vars(default).items():
        if isinstance(sub, PretrainedConfig):
            arguments[key] = {**sub.to_dict(), **_tiny_values(sub, family.model_type if sub is text else None)}
    arguments.update({k: v for k, v in TINY.items() if k.endswith("_token_id") and _settable(default, k)})
    return config_class(**arguments)


def build(family: ModelFamily, dtype: torch.dtype = torch.float32):
    """A tiny random model of ``family`` (seeded), in ``dtype``."""
    import transformers

    torch.manual_seed(0)
    config = tiny_config(family)
    model_class = getattr(transformers, family.class_name)
    if family.base or not isinstance(config, model_class.config_class):
        config = config.get_text_config()  # a causal LM over a composite config's text part (Qwen3.5)
    with torch.device("meta"):  # count first: a size TINY missed can make a default-sized model
        parameters = sum(p.numel() for p in model_class._from_config(config).parameters())
    if parameters > MAX_PARAMETERS:
        raise NotTiny(f"{family.model_type}: {parameters / 1e6:.0f}M parameters after TINY (sizes it does not name)")
    return model_class._from_config(config, torch_dtype=dtype)


#: A tiny model has fewer parameters than this.
MAX_PARAMETERS = 25_000_000


class NotTiny(ValueError):
    """The family's config has sizes ``TINY`` does not set."""
