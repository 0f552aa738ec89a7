"""Tiny models of every family a user loads with an Auto class (issue 29): multimodal configs,
their sub-configs shrunk one by one by the rules of `tests.tiny`, and the relations between
towers a config checks kept (`FAMILY_PATCHES`). Inputs for them are `tests.tiny_inputs`."""

from __future__ import annotations

import copy

from tests.tiny import (
    PATCHES,
    SIZES,
    TOKEN_IDS,
    VOCAB,
    _ints,
    _layer_list,
    _restage,
    _shrink,
    check_timm,
    tiny_config,
)

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


#: a text config's output vocabulary under its padded ``vocab_size`` (Inkling-2's head of
#: 200058 logits over a 201024-row embedding): the tiny vocabulary, or the tiny model kept a
#: 200058-wide head (25 M parameters, 20 times the rest)
UNPADDED_VOCAB = ("unpadded_vocab_size",)
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
    kinds = fields.get("layers_block_type")
    if "num_hidden_layers" not in fields and isinstance(kinds, list) and len(kinds) > 2:
        # a hybrid config whose layer count is its list of layer kinds (Nemotron-H's 52, a
        # property, so `_shrink` sees no count to cut by): one layer of each kind
        kwargs["layers_block_type"] = _layer_list(kinds, max(2, len(set(kinds))))
    kwargs.update({k: v for k, v in AUDIO.items() if isinstance(fields.get(k), int)})
    for k in UNPADDED_VOCAB:  # the head's real vocabulary under the padded embedding's
        if isinstance(fields.get(k), int) and "vocab_size" in kwargs:
            kwargs[k] = kwargs["vocab_size"]
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
    _fit_sibling_widths(fields, kwargs)
    for k, v in PATCHES.get(fields.get("model_type"), {}).items():  # a sub-config's own bugs
        if "." in k:
            continue
        v = copy.deepcopy(v)  # the config may add to it in place (rope's mrope_section)
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


#: endings of a sub-config's list of conv stage widths whose last stage feeds a sibling
#: sub-config (`_fit_sibling_widths`)
CHANNEL_LISTS = ("_channels",)


def _fit_sibling_widths(fields: dict, kwargs: dict) -> None:
    """Widths one sub-config repeats of a sibling's, at every level of the tree (the top level's
    own copies are `_fit_towers`'):

    - a copy of a sibling tower's width (`TOWER_WIDTHS`: Nemotron-3 diarization's
      ``head_config.audio_hidden_size`` 512 beside its ``audio_config``, which its config checks
      as it is built) is that tower's tiny width;
    - a list of conv stage widths (`CHANNEL_LISTS`) that ends at a sibling's default hidden size
      feeds that sibling (DeepSeek-OCR-2's SAM neck, ``downsample_channels`` [512, 896], into its
      896-wide encoder; Unlimited-OCR's [512, 1024] into its 1024-wide CLIP): it ends at the
      sibling's tiny width, each earlier stage half the next."""
    widths = {  # each sibling's default hidden size: its tiny one
        fields[name]["hidden_size"]: sub["hidden_size"]
        for name, sub in kwargs.items()
        if isinstance(sub, dict)
        and isinstance(fields.get(name), dict)
        and type(fields[name].get("hidden_size")) is int
        and type(sub.get("hidden_size")) is int
    }
    for name, sub in kwargs.items():
        if not isinstance(sub, dict):
            continue
        for k, tower in TOWER_WIDTHS.items():
            inner = kwargs.get(tower)
            width = inner.get("hidden_size") if isinstance(inner, dict) else None
            if isinstance(sub.get(k), int) and isinstance(width, int):
                sub[k] = width
        own = fields[name].get("hidden_size") if isinstance(fields.get(name), dict) else None
        for k, v in sub.items():
            if not (k.endswith(CHANNEL_LISTS) and _ints(v) and v and v[-1] in widths):
                continue
            if v[-1] == own:  # its own width, not a sibling's
                continue
            end = widths[v[-1]]
            sub[k] = [max(1, end // 2 ** (len(v) - 1 - i)) for i in range(len(v))]


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
        _fit_backbone(config)
        patches = FAMILY_PATCHES.get(model_type, {})  # built when used, as below
        patches = {k: v() if callable(v) else copy.deepcopy(v) for k, v in patches.items()}
        _set_fields(config, patches)  # a built text-path config
        return config
    cls = CONFIG_MAPPING[model_type]
    if class_name and hasattr(transformers, class_name):
        cls = getattr(transformers, class_name).config_class
    fields = cls().to_dict()
    kwargs = _shrink_tree(fields, True)
    for k, v in FAMILY_PATCHES.get(model_type, {}).items():  # checked as the config is built
        *path, attr = k.split(".")
        target = kwargs
        for sub in path:  # a sub-config's sub-config: vision_config.sam_config.field
            target = target[sub]
        target[attr] = v() if callable(v) else copy.deepcopy(v)  # a value built when used
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
    _fit_backbone(config)
    _set_fields(config, CLASS_PATCHES.get(class_name, {}))
    config._attn_implementation = "eager"
    return config


#: a timm backbone (DETR's family: ``timm_backbone`` named ``resnet50``) built by transformers'
#: own model of that layout instead when timm is not installed (timm needs torchvision, which
#: cannot be installed beside the CPU torch build here): timm name -> transformers model type
TIMM_FREE = {"resnet50": "resnet"}
#: the tiny stand-in backbone's stages: as many as the timm one's ``out_indices`` name, each one
#: basic block, 8 to 64 channels (ResNet-50's 256-2048 bottlenecks are 23 M parameters)
BACKBONE_WIDTH = 8


def _fit_backbone(config) -> None:
    """A config whose backbone is a timm model (`TIMM_FREE`) gets, where timm is missing,
    transformers' own backbone of the same layout, shrunk (`BACKBONE_WIDTH`), with the stages
    the timm one's ``out_indices`` name, and ``use_timm_backbone`` off: the model then builds
    it with ``load_backbone`` as it would a published transformers backbone. The detector on
    top reads only the stages' channel counts (``backbone.channels``), so nothing else moves."""
    import importlib.util

    from transformers import CONFIG_MAPPING

    backbone = getattr(config, "backbone_config", None)
    kind = TIMM_FREE.get(getattr(backbone, "backbone", None))
    if getattr(backbone, "model_type", None) != "timm_backbone" or kind is None:
        return
    if importlib.util.find_spec("timm") is not None:
        return
    stages = list(getattr(backbone, "out_indices", None) or [4])
    n = max(stages)
    config.backbone_config = CONFIG_MAPPING[kind](
        num_channels=getattr(backbone, "num_channels", 3),
        embedding_size=BACKBONE_WIDTH,
        hidden_sizes=[BACKBONE_WIDTH * 2**i for i in range(n)],
        depths=[1] * n,
        layer_type="basic",
        out_features=[f"stage{i}" for i in stages],
    )
    if hasattr(config, "use_timm_backbone"):
        config.use_timm_backbone = False


def _set_fields(config, patches: dict) -> None:
    """Set ``patches`` (``field`` or ``sub_config.field``) on a built config."""
    for k, v in patches.items():
        *path, attr = k.split(".")
        target = config
        for sub in path:
            target = getattr(target, sub)
        setattr(target, attr, v)


#: a VLM's timm vision tower (``vision_config`` of type ``timm_wrapper``), tiny: a timm model is
#: built by name with ``model_args`` (no sizes a shrinker could read), so its size is set here
#: as transformers' own tests set it; ``image_size`` is the made-up image's side (the tower
#: takes any; `tpkit.trace.inputs` reads it). Needs timm (`tests.tiny.check_timm`).
TIMM_TOWERS = {
    # FastViT-MCi3 reparameterised (``inference_mode``, the published layout): 2 stages of 2
    # RepMixer blocks, 8 / 16 channels; its conv head gives ``hidden_size`` channels
    "fast_vlm": {
        "architecture": "fastvit_mci3",
        "hidden_size": 32,
        "image_size": 32,
        "model_args": {
            "inference_mode": True,
            "layers": (2, 2),
            "embed_dims": (8, 16),
            "mlp_ratios": (4, 4),
            "se_downsamples": (False, False),
            "downsamples": (False, True),
            "pos_embs": (None, None),
            "token_mixers": ("repmixer", "repmixer"),
            "lkc_use_act": True,
            "stem_use_scale_branch": False,
        },
    },
    # the published Perception-LM's PE-core ViT (its projector reads ``embed_dim``): 2 blocks of
    # 64, 4 heads, on a 28 px image (2 x 2 patches of 14, the rotary's reference grid)
    "perception_lm": {
        "architecture": "vit_pe_core_large_patch14_336",
        "image_size": 28,
        "model_args": {
            "embed_dim": 64,
            "depth": 2,
            "num_heads": 4,
            "img_size": (28, 28),
            "ref_feat_shape": (2, 2),
            "global_pool": "",
            "use_post_transformer_norm": False,
            "init_values": 0.1,
        },
    },
}


def _mobilenet_v5_blocks() -> list:
    """A tiny MobileNet-V5 (Gemma-3n's tower) as timm's ``block_args``: the published
    layout's kinds of block (an edge-residual stem stage, universal inverted residuals, a
    multi-query attention between them) in 3 stages of 16-32 channels, each halving the grid.
    timm builds MobileNet-V5 from decoded block strings only; where timm is missing they stay
    strings (the model cannot be built then anyway: `check_timm` says so first)."""
    stages = [
        ["er_r1_k3_s2_e4_c16"],
        ["uir_r1_a3_k5_s2_e4_c32"],
        ["uir_r1_a3_k5_s2_e4_c32", "mqa_r1_k3_h2_s1_d16_c32", "uir_r1_a0_k0_s1_e2_c32"],
    ]
    try:
        from timm.models.mobilenetv5 import decode_arch_def  # its builder, re-exported
    except ImportError:
        return stages
    return decode_arch_def(stages)


TIMM_TOWERS["gemma3n"] = {
    # MobileNet-V5's fusion adapter always gives 2048 channels (the tower's ``hidden_size``,
    # which the model reshapes its output by), pooled to a 2 x 2 grid: 4 soft tokens an image
    "hidden_size": 2048,
    "image_size": 32,
    "model_args": lambda: {"block_args": _mobilenet_v5_blocks(), "msfa_output_resolution": 2},
}
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
    # its ``patch_size`` is the pixels of each patch its ViTs see as a whole image (it checks
    # that each sub-config's ``image_size`` equals it), and its forward refuses an image whose
    # smallest scale (ratio 0.25) is under one patch: 8-px patches of the 32-px tiny image, 2-px
    # ViT patches; its ``intermediate_hook_ids`` (11, 5) name layers of the 2-layer patch ViT,
    # and its fusion widths (256-1024) shrink like the rest. Set on the built config: `tiny_config`
    # gives it (no text sub-config), so these bypass the build-time check, which they satisfy
    "depth_pro": {
        "patch_size": 8,
        "intermediate_hook_ids": [1, 0],
        "intermediate_feature_dims": [64, 64],
        "scaled_images_feature_dims": [64, 64, 64],
        "fusion_hidden_size": 64,
        **{
            f"{sub}.{k}": v
            for sub in ("image_model_config", "patch_model_config", "fov_model_config")
            for k, v in (("image_size", 8), ("patch_size", 2))
        },
    },
    # its SAM neck's last conv stage feeds the encoder, whose width the modeling code reads
    # (``torch.cat`` with its learned queries): the default config's [512, 896] names the
    # published 896-wide encoder, not its own default encoder_config (4096), so no width rule
    # sees the relation
    "deepseek_ocr2": {"vision_config.sam_config.downsample_channels": [32, 64]},
    # its default leaves the deepstack projectors unset (the model takes len() of the map):
    # (vision hidden state, text layer) pairs naming the tiny 2-layer tower's and text model's
    # layers; a Q-Former window of 4 patches (the tiny 4 x 4 grid: the published 8 is wider)
    # read by 2 x 2 queries; the 4 spatial offset groups injected at the 2 text layers
    "granite4_vision": {
        "deepstack_layer_map": [[-1, 0], [-2, 1]],
        "downsample_rate": "2/4",
        "spatial_target_layers": [0, 1, 0, 1],
    },
    # the projector reads 2 x 2 merged patches of the tower (4 x its 64) and is 128 wide inside
    **{
        t: {"out_hidden_size": 256, "projector_hidden_size": 128}
        for t in ("muse_glimmer", "muse_spark")
    },
    # timm towers (`TIMM_TOWERS`): the published timm architecture, shrunk through the
    # ``model_args`` timm builds it with, as transformers' own tests shrink it
    **{t: {f"vision_config.{k}": v for k, v in tower.items()} for t, tower in TIMM_TOWERS.items()},
}
FAMILY_PATCHES["gemma3n"].update(
    {
        "vision_soft_tokens_per_image": 4,  # the 2 x 2 pooled grid
        # the per-layer token embeddings (262144 ids x 35 layers x 256: 134 M parameters of
        # the tiny model's 136 M) over the tiny vocabulary
        "text_config.vocab_size_per_layer_input": VOCAB,
    }
)


def _vq_vocabulary(kind: str) -> dict[str, int]:
    """A VQ image tokenizer's vocabulary map (token name to id: tokenizer data a default config
    leaves unset, from which Chameleon's and Emu3's models read their image token ids) in the
    published naming, for the tiny model: `CODEBOOK` codes from a third of the tiny vocabulary
    on (as `_fit_offsets` lays code ranges out), Emu3's row end after them, and the ``<image>``
    placeholder on a free id above the random text ids (`TEXT_IDS`)."""
    start = VOCAB // 3
    if kind == "chameleon":  # digits written as letters: 12 -> "IMGIMGBCZ"
        digits = {str(i): chr(ord("A") + i) for i in range(10)}
        codes = {
            "IMGIMG" + "".join(digits[c] for c in str(i)) + "Z": start + i for i in range(CODEBOOK)
        }
        return {**codes, "<image>": TEXT_IDS + 1}
    codes = {f"<|visual token {i:06d}|>": start + i for i in range(CODEBOOK)}
    return {**codes, "<|extra_200|>": start + CODEBOOK, "<image>": TEXT_IDS + 1}


#: a VQ image tokenizer's encoder, tiny: 32 base channels (its GroupNorms have 32 groups), one
#: res block, and stages (``channel_multiplier``, below) that downsample the 32-px image 8 times
#: (4 x 4 codes per image: the text model has 64 positions)
VQ_TOWER = {"base_channels": 32, "num_res_blocks": 1}
FAMILY_PATCHES.update(
    {
        # its codes must fit the tiny vocabulary: `CODEBOOK` codes, each a named token of the
        # vocabulary map (`_vq_vocabulary`)
        "chameleon": {
            "vocabulary_map": _vq_vocabulary("chameleon"),
            "image_token_id": TEXT_IDS + 1,  # its config reads it off the map, then drops it
            "vq_config.num_embeddings": CODEBOOK,
            "vq_config.channel_multiplier": [1, 1, 1, 2],
            "vq_config.latent_channels": 16,
            "vq_config.resolution": 32,
            **{f"vq_config.{k}": v for k, v in VQ_TOWER.items()},
        },
        "emu3": {
            "vocabulary_map": _vq_vocabulary("emu3"),
            "vq_config.codebook_size": CODEBOOK,
            "vq_config.channel_multiplier": [1, 1, 1, 2],
            **{f"vq_config.{k}": v for k, v in VQ_TOWER.items()},
        },
    }
)
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
#: the same for an audio sub-config, whose projector into the text model is ``output_dim`` wide
#: (Qwen3-ASR's and Qwen-Omni's 3584, Qwen2.5-7B's width, left against the tiny text model's 64
#: where the text default is another: Qwen3-ASR's). Audio configs only: elsewhere the name means
#: an inner width (Granite-Speech's encoder feed-forward, ESMFold-2's atom stack)
AUDIO_OUTPUT_WIDTHS = (*OUTPUT_WIDTHS, "output_dim")
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
    for n, names in (("vision_config", OUTPUT_WIDTHS), ("audio_config", AUDIO_OUTPUT_WIDTHS)):
        sub = getattr(config, n, None)
        for k in names:
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
    check_timm(config)
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
