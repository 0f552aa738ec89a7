"""Trace inputs made up from the model itself, when the user gives none.

A trace needs one forward, and a forward needs the inputs its code reads: token ids for a
language model, ``pixel_values`` for ViT / ResNet / ConvNeXt, ``input_values`` for Wav2Vec2,
``input_features`` + ``decoder_input_ids`` for Whisper, both towers' inputs for a dual encoder
(CLIP), and, for a bare transformer block, ``hidden_states`` plus whatever its forward requires
(rotary ``position_embeddings``, Bloom's ``alibi`` and additive mask). The names come from the
model's ``main_input_name``, an overridden ``dummy_inputs`` and its forward's signature; the
sizes from its config (image size and channels, the feature extractor's strides, mel bins) or,
for a plain module, from its first layer's weight. transformers has no such helper beyond
``dummy_inputs``, which gives only ``input_ids`` for most models.

A multimodal model's towers get inputs that agree with its ids: a grid VLM's patches and grid,
an audio-LLM's features, feature mask and as many placeholders as its tower gives features;
an index argument that a config's list of names sizes (X-MOD's ``lang_ids``) is given too.
Pure: meta tensors and small CPU integer tensors; the one forward run here is an audio-LLM's
audio features on fake tensors, once per model, to count its placeholders
(`_audio_tokens`, under `tpkit.trace.shadow.ShadowValues`: the mask's lengths are read).
A trace that fails on these inputs falls back per layer (`tpkit.sources.fallback`).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from tpkit.compat import fake_mode
from tpkit.plan.layout import in_width, kind_of
from tpkit.trace.kept_state import kept_attributes
from tpkit.trace.shadow import GivenValues, ShadowValues

__all__ = [
    "GRID_IMAGE",
    "InputRecipe",
    "input_embeddings",
    "output_embeddings",
    "synthesize_inputs",
    "text_only",
    "trying",
    "unflattened_patches",
]

#: the side of a made-up image when the config names none (ResNet, ConvNeXt): every stem and
#: downsampling stage of those nets still leaves at least one pixel
DEFAULT_IMAGE = 32
#: frames of made-up audio (1 s at wav2vec2's 20 ms per frame)
MIN_FRAMES = 50
#: config attributes that say the token ids carry image / audio placeholders (LLaVA, Qwen2-VL,
#: Qwen2-Audio): such a model's towers run only when their input is given with the ids
_PLACEHOLDERS = (
    "image_token_id",
    "image_token_index",
    "audio_token_id",
    "audio_token_index",
)
#: words in a forward argument ``image_*`` that give the images' layout as values (`_tower_names`)
_LAYOUT = ("grid",)
#: the inputs of a placeholder model's towers, each traced with the ids (`_tower_names`)
_TOWER_INPUTS = ("pixel_values", "input_features", "input_values")
#: a made-up grid image's side in merged patches (`_grid_inputs`): 2 x 2 tokens per image, each
#: ``spatial_merge_size``**2 patches, one temporal patch; small whatever the model's size
GRID_IMAGE = 2
#: the grid argument's columns, by the ending of its name (`_grid_inputs`)
_GRID_COLUMNS = MappingProxyType({"_grid_thw": 3, "_grid_hw": 2})
#: the forward argument of a NaFlex tower's per-image patch grid, [images, 2] (`_grid_inputs`)
_SHAPES = "spatial_shapes"
#: the ending of a forward argument ``image_*`` that gives each image's merge size, [images]
#: (VideoLLaMA-3's ``image_merge_sizes``: the processor's, no config field): `_grid_inputs`
_MERGES = "merge_sizes"
#: config attributes of the tokens that open / close an image (`_grid_inputs`), first found
_IMAGE_START = ("vision_start_token_id", "image_start_token_id", "boi_token_id")
_IMAGE_END = ("vision_end_token_id", "image_end_token_id", "eoi_token_id")
#: config attributes of an audio-LLM's audio placeholder token (`_audio_inputs`), first found
_AUDIO_TOKEN = ("audio_token_id", "audio_token_index")
#: forward arguments named ``<stem>_ids`` that are not an index set by a config list
#: (`_config_ids`): token, position and segment ids have their own rules or defaults
_OWN_IDS = ("input", "position", "token_type", "decoder_input", "decoder_position", "cache")


@dataclass
class InputRecipe:
    """How one analysis makes up its model's inputs: settled by the trace's retries, then used
    by every later forward of the same analysis (its dry runs), and what was measured once.
    One per `tpkit.trace.analysis.Analysis`: nothing of it outlives the analysis, so a
    model planned twice is planned twice the same way.

    - ``one_row``: the forward refused `tpkit.trace.fake.TRACE_BATCH` rows and ran with one
      (GPT-2's sequence classifiers without a pad token);
    - ``text_only``: the forward with tower inputs failed and the ids alone ran (`text_only`);
    - ``unflat``: a grid VLM's patches ran unflattened (`unflattened_patches`);
    - ``audio_tokens``: an audio-LLM's placeholders per made-up audio (`_audio_tokens`),
      measured once (``audio_measured``; None where that forward failed);
    - ``codebook_width``: the ids layout of a model with ``num_codebooks``
      (`_codebook_ids_shape`), read once off its input embedding (None: not read yet, or
      stacked)."""

    one_row: bool = False
    text_only: bool = False
    unflat: bool = False
    audio_tokens: int | None = None
    audio_measured: bool = False
    codebook_width: int | None = None


@contextlib.contextmanager
def trying(recipe: InputRecipe, **changes: bool) -> Iterator[None]:
    """``recipe`` with ``changes`` inside the block, and from then on if it exits cleanly (the
    forward accepted the inputs made so); put back as it was when the block raises."""
    saved = {k: getattr(recipe, k) for k in changes}
    for k, v in changes.items():
        setattr(recipe, k, v)
    try:
        yield
    except BaseException:
        for k, v in saved.items():
            setattr(recipe, k, v)
        raise


def text_only(recipe: InputRecipe) -> contextlib.AbstractContextManager[None]:
    """Inside the block, and from then on if it exits cleanly, the made-up inputs carry no
    tower inputs (the ids alone, as before towers were traced): the trace's retry when a
    forward with made-up images or audio fails, so one tower the made-up inputs do not fit
    costs that tower's split, not the whole plan."""
    return trying(recipe, text_only=True)


@contextlib.contextmanager
def unflattened_patches(model: nn.Module, recipe: InputRecipe) -> Iterator[bool]:
    """Inside the block, and from then on if it exits cleanly, a grid VLM's made-up patches are
    [patches, channels, (temporal,) patch, patch] instead of flattened to one row each: the
    trace's retry before `text_only`. The processors of the Qwen2-VL lineage flatten each
    patch, PaddleOCR-VL's keeps it as an image its patch embedding reshapes as five dims, and
    nothing in the model's config or signature says which (each tower's code does): the
    layout that runs is the one kept. Yields whether the model has grid inputs at all (False:
    nothing changed, no retry is worth a trace)."""
    config = getattr(model, "config", None)
    grid = config is not None and not recipe.unflat
    grid = grid and bool(_grid_inputs(model, config, _params(model), 1, 1, recipe))
    if not grid:
        yield False
        return
    with trying(recipe, unflat=True):
        yield True


def synthesize_inputs(
    model: nn.Module, batch: int, seq: int, recipe: InputRecipe | None = None
) -> tuple[tuple, dict]:
    """(args, kwargs) of meta tensors that ``model``'s forward accepts, ``batch`` rows of
    ``seq`` tokens / frames / patches, made as ``recipe`` says (a fresh one: the first try).
    Raises ValueError when the model has nothing to read sizes from (no config, no Linear,
    Conv1D, Embedding, EmbeddingBag or conv)."""
    recipe = InputRecipe() if recipe is None else recipe
    config = getattr(model, "config", None)
    if config is not None and hasattr(model, "get_input_embeddings"):  # a transformers model
        return (), _model_inputs(model, config, batch, seq, recipe)
    return _module_inputs(model, batch, seq)


def _params(model: nn.Module) -> dict[str, inspect.Parameter]:
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return {}
    kinds = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return {n: p for n, p in sig.parameters.items() if p.kind not in kinds}


def _required(params: dict[str, inspect.Parameter]) -> list[str]:
    return [n for n, p in params.items() if p.default is inspect.Parameter.empty]


def _configs(config: Any) -> Iterator[Any]:
    """The config, then its sub-configs (CLIP's vision_config, a VLM's text_config)."""
    yield config
    for name in (
        "vision_config",
        "audio_config",
        "encoder_config",
        "encoder",
        "text_config",
        "decoder",
    ):
        sub = getattr(config, name, None)
        if sub is not None and not isinstance(sub, (int, float, str, bool)):
            yield sub


def _read(config: Any, *names: str) -> Any:
    for c in _configs(config):
        for name in names:
            value = getattr(c, name, None)
            if value is not None:
                return value
    return None


def _model_inputs(
    model: nn.Module, config: Any, batch: int, seq: int, recipe: InputRecipe
) -> dict[str, Any]:
    """A transformers model's inputs: its main input, a dual encoder's other tower, the
    decoder's start ids, every required argument, ``use_cache=False``."""
    params = _params(model)
    main = getattr(model, "main_input_name", "input_ids")
    names = [main]
    # a mask is optional everywhere, and a made-up one only adds data-dependent branches
    names += [n for n in _dummy_names(model) if n in params and "mask" not in n]
    dual = (
        getattr(config, "text_config", None) is not None
        and not any(_read(config, p) is not None for p in _PLACEHOLDERS)
        and "input_ids" in params
    )
    if dual:  # CLIP, SigLIP, CLAP: both towers run in one forward, each needs its input
        names += [n for n in ("input_ids", "pixel_values", "input_features") if n in params]
    towers = not recipe.text_only
    if not towers:  # a tower input named by ``dummy_inputs`` (Voxtral's input_features) too
        names = [n for n in names if n == main or n not in _TOWER_INPUTS]
    names += _tower_names(config, params) if towers else []
    if getattr(config, "is_encoder_decoder", False) or "decoder_input_ids" in _required(params):
        names.append("decoder_input_ids")
    names += _required(params)
    kwargs: dict[str, Any] = {}
    for name in dict.fromkeys(names):
        value = _model_input(model, config, name, batch, seq, recipe)
        if value is not None:
            kwargs[name] = value
    if main not in kwargs and main in params:  # Perceiver's ``inputs``: what its first layer reads
        first = _first_input(model, batch, seq)
        if first is not None:
            kwargs[main] = first[0]
    if towers:
        kwargs.update(_grid_inputs(model, config, params, batch, seq, recipe))
        kwargs.update(_audio_inputs(model, config, params, batch, seq, recipe))
    kwargs.update(_config_ids(config, params, batch))
    _naflex_patches(config, params, kwargs)
    pixels = kwargs.get("pixel_values")
    if pixels is not None and pixels.ndim == 4 and _vision_takes(model, config, "image_sizes"):
        # a Pixtral tower (Mistral-3) cuts each image to its size: the whole made-up image
        kwargs["image_sizes"] = torch.tensor([list(pixels.shape[-2:])] * len(pixels))
    if "use_cache" in params or getattr(config, "use_cache", None) is not None:
        kwargs["use_cache"] = False
    return kwargs


def _naflex_patches(config: Any, params: dict[str, inspect.Parameter], kwargs: dict) -> None:
    """A NaFlex vision model (a forward that takes `_SHAPES` beside its pixels: SigLIP-2's
    encoders and classifier) reads each image as its processor gives it, flattened patches
    [images, patches, channels * patch * patch] with each image's patch grid, whose values its
    code reads (positional embeddings resized to the grid): the made-up [images, channels,
    height, width] image as such, every patch real. Without it the patch embedding's
    ``Linear(channels * patch * patch)`` met the image's width, the trace failed and the model
    took the per-layer fallback (its position table split, read whole by the resize)."""
    pixels = kwargs.get("pixel_values")
    patch = _read(config, "patch_size")
    if _SHAPES not in params or _SHAPES in kwargs or pixels is None or pixels.ndim != 4:
        return
    if not isinstance(patch, int) or patch <= 0 or min(pixels.shape[-2:]) < patch:
        return
    b, c, h, w = pixels.shape
    rows, cols = h // patch, w // patch
    shape = (b, rows * cols, c * patch * patch)
    kwargs["pixel_values"] = torch.zeros(shape, dtype=pixels.dtype, device=pixels.device)
    kwargs[_SHAPES] = torch.tensor([[rows, cols]] * b)
    for name in _required(params):  # Siglip2VisionModel requires its ``pixel_attention_mask``
        if name.startswith("pixel_") and name.endswith("mask"):
            kwargs[name] = torch.ones(shape[:2], dtype=torch.long)


def _tower_names(config: Any, params: dict[str, inspect.Parameter]) -> list[str]:
    """The inputs of a multimodal model's vision and audio towers (``pixel_values``,
    ``input_features``), traced with its token ids: without them the towers never run in the
    trace, inference sees none of their linears and leaves every one whole (a tiny LLaVA's
    vision tower and projector were 0% split). A fake forward does not read the values, so the
    ids need no placeholders for the features: the dataflow is the same. Only a tower whose
    config says it is there (`_PLACEHOLDERS`, and a sub-config of its modality) is fed, and no
    vision tower whose forward takes the images' patch grid (`_LAYOUT`: Qwen2-VL's
    ``image_grid_thw``, 35 image-text-to-text models): its code reads those values, which a
    fake forward has not, and its pixels are flattened patches, not [batch, channels, height,
    width], so that trace keeps to the ids as before."""
    if not any(_read(config, p) is not None for p in _PLACEHOLDERS):
        return []
    out = []
    layout = [n for n in params if n.startswith("image_") and any(w in n for w in _LAYOUT)]
    layout += [n for n in params if n == _SHAPES]
    if (
        getattr(config, "vision_config", None) is not None
        and "pixel_values" in params
        and not layout
    ):
        out.append("pixel_values")
    if getattr(config, "audio_config", None) is not None:
        out += [n for n in _TOWER_INPUTS[1:] if n in params][:1]
    return out


def _grid_inputs(
    model: nn.Module,
    config: Any,
    params: dict[str, inspect.Parameter],
    batch: int,
    seq: int,
    recipe: InputRecipe,
) -> dict[str, torch.Tensor]:
    """A grid VLM's image inputs, consistent with each other (Qwen2-VL lineage: a forward that
    takes ``image_grid_thw`` / ``image_grid_hw``): one image per row of `GRID_IMAGE` x
    `GRID_IMAGE` merged patches; ``pixel_values`` as the flattened patches the tower takes,
    [sum(t * h * w), channels * temporal_patch_size * patch_size**2] (meta); the grid with its
    real values; ``input_ids`` with as many image placeholders per row as the tower gives
    features (t * h * w / spatial_merge_size**2), between the image start / end tokens where
    the config names them, and ``mm_token_type_ids`` marking them where the forward takes it.
    The grid, ids and token types are small CPU tensors: their code reads their values (the
    rotary positions per image, the attention's per-image lengths, the placeholder count), so
    the fake forward is given them (`tpkit.trace.fake.fake_inputs` keeps the values of integer
    inputs for `tpkit.trace.shadow.ShadowValues`). {} for any other model, or where the vision
    config lacks a patch size."""
    placeholder = next(
        (
            v
            for p in ("image_token_id", "image_token_index")
            if isinstance(v := _read(config, p), int)
        ),
        None,
    )
    vision = getattr(config, "vision_config", None)
    grid = next(
        (
            (n, cols)
            for n in params
            for end, cols in _GRID_COLUMNS.items()
            if n.startswith("image_") and n.endswith(end)
        ),
        None,
    )
    if grid is None and _SHAPES in params:  # NaFlex towers (LFM2-VL): rows of patches per image
        grid = (_SHAPES, 2)
    patch = _read(vision, "patch_size", "spatial_patch_size") if vision is not None else None
    if placeholder is None or grid is None or "pixel_values" not in params:
        return {}
    if not isinstance(patch, int):
        return {}
    name, cols = grid
    merge = _read(vision, "spatial_merge_size", "merge_size")
    merge = merge if isinstance(merge, int) else getattr(config, "downsample_factor", None)
    merge = merge if isinstance(merge, int) and merge > 0 else 1
    temporal = _read(vision, "temporal_patch_size") if cols == 3 else None
    temporal = temporal if isinstance(temporal, int) and temporal > 0 else 1
    channels = _read(vision, "in_channels", "num_channels")
    channels = channels if isinstance(channels, int) else 3
    side = GRID_IMAGE * merge
    thw = [1, side, side][-cols:]
    patches, tokens = side * side, GRID_IMAGE * GRID_IMAGE
    width: tuple[int, ...] = (channels * temporal * patch * patch,)
    if recipe.unflat:  # `unflattened_patches`
        width = (channels, *([temporal] * (temporal > 1)), patch, patch)
    start, end = (
        next((v for a in attrs if isinstance(v := getattr(config, a, None), int)), None)
        for attrs in (_IMAGE_START, _IMAGE_END)
    )
    image = [start] * (start is not None) + [placeholder] * tokens + [end] * (end is not None)
    text = _text_id(config)
    length = max(seq, len(image) + 2)
    row = [text] + image + [text] * (length - len(image) - 1)
    ids = torch.tensor([row] * batch, dtype=torch.long)
    rows = (batch * patches,) if name != _SHAPES else (batch, patches)
    out = {
        "input_ids": ids,
        "pixel_values": torch.zeros((*rows, *width), dtype=_float_dtype(model), device="meta"),
        name: torch.tensor([thw] * batch, dtype=torch.long),
    }
    for n in params:  # each image's merge size where the forward takes it
        if n.startswith("image_") and n.endswith(_MERGES):
            out[n] = torch.full((batch,), merge, dtype=torch.long)
    if name == _SHAPES and "pixel_attention_mask" in params:
        out["pixel_attention_mask"] = torch.ones((batch, patches), dtype=torch.bool)
    if "mm_token_type_ids" in params:
        out["mm_token_type_ids"] = (ids == placeholder).long()
    return out


def _audio_inputs(
    model: nn.Module,
    config: Any,
    params: dict[str, inspect.Parameter],
    batch: int,
    seq: int,
    recipe: InputRecipe,
) -> dict[str, torch.Tensor]:
    """An audio-LLM's audio inputs, consistent with each other (Qwen2-Audio, Voxtral,
    AudioFlamingo3, GLM-ASR: a config with an audio placeholder token and an ``audio_config``):
    one whole made-up audio per row (``input_features`` as `_audio_features` makes them), its
    feature mask all ones where the forward takes one (``feature_attention_mask``,
    ``input_features_mask``), and ``input_ids`` with as many placeholders per row as the tower
    gives features for one audio. That count is what the encoder's convs, pooling and the
    projector's frame stacking leave, and no config rule gives it for every model, so it is
    measured (`_audio_tokens`). The ids and the mask are CPU tensors with values: the forward
    counts placeholders and mask lengths (`tpkit.trace.shadow.GivenValues`). {} for any other model, or where the
    count cannot be measured (the trace then keeps to the text, `text_only`)."""
    token = next((v for a in _AUDIO_TOKEN if isinstance(v := getattr(config, a, None), int)), None)
    if token is None or getattr(config, "audio_config", None) is None:
        return {}
    if "input_features" not in params or "input_ids" not in params:
        return {}
    features = _audio_features(model, config, batch)
    if features is None or features.ndim != 3:
        return {}
    masks = [n for n in params if "feature" in n and n.endswith("mask")]
    mask = torch.ones((batch, features.shape[-1]), dtype=torch.long)
    if not recipe.audio_measured:
        one = {m: mask[:1] for m in masks}
        recipe.audio_tokens = _audio_tokens(model, config, features[:1], one)
        recipe.audio_measured = True
    count = recipe.audio_tokens
    if not count:
        return {}
    text = _text_id(config)
    length = max(seq, count + 2)
    row = [text] + [token] * count + [text] * (length - count - 1)
    out = {"input_ids": torch.tensor([row] * batch, dtype=torch.long), "input_features": features}
    out.update(dict.fromkeys(masks, mask))
    return out


def _audio_tokens(
    model: nn.Module, config: Any, features: torch.Tensor, masks: dict[str, torch.Tensor]
) -> int | None:
    """Placeholders for one made-up audio (``features``: one row, meta; ``masks``: its feature
    masks, CPU tensors with values): the rows of the features the model puts in their place,
    from one forward on fake tensors (no memory, no compute, any size) of its
    ``get_audio_features`` (its ``pooler_output``: Voxtral stacks four frames per feature
    there), else of its audio tower (the module built from ``config.audio_config``:
    Qwen2-Audio scatters the tower's output itself). The masks keep their values
    (`tpkit.trace.shadow.GivenValues`) and the forward runs under
    `tpkit.trace.shadow.ShadowValues`, so the valid frames a model selects are the ones its own
    length formula gives, as in the trace's forward: GLM-ASR reshapes its tower's output by the
    audio config's ``intermediate_size`` but counts valid frames with a fixed merge of 4, and
    keeps only the rows the mask's lengths allow (taking every row gave 32 placeholders per
    audio for the 16 features its forward keeps). None where that forward fails."""
    get = getattr(model, "get_audio_features", None)
    run: Any = None
    if callable(get):
        run, takes = get, _signature(get)
    else:
        audio = config.audio_config
        tower = next((m for m in model.modules() if getattr(m, "config", None) is audio), None)
        if tower is None:
            return None
        run, takes = tower, _params(tower)
    fake = fake_mode()
    values = GivenValues()
    given = {
        k: values.keep(fake.from_tensor(v.to("meta")), v) for k, v in masks.items() if k in takes
    }
    x = fake.from_tensor(features)  # outside the modes: `ShadowValues` would see its making
    try:
        with _fake_state(model, fake), torch.no_grad(), fake, ShadowValues(fake, values):
            out = run(x, **given)
    except Exception:  # noqa: BLE001 - model code may do anything on fake tensors
        return None
    if not isinstance(out, torch.Tensor):
        pooled = getattr(out, "pooler_output", None)
        out = (
            pooled if isinstance(pooled, torch.Tensor) else getattr(out, "last_hidden_state", None)
        )
    if not isinstance(out, torch.Tensor) or out.ndim < 2:
        return None
    return int(out.numel() // out.shape[-1])


def _signature(fn: Any) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return {}


@contextlib.contextmanager
def _fake_state(model: nn.Module, fake: Any) -> Iterator[None]:
    """Every parameter and buffer of ``model`` swapped for a fake meta tensor of its shape
    inside the block (the measurement of `_audio_tokens`; `tpkit.trace.fake.meta_state` does
    the same for the trace, which runs later and imports this module)."""
    saved = []
    for mod in model.modules():
        for store in (mod._parameters, mod._buffers):
            saved += [(store, k, v) for k, v in store.items() if v is not None]
    memo: dict[int, torch.Tensor] = {}
    try:
        for store, k, v in saved:
            if id(v) not in memo:
                meta = fake.from_tensor(torch.empty(v.shape, dtype=v.dtype, device="meta"))
                memo[id(v)] = nn.Parameter(meta, False) if isinstance(v, nn.Parameter) else meta
            store[k] = memo[id(v)]
        with kept_attributes(model):  # as `meta_state`: the probe leaves no state behind
            yield
    finally:
        for store, k, v in saved:
            store[k] = v


def _config_ids(
    config: Any, params: dict[str, inspect.Parameter], batch: int
) -> dict[str, torch.Tensor]:
    """Index arguments that a config's list of names sizes: a forward argument ``<stem>_ids``
    (not token, position or segment ids) where the config has a non-empty list, tuple or dict
    of names (strings) whose attribute starts with the stem (X-MOD's ``lang_ids`` and
    ``config.languages``; a list of numbers, an image size or mean, is no index): [batch]
    zeros, the first name, with values (`tpkit.trace.shadow.GivenValues`). Without them X-MOD's forward raises
    unless a default language was set, and its trace on meta fell back per layer."""
    out = {}
    for name in params:
        stem = name.removesuffix("_ids") if name.endswith("_ids") else ""
        if not stem or stem in _OWN_IDS:
            continue
        named = any(
            k.startswith(stem) and _names(v) for c in _configs(config) for k, v in vars(c).items()
        )
        if named:
            out[name] = torch.zeros(batch, dtype=torch.long)
    return out


def _names(value: Any) -> bool:
    """Whether ``value`` is a non-empty list, tuple or dict of strings (a dict: its keys)."""
    return (
        isinstance(value, (list, tuple, dict))
        and bool(value)
        and all(isinstance(v, str) for v in value)
    )


def _vision_takes(model: nn.Module, config: Any, name: str) -> bool:
    """Whether the vision tower's own forward (the module built from ``config.vision_config``)
    takes ``name``: LLaVA's forward takes ``image_sizes`` too but its CLIP tower does not."""
    vision = getattr(config, "vision_config", None)
    for mod in model.modules():
        if vision is not None and getattr(mod, "config", None) is vision:
            return name in _params(mod)
    return False


def _text_id(config: Any) -> int:
    """The smallest token id that no ``*_token_id`` / ``*_token_index`` of the config names:
    text, not a placeholder or a marker."""
    special = set()
    for c in _configs(config):
        for k, v in vars(c).items():
            if isinstance(v, int) and k.endswith(("_token_id", "_token_index")):
                special.add(v)
    return next(i for i in range(len(special) + 1) if i not in special)


def _dummy_names(model: nn.Module) -> list[str]:
    """The keys of ``dummy_inputs`` where the model's class overrides transformers' default
    (which names only ``input_ids``): the inputs its authors say a forward needs."""
    for cls in type(model).__mro__:
        if "dummy_inputs" in cls.__dict__:
            if cls.__module__.startswith("transformers.modeling_utils"):
                return []
            try:
                return list(model.dummy_inputs)
            except Exception:  # noqa: BLE001 - a user's property may need anything
                return []
    return []


def _model_input(
    model: nn.Module, config: Any, name: str, batch: int, seq: int, recipe: InputRecipe
) -> Any:
    if name.endswith("input_ids") or name == "labels":
        codebooks = getattr(config, "num_codebooks", None)  # MusicGen: codebooks stacked in batch
        codebooks = codebooks if isinstance(codebooks, int) and codebooks > 0 else None
        shape = (batch * (codebooks or 1), seq)
        if name == "input_ids" and codebooks:
            shape = _codebook_ids_shape(model, shape, batch, codebooks, recipe) or shape
        start = getattr(config, "decoder_start_token_id", None) if "decoder" in name else None
        ids = torch.zeros(shape, dtype=torch.long, device="meta")
        return ids.fill_(start) if isinstance(start, int) and start >= 0 else ids
    dtype = _float_dtype(model)
    if name == "pixel_values":
        return torch.zeros((batch, *_image_shape(config)), dtype=dtype, device="meta")
    if name == "input_values":
        bins, frames = _read(config, "num_mel_bins"), _read(config, "max_length")
        if isinstance(bins, int) and isinstance(frames, int):  # a spectrogram (AST)
            return torch.zeros((batch, frames, bins), dtype=dtype, device="meta")
        return torch.zeros((batch, _waveform_length(config, seq)), dtype=dtype, device="meta")
    if name == "input_features":
        return _audio_features(model, config, batch)
    if name == "attention_mask":
        return torch.ones((batch, seq), dtype=torch.long, device="meta")
    return None  # anything else required keeps its default error: validation names it


def _codebook_ids_shape(
    model: nn.Module,
    stacked: tuple[int, int],
    batch: int,
    codebooks: int,
    recipe: InputRecipe,
) -> tuple[int, ...] | None:
    """The ``input_ids`` layout of a model with ``num_codebooks``, read off its input
    embedding: MusicGen's decoder takes the codebooks stacked in the batch ([batch *
    codebooks, seq], ``stacked``; its embedding is a ModuleList the decoder indexes), Kyutai's
    speech-to-text one row per step of its text token and each codebook's audio token
    ([batch, seq, 1 + codebooks]: its embedding adds one offset per last-dim position and sums
    them). Stacked ids there failed its trace, and the model took the per-layer fallback.
    The embedding is run on fake ids of each layout, ``stacked`` first, once per analysis
    (`InputRecipe.codebook_width`: later calls come from dry runs, whose weights are fakes of
    another mode); the first it embeds
    to one vector per (row, step) wins. None for the stacked layout, also when the embedding
    takes none of them or cannot be called alone."""
    seq = stacked[1]
    if recipe.codebook_width is None:
        width = _embedded_width(model, (stacked, (1, seq, codebooks + 1), (1, seq, codebooks)))
        if width is None:
            return None
        recipe.codebook_width = width
    width = recipe.codebook_width
    return (batch, seq, width) if width else None


def _embedded_width(model: nn.Module, shapes: tuple[tuple[int, ...], ...]) -> int | None:
    """The last dim of the first of ``shapes`` (0 for a 2-D one) that ``model``'s input
    embedding turns into [rows, steps, features] on fake ids, or None."""
    embed = input_embeddings(model)
    if embed is None:
        return None
    held = next(iter(embed.parameters()), None)  # meta or real: the ids go where it is
    device = held.device if held is not None else torch.device("cpu")
    quiet = logging.getLogger("torch._subclasses.fake_tensor")
    level, quiet.level = quiet.level, logging.CRITICAL  # a refused layout is no error here
    try:
        for shape in shapes:
            try:
                with fake_mode():
                    out = embed(torch.zeros(shape, dtype=torch.long, device=device))
            except Exception:  # noqa: BLE001, S112 - an embedding may refuse all but its own
                continue
            if isinstance(out, torch.Tensor) and out.ndim == 3 and out.shape[:2] == shape[:2]:
                return shape[2] if len(shape) == 3 else 0
    finally:
        quiet.setLevel(level)
    return None


def _float_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _image_shape(config: Any) -> tuple[int, int, int]:
    """[channels, height, width] from the (vision) config: ``num_channels`` and ``image_size``
    (an int or a pair), `DEFAULT_IMAGE` where the net takes any size."""
    channels = _read(config, "num_channels", "in_channels")
    size = _read(config, "image_size", "img_size", "input_size")
    if isinstance(size, (list, tuple)):
        h, w = int(size[-2]), int(size[-1])
    else:
        h = w = int(size) if isinstance(size, int) else DEFAULT_IMAGE
    return (int(channels) if isinstance(channels, int) else 3, h, w)


def _waveform_length(config: Any, frames: int) -> int:
    """Samples that the convolutional feature extractor (``conv_kernel`` / ``conv_stride``)
    turns into `MIN_FRAMES` frames or more: at least the positional conv's width and twice
    the SpecAugment mask's (which a model in training mode draws over the frames)."""
    kernels, strides = _read(config, "conv_kernel"), _read(config, "conv_stride")
    if not isinstance(kernels, (list, tuple)) or not isinstance(strides, (list, tuple)):
        return 16000  # 1 s at 16 kHz
    widths = [_read(config, a) for a in ("num_conv_pos_embeddings", "conv_pos_kernel_size")]
    mask = _read(config, "mask_time_length")
    widths.append(2 * mask if isinstance(mask, int) else 0)
    n = max(frames, MIN_FRAMES, *(w for w in widths if isinstance(w, int)))
    for k, s in reversed(list(zip(kernels, strides, strict=False))):
        n = (n - 1) * int(s) + int(k)
    return n


def _audio_features(model: nn.Module, config: Any, batch: int) -> torch.Tensor | None:
    """Fake ``input_features``: [batch, channels of the first Conv1d, frames], the frames its
    encoder's positions take back through the convs' strides (Whisper: 1500 positions x stride
    2 = the 3000 frames it insists on); else [batch, 64 frames, features per frame], the
    layout of the conformer encoders (Parakeet, Wav2Vec2-BERT: as wide as the config's
    ``feature_projection_input_dim`` where it names one). An audio-LLM's encoder without
    learned positions (GLM-ASR's rotary one) gives its positions as the audio config's
    ``max_position_embeddings``."""
    convs = [m for m in model.modules() if isinstance(m, nn.Conv1d)]
    positions = _read(config, "max_source_positions")
    audio = getattr(config, "audio_config", None)
    if positions is None and audio is not None:  # GLM-ASR's rotary Whisper encoder
        positions = getattr(audio, "max_position_embeddings", None)
    dtype = _float_dtype(model)
    # the width a conformer's feature projection reads (Wav2Vec2-BERT, SeamlessM4T: two frames
    # of 80 mel bins stacked into 160): its convs are the layers' own, not a Whisper stem
    stacked = _read(config, "feature_projection_input_dim")
    if isinstance(stacked, int):
        return torch.zeros((batch, 64, stacked), dtype=dtype, device="meta")
    if convs and isinstance(positions, int):
        frames = positions * math.prod(int(c.stride[0]) for c in convs)
        shape = (batch, convs[0].in_channels, frames)
        return torch.zeros(shape, dtype=dtype, device="meta")
    bins = _read(config, "num_mel_bins", "feature_size", "input_feat_per_channel")
    if isinstance(bins, int):
        return torch.zeros((batch, 64, bins), dtype=dtype, device="meta")
    return None


def _first_layer(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The layer whose kind says what the input is: a token table, a linear, else a
    convolution, the first in registration order. A convolution counts before a linear only
    in an ``nn.Sequential``, where registration order is the order of the calls (a bare Mamba
    mixer registers its conv before the in_proj that its input goes through first)."""
    found: dict[str, nn.Module] = {}
    for mod in model.modules():
        if isinstance(mod, (nn.Embedding, nn.EmbeddingBag)):
            kind = "ids"
        elif isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            kind = "conv"
        elif kind_of(mod) in ("linear", "conv1d"):
            kind = "linear"
        else:
            continue
        if kind != "conv" or isinstance(model, nn.Sequential):
            return kind, mod
        found.setdefault(kind, mod)
    return ("conv", found["conv"]) if found else None


def _first_input(model: nn.Module, batch: int, seq: int) -> tuple[torch.Tensor, str] | None:
    """One meta tensor shaped for the model's first layer (`_first_layer`), and that layer's
    kind: [batch, seq] ids for a token table, [batch, in_channels, side...] for a convolution,
    [batch, seq, in_features] for a linear. None where it has none. A plain module's input,
    and a transformers model's main input that no name rule knows (Perceiver's ``inputs``,
    "anything" by its docstring: what its input preprocessor reads)."""
    first = _first_layer(model)
    if first is None:
        return None
    what, mod = first
    dtype = mod.weight.dtype if mod.weight.is_floating_point() else torch.float32
    if what == "ids":
        return torch.zeros((batch, seq), dtype=torch.long, device="meta"), what
    if what == "conv":
        dims = mod.weight.ndim - 2
        shape = (batch, mod.in_channels, *([max(seq, 8)] * dims))
        return torch.zeros(shape, dtype=dtype, device="meta"), what
    hidden = in_width(mod, kind_of(mod))
    return torch.zeros((batch, seq, hidden), dtype=dtype, device="meta"), what


def _module_inputs(model: nn.Module, batch: int, seq: int) -> tuple[tuple, dict]:
    """A plain module's inputs: one tensor shaped for its first layer, or, for a bare block
    whose forward requires more (a Llama layer's rotary embeddings, a Bloom block's alibi and
    mask), every argument it requires by name, sized from its submodules."""
    first = _first_input(model, batch, seq)
    if first is None:
        raise ValueError(f"{type(model).__name__} has no Linear, Conv1D or Embedding to trace.")
    x, what = first
    if what != "linear":
        return (x,), {}
    params = _params(model)
    names = list(params)
    if not names:
        return (x,), {}
    kwargs: dict[str, Any] = {}
    for name in names[1:]:
        value = _block_input(model, name, params[name], x)
        if value is not None:
            kwargs[name] = value
    return (x,), kwargs


def _attr(model: nn.Module, *names: str) -> int | None:
    """The first int attribute of that name on ``model`` or a submodule (an attention's
    ``head_dim``, ``num_heads``)."""
    for mod in model.modules():
        for name in names:
            value = getattr(mod, name, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def _block_input(model: nn.Module, name: str, param: inspect.Parameter, x: torch.Tensor) -> Any:
    """A bare block's argument after its hidden states: the ones whose code cannot take their
    default (None) by name, every other required one as another [b, s, hidden] tensor."""
    b, s, hidden = x.shape
    if name == "position_embeddings":  # (cos, sin), [b, s, head_dim] each
        heads = _attr(model, "num_heads", "num_attention_heads")
        head_dim = _attr(model, "head_dim") or (hidden // heads if heads else None)
        if head_dim is None:
            return None
        cos = torch.ones((b, s, head_dim), dtype=x.dtype, device="meta")
        return (cos, torch.zeros_like(cos))
    required = param.default is inspect.Parameter.empty
    if not required:
        return False if name in ("use_cache", "output_attentions") else None
    if name == "alibi":  # Bloom: [b * heads, 1, s]
        heads = _attr(model, "num_heads", "n_head") or 1
        return torch.zeros((b * heads, 1, s), dtype=x.dtype, device="meta")
    if name in ("attention_mask", "causal_mask", "mask"):  # additive, nothing masked
        return torch.zeros((b, 1, s, s), dtype=x.dtype, device="meta")
    if name == "position_ids":
        return torch.arange(s, device="meta").expand(b, s)
    return torch.zeros_like(x)  # another stream of hidden states (a cross-attention's)


def input_embeddings(model: nn.Module) -> nn.Module | None:
    """``model.get_input_embeddings()``, or None where the model has none: transformers raises
    NotImplementedError for a model without a token table (ResNet, CLIP's wrapper, Wav2Vec2)."""
    return _embeddings(model, "get_input_embeddings")


def output_embeddings(model: nn.Module) -> nn.Module | None:
    """``model.get_output_embeddings()``, or None where the model has none (or cannot say)."""
    return _embeddings(model, "get_output_embeddings")


def _embeddings(model: nn.Module, getter: str) -> nn.Module | None:
    get = getattr(model, getter, None)
    if get is None:
        return None
    try:
        out = get()
    except (NotImplementedError, AttributeError):
        return None
    return out if isinstance(out, nn.Module) else None
