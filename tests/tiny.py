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
    # VibeVoice's speech tokenizers: a conv stack doubling 32 filters over 7 stages of 3 to 8
    # blocks (343M parameters each in a "tiny" model: its sweep row ran out of time): 4 filters,
    # one block a stage, the stages (and so the downsampling) kept
    "vibevoice_acoustic_tokenizer": {"depths": [1] * 7, "num_filters": 4},
    "vibevoice_acoustic_tokenizer_encoder": {"depths": [1] * 7, "num_filters": 4},
    # the LM head needs a decoder; axial position dims must sum to hidden; LSH hashing seeded;
    # its backward needs training mode, whose forward takes only sequences of the full axial
    # length: that set to the tiny inputs' 9 (3 x 3, chunks of 9), with no dropout, so that
    # gradients are compared in training mode (`benchmarks.coverage`)
    "reformer": {
        "is_decoder": True,
        "axial_pos_embds_dim": [32, 32],
        "hash_seed": 0,
        "axial_pos_shape": [3, 3],
        "lsh_attn_chunk_length": 9,
        "local_attn_chunk_length": 9,
        "hidden_dropout_prob": 0.0,
        "local_attention_probs_dropout_prob": 0.0,
    },
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
    # a timm model is built by name, with no size fields to shrink: timm's own tiny test models
    # (``test_resnet``: ResNet's layout, 4 stages of 1 block, 0.4 M parameters) stand in for
    # the defaults' ResNet-50; the backbone's default names none (`FULL_PATCHES`)
    "timm_wrapper": {"architecture": "test_resnet"},
    "timm_backbone": {"backbone": "test_resnet", "out_indices": [1, 2, 3, 4]},
}


# What the default (full-size) config needs to build at all: each a bug of the default itself,
# given the published model's value where the default leaves it unset. A key "sub.attr" is set on
# a sub-config; a callable value is called (a large value built only when used). A sub-config's
# own model type's entry applies to it too (Cohere-Compass's text config is cohere_compass_text).
FULL_PATCHES = {
    "cohere_compass_text": PATCHES["cohere_compass_text"],
    "dbrx": PATCHES["dbrx"],
    "gemma4_assistant": PATCHES["gemma4_assistant"],
    "reformer": {"is_decoder": True},  # the LM head needs a decoder (a masked LM: `full_config`)
    "moonshine_streaming": {"num_key_value_heads": 8},  # read, unset (MHA: 8 query heads)
    # the indexed-attention layers need indexer sizes the default leaves unset (no published
    # values: the index head as wide as the rope, 16 query heads, a 2048-token budget); the
    # multimodal qwen4_exp gets them through its text config's type
    "qwen4_exp_text": {
        "indexer_n_heads": 16,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 256,
        "indexer_budget": 2048,
        "indexer_compress_ratio": 4,
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
    # the default SigLIP tower has 14 heads of a 1152 width (not divisible); the published
    # Aya-Vision checkpoints' tower (SigLIP so400m) has 16
    "aya_vision": {"vision_config.num_attention_heads": 16},
    # the experts are unset though every layer builds them: DiffusionGemma-26B-A4B's MoE, as
    # Gemma-4-26B-A4B's (128 experts of 704, 8 per token)
    "diffusion_gemma_text": {"num_experts": 128, "top_k_experts": 8, "moe_intermediate_size": 704},
    # ESM-2's published vocabulary (33 tokens, pad 1): the default leaves both unset
    "esm": {"vocab_size": 33, "pad_token_id": 1},
    # the image tokenizer's vocabulary map is tokenizer data the default leaves unset; built in
    # the published layout: Chameleon's 8192 VQ codes as "IMGIMG<code in letters>Z" at ids 4 on,
    # "<image>" at 8711
    "chameleon": {"vocabulary_map": lambda: _image_vocabulary("chameleon")},
    # Emu3's 32768 VQ codes as "<|visual token NNNNNN|>" on the top ids of its 184622 (151854 on),
    # the row end "<|extra_200|>" at 151846 (Qwen's extra tokens from 151646), "<image>" at the
    # last id
    "emu3": {"vocabulary_map": lambda: _image_vocabulary("emu3")},
    # the deepstack projectors are unset: the published Granite-4-Vision injects 4 deepstack
    # streams at text layers 0, 3, 6, 9 (its 4 spatial ones at the default's 12..21) through a
    # 4/8 window Q-Former; the vision layers tapped are not published here (evenly spaced)
    "granite4_vision": {
        "deepstack_layer_map": [[-10, 0], [-7, 3], [-4, 6], [-1, 9]],
        "downsample_rate": "4/8",
    },
    # each layer's MLP kind is unset (the model indexes the list per layer) and so is the
    # routing's top-k: as DeepSeek-OCR's decoder, the first layer dense, the rest MoE, 6 experts
    # per token (the default's 32 layers kept)
    "deepseek_ocr2_text": {
        "mlp_layer_types": ["dense"] + ["sparse"] * 31,
        "num_experts_per_tok": 6,
    },
    # a timm backbone names no timm model by default: the one DETR's family names (ResNet-50,
    # its 4 stages)
    "timm_backbone": {"backbone": "resnet50", "out_indices": [1, 2, 3, 4]},
    # the default tower (TimmWrapper's ResNet-50) has no ``model_args``, from whose
    # ``embed_dim`` the projector is built: the published Perception-LM-1B/3B tower, PE-core-L
    # (1024 wide, 23 blocks, 448 px images of 14 px patches, layer scale 0.1, no final norm)
    "perception_lm": {
        "vision_config.architecture": "vit_pe_core_large_patch14_336",
        "vision_config.model_args": lambda: {
            "embed_dim": 1024,
            "depth": 23,
            "img_size": (448, 448),
            "global_pool": "",
            "use_post_transformer_norm": False,
            "init_values": 0.1,
            "ref_feat_shape": (32, 32),
        },
    },
}


def _image_vocabulary(kind: str) -> dict[str, int]:
    """A VQ image tokenizer's vocabulary map (token name to id) in the published layout of
    ``kind``: what Chameleon's and Emu3's models read their image token ids from."""
    if kind == "chameleon":  # digits written as letters: 123 -> "IMGIMGBCDZ"
        digits = {str(i): chr(ord("A") + i) for i in range(10)}
        out = {"IMGIMG" + "".join(digits[c] for c in str(i)) + "Z": 4 + i for i in range(8192)}
        return {**out, "<image>": 8711}
    out = {f"<|visual token {i:06d}|>": 151854 + i for i in range(32768)}
    return {**out, "<|extra_200|>": 151846, "<image>": 184621}


#: unset fields the modeling code divides by, filled as the model's own default would read them
#: (on the config and on each of its sub-configs: HunYuan-VL's text config leaves head_dim None)
_UNSET = {
    "vocab_size": lambda c: 32,  # a CTC head's default (Wav2Vec2-BERT / -Conformer leave it None)
    "head_dim": lambda c: c.hidden_size // c.num_attention_heads,
    "num_key_value_heads": lambda c: c.num_attention_heads,
}
#: a timm backbone the default names (DETR's family) built by transformers' own model of the same
#: layout instead, where timm is not installed (it needs torchvision): timm name -> config kwargs
_TIMM_FREE = {"resnet50": {"model_type": "resnet"}}  # ResNetConfig's defaults are ResNet-50's


def full_config(model_type: str, class_name: str, repairs: list[str] | None = None):
    """The architecture's default config at its full size, as a user of the published model
    builds it: `FULL_PATCHES` and `_UNSET` repair only what keeps the default from building,
    and a timm backbone is swapped for transformers' own (`_TIMM_FREE`) where timm is missing.
    ``repairs``: each repair made is appended to it, in one line (what a report shows)."""
    import transformers
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    if hasattr(transformers, class_name):
        cls = getattr(transformers, class_name).config_class
    log = repairs if repairs is not None else []
    patches = _fresh(FULL_PATCHES.get(model_type, {}))
    kwargs = {k: v for k, v in patches.items() if "." not in k}
    config = cls(**kwargs)
    swap = _timm_free(config)
    if swap is not None:
        kwargs.update(use_timm_backbone=False, backbone_config=swap[0])
        config = cls(**kwargs)
        log.append(swap[1])
    for k, v in patches.items():
        if "." in k:
            sub, attr = k.split(".", 1)
            setattr(getattr(config, sub), attr, v)
    log.extend(f"{k}={_brief(v)}" for k, v in patches.items())
    if class_name.endswith("ForMaskedLM") and getattr(config, "is_decoder", None):
        config.is_decoder = False  # a masked LM reads both ways (Reformer's patch is the LM's)
        log.append("is_decoder=False (a masked LM)")
    _repair_tree(config, log, top=True)
    check_timm(config)
    return config


def _fresh(patches: dict) -> dict:
    """A copy of ``patches`` to hand a config: callables called, the rest deep-copied. A config
    changes a dict it is given in place (transformers adds ``mrope_section`` to a
    ``rope_parameters`` dict), which would change the module's patch for every later build in
    the process: a second build of Cohere-Compass then failed on one rank only."""
    import copy

    return {k: v() if callable(v) else copy.deepcopy(v) for k, v in patches.items()}


def _brief(v) -> str:
    """A patch value in a report: a large one (a vocabulary map) by its size."""
    return f"<{len(v)} entries>" if isinstance(v, dict) and len(v) > 8 else repr(v)


def _repair_tree(config, log: list[str], top: bool) -> None:
    """`_UNSET` fills on ``config`` and, with their own model type's `FULL_PATCHES`, on each of
    its sub-configs (recursively); each repair appended to ``log``."""
    if not top:
        name = getattr(config, "model_type", "")
        for k, v in _fresh(FULL_PATCHES.get(name, {})).items():
            if "." not in k:
                setattr(config, k, v)
                log.append(f"{name}.{k}={_brief(getattr(config, k))}")
    for attr, fill in _UNSET.items():
        try:
            unset = attr in config.to_dict() and getattr(config, attr) is None
        except (AttributeError, RuntimeError):  # a per-layer attribute refuses global reads
            unset = False
        if unset:
            setattr(config, attr, fill(config))
            log.append(f"{'' if top else config.model_type + '.'}{attr}={getattr(config, attr)}")
    for key in getattr(config, "sub_configs", None) or ():
        sub = getattr(config, key, None)
        if hasattr(sub, "to_dict") and hasattr(sub, "model_type"):
            _repair_tree(sub, log, top=False)


class NeedsTimm(ImportError):
    """A model built of timm models where timm is not installed: the row says so in one line
    (transformers' own error names PIL first, then timm, over several lines)."""


def timm_models(config) -> list[str]:
    """The timm models ``config`` builds (on itself or any sub-config, by field: a timm
    wrapper's ``architecture`` with its ``model_args``, a timm backbone's ``backbone``, a
    model's ``use_timm_backbone``), as "where: name"."""
    out, todo, seen = [], [("config", config)], set()
    while todo:
        where, c = todo.pop()
        if id(c) in seen:
            continue
        seen.add(id(c))
        fields = vars(c)
        if "architecture" in fields and "model_args" in fields:
            out.append(f"{where}: {c.architecture}")
        if getattr(c, "model_type", None) == "timm_backbone" or fields.get("use_timm_backbone"):
            out.append(f"{where}: {getattr(c, 'backbone', None)}")
        todo += [(f"{where}.{k}", v) for k, v in fields.items() if hasattr(v, "to_dict")]
    return out


def check_timm(config) -> None:
    """Raise `NeedsTimm` (one line: which timm models, and why timm is missing) when
    ``config`` builds timm models and timm cannot be imported."""
    import importlib.util

    names = timm_models(config)
    if names and importlib.util.find_spec("timm") is None:
        raise NeedsTimm(
            f"needs timm ({'; '.join(names)}), which is not installed: timm needs torchvision, "
            "which cannot be installed beside this torch build; run this row where timm is"
        )


def _timm_free(config) -> tuple | None:
    """(transformers' backbone config, the repair in a line) for a config whose backbone is a
    timm model `_TIMM_FREE` knows, when timm is not installed; else None. The backbone's
    stages are the timm one's ``out_indices``."""
    import importlib.util

    from transformers import CONFIG_MAPPING

    bb = getattr(config, "backbone_config", None)
    name = getattr(bb, "backbone", None)
    if getattr(bb, "model_type", None) != "timm_backbone" or name not in _TIMM_FREE:
        return None
    if importlib.util.find_spec("timm") is not None:
        return None
    fields = dict(_TIMM_FREE[name])
    kind = fields.pop("model_type")
    stages = list(getattr(bb, "out_indices", None) or [4])
    out = CONFIG_MAPPING[kind](**fields, out_features=[f"stage{i}" for i in stages])
    return out, (
        f"use_timm_backbone=False: transformers' {kind} ({name} layout, stages {stages}) as "
        "backbone_config, timm not being installed"
    )


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
    patches = _fresh(PATCHES.get(model_type, {}))
    try:
        default = cls()
    except Exception:  # noqa: BLE001 - a default that fails its own checks (Gemma-4 assistant)
        default = cls(**{k: v for k, v in patches.items() if "." not in k})
    fields = default.to_dict()
    towers = ("vision_config", "audio_config", "text_config", "encoder")
    if any(k in fields for k in towers) or any(
        isinstance(v, dict) and any(k in v for k in towers) for v in fields.values()
    ):  # also a model of models (pi0's PaliGemma under ``vlm_config``: 3B left unshrunk)
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
