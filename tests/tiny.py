"""Tiny models of every transformers text architecture, built from their default configs.

A generic shrinker of sizes (by config field name, never by architecture name): hidden sizes to
64, intermediate to 128, layers to 2, heads to 4, vocabularies to 101 (odd on purpose), with the
relations some architectures check kept (`DERIVED`) and the smallest patch for default configs
the installed transformers cannot build (`PATCHES`, each naming the bug). No weights are
downloaded. Used by the tests and by ``benchmarks/coverage.py``.
"""

from __future__ import annotations

VOCAB = 101
BATCH, SEQ = 2, 9

# Generic shrinker: any of these config fields present in an architecture's config is set.
SIZES = {
    64: (
        "hidden_size",
        "n_embd",
        "d_model",
        "dim",
        "embed_dim",
        "model_dim",
        "word_embed_proj_dim",
        "embedding_size",
        "n_embed",
        "emb_dim",
        "d_latents",  # Perceiver's latent width
    ),
    128: (
        "intermediate_size",
        "ffn_dim",
        "d_ff",
        "n_inner",
        "encoder_ffn_dim",
        "decoder_ffn_dim",
        "ffn_hidden_size",
        "hidden_dim",
        "inner_hidden_size",
    ),
    32: (
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "expert_intermediate_size",
        "kv_lora_rank",
        "q_lora_rank",
    ),
    2: (
        "num_hidden_layers",
        "n_layer",
        "num_layers",
        "num_decoder_layers",
        "encoder_layers",
        "decoder_layers",
        "n_layers",
        "num_encoder_layers",
        "num_experts_per_tok",
        "num_experts_per_token",
        "top_k_experts",  # DiffusionGemma's default leaves it None, its router reads it
        "num_key_value_heads",
        "num_kv_heads",
        "n_head_kv",
        "multi_query_group_num",
        "num_self_attends_per_block",  # Perceiver: 26 self-attention layers
    ),
    4: (
        "num_attention_heads",
        "n_head",
        "num_heads",
        "encoder_attention_heads",
        "decoder_attention_heads",
        "n_heads",
        "num_experts",
        "num_local_experts",
        "n_routed_experts",
        "num_self_attention_heads",  # Perceiver
        "num_cross_attention_heads",
    ),
    16: (
        "head_dim",
        "d_kv",
        "kv_channels",
        "attention_head_size",
        "qk_rope_head_dim",
        "rotary_dim",
        "qk_nope_head_dim",
        "v_head_dim",
        "attention_head_dim",
        "num_latents",  # Perceiver: 256 latents
    ),
}
POSITIONS = ("max_position_embeddings", "n_positions", "max_seq_len", "n_ctx", "seq_length")
TOKEN_IDS = (
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "decoder_start_token_id",
    "sep_token_id",
)


#: widths of an MLA query / key head that are its no-rope plus its rope part: kept so where the
#: default config has them so (Mistral-4's 64 + 64 = 128; shrunk to 16 each, a 16-wide head
#: left the rotary half its keys' width)
MLA_HEAD_WIDTHS = ("qk_head_dim", "head_dim")


def architectures() -> list[tuple[str, str, str]]:
    """(model_type, class name, kind) for every causal-LM and seq2seq architecture."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    )

    out = [(t, c, "causal-lm") for t, c in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()]
    out += [(t, c, "seq2seq") for t, c in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES.items()]
    return out


# Relations between size fields that some architectures check or rely on; the generic shrinker
# keeps them (by field name, never by architecture name).
DERIVED = {
    # SSM (Mamba-2 style): heads x head_dim == expand x hidden
    "mamba_headdim": lambda c: c.get("mamba_expand", 2) * 64 // c.get("n_mamba_heads", 1),
    "mamba_dt_rank": lambda c: 4,
    "time_step_rank": lambda c: 4,
    # BLT: the byte encoder's patches (hidden x cross_attn_k) are the global model's hidden
    "hidden_size_global": lambda c: 64 * c.get("cross_attn_k", 1),
    # hybrids whose attention reads [hidden, embeddings] concatenated (Zamba)
    # EfficientNet: the top conv is round_filters(1280) wide, its BatchNorm ``hidden_dim`` (128):
    # the width multiplier that makes them agree (every other width shrinks with it)
    "width_coefficient": lambda c: 128 / 1280,
    # Kyutai: the audio pad id is the one past the text and every codebook's ids
    "audio_pad_token_id": lambda c: (
        VOCAB + c["num_codebooks"] * c["codebook_vocab_size"]
        if c.get("num_codebooks") and c.get("codebook_vocab_size")
        else c["audio_pad_token_id"]
    ),
    "depth_coefficient": lambda c: 1.0,  # one block per stage repeat, not 3.1 (B7)
    "num_block_repeats": lambda c: [1] * len(c["num_block_repeats"]),  # one block per stage
    "attention_hidden_size": lambda c: (
        64 * max(1, round(c["_attention_hidden_size"] / c["_hidden"]))
    ),
}
# Default configs that do not build a model in the installed transformers: the smallest patch
# that does, per field. Each names the bug it works around.
PATCHES = {
    "cohere_compass_text": {  # default rope_parameters is {} but layers look up their type
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    },
    "gemma3n_text": {"num_kv_shared_layers": 0},  # 15 shared-KV layers of 2
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},  # default layer_types is None
    "dbrx": {"attn_config.rope_theta": 10000.0, "attn_config.clip_qkv": 8.0},  # both read, unset
    # the LM head needs a decoder; axial position dims must sum to hidden; LSH hashing seeded
    "reformer": {"is_decoder": True, "axial_pos_embds_dim": [32, 32], "hash_seed": 0},
    # the decoder reads num_key_value_heads, which the default config lacks (MHA: as many as
    # the query heads)
    "moonshine_streaming": {"num_key_value_heads": 4},
    # no pad id by default, but the embeddings mask it (ESM-2's published pad id is 1)
    "esm": {"pad_token_id": 1},
    # the global transformer is as wide as the byte encoder's patches (64 x cross_attn_k 2)
    "blt": {
        "global_config.hidden_size": 128,
        "global_config.head_dim": 32,
        "encoder_hash_byte_group_vocab": 1009,
    },
    # indexed-attention layers need the indexer sizes, which the default leaves unset
    **{
        t: {
            "indexer_n_heads": 2,
            "indexer_kv_heads": 1,
            "indexer_head_dim": 16,
            "indexer_budget": 8,
            "indexer_compress_ratio": 2,
        }
        for t in ("qwen4_exp", "qwen4_exp_text")
    },
    # the per-layer MLP kinds are unset by default, and read per layer (DeepSeek-OCR-2's
    # published model: the first layer dense, the rest sparse)
    "deepseek_ocr2_text": {"mlp_layer_types": ["dense", "sparse"]},
    # the sliding layers' heads are nope + rope wide (the default says so only in its
    # per-layer overrides, 192 + 64, which name layers past the 2 tiny ones)
    "dots3_note_text": {"head_dim": 32},
    # the model builds a sliding-window mask whether or not a layer slides, and the default
    # sets no window (Step-3.5's text model, Step-3.7's too)
    "step3p5": {"sliding_window": 4},
    # the shared attention block is tied across its uses, so it must be used twice
    "zamba": {
        "num_hidden_layers": 3,
        "layers_block_type": ["linear_attention", "hybrid", "hybrid"],
    },
    # the default text config (Gemma-4's) fails the assistant's own check: no per-layer inputs
    "gemma4_assistant": {
        "text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}
    },
}


# What the default (full-size) config needs to build at all: each a bug of the default itself,
# given the published model's value where the default leaves it unset.
FULL_PATCHES = {
    "cohere_compass_text": PATCHES["cohere_compass_text"],
    "dbrx": PATCHES["dbrx"],
    "gemma4_assistant": PATCHES["gemma4_assistant"],
    "reformer": {"is_decoder": True},  # the LM head needs a decoder
    "moonshine_streaming": {"num_key_value_heads": 8},  # read, unset (MHA: 8 query heads)
    # the indexed-attention layers need indexer sizes the default leaves unset (no published
    # values: the index head as wide as the rope, 16 query heads, a 2048-token budget)
    **{
        t: {
            "indexer_n_heads": 16,
            "indexer_kv_heads": 1,
            "indexer_head_dim": 256,
            "indexer_budget": 2048,
            "indexer_compress_ratio": 4,
        }
        for t in ("qwen4_exp", "qwen4_exp_text")
    },
    # experts unset (dots.llm1: 128 routed, 6 per token, 2 shared)
    "dots1": {"n_routed_experts": 128, "num_experts_per_tok": 6, "n_shared_experts": 2},
    # layer_types unset (LFM2-8B-A1B: attention at layers 2, 6, 10, 14, 18, 21 of 24)
    "lfm2_moe": {
        "num_hidden_layers": 24,
        "layer_types": [
            "full_attention" if i in (2, 6, 10, 14, 18, 21) else "conv" for i in range(24)
        ],
    },
}
#: unset fields the modeling code divides by, filled as the model's own default would read them
_UNSET = {
    "vocab_size": lambda c: 32,  # a CTC head's default (Wav2Vec2-BERT / -Conformer leave it None)
    "head_dim": lambda c: c.hidden_size // c.num_attention_heads,
    "num_key_value_heads": lambda c: c.num_attention_heads,
}


def full_config(model_type: str, class_name: str):
    """The architecture's default config at its full size, as a user of the published model
    builds it: `FULL_PATCHES` and `_UNSET` repair only what keeps the default from building."""
    import transformers
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    if hasattr(transformers, class_name):
        cls = getattr(transformers, class_name).config_class
    patches = FULL_PATCHES.get(model_type, {})
    config = cls(**{k: v for k, v in patches.items() if "." not in k})
    for k, v in patches.items():
        if "." in k:
            sub, attr = k.split(".", 1)
            setattr(getattr(config, sub), attr, v)
    for attr, fill in _UNSET.items():
        try:
            unset = attr in config.to_dict() and getattr(config, attr) is None
        except (AttributeError, RuntimeError):  # a per-layer attribute refuses global reads
            unset = False
        if unset:
            setattr(config, attr, fill(config))
    return config


def _layer_list(values: list, n: int) -> list:
    """A per-layer list cut to n layers, keeping one of each distinct kind first, so a hybrid
    model's tiny config still has each kind of layer (attention, SSM, MoE, ...)."""
    kinds = list(dict.fromkeys(values))
    out = (kinds + values)[:n]
    return out + [values[-1]] * (n - len(out))


def _shrink(fields: dict) -> dict:
    """The shrunk values for one config's fields (see SIZES and DERIVED)."""
    kwargs = {k: v for v, keys in SIZES.items() for k in keys if k in fields}
    # a cross-attention's own sizes (Dia's decoder: ``cross_hidden_size``, the encoder's width)
    kwargs.update(
        {f"cross_{k}": v for v, keys in SIZES.items() for k in keys if f"cross_{k}" in fields}
    )
    kwargs.update({k: 64 for k in POSITIONS if k in fields})
    kwargs["vocab_size"] = VOCAB
    for k in TOKEN_IDS:
        v = fields.get(k)
        if isinstance(v, int) and v >= VOCAB:
            kwargs[k] = 2 if k != "pad_token_id" else 1
    heads, kv = fields.get("num_attention_heads"), fields.get("num_key_value_heads")
    if "num_key_value_heads" in fields and (kv is None or kv == heads):
        # MHA (and MLA, whose keys are per query head) keeps as many KV heads as query heads
        kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", 4)
    for k in ("n_group", "num_expert_group", "num_group"):  # grouped routing over the 4 experts
        if (fields.get(k) or 0) > 2:
            kwargs.update({k: 2, "topk_group": 1})
    for k in MLA_HEAD_WIDTHS:  # an MLA head as wide as its no-rope and rope parts (Mistral-4)
        nope, rope = fields.get("qk_nope_head_dim"), fields.get("qk_rope_head_dim")
        if (
            isinstance(nope, int)
            and isinstance(rope, int)
            and rope
            and fields.get(k) == nope + rope
        ):
            kwargs[k] = kwargs["qk_nope_head_dim"] + kwargs["qk_rope_head_dim"]
    for k in ("n_shared_experts",):  # None in some defaults, multiplied by a size in the model
        if k in fields and fields[k] is None:
            kwargs[k] = 1
    if {"expand", "head_dim", "num_heads"} <= fields.keys() and "num_attention_heads" not in fields:
        kwargs["num_heads"] = fields["expand"] * 64 // 16  # Mamba-2: heads x head_dim == expand x d
    ctx = dict(fields, _hidden=fields.get("hidden_size") or 1)
    ctx["_attention_hidden_size"] = fields.get("attention_hidden_size") or ctx["_hidden"]
    for k, rule in DERIVED.items():
        if k in fields:
            kwargs[k] = rule(ctx)
    if "attention_hidden_size" in kwargs and "attention_head_dim" in fields:
        kwargs["attention_head_dim"] = kwargs["attention_hidden_size"] // kwargs.get(
            "num_attention_heads", 4
        )
    n_layers = fields.get("num_hidden_layers")
    for k, v in fields.items():  # per-layer kind lists follow the layer count
        if isinstance(v, list) and n_layers and len(v) == n_layers and k.endswith("types"):
            kwargs[k] = _layer_list(v, 2)
    if fields.get("layers_block_type") and n_layers:
        kwargs["layers_block_type"] = _layer_list(fields["layers_block_type"], 2)
    _per_stage(fields, kwargs, n_layers)
    for k, cap in CONV_STACKS.items():  # a speech model's conv feature extractor
        if _ints(fields.get(k)):
            kwargs[k] = [min(v, cap) for v in fields[k]]
        elif isinstance(fields.get(k), int) and fields[k] > cap:
            kwargs[k] = cap
    for k, v in fields.items():  # a depthwise conv's groups: as many as the width (Mimi's)
        if (
            k.endswith("_groups")
            and isinstance(v, int)
            and v > 1
            and v == fields.get("hidden_size")
        ):
            kwargs[k] = kwargs["hidden_size"]
    positions = next((kwargs[k] for k in POSITIONS if k in kwargs), None)
    for k in WINDOWS:  # Granite-Speech's conformer blocks of 128 in 64 positions
        if isinstance(fields.get(k), int) and positions and fields[k] > positions:
            kwargs[k] = positions
    return kwargs


#: fields of a backbone config that name its stages (``stem``, ``stage1``...): derived from the
#: layer count, they name stages the shrunk config no longer has (Dinov2's ``out_features``
#: ["stage12"] of 2 layers): dropped, so the config derives them again (its last stage)
STAGE_FIELDS = ("stage_names", "out_features", "out_indices")
#: a wav2vec2-style conv feature extractor's channels per layer (512 x 7 by default: 20 times
#: the rest of a tiny model's time) and its positional conv's width (128, which sets the
#: made-up waveform's least length): capped
CONV_STACKS = {"conv_dim": 32, "num_conv_pos_embeddings": 16}
#: fields of a window (block-wise attention's context) that must fit the shrunk positions
WINDOWS = ("context_size",)


def _restage(fields: dict) -> dict:
    """``fields`` (a sub-config's, shrunk) without `STAGE_FIELDS` where its stage names outnumber
    its layers plus the stem."""
    names, layers = fields.get("stage_names"), fields.get("num_hidden_layers")
    if isinstance(names, list) and isinstance(layers, int) and len(names) > layers + 1:
        return {k: v for k, v in fields.items() if k not in STAGE_FIELDS}
    return fields


def _ints(v) -> bool:
    return isinstance(v, (list, tuple)) and bool(v) and all(type(i) is int for i in v)


def _per_stage(fields: dict, kwargs: dict, n_layers) -> None:
    """Size fields whose default is a list (a hierarchical net's per-stage widths and heads:
    PVT's ``num_attention_heads`` [1, 2, 5, 8], CvT's ``embed_dim`` [64, 192, 384]; Gemma-3n's
    per-layer ``intermediate_size``) stay lists: strict configs refuse the plain int `SIZES`
    gives. Each entry becomes that size; a per-layer list (as long as the layer count) follows
    the 2 layers. The stage count is kept: cutting it breaks backbones whose other per-stage
    fields (LeViT's ``down_ops``, ConvNeXt's ``num_stages``) the config does not derive."""
    for k, v in list(kwargs.items()):
        d = fields.get(k)
        if isinstance(v, int) and _ints(d):
            kwargs[k] = [v] * (2 if n_layers and len(d) == n_layers else len(d))


def tiny_config(model_type: str, class_name: str | None = None):
    """The architecture's default config with every known size field shrunk; None when the
    config is not a text one (it holds vision / audio / text sub-configs)."""
    import transformers
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    if class_name and hasattr(transformers, class_name):  # e.g. MusicGen's decoder-only config
        cls = getattr(transformers, class_name).config_class
    patches = PATCHES.get(model_type, {})
    try:
        default = cls()
    except Exception:  # noqa: BLE001 - a default that fails its own checks (Gemma-4 assistant)
        default = cls(**{k: v for k, v in patches.items() if "." not in k})
    fields = default.to_dict()
    if any(k in fields for k in ("vision_config", "audio_config", "text_config", "encoder")):
        return None
    kwargs = _shrink(fields)
    for k, v in fields.items():  # sub-configs held as dicts (BLT's encoder/decoder/patcher)
        if isinstance(v, dict) and any(f in v for f in SIZES[64]):
            kwargs[k] = _restage({**v, **_shrink(v)})
    kwargs.update({k: v for k, v in patches.items() if "." not in k})
    try:
        config = cls(**kwargs)
    except Exception:  # noqa: BLE001 - fall back to setting attributes after construction
        config = cls()
        for k, v in kwargs.items():
            sub = getattr(config, k, None)
            if isinstance(v, dict) and hasattr(sub, "to_dict"):  # a sub-config stays a config
                v = type(sub)(**v)
            setattr(config, k, v)
    if class_name and class_name.endswith("ForMaskedLM") and getattr(config, "is_decoder", None):
        config.is_decoder = False  # a masked LM reads both ways (Reformer's patch is the LM's)
    for k, v in patches.items():
        if "." in k:
            sub, attr = k.split(".", 1)
            setattr(getattr(config, sub), attr, v)
    for k in ("use_cache",):
        if hasattr(config, k):
            setattr(config, k, False)
    config._attn_implementation = "eager"
    return config


def build(model_type: str, class_name: str, device: str = "cpu"):
    import torch
    import transformers

    config = tiny_config(model_type, class_name)
    if config is None:
        raise NotText("multimodal config (vision/audio/text sub-configs)")
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, class_name)(config)
    if hasattr(model, "set_default_language"):  # X-MOD routes through per-language adapters
        model.set_default_language(next(iter(config.languages)))
    return model.float().eval()


class NotText(Exception):
    """The architecture is not a text-only one."""


def on_meta(class_name: str, **config):
    """transformers' ``class_name`` built on the meta device from its config class with these
    fields (no memory, for planning at any size)."""
    import torch
    import transformers

    cls = getattr(transformers, class_name)
    with torch.device("meta"):
        return cls(cls.config_class(**config))


def inputs(model, kind: str) -> dict:
    import torch

    g = torch.Generator().manual_seed(1)
    emb = model.get_input_embeddings()
    if isinstance(emb, torch.nn.ModuleList):  # one embedding per codebook (MusicGen)
        emb = emb[0]
    vocab = min(VOCAB, emb.num_embeddings)
    rows = BATCH * getattr(model.config, "num_codebooks", 1)  # codebooks are stacked in the batch
    ids = torch.randint(3, vocab, (rows, SEQ), generator=g)
    out = {"input_ids": ids}
    if kind == "seq2seq" or getattr(model.config, "is_encoder_decoder", False):
        out["decoder_input_ids"] = ids[:, :5]
    return out


# ---------------------------------------------------------------------------------------------
# Every family (issue 29): multimodal configs, their sub-configs shrunk one by one, and inputs
# for whatever the model's forward reads (pixels, audio, placeholder tokens).

#: the families a user loads with an Auto class: (family, transformers' mapping of model type to
#: class name). Order matters only for the report.
FAMILIES = (
    ("causal-lm", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    ("seq2seq", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    ("image-text-to-text", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"),
    ("speech-seq2seq", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES"),
    ("ctc", "MODEL_FOR_CTC_MAPPING_NAMES"),
    ("audio-classification", "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES"),
    ("image-classification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"),
    ("vision-encoder", "MODEL_FOR_IMAGE_MAPPING_NAMES"),
    ("masked-lm", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    ("dual-encoder", "MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES"),
)
#: image sides: small, and a multiple of every common patch size (a tiny ViT sees 4 x 4 patches)
IMAGE = {"image_size": 32, "patch_size": 8}
#: patches per image side of a one-tower vision model (`_image_size`)
PATCHES_PER_SIDE = 4


def _image_size(config) -> dict:
    """The image side of a one-tower vision model (no sub-configs): its own ``patch_size`` is
    kept and the image made `PATCHES_PER_SIDE` patches wide (at least ``IMAGE``'s 32), since
    that patch is not always one conv a shrinker may resize: LeViT's conv stem downsamples by
    16 whatever the field says, and a hierarchical net (Swin, ConvNeXt, MobileViT) halves its
    grid per stage after a stem of 4 (a 32 px image and a patch of 8 left ConvNeXt's last
    stage 1 x 1 under a 2 x 2 kernel). A net that unfolds patches at its ``output_stride``
    (MobileViT-v2: 32) gets at least one patch there."""
    patch = getattr(config, "patch_size", None)
    patch = patch[-1] if _ints(patch) else patch
    if not isinstance(patch, int):
        return {"image_size": IMAGE["image_size"]}
    stride = getattr(config, "output_stride", None)  # MobileViT: unfolds patches at stride 32
    least = patch * stride if isinstance(stride, int) else 0
    return {"image_size": max(IMAGE["image_size"], PATCHES_PER_SIDE * patch, least)}


#: audio positions: a speech encoder's frames (Whisper reads exactly 2 x max_source_positions)
AUDIO = {"max_source_positions": 32, "max_target_positions": 64}
#: name endings of fields that follow the hidden size when their default equals it
_WIDTHS = ("_size", "_dim")
#: token-id fields a multimodal config points into the text vocabulary with (image / audio /
#: video placeholders, boi / eoi markers): moved to the top ids of the tiny vocabulary, which the
#: random text ids never draw (`family_inputs` draws below `TEXT_IDS`)
TEXT_IDS = VOCAB - 12


def family_architectures(families: list[str] | None = None) -> list[tuple[str, str, str]]:
    """(model_type, class name, family) for every architecture of the `FAMILIES` named (all by
    default); a class that appears in two families is listed under the first."""
    import transformers
    from transformers.models.auto import modeling_auto

    out, seen = [], set()
    for family, mapping in FAMILIES:
        if families and family not in families:
            continue
        for model_type, cls in getattr(modeling_auto, mapping, {}).items():
            cls = cls[0] if isinstance(cls, (list, tuple)) else cls
            if (model_type, cls) in seen or not hasattr(transformers, cls):
                continue
            seen.add((model_type, cls))
            out.append((model_type, cls, family))
    return out


def _is_sub(v) -> bool:
    return isinstance(v, dict) and any(
        k in v for k in (*SIZES[64], *SIZES[128], "model_type", "hidden_sizes")
    )


def _shrink_tree(fields: dict, top: bool) -> dict:
    """`_shrink` of one (sub-)config's fields, its own sub-configs shrunk the same way, image
    sizes set (`IMAGE`) and placeholder token ids moved into the tiny vocabulary."""
    kwargs = _shrink(fields)
    kwargs.update({k: v for k, v in AUDIO.items() if isinstance(fields.get(k), int)})
    width = fields.get("hidden_size")
    for k, v in fields.items():  # sizes that default to the hidden size (SigLIP's projection)
        if k not in kwargs and isinstance(width, int) and v == width and k.endswith(_WIDTHS):
            kwargs[k] = 64
    if "vocab_size" not in fields and not top:
        kwargs.pop("vocab_size", None)
    for k, v in IMAGE.items():
        if isinstance(fields.get(k), int):
            kwargs[k] = v
        elif isinstance(fields.get(k), (list, tuple)) and len(fields[k]) == 2:
            kwargs[k] = [v, v]
    if "hidden_sizes" in fields and isinstance(fields["hidden_sizes"], list):  # conv stages
        n = min(len(fields["hidden_sizes"]), 2)
        kwargs["hidden_sizes"] = [16 * 2**i for i in range(n)]
        for k in ("depths", "num_stages"):
            if isinstance(fields.get(k), list):
                kwargs[k] = [1] * n
            elif k == "num_stages" and k in fields:
                kwargs[k] = n
    slot = VOCAB - 1
    for k, v in fields.items():
        if isinstance(v, int) and k.endswith(("_token_id", "_token_index")) and v >= VOCAB:
            kwargs[k] = slot if k not in TOKEN_IDS else kwargs.get(k, 2)
            slot -= 1
    _fit_layers(fields, kwargs)
    _fit_rope(fields, kwargs)
    for k, v in fields.items():
        if _is_sub(v):
            kwargs[k] = _restage({**v, **_shrink_tree(v, False)})
    for k, v in PATCHES.get(fields.get("model_type"), {}).items():  # a sub-config's own bugs
        if "." in k:
            continue
        kwargs[k] = {**kwargs[k], **v} if isinstance(kwargs.get(k), dict) else v
    if top:
        _fit_towers(fields, kwargs)
    return kwargs


#: a per-layer override table (Gemma-4's ``per_layer_config``: {"05": {"head_dim": 512}, ...}),
#: keyed by layer index
PER_LAYER_TABLES = ("per_layer_config",)
#: top-level fields that repeat a tower's width for the projector after it (Nemotron-H-Omni's
#: ``vision_hidden_size`` 1280, left unshrunk against the tiny tower's 64), by sub-config
TOWER_WIDTHS = {"vision_hidden_size": "vision_config", "audio_hidden_size": "audio_config"}
#: a list of a tower's layer indexes that another sub-config reads (Molmo-2's adapter taps
#: ``vision_feature_layer`` [24, 18] of 25 vision layers)
TOWER_LAYERS = ("vision_feature_layer",)


def _fit_layers(fields: dict, kwargs: dict) -> None:
    """Per-layer fields of a config whose layer count was cut, before it is built (strict
    configs check them): every list as long as the default layer count (Gemma-3n's
    ``activation_sparsity_pattern``, Mistral-Large-4's ``kv_source_layers``) cut like the
    layer kinds (`_layer_list`: each distinct value first, so a list of layer indexes starts
    0, 1), a per-layer override table (`PER_LAYER_TABLES`) keeps only the layers left (its
    entries carry unshrunk sizes: 512-wide heads, 64 heads, so none is moved onto a kept
    layer), and a width whose default is 0 (GLM-5-Next's ``qk_rope_head_dim``: no rotary in
    its sparse-attention layers) stays 0 rather than becoming a tiny size."""
    n, m = fields.get("num_hidden_layers"), kwargs.get("num_hidden_layers")
    for k, v in list(kwargs.items()):
        if fields.get(k) == 0 and isinstance(v, int) and k.endswith(_WIDTHS):
            kwargs[k] = 0
    if not (isinstance(n, int) and isinstance(m, int) and n > m):
        return
    for k, v in fields.items():
        if k not in kwargs and isinstance(v, list) and len(v) == n:
            kwargs[k] = _layer_list(v, m)
    for k in PER_LAYER_TABLES:
        table = fields.get(k)
        if isinstance(table, dict) and all(str(i).isdigit() for i in table):
            kwargs[k] = {i: v for i, v in table.items() if int(i) < m}


def _rotary_half(fields: dict, rope: dict) -> int:
    """Half the rotary width of one attention config's fields: its ``qk_rope_head_dim`` (MLA),
    else its head width, times the ``partial_rotary_factor`` (GLM-4V-MoE's 0.5)."""
    heads = fields.get("num_attention_heads") or 4
    width = fields.get("qk_rope_head_dim") or fields.get("head_dim")
    width = width or (fields.get("hidden_size") or 64) // heads
    factor = rope.get("partial_rotary_factor") or fields.get("partial_rotary_factor") or 1.0
    return int(width * factor) // 2


def _scaled_sections(section: list, half: int) -> list:
    scaled = [s * half // sum(section) for s in section]
    scaled[-1] += half - sum(scaled)
    return scaled


def _fit_rope(fields: dict, kwargs: dict) -> None:
    """A multimodal rotary's ``mrope_section`` (time / height / width rotary half-dims,
    Cosmos-3-Edge's [24, 20, 20] of a 128-wide head) scaled to the tiny rotary (`_rotary_half`)
    before the config is built: strict configs check the sum as they are built."""
    rope = fields.get("rope_parameters")
    if isinstance(rope, dict) and _ints(rope.get("mrope_section")):
        half = _rotary_half({**fields, **kwargs}, rope)
        section = _scaled_sections(rope["mrope_section"], half)
        kwargs["rope_parameters"] = {**rope, "mrope_section": section}


def _fit_towers(fields: dict, kwargs: dict) -> None:
    """Relations between the shrunk sub-configs a config checks as it is built: a tower's
    output width (`OUTPUT_WIDTHS`: Granite-Docling's ``out_hidden_size``, Inkling-2's
    ``text_hidden_size``), and any tower width the shrinker left at the text model's default
    hidden size (dots3-note's adapters' ``adapter_out_dim`` 5120, Florence-2's
    ``projection_dim``), is the text model's hidden size (its first `SIZES` width field); a
    top-level copy of a tower's width (`TOWER_WIDTHS`, or any top-level width left at a
    sub-config's default hidden size: Kimi-K2.5's ``projection_hidden_size``) is the tower's;
    lists of a tower's layer indexes (`TOWER_LAYERS`) name layers it has (`_fit_tower_layers`);
    discrete tokenizers' code ranges fit the tiny vocabulary (`_fit_offsets`)."""
    text = kwargs.get("text_config") if isinstance(kwargs.get("text_config"), dict) else kwargs
    width = text.get("hidden_size")
    default = fields.get("text_config") if isinstance(fields.get("text_config"), dict) else fields
    text_width = next((default[k] for k in SIZES[64] if isinstance(default.get(k), int)), None)
    tiny_width = next((text[k] for k in SIZES[64] if isinstance(text.get(k), int)), None)
    vision = kwargs.get("vision_config") if isinstance(kwargs.get("vision_config"), dict) else {}
    layers = vision.get("num_hidden_layers")
    _fit_offsets(fields, kwargs)
    for k, sub in TOWER_WIDTHS.items():
        inner = kwargs.get(sub)
        if isinstance(fields.get(k), int) and isinstance(inner, dict) and "hidden_size" in inner:
            kwargs[k] = inner["hidden_size"]
    widths = {  # each sub-config's default hidden size: its tiny one
        fields[name]["hidden_size"]: sub["hidden_size"]
        for name, sub in kwargs.items()
        if isinstance(sub, dict)
        and isinstance(fields.get(name), dict)
        and isinstance(fields[name].get("hidden_size"), int)
        and isinstance(sub.get("hidden_size"), int)
    }
    for k, v in fields.items():  # a projector's width left at a tower's (Kimi-K2.5's 1152)
        if k not in kwargs and k.endswith(_WIDTHS) and type(v) is int and v in widths:
            kwargs[k] = widths[v]
    for name, sub in kwargs.items():
        if not isinstance(sub, dict) or not isinstance(fields.get(name), dict):
            continue
        for k in OUTPUT_WIDTHS:
            if name != "text_config" and isinstance(sub.get(k), int) and isinstance(width, int):
                sub[k] = width
        for k, v in sub.items():  # a width left at the text model's default width (an adapter's)
            left = type(v) is int and v == fields[name].get(k) == text_width != tiny_width
            left = left and isinstance(tiny_width, int)
            if name != "text_config" and k.endswith(_WIDTHS) and left:
                sub[k] = tiny_width
        _fit_tower_layers(sub, layers)
    _fit_tower_layers(kwargs, layers, fields)


def _fit_tower_layers(sub: dict, layers, fields: dict | None = None) -> None:
    """`TOWER_LAYERS` of ``sub`` (a sub-config's, or the top-level one from ``fields``:
    VipLLaVA's [-2, -5, -8, -11, 6]) that name vision layers past the tiny tower's ``layers``
    name its last ones, -1, -2, at most one per layer (the projector reads as many as the list
    names); negative ones only, past its first hidden state, the last ones in turn, as many as
    before."""
    for k in TOWER_LAYERS:
        v = sub.get(k, (fields or {}).get(k))
        if not isinstance(layers, int) or not _ints(v):
            continue
        if max(v) >= layers:
            sub[k] = [-1 - i for i in range(min(len(v), layers))]
        elif min(v) < -layers - 1:  # hidden states: the embeddings, then one per layer
            sub[k] = [-1 - i % (layers + 1) for i in range(len(v))]


#: where a discrete tokenizer's codes start in the text vocabulary (Apertus-1.5's image codes at
#: 131272, its audio codes right after the image codebook), by the sub-config whose
#: ``codebook_size`` the range spans
TOKEN_OFFSETS = {"image_token_offset": "vision_config", "audio_token_offset": "audio_config"}
#: a discrete tokenizer's codebook in a tiny model: its code ranges fit the 101-id vocabulary
CODEBOOK = 16


def _fit_offsets(fields: dict, kwargs: dict) -> None:
    """Code ranges of discrete image / audio tokenizers (`TOKEN_OFFSETS`) laid out again in
    the tiny vocabulary, in their default order, one after the other from a third of it, each
    `CODEBOOK` codes: the default ranges (131072 image codes, 4096 audio codes) end past the
    101 ids and strict configs check both that they are adjacent and that they fit."""
    ranges = sorted((v, k) for k, v in fields.items() if k in TOKEN_OFFSETS and isinstance(v, int))
    start = VOCAB // 3
    for _, k in ranges:
        sub = kwargs.get(TOKEN_OFFSETS[k])
        if not isinstance(sub, dict) or not isinstance(sub.get("codebook_size"), int):
            return
        sub["codebook_size"] = CODEBOOK
        kwargs[k] = start
        start += CODEBOOK


def tiny_family_config(model_type: str, class_name: str | None = None):
    """The default config of any architecture, text or not, shrunk: `tiny_config` where that
    gives one, else every sub-config (vision, audio, text, encoder...) shrunk by the same rules
    (`_shrink_tree`). Placeholder token ids land in the top of the tiny vocabulary."""
    import transformers
    from transformers import CONFIG_MAPPING

    config = tiny_config(model_type, class_name)
    if config is not None:
        for k, v in {**AUDIO, **_image_size(config)}.items():
            if isinstance(getattr(config, k, None), int):
                setattr(config, k, v)
            elif (
                isinstance(getattr(config, k, None), (list, tuple)) and len(getattr(config, k)) == 2
            ):
                setattr(config, k, [v, v])
        _fit_vision(config)
        return config
    cls = CONFIG_MAPPING[model_type]
    if class_name and hasattr(transformers, class_name):
        cls = getattr(transformers, class_name).config_class
    fields = cls().to_dict()
    kwargs = _shrink_tree(fields, True)
    for k, v in FAMILY_PATCHES.get(model_type, {}).items():  # checked as the config is built
        sub, attr = k.split(".", 1) if "." in k else ("", k)
        (kwargs[sub] if sub else kwargs)[attr] = v
    config = cls(**kwargs)
    for sub in ("text_config", "vision_config", "audio_config"):  # eager everywhere
        if getattr(config, sub, None) is not None and hasattr(getattr(config, sub), "use_cache"):
            getattr(config, sub).use_cache = False
    if hasattr(config, "use_cache"):
        config.use_cache = False
    _fit_family(config)
    _fit_vision(config)
    for (k, token), method in (
        (IMAGE_PLACEHOLDER, "get_image_features"),
        (VIDEO_PLACEHOLDER, "get_video_features"),
    ):
        fills = hasattr(getattr(transformers, class_name or "", None), method)
        if fills and k in vars(config) and getattr(config, k) is None:
            setattr(config, k, token)
    for k, v in CLASS_PATCHES.get(class_name, {}).items():
        sub, attr = k.split(".", 1) if "." in k else ("", k)
        setattr(getattr(config, sub) if sub else config, attr, v)
    config._attn_implementation = "eager"
    return config


#: relations between sub-configs that a config checks as it is built, or the model relies on,
#: and no rule here keeps (sub-config.field, or a top-level field), by model type
FAMILY_PATCHES = {
    # the adaptor's MLP is a quarter of the text model's width (64 // 4)
    "fun_asr_nano": {"adaptor_config.intermediate_size": 16},
    # the aligner gives image features ``projection_dim`` wide into the text model: the default
    # says 2048 (Janus-Pro-1B's text width) against its own 4096-wide text config
    "janus": {"vision_config.projection_dim": 64},
    # its rotary pairs the height and width sections, so they must stay equal: the code's own
    # default [22, 22, 20] (not the [16, 24, 24] `_fit_family` assumes where a config names none)
    "ernie4_5_vl_moe": {
        "text_config.rope_parameters": {
            "rope_type": "default",
            "rope_theta": 500000.0,
            "mrope_section": [22, 22, 20],
        }
    },
    # the projector reads 2 x 2 merged patches of the tower (4 x its 64) and is 128 wide inside
    **{
        t: {"out_hidden_size": 256, "projector_hidden_size": 128}
        for t in ("muse_glimmer", "muse_spark")
    },
}
#: flags a head class needs that its family's default config leaves off (sub-config.field)
CLASS_PATCHES = {
    # the image-text matching head runs the Q-Former on the text too: its published config
    # builds the Q-Former's text feed-forward, the default does not
    "Blip2ForImageTextRetrieval": {"qformer_config.use_qformer_text_input": True},
    # the yes / no answer tokens are read off the config with Gemma's ids (10784, 3771) as the
    # default, past the tiny vocabulary: two text ids
    "ShieldGemma2ForImageClassification": {"yes_token_index": 3, "no_token_index": 4},
    # the image embedding is the EfficientNet's pooled last stage, unprojected: the text
    # projection must be as wide (640 = round_filters(320) at width 2.0; 32 at the tiny 0.1)
    # and the 7 conv blocks of 8-32 channels at the default init (std 0.02: a depthwise 3 x 3
    # conv scales by about 0.06) leave a pooled image of 1e-30, whose norm underflows to 0 and
    # made the normalised image embedding NaN: an init that keeps it near 1e-5
    "AlignModel": {"projection_dim": 32, "vision_config.initializer_range": 0.3},
}
#: fields of a multimodal sub-config shrunk besides `SIZES` (a vision tower's block count)
FAMILY_SIZES = {"depth": 2}
#: placeholder fields a default config leaves None (no audio could be given: Voxtral's audio
#: token): set to a free id above the random text ids (`TEXT_IDS`), so the tower can run
PLACEHOLDER_FIELDS = {"audio_token_id": TEXT_IDS}
#: the image placeholder a default config leaves None (BLIP-2's, InstructBLIP's): given a free id
#: for a class that fills placeholders (``get_image_features``) only, since BLIP-2's retrieval
#: head reads a set one as "query tokens lead the ids". Not ``image_token_id``: MiniCPM-V's and
#: Nemotron-H-Omni's towers then need inputs no rule here makes (patch grids, tiles), and they
#: run text-only as before
IMAGE_PLACEHOLDER = ("image_token_index", TEXT_IDS + 1)
#: the video placeholder a default config leaves None (InstructBLIP-Video's): a free id, for a
#: class that fills video placeholders (``get_video_features``)
VIDEO_PLACEHOLDER = ("video_token_index", TEXT_IDS + 2)
#: frames of the made-up video of a VLM that reads its ``pixel_values`` as one (`_fit_video`):
#: one, as each frame gives its 32 query tokens and the tiny text model has 64 positions
VIDEO_FRAMES = 1
#: fields of a vision / audio sub-config that give the width its features reach the text model
#: with (Qwen3-VL's, GLM-4V's merger output): set to the text model's hidden size, which the
#: placeholder embeddings they replace have (the shrunk default left 3584 / 4096 against 64)
OUTPUT_WIDTHS = ("out_hidden_size", "text_hidden_size")
#: endings of a vision sub-config's lists of block indexes (Qwen3-VL's deepstack taps at blocks
#: 8, 16, 24): past the cut ``depth`` they name no block and their mergers never run, so they
#: become the first blocks (`_fit_family`)
LAYER_INDEXES = ("_indexes", "_indices")
#: fields giving the tokens an image is pooled to (Gemma-3's 256: a 16 x 16 average pool of the
#: patch grid): past the tiny grid (4 x 4 patches) the pool's stride is 0 (`_fit_family`)
TOKENS_PER_IMAGE = ("mm_tokens_per_image", "vision_soft_tokens_per_image")

#: endings of a table of query tokens per image patch count (Aria's projector: 1225 or 4900
#: patches, a 490 / 980 px image, give 128 or 256 queries): re-keyed to the tiny image's patch
#: count, with as many queries as a pool to half the grid's side (`TOKENS_PER_IMAGE`), and its
#: ``max_value_`` copy (the learned queries' count) set to match (`_fit_family`)
QUERIES_BY_PATCHES = ("patch_to_query_dict",)


#: an any-resolution VLM's tile grids (LLaVA-NeXT's [[336, 672], ...] px): the tiny image is cut
#: into tiles as wide as the vision tower's image, so one grid of one tile (`_fit_family`), and
#: its pixels are [batch, 1 + 1 tiles, channels, height, width]: the resized whole image first,
#: then the tile, as the processor gives them (`family_inputs`)
ANY_RES = "image_grid_pinpoints"


def _fit_family(config) -> None:
    """What a shrunk multimodal config needs besides `_shrink_tree`, by field name: a vision
    tower's ``depth`` (32 blocks in Qwen2-VL's default) cut to `FAMILY_SIZES`, a placeholder
    token the default config leaves None given an id (`PLACEHOLDER_FIELDS`), and a multimodal
    rotary's ``mrope_section`` (the rotary half-dims given to time / height / width, [16, 24,
    24] of a 128-wide head, the code's default where the config names none) scaled to the tiny
    head (16 wide: [2, 3, 3]) wherever the config says it reads one. A tower's output width
    (`OUTPUT_WIDTHS`) follows the text model's hidden size, and its lists of block indexes
    (`LAYER_INDEXES`) name blocks that are left."""
    text = getattr(config, "text_config", None) or config
    for sub in (getattr(config, n, None) for n in ("vision_config", "audio_config")):
        for k in OUTPUT_WIDTHS:
            if sub is not None and isinstance(getattr(sub, k, None), int):
                setattr(sub, k, text.hidden_size)
    for k, token in PLACEHOLDER_FIELDS.items():
        if k in vars(config) and getattr(config, k) is None:
            setattr(config, k, token)
    for sub in (getattr(config, n, None) for n in ("vision_config", "audio_config")):
        for k, v in FAMILY_SIZES.items():
            if sub is not None and isinstance(getattr(sub, k, None), int) and getattr(sub, k) > v:
                setattr(sub, k, v)
        depth = getattr(sub, "depth", None) if sub is not None else None
        for k, v in vars(sub).items() if isinstance(depth, int) else ():
            layers = isinstance(v, list) and v and all(isinstance(i, int) for i in v)
            if k.endswith(LAYER_INDEXES) and layers and max(v) >= depth:
                setattr(sub, k, list(range(min(len(v), depth))))
    vision = getattr(config, "vision_config", None)
    side = _patches_per_side(vision)
    size = getattr(vision, "image_size", None)
    if isinstance(getattr(config, ANY_RES, None), list) and isinstance(size, int):
        setattr(config, ANY_RES, [[size, size]])
    for k in TOKENS_PER_IMAGE:  # pooled to a square of tokens: at most half the patch grid's side
        if side and isinstance(getattr(config, k, None), int) and getattr(config, k) > side**2:
            setattr(config, k, max(1, side // 2) ** 2)
    for k, v in list(vars(config).items()):  # queries per patch count: the tiny image's count
        if side and k.endswith(QUERIES_BY_PATCHES) and isinstance(v, dict) and v:
            setattr(config, k, {side**2: max(1, side // 2) ** 2})
            if isinstance(getattr(config, f"max_value_{k}", None), int):
                setattr(config, f"max_value_{k}", max(1, side // 2) ** 2)
    text = getattr(config, "text_config", None) or config
    rope = getattr(text, "rope_parameters", None)
    reads = "mrope_section" in (getattr(type(text), "ignore_keys_at_rope_validation", None) or ())
    if not isinstance(rope, dict) or not (reads or "mrope_section" in rope):
        return
    section = rope.get("mrope_section") or [16, 24, 24]
    rope["mrope_section"] = _scaled_sections(section, _rotary_half(vars(text), rope))


#: a video tower's frames per temporal patch (its ``tubelet_size``: an int, or [time, height,
#: width]) times this: two patches in time, so temporal attention has something to mix
VIDEO_TIME_PATCHES = 2
#: the widths of a pixel-shuffle adapter's output, in and out of its projector (`_fit_vision`)
PROJECTOR_WIDTHS = ("projector_input_dim", "projector_output_dim", "vision_output_dim")
#: a windowed hierarchical net's (Swin's) attention window, in patches
WINDOW = 2


def _vision_configs(config) -> list:
    """The config and its sub-configs that describe images (an ``image_size`` field)."""
    subs = [config] + [v for v in vars(config).values() if hasattr(v, "to_dict")]
    return [c for c in subs if isinstance(getattr(c, "image_size", None), int)]


def _fit_vision(config) -> None:
    """What a shrunk image or video config needs for its tiny image, by field name, on the
    config and each sub-config with an ``image_size``:

    - a video tower (``num_frames``) gets `VIDEO_TIME_PATCHES` temporal patches and a spatial
      tubelet at most half the image (VideoPrism's 18 px of a 32 px image);
    - per-kind layer counts (``num_*_layers``: VideoPrism's 12 spatial and 4 temporal, Mllama's
      8 global) are cut like ``num_hidden_layers``, and lists of layer indexes
      (`LAYER_INDEXES`: Mllama's intermediate layers 3, 7, 15, 23, 30) name layers that are
      left; an output as wide as the layers it concatenates (Mllama's ``vision_output_dim``,
      hidden x (1 + indexes)) follows;
    - a windowed hierarchical net (``window_size`` with per-stage ``depths``: Swin, Donut-Swin)
      gets a `WINDOW`-patch window and an image whose every stage is at least one window wide:
      transformers' Swin clips its window to a smaller stage's grid but keeps the relative
      position table of the configured window (a 7-patch window on a 4 x 4 stage failed "16
      vs 49");
    - a pixel-shuffle adapter (Llama-4's: ``pixel_shuffle_ratio`` with ``projector_input_dim``)
      reads the shuffled patches, hidden / ratio**2 wide, with an MLP ``intermediate_size``
      wide, and gives `PROJECTOR_WIDTHS` features (the default config's 768 / 0.5**2 is not
      its 5632, nor its 4096-wide output its 7680 ``vision_output_dim``: the published model's
      are 1408 and 4096 throughout): set so, at the tiny hidden size."""
    for c in _vision_configs(config):
        ratio = getattr(c, "pixel_shuffle_ratio", None)
        frames = getattr(c, "num_frames", None)
        tubelet = getattr(c, "tubelet_size", None)
        if isinstance(frames, int):
            time = tubelet if isinstance(tubelet, int) else (tubelet or [1])[0]
            c.num_frames = VIDEO_TIME_PATCHES * time
            if _ints(tubelet) and len(tubelet) == 3:
                side = min(tubelet[1], c.image_size // 2)
                c.tubelet_size = [tubelet[0], side, side]
        for k, v in list(vars(c).items()):
            if k.startswith("num_") and k.endswith("_layers") and isinstance(v, int) and v > 2:
                setattr(c, k, 2)
        layers = getattr(c, "num_hidden_layers", None)
        for k, v in list(vars(c).items()) if isinstance(layers, int) else ():
            if k.endswith(LAYER_INDEXES) and _ints(v) and max(v) >= layers:
                setattr(c, k, list(range(min(len(v), layers))))
                if isinstance(getattr(c, "vision_output_dim", None), int) and not ratio:
                    c.vision_output_dim = c.hidden_size * (1 + len(getattr(c, k)))
        ratio = getattr(c, "pixel_shuffle_ratio", None)
        if isinstance(ratio, float) and isinstance(getattr(c, "projector_input_dim", None), int):
            c.intermediate_size = round(c.hidden_size / ratio**2)
            for k in PROJECTOR_WIDTHS:
                setattr(c, k, c.hidden_size)
        window, depths = getattr(c, "window_size", None), getattr(c, "depths", None)
        patch = getattr(c, "patch_size", None)
        if isinstance(window, int) and _ints(depths) and isinstance(patch, int):
            c.window_size = min(window, WINDOW)
            c.image_size = max(c.image_size, patch * c.window_size * 2 ** (len(depths) - 1))


def _patches_per_side(vision) -> int:
    size, patch = getattr(vision, "image_size", None), getattr(vision, "patch_size", None)
    return size // patch if isinstance(size, int) and isinstance(patch, int) else 0


def _fit_rotary_sections(model, config) -> bool:
    """A multimodal rotary whose ``mrope_section`` its code defaults to ([16, 24, 24] in
    PaddleOCR-VL, whose config names none, so `_fit_family` cannot see it) does not add up to
    its tiny ``inv_freq`` (a 16-wide head's 8): the sections scaled to it, set in the text
    config's ``rope_parameters`` for a rebuild. Read off the built modules (any module with
    both attributes), never by architecture name. Whether anything was set."""
    text = getattr(config, "text_config", None) or config
    rope = getattr(text, "rope_parameters", None)
    for mod in model.modules():
        section, freq = getattr(mod, "mrope_section", None), getattr(mod, "inv_freq", None)
        if not isinstance(section, list) or freq is None or not isinstance(rope, dict):
            continue
        half = freq.numel()
        if sum(section) == half or "mrope_section" in rope:
            continue
        scaled = [s * half // sum(section) for s in section]
        scaled[-1] += half - sum(scaled)
        rope["mrope_section"] = scaled
        return True
    return False


def build_family(model_type: str, class_name: str, device: str = "cpu"):
    """The tiny model of any family (`tiny_family_config`), float32, eval mode."""
    import torch
    import transformers

    config = tiny_family_config(model_type, class_name)
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, class_name)(config)
    if _fit_rotary_sections(model, config):  # the sections its code defaults to, scaled
        torch.manual_seed(0)
        with torch.device(device):
            model = getattr(transformers, class_name)(config)
    if hasattr(model, "set_default_language"):
        model.set_default_language(next(iter(config.languages)))
    return model.float().eval()


def family_inputs(model, family: str) -> dict:
    """Real inputs for any family's tiny model: text families as `inputs`; others as the trace
    makes them up (`tpkit.plan.inputs.synthesize_inputs`: pixel_values, input_features,
    input_values, both towers of a dual encoder, decoder ids), filled with random values, and
    for a model whose ids carry image placeholders, as many of them per row as its vision tower
    gives features for one image (`get_image_features`), after one text token. Then fitted to
    what the model reads (`_fit_main_input`, `_fit_noise`, `_fit_layout`): a wrapper's main
    input as its encoder's, an image family's main input an image, a video tower's pixels
    [batch, frames, channels, height, width], a fixed masking noise, an audio layout that runs;
    an any-resolution VLM's image as its whole image and one tile (`ANY_RES`) with its
    ``image_sizes``, and text ids where the trace made none but the code reads them."""
    import inspect

    import torch

    from tpkit.plan.inputs import synthesize_inputs

    if family in ("causal-lm", "seq2seq") and model.main_input_name == "input_ids":
        return inputs(model, family)
    if type(model).__name__ in OWN_INPUTS:
        return OWN_INPUTS[type(model).__name__](model)
    _, made = synthesize_inputs(model, BATCH, SEQ)
    _fit_main_input(model, family, made)
    g = torch.Generator().manual_seed(1)
    config = model.config
    vocab = getattr(getattr(config, "text_config", None) or config, "vocab_size", None) or VOCAB
    top = min(TEXT_IDS, vocab)
    out = {}
    for k, v in made.items():
        if not isinstance(v, torch.Tensor):
            out[k] = v
        elif v.device.type != "meta":  # values made up to agree (an image grid, its ids)
            out[k] = _random_text(v, top, g) if k == "input_ids" else v.clone()
        elif v.dtype == torch.long:
            out[k] = torch.randint(3, top, tuple(v.shape), generator=g)
        else:
            out[k] = torch.randn(tuple(v.shape), generator=g)
    token = next(
        (
            getattr(config, k)
            for k in ("image_token_id", "image_token_index")
            if isinstance(getattr(config, k, None), int)
        ),
        None,
    )
    if not any(hasattr(m, "get_image_features") for m in model.modules()):
        token = None  # no placeholders to fill: BLIP-2's retrieval head, Mllama's cross-attention
    pixels = out.get("pixel_values")
    if isinstance(getattr(config, ANY_RES, None), list) and pixels is not None and pixels.ndim == 4:
        out["pixel_values"] = torch.randn((pixels.shape[0], 2, *pixels.shape[1:]), generator=g)
    _fit_image_sizes(model, out)
    _fit_patch_pixels(model, out)
    params = inspect.signature(model.forward).parameters
    _fit_more_pixels(model, out, params, g)
    if (
        token is not None
        and "pixel_values" in out
        and "input_ids" not in out
        and "input_ids" in params
    ):
        # InstructBLIP's ids are optional in the signature, not in its code: text with them,
        # kept where its vision tower runs on what the trace made up (MiniCPM-V's needs more)
        ids = torch.randint(3, top, (out["pixel_values"].shape[0], SEQ), generator=g)
        try:
            _image_layout(model, out["pixel_values"], out)
            out["input_ids"] = ids
        except Exception:  # noqa: BLE001, S110 - the tower's own inputs: left as made up
            pass
    placed = token is not None and "input_ids" in out and bool((out["input_ids"] == token).any())
    if token is not None and "pixel_values" in out and "input_ids" in out and not placed:
        n, out["pixel_values"] = _image_layout(model, out["pixel_values"], out)
        ids = out["input_ids"]
        per_row = n // ids.shape[0]
        image = torch.full((ids.shape[0], per_row), token, dtype=torch.long)
        out["input_ids"] = torch.cat([ids[:, :1], image, ids[:, 1:]], dim=1)
    elif placed and "pixel_values" in out:
        _recount_placeholders(model, out, token)
    _fit_position_mask(model, out, params)
    _fit_canvas(model, out, params, top, g)
    _fit_video(model, out, top, g)
    _fit_noise(model, out, g)
    _fit_patches(model, out)
    _fit_tiles(model, out)
    return _fit_layout(model, out)


def _fit_canvas(model, out: dict, params, top: int, g) -> None:
    """A block-diffusion decoder's canvas (``config.canvas_length`` ids): left out, the model
    draws it with ``torch.randint`` on every call (DiffusionGemma), so each rank and each run
    would see other tokens."""
    import torch

    length = getattr(model.config, "canvas_length", None)
    wanted = "decoder_input_ids" in params and "decoder_input_ids" not in out
    if isinstance(length, int) and wanted and "input_ids" in out:
        shape = (out["input_ids"].shape[0], length)
        out["decoder_input_ids"] = torch.randint(3, top, shape, generator=g)


def _fit_more_pixels(model, out: dict, params, g) -> None:
    """A second image input of the forward that ``get_image_features`` requires (DeepSeek-VL
    hybrid's ``high_res_pixel_values``: ``<prefix>pixel_values``) made like ``pixel_values``, at
    the image size of the sub-config it names (``<prefix>vision_config``) where there is one."""
    import inspect

    import torch

    pixels = out.get("pixel_values")
    inner = next((m for m in model.modules() if hasattr(m, "get_image_features")), None)
    if inner is None or not isinstance(pixels, torch.Tensor) or pixels.ndim != 4:
        return
    needs = inspect.signature(inner.get_image_features).parameters
    for k, p in needs.items():
        if k == "pixel_values" or not k.endswith("pixel_values") or k in out or k not in params:
            continue
        if p.default is not inspect.Parameter.empty:
            continue
        sub = getattr(model.config, k[: -len("pixel_values")] + "vision_config", None)
        size = getattr(sub, "image_size", None)
        size = (size, size) if isinstance(size, int) else tuple(pixels.shape[-2:])
        out[k] = torch.randn((*pixels.shape[:2], *size), generator=g)


def _fit_patch_pixels(model, out: dict) -> None:
    """Flattened patches [patches, channels x patch x patch] (the trace's layout for a tower
    that reads an ``image_grid_thw``: Qwen2-VL's, whose patch embedding unflattens them) in the
    first layout the tower runs on, where it does not run on them: each patch an image
    [patches, channels, patch, patch] (Kimi-K2.5's conv stem), or those as one sequence
    [1, patches, channels, patch, patch] (PaddleOCR-VL's), or flattened patches as wide as the
    tower's first linear reads (Muse's two frames per patch, ``patch_temporal``)."""
    import torch

    pixels = out.get("pixel_values")
    vision = getattr(model.config, "vision_config", None)
    patch = getattr(vision, "patch_size", None)
    if not isinstance(pixels, torch.Tensor) or pixels.ndim != 2 or not isinstance(patch, int):
        return
    channels = getattr(vision, "num_channels", None) or 3
    tower = next((m for m in model.modules() if getattr(m, "config", None) is vision), model)
    first = next((m for m in tower.modules() if isinstance(m, torch.nn.Linear)), None)
    candidates = [pixels]
    if pixels.shape[1] == channels * patch * patch:
        images = pixels.view(-1, channels, patch, patch)
        candidates += [images, images[None]]
    if first is not None and first.in_features % pixels.shape[1] == 0:
        # patches of more frames than the trace read off the config (Muse's ``patch_temporal``)
        g = torch.Generator().manual_seed(3)
        candidates.append(torch.randn((pixels.shape[0], first.in_features), generator=g))
    for candidate in candidates:
        try:
            _image_tokens(model, candidate, out)
        except Exception:  # noqa: BLE001, S112 - the tower's own error for another layout
            continue
        out["pixel_values"] = candidate
        return


def _fit_video(model, out: dict, top: int, g) -> None:
    """A VLM whose only visual input is a video given as ``pixel_values`` (a
    ``get_video_features`` and no ``get_image_features``: InstructBLIP-Video) gets the made-up
    image as `VIDEO_FRAMES` frames [batch, frames, channels, height, width], text ids where the
    trace made none, and as many video placeholders per row as the features it gives, after
    the first id."""
    import inspect

    import torch

    inner = next((m for m in model.modules() if hasattr(m, "get_video_features")), None)
    pixels = out.get("pixel_values")
    token = getattr(model.config, "video_token_id", None)
    if inner is None or any(hasattr(m, "get_image_features") for m in model.modules()):
        return
    if not isinstance(pixels, torch.Tensor) or pixels.ndim != 4 or not isinstance(token, int):
        return
    video = pixels[:, None].expand(-1, VIDEO_FRAMES, -1, -1, -1).contiguous()
    params = inspect.signature(inner.get_video_features).parameters
    extra = {k: v for k, v in out.items() if k in params and k != "pixel_values"}
    with torch.no_grad():
        feats = inner.get_video_features(pixel_values=video, **extra)
    feats = getattr(feats, "pooler_output", feats)
    rows = video.shape[0]
    ids = out.get("input_ids")
    ids = ids if ids is not None else torch.randint(3, top, (rows, SEQ), generator=g)
    placeholders = torch.full((rows, feats.numel() // feats.shape[-1] // rows), token)
    out["input_ids"] = torch.cat([ids[:, :1], placeholders, ids[:, 1:]], dim=1)
    out["pixel_values"] = video


#: a forward argument that marks the positions image embeddings fill (Kosmos-2's), instead of a
#: placeholder token id
POSITION_MASK = "image_embeds_position_mask"


def _fit_position_mask(model, out: dict, params) -> None:
    """A VLM that takes the image's positions as a mask (`POSITION_MASK`) rather than as
    placeholder ids is given as many positions per row as its tower gives features, after the
    first id (the ids there are text ids, which the image embeddings replace)."""
    import torch

    ids, pixels = out.get("input_ids"), out.get("pixel_values")
    if POSITION_MASK not in params or POSITION_MASK in out or ids is None or pixels is None:
        return
    rows = ids.shape[0]
    per_row = _image_tokens(model, pixels, out) // rows
    image = ids[:, 1:2].expand(rows, per_row)
    out["input_ids"] = torch.cat([ids[:, :1], image, ids[:, 1:]], dim=1)
    mask = torch.zeros(out["input_ids"].shape, dtype=torch.long)
    mask[:, 1 : 1 + per_row] = 1
    out[POSITION_MASK] = mask


#: per-token type ids that mark each placeholder's kind (HunYuan-VL's ``mm_token_type_ids``)
TOKEN_TYPES = ("mm_token_type_ids", "token_type_ids")


def _recount_placeholders(model, out: dict, token: int) -> None:
    """Placeholders the trace made up (one per merged patch of the ``image_grid_thw`` it made
    up) re-counted against the rows ``get_image_features`` gives, where these differ: a tower
    that adds rows of its own (HunYuan-VL's row breaks and image start / end embeddings, 8 for
    a 2 x 2 merged grid) is given that many per text row, after its first id, with the token
    type ids (`TOKEN_TYPES`) of the placeholders moved along. Left as made up where the tower
    does not run on the made-up inputs or the rows do not split evenly over the text rows."""
    import torch

    ids = out["input_ids"]
    have = ids == token
    try:
        n = _image_tokens(model, out["pixel_values"], out)
    except Exception:  # noqa: BLE001 - the tower's own error: the forward reports it
        return
    rows = ids.shape[0]
    if n == int(have.sum()) or n % rows or bool((have.sum(1) != have.sum(1)[0]).any()):
        return
    text = ids[~have].view(rows, -1)
    image = torch.full((rows, n // rows), token, dtype=torch.long)
    out["input_ids"] = torch.cat([text[:, :1], image, text[:, 1:]], dim=1)
    for k in TOKEN_TYPES:
        types = out.get(k)
        if isinstance(types, torch.Tensor) and types.shape == ids.shape:
            kind = int(types[have][0])
            plain = types[~have].view(rows, -1)
            marks = torch.full((rows, n // rows), kind, dtype=types.dtype)
            out[k] = torch.cat([plain[:, :1], marks, plain[:, 1:]], dim=1)


def _fit_image_sizes(model, out: dict) -> None:
    """A VLM whose ``get_image_features`` needs each image's ``image_sizes`` (LLaVA-NeXT's
    any-resolution tiling: [height, width] of the original image, which the trace cannot make
    up) gets the made-up image's own size, one per row."""
    import inspect

    import torch

    pixels = out.get("pixel_values")
    inner = next((m for m in model.modules() if hasattr(m, "get_image_features")), None)
    if inner is None or not isinstance(pixels, torch.Tensor) or "image_sizes" in out:
        return
    param = inspect.signature(inner.get_image_features).parameters.get("image_sizes")
    if param is not None and param.default is inspect.Parameter.empty:
        out["image_sizes"] = torch.tensor([list(pixels.shape[-2:])] * pixels.shape[0])


def _codebook_ids(model) -> dict:
    """Kyutai's ids: [batch, positions, 1 + codebooks], each position's text id then one id per
    audio codebook (the embedding offsets each into its codebook's rows and sums them)."""
    import torch

    g = torch.Generator().manual_seed(1)
    config = model.config
    shape = (BATCH, SEQ, 1 + config.num_codebooks)
    return {
        "input_ids": torch.randint(3, min(VOCAB, config.codebook_vocab_size), shape, generator=g)
    }


def _streamed_audio(model) -> dict:
    """Voxtral-Realtime's inputs: it adds one audio embedding to each text position, so the
    features give exactly as many as there are ids: 8 mel frames each (its conv stem's stride
    2 times the projector's stacking of 4 frames)."""
    import torch

    g = torch.Generator().manual_seed(1)
    bins = model.config.audio_config.num_mel_bins
    return {
        "input_ids": torch.randint(3, TEXT_IDS, (BATCH, SEQ), generator=g),
        "input_features": torch.randn((BATCH, bins, 8 * SEQ), generator=g),
        "use_cache": False,
    }


#: made-up inputs of models whose input layout no rule here gives, by class (keep it small)
OWN_INPUTS = {
    "KyutaiSpeechToTextForConditionalGeneration": _codebook_ids,
    "VoxtralRealtimeForConditionalGeneration": _streamed_audio,
}
#: main inputs that name what they hold (anything else, Perceiver's and SpeechEncoderDecoder's
#: ``inputs``, says nothing: `_fit_main_input`)
KNOWN_INPUTS = (
    "input_ids",
    "pixel_values",
    "pixel_values_videos",
    "input_values",
    "input_features",
)
#: the families whose main input is an image
IMAGE_FAMILIES = ("image-classification", "vision-encoder")
#: the families whose main input is audio, and the audio inputs `_fit_layout` may lay out anew
AUDIO_INPUTS = ("input_values", "input_features")


def _fit_main_input(model, family: str, made: dict) -> None:
    """``made`` (meta tensors from `synthesize_inputs`) fitted to what the model reads, in place:

    - a main input whose name says nothing (`KNOWN_INPUTS`) is, for a wrapper with an encoder
      of its own (SpeechEncoderDecoder's wav2vec2), what that encoder takes as its main input;
      in an image family (`IMAGE_FAMILIES`: Perceiver's learned-position classifier), an image
      [batch, channels, height, width] from the config;
    - a video tower's pixels (a config with ``num_frames``: TimeSformer, VideoMAE, ViViT,
      VideoPrism) are [batch, frames, channels, height, width]: the trace's [batch, channels,
      height, width] image, or its guess of a linear's input for ``pixel_values_videos``, given
      as many frames as the config says."""
    import torch

    from tpkit.plan.inputs import synthesize_inputs

    main = getattr(model, "main_input_name", None)
    encoder = getattr(model, "get_encoder", lambda: None)() if main not in KNOWN_INPUTS else None
    inner = getattr(encoder, "main_input_name", None) if encoder is not model else None
    if main in made and inner in KNOWN_INPUTS[1:]:
        made[main] = synthesize_inputs(encoder, BATCH, SEQ)[1][inner]
    elif main in made and main not in KNOWN_INPUTS and family in IMAGE_FAMILIES:
        made[main] = torch.zeros((BATCH, *_image_chw(model.config)), device="meta")
    video = next((c for c in _vision_configs(model.config) if hasattr(c, "num_frames")), None)
    for k in ("pixel_values", "pixel_values_videos"):
        if video is not None and k in made and made[k].ndim != 5:
            shape = (BATCH, video.num_frames, *_image_chw(video))
            made[k] = torch.zeros(shape, device="meta")


def _image_chw(config) -> tuple[int, int, int]:
    size = getattr(config, "image_size", None)
    size = size if isinstance(size, int) else IMAGE["image_size"]
    return (getattr(config, "num_channels", None) or 3, size, size)


#: the forward argument of a NaFlex tower's per-image patch grid (SigLIP-2), [images, 2]
SPATIAL_SHAPES = "spatial_shapes"


def _fit_patches(model, out: dict) -> None:
    """A NaFlex vision model (a forward that takes `SPATIAL_SHAPES`: SigLIP-2) reads each image
    as its processor gives it, flattened patches [images, patches, patch * patch * channels]
    with the patch grid and a mask of the real patches: the made-up [images, channels, height,
    width] image cut so (the processor's order: rows of patches, each patch's pixels, then
    channels), every patch real."""
    import inspect

    import torch

    pixels = out.get("pixel_values")
    config = getattr(model.config, "vision_config", None) or model.config
    patch = getattr(config, "patch_size", None)
    params = inspect.signature(model.forward).parameters
    if SPATIAL_SHAPES not in params or pixels is None or pixels.ndim != 4 or SPATIAL_SHAPES in out:
        return
    if not isinstance(patch, int):
        return
    b, c, h, w = pixels.shape
    grid = pixels.reshape(b, c, h // patch, patch, w // patch, patch)
    out["pixel_values"] = grid.permute(0, 2, 4, 3, 5, 1).reshape(b, -1, patch * patch * c)
    out[SPATIAL_SHAPES] = torch.tensor([[h // patch, w // patch]] * b)
    mask = [k for k in params if k.startswith("pixel_") and k.endswith("mask")]
    for k in mask:  # SigLIP-2's ``pixel_attention_mask``
        out[k] = torch.ones(out["pixel_values"].shape[:2], dtype=torch.long)


#: the forward arguments of a tiled vision tower (Mllama's): each image's aspect ratio, as an
#: index into the config's ``supported_aspect_ratios`` offset by 1, and its mask of real tiles
ASPECT_RATIO = ("aspect_ratio_ids", "aspect_ratio_mask")


def _fit_tiles(model, out: dict) -> None:
    """A tiled vision tower (a forward that takes `ASPECT_RATIO`: Mllama's) reads images cut
    into tiles, [batch, images, tiles, channels, height, width], with each image's aspect ratio
    id and its tile mask: the made-up image is one image per row, in ``max_num_tiles`` tiles
    (aspect ratio id 1: the config's first ratio, 1 x 1, so one real tile, the others masked,
    as the processor pads a square image)."""
    import inspect

    import torch

    pixels = out.get("pixel_values")
    config = getattr(model.config, "vision_config", None) or model.config
    tiles = getattr(config, "max_num_tiles", None)
    params = inspect.signature(model.forward).parameters
    if not all(k in params for k in ASPECT_RATIO) or pixels is None or pixels.ndim != 4:
        return
    if not isinstance(tiles, int) or any(k in out for k in ASPECT_RATIO):
        return
    b = pixels.shape[0]
    out["pixel_values"] = pixels[:, None, None].expand(b, 1, tiles, *pixels.shape[1:]).clone()
    out["aspect_ratio_ids"] = torch.ones((b, 1), dtype=torch.long)
    mask = torch.zeros((b, 1, tiles), dtype=torch.long)
    mask[:, :, 0] = 1
    out["aspect_ratio_mask"] = mask


def _fit_noise(model, out: dict, g) -> None:
    """A forward that takes ``noise`` (ViT-MAE's random masking: one value per patch, the
    lowest kept) gets one drawn here, so every run of the same inputs masks the same patches:
    without it the reference and the tensor-parallel run drew their own and differed by 3.6."""
    import inspect

    import torch

    pixels = out.get("pixel_values")
    config = getattr(model.config, "vision_config", None) or model.config
    patch = getattr(config, "patch_size", None)
    if "noise" not in inspect.signature(model.forward).parameters or pixels is None:
        return
    if isinstance(patch, int) and "noise" not in out:
        patches = (pixels.shape[-2] // patch) * (pixels.shape[-1] // patch)
        out["noise"] = torch.rand((pixels.shape[0], patches), generator=g)


def _fit_layout(model, out: dict) -> dict:
    """``out`` with its audio input (`AUDIO_INPUTS`) in the layout the model runs on. Nothing in
    a config or signature says whether a waveform is [batch, samples] (wav2vec2 adds the
    channel itself) or [batch, 1, samples] (OmniASR's and VibeVoice's first conv reads it as
    is), nor whether features are [batch, bins, frames] (Whisper) or [batch, frames, bins]
    (Speech2Text transposes them itself), nor how many frames a processor stacks into one
    feature: a copy of the model tries the made-up layout, then the others; the first that
    runs is kept (else the made-up one, whose error the
    reference then reports). A copy, so that no state a forward leaves behind reaches the
    model."""
    import copy
    import inspect

    import torch

    key = next((k for k in AUDIO_INPUTS if isinstance(out.get(k), torch.Tensor)), None)
    if key is None:
        return out
    x = out[key]
    others = [x.unsqueeze(1)] if x.ndim == 2 else [x.transpose(1, 2)] if x.ndim == 3 else []
    if x.ndim == 2 and x.shape[-1] > WAVE_CUT:  # a whole number of a codec's frames
        others.append(x[:, :WAVE_CUT])
    first = next((m for m in model.modules() if isinstance(m, torch.nn.Linear)), None)
    if x.ndim == 3 and first is not None and first.in_features != x.shape[-1]:
        # frames stacked or expanded as the processor does (Granite-Speech: 4 x 80 mel bins,
        # FunASR: 7 x 80) before the encoder's first linear: features as wide as it reads
        g = torch.Generator().manual_seed(2)
        others.append(torch.randn((*x.shape[:2], first.in_features), generator=g))
        # and half as many of them, for a position table that ends before the made-up frame
        # count (FunASR's 63 positions for 64 frames)
        others.append(torch.randn((x.shape[0], x.shape[1] // 2, first.in_features), generator=g))
    if not others:
        return out
    probe = copy.deepcopy(model)
    masked = any(k in inspect.signature(model.forward).parameters for k in AUDIO_MASKS)
    tries = [(c, None) for c in (x, *others)]  # no mask first: the model's own default
    if masked:  # a frame mask over the last axis, else (features [batch, frames, bins]) the 2nd
        tries += [(c, a) for c in (x, *others) for a in ((-1, 1) if c.ndim == 3 else (-1,))]
    for candidate, axis in tries:
        try:
            given = _place_audio(probe, {**out, key: candidate.contiguous()}, key, axis)
            with torch.no_grad():
                probe(**given)
        except Exception:  # noqa: BLE001, S112 - model code may raise anything for a layout
            continue
        return given
    return out


#: forward arguments masking an audio input's padding (per sample or per frame), which some
#: audio-LLMs read unconditionally (Qwen-Omni's ``feature_attention_mask``, Apertus-1.5's
#: ``padding_mask``): all ones, every frame real, over the layout's last axis or (features
#: [batch, frames, bins]: FunASR's) its second (`_fit_layout` tries both)
AUDIO_MASKS = ("feature_attention_mask", "padding_mask", "input_features_mask")


#: a made-up waveform cut to this many samples, for a codec that takes only a whole number
#: of its frames (Muse-Spark's 96 samples; the processor pads to it): 15360 = 2**10 x 15, a
#: multiple of the common hops (96, 120, 128, 160, 240, 256, 320, 480, 512, 640...)
WAVE_CUT = 15360


def _place_audio(model, out: dict, key: str, axis: int | None = None) -> dict:
    """``out`` with as many audio placeholders per row (after its first id) as the model's
    ``get_audio_features`` gives rows for the audio ``out[key]``, where the config names an
    audio token and the ids carry none: an audio-LLM whose tower reads a waveform (OmniASR),
    which `tpkit.plan.inputs` does not count (it counts for ``input_features``). With an
    ``axis``, an all-ones frame mask (`AUDIO_MASKS`) over that axis of the audio is given too,
    where the forward takes one."""
    import inspect

    import torch

    config = model.config
    params = inspect.signature(model.forward).parameters
    mask = next((k for k in AUDIO_MASKS if k in params), None) if axis is not None else None
    if mask is not None and mask not in out:  # every frame real (a required mask: Qwen-Omni's)
        shape = (out[key].shape[0], out[key].shape[axis])
        out = {**out, mask: torch.ones(shape, dtype=torch.long)}
    token = next(
        (
            getattr(config, k)
            for k in ("audio_token_id", "audio_token_index")
            if isinstance(getattr(config, k, None), int)
        ),
        None,
    )
    ids = out.get("input_ids")
    inner = next((m for m in model.modules() if hasattr(m, "get_audio_features")), None)
    if token is None or ids is None or inner is None or bool((ids == token).any()):
        return out
    takes = inspect.signature(inner.get_audio_features).parameters
    extra = {mask: out[mask]} if mask in takes else {}
    with torch.no_grad():
        feats = inner.get_audio_features(out[key], **extra)
    feats = getattr(feats, "pooler_output", feats)
    parts = [feats] if isinstance(feats, torch.Tensor) else list(feats)
    per_row = sum(t.numel() // t.shape[-1] for t in parts) // ids.shape[0]
    audio = torch.full((ids.shape[0], per_row), token, dtype=torch.long)
    return {**out, "input_ids": torch.cat([ids[:, :1], audio, ids[:, 1:]], dim=1)}


def _image_tokens(model, pixel_values, given: dict | None = None) -> int:
    """Placeholder tokens the vision tower fills for ``pixel_values``: the rows of the
    features ``get_image_features`` returns (a tensor, a list per image, or their pooled
    output), given the other inputs it takes from ``given`` (LLaVA-NeXT's ``image_sizes``,
    InstructBLIP's ``qformer_input_ids``)."""
    import inspect

    import torch

    # a head over a VLM without the method itself (ShieldGemma-2, ModernVBERT): its inner model's
    inner = next((m for m in model.modules() if hasattr(m, "get_image_features")), model)
    params = inspect.signature(inner.get_image_features).parameters
    extra = {k: v for k, v in (given or {}).items() if k in params and k != "pixel_values"}
    with torch.no_grad():
        feats = inner.get_image_features(pixel_values=pixel_values, **extra)
    feats = getattr(feats, "pooler_output", feats)
    parts = [feats] if isinstance(feats, torch.Tensor) else list(feats)
    return sum(t.numel() // t.shape[-1] for t in parts)


def _image_layout(model, pixel_values, given: dict | None = None):
    """(placeholders, pixels) for `_image_tokens`: the made-up [batch, channels, height,
    width] images, else one image per row as [batch, 1, channels, height, width] (Idefics-3's
    and ModernVBERT's layout, images per text row: nothing but their code says so), the first
    the vision tower runs on; that one with a mask of its real tiles (`TILE_MASK`, all true:
    Granite-Docling's tiles), which is then put in ``given`` too."""
    import torch

    try:
        return _image_tokens(model, pixel_values, given), pixel_values
    except Exception:  # noqa: BLE001 - the other layout, else its error
        if pixel_values.ndim != 4:
            raise
    pixel_values = pixel_values.unsqueeze(1)
    try:
        return _image_tokens(model, pixel_values, given), pixel_values
    except Exception:  # noqa: BLE001 - with a tile mask, else its error
        if given is None or TILE_MASK in given:
            raise
        mask = torch.ones(pixel_values.shape[:2], dtype=torch.bool)
        n = _image_tokens(model, pixel_values, {**given, TILE_MASK: mask})
        given[TILE_MASK] = mask
        return n, pixel_values


#: the mask of an image's real tiles [batch, tiles] that a tiled VLM's tower reads
TILE_MASK = "pixel_attention_mask"


def _random_text(ids, top: int, g):
    """Made-up ids with their text positions (the first id's value: `synthesize_inputs` fills
    text with one id) drawn at random below ``top``, the placeholders and markers kept."""
    import torch

    out = ids.clone()
    text = ids == ids[0, 0]
    out[text] = torch.randint(3, top, (int(text.sum()),), generator=g)
    return out
