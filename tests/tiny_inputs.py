"""Inputs for the tiny models of every family (`tests.tiny_family`): whatever the model's forward
reads (pixels, audio, placeholder tokens, patch grids, tiles, canvases), made to fit the tiny
config so the unsharded reference runs."""

from __future__ import annotations

from tests.tiny import BATCH, SEQ, VOCAB, inputs
from tests.tiny_family import ANY_RES, IMAGE, TEXT_IDS, VIDEO_FRAMES, _vision_configs


def family_inputs(model, family: str) -> dict:
    """Real inputs for any family's tiny model: text families as `inputs`; others as the trace
    makes them up (`tpkit.trace.inputs.synthesize_inputs`: pixel_values, input_features,
    input_values, both towers of a dual encoder, decoder ids), filled with random values, and
    for a model whose ids carry image placeholders, as many of them per row as its vision tower
    gives features for one image (`get_image_features`), after one text token. Then fitted to
    what the model reads (`_fit_main_input`, `_fit_noise`, `_fit_layout`): a wrapper's main
    input as its encoder's, an image family's main input an image, a video tower's pixels
    [batch, frames, channels, height, width], a fixed masking noise, an audio layout that runs;
    an any-resolution VLM's image as its whole image and one tile (`ANY_RES`) with its
    ``image_sizes``, and text ids where the trace made none but the code reads them; an image
    cut into patches of frames where the tower reads those (`_fit_frame_patches`), and an
    action-chunk policy's state, noise, timestep and camera prefix (`_fit_action_chunk`)."""
    import inspect

    import torch

    from tpkit.trace.inputs import synthesize_inputs

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
    params = inspect.signature(model.forward).parameters
    if token is not None and "pixel_values" in params and "pixel_values" not in out:
        _fit_tokenizer_pixels(model, out, g)
    pixels = out.get("pixel_values")
    if isinstance(getattr(config, ANY_RES, None), list) and pixels is not None and pixels.ndim == 4:
        out["pixel_values"] = torch.randn((pixels.shape[0], 2, *pixels.shape[1:]), generator=g)
    _fit_image_sizes(model, out)
    _fit_patch_pixels(model, out)
    _fit_frame_patches(model, out)
    _fit_cross_images(model, out, params, g)
    _fit_boxes(model, out, params, g)
    _fit_flattened_patches(model, out, g)
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
    _fit_action_chunk(model, out, params, top, g)
    return _fit_layout(model, out)


#: the forward argument of a cross-attention VLM that says which images each text position
#: sees (IDEFICS-1's: [batch, text positions, images]): its images reach the text through
#: cross-attention layers, not placeholder tokens
CROSS_IMAGE_MASK = "image_attention_mask"


def _fit_cross_images(model, out: dict, params, g) -> None:
    """A cross-attention VLM (a forward taking `CROSS_IMAGE_MASK` and ``pixel_values``) whose
    pixels the trace did not make up (IDEFICS-1 reads them [batch, images, channels, height,
    width], and refuses a forward without some image input) gets one image per row, of its
    vision sub-config's size, seen by every text position (the mask all ones)."""
    import torch

    ids = out.get("input_ids")
    vision = getattr(model.config, "vision_config", None)
    wanted = CROSS_IMAGE_MASK in params and "pixel_values" in params
    if not wanted or "pixel_values" in out or ids is None or vision is None:
        return
    rows = ids.shape[0]
    out["pixel_values"] = torch.randn((rows, 1, *_image_chw(vision)), generator=g)
    out[CROSS_IMAGE_MASK] = torch.ones((rows, ids.shape[1], 1), dtype=torch.long)


#: the forward argument of a document model's per-token layout boxes [batch, positions, 4]
BOXES = "bbox"


def _fit_boxes(model, out: dict, params, g) -> None:
    """A document model (a forward taking `BOXES`) that does not run without them (UDOP: its
    2-D relative attention bias reads each token's box) gets a box per text position, in the
    page's [0, 1] units (x0 <= x1, y0 <= y1, as the processor normalises them), and where its
    forward takes ``pixel_values`` and the trace made none, the page image at the config's
    ``image_size``, so the patches its encoder adds to the tokens under them are read too.
    Models that run without boxes (LayoutLM's default all-zero boxes, read as 0-1000 ids) keep
    their inputs: whether one does is tried on a copy, as `_fit_layout` does."""
    import copy

    import torch

    ids = out.get("input_ids")
    if BOXES not in params or BOXES in out or ids is None:
        return
    try:
        with torch.no_grad():
            copy.deepcopy(model)(**out)
    except Exception:  # noqa: BLE001 - model code may raise anything without its boxes
        pass
    else:
        return
    corners = torch.rand((*ids.shape, 2, 2), generator=g).sort(dim=-2).values  # [.., lo/hi, x/y]
    out[BOXES] = corners.flatten(-2)  # x0, y0, x1, y1
    size = getattr(model.config, "image_size", None)
    if "pixel_values" in params and "pixel_values" not in out and isinstance(size, int):
        out["pixel_values"] = torch.randn((ids.shape[0], *_image_chw(model.config)), generator=g)


#: the input of a tower that reads an image as its processor's flattened patches, each led by
#: its row and column (Pix2Struct's: [batch, patches, 2 + channels x patch x patch]), and the
#: vision config's field giving the patch's width after the two
FLATTENED_PATCHES = ("flattened_patches", "patch_embed_hidden_size")


def _fit_flattened_patches(model, out: dict, g) -> None:
    """Flattened patches (`FLATTENED_PATCHES`) as the processor gives them: the trace reads the
    patch width (``patch_embed_hidden_size``) off the config but not the two leading columns,
    the patch's 1-based row and column on its grid, which the tower embeds as ids (the width
    it projects is the rest). A square grid of ``PATCHES_PER_SIDE`` rows and columns."""
    import torch

    from tests.tiny_family import PATCHES_PER_SIDE

    key, field = FLATTENED_PATCHES
    patches = out.get(key)
    vision = getattr(model.config, "vision_config", None) or model.config
    width = getattr(vision, field, None)
    if not isinstance(patches, torch.Tensor) or not isinstance(width, int):
        return
    if patches.ndim != 3 or patches.shape[-1] != width:
        return
    side = PATCHES_PER_SIDE
    rows = torch.arange(1, side + 1).repeat_interleave(side)
    cols = torch.arange(1, side + 1).repeat(side)
    place = torch.stack([rows, cols], dim=-1).float().expand(patches.shape[0], -1, -1)
    pixels = torch.randn((patches.shape[0], side * side, width), generator=g)
    out[key] = torch.cat([place, pixels], dim=-1)


def _fit_tokenizer_pixels(model, out: dict, g) -> None:
    """An image per text row, of the vision sub-config's size (else `IMAGE`'s), for a VLM
    whose image tokenizer the trace makes no pixels for (Chameleon's and Emu3's VQ-VAE, which
    has no ``image_size``), where its ``get_image_features`` runs on them; the placeholders
    are then counted as for any VLM. Left text-only where the tower needs more than an image."""
    import torch

    ids = out.get("input_ids")
    config = model.config
    vision = getattr(config, "vision_config", None) or getattr(config, "vq_config", None)
    if ids is None:
        return
    pixels = torch.randn((ids.shape[0], *_image_chw(vision or config)), generator=g)
    trial = {**out, "pixel_values": pixels}
    _fit_image_sizes(model, trial)  # Emu3's tokenizer reads each image's size
    try:
        _image_layout(model, pixels, dict(trial))
    except Exception:  # noqa: BLE001, S110 - the tower's own inputs: left text-only
        return
    out.update(trial)


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
    [1, patches, channels, patch, patch] (PaddleOCR-VL's), or one block of ``spatial_merge_size``
    squared patches per row, channels last (Inkling-2's [tokens, 16, 16, 3]), or flattened
    patches as wide as the tower's first linear reads (Muse's two frames per patch,
    ``patch_temporal``)."""
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
    merge = getattr(vision, "spatial_merge_size", None)
    if isinstance(merge, int) and pixels.shape[1] == channels * patch * patch:
        # a block of merge x merge patches per row, channels last (Inkling-2's: one row per
        # text token, its grid counted in tokens)
        g = torch.Generator().manual_seed(3)
        side = merge * patch
        candidates.append(torch.randn((pixels.shape[0], side, side, channels), generator=g))
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


#: the vision config's field giving the frames per patch of a tower that reads an image as
#: patches of that many frames, channels last (Inkling's: [patches, frames, patch, patch,
#: channels], folded 4 x 4 then 2 x 2 x 2 into one token per patch)
FRAME_PATCHES = "temporal_patch_size"


def _fit_frame_patches(model, out: dict) -> None:
    """The made-up images [batch, channels, height, width] cut into the patches a tower reads
    (`FRAME_PATCHES`), where it runs on neither the images nor one image per row: each image's
    ``patch_size`` squares, rows of patches first (the processor's order), each square
    repeated over ``temporal_patch_size`` frames (a still image as a video, as Qwen2-VL's
    processor gives it), channels last: [batch x patches, frames, patch, patch, channels].
    Kept only where the tower runs on them (one token per patch for Inkling)."""
    import torch

    pixels = out.get("pixel_values")
    vision = getattr(model.config, "vision_config", None)
    patch, frames = getattr(vision, "patch_size", None), getattr(vision, FRAME_PATCHES, None)
    if not isinstance(pixels, torch.Tensor) or pixels.ndim != 4:
        return
    if not isinstance(patch, int) or not isinstance(frames, int):
        return
    b, c, h, w = pixels.shape
    if h % patch or w % patch:
        return
    try:
        _image_layout(model, pixels, dict(out))
    except Exception:  # noqa: BLE001 - the tower's own error for the made-up layouts
        pass
    else:
        return
    grid = pixels.reshape(b, c, h // patch, patch, w // patch, patch).permute(0, 2, 4, 3, 5, 1)
    squares = grid.reshape(-1, 1, patch, patch, c).expand(-1, frames, -1, -1, -1).contiguous()
    try:
        _image_tokens(model, squares, out)
    except Exception:  # noqa: BLE001, S110 - not this tower's layout: its error is reported later
        return
    out["pixel_values"] = squares


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

    from tpkit.trace.inputs import synthesize_inputs

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


#: config fields of an action-chunk policy (PI0's, PI0.5's): it predicts ``chunk_size`` actions
#: of ``max_action_dim`` values each, from a state vector of ``max_state_dim`` values (where the
#: config has one) and an image-text prefix, by flow matching from ``noise`` at a ``timestep``
ACTION_CHUNK = ("chunk_size", "max_action_dim", "max_state_dim")


def _fit_action_chunk(model, out: dict, params, top: int, g) -> None:
    """An action-chunk policy (a config with `ACTION_CHUNK`'s sizes and a forward that takes
    ``noise``) gets what its forward reads, none of which the trace makes up:

    - ``noise`` [batch, chunk_size, max_action_dim] and a ``timestep`` in (0, 1) per row: left
      out, the forward draws both itself (a Beta-distributed timestep), so each run differs;
    - the robot ``state`` [batch, max_state_dim], floats (the trace took the main input for
      text ids: PI0's "normal_kernel_cpu not implemented for 'Long'");
    - the prefix its VLM reads unconditionally (without pixels no cache is built: PI0.5's
      "'NoneType' object has no attribute 'get_seq_length'"): one camera per row, [batch,
      cameras, channels, height, width] at the size of the vision sub-config of the module
      with ``get_image_features``, a mask of the cameras present (`TILE_MASK`, all true), and
      after the first text id as many of that sub-config's image placeholders per row as
      ``get_image_features`` gives rows for one image."""
    import torch

    config = model.config
    chunk, action, state = (getattr(config, k, None) for k in ACTION_CHUNK)
    if not isinstance(chunk, int) or not isinstance(action, int) or "noise" not in params:
        return
    out.setdefault("noise", torch.randn((BATCH, chunk, action), generator=g))
    if "timestep" in params:
        out.setdefault("timestep", torch.rand((BATCH,), generator=g))
    if "state" in params and isinstance(state, int):
        given = out.get("state")
        fits = isinstance(given, torch.Tensor) and given.is_floating_point()
        if not fits or given.shape != (BATCH, state):
            out["state"] = torch.randn((BATCH, state), generator=g)
    inner = next((m for m in model.modules() if hasattr(m, "get_image_features")), None)
    vlm = getattr(inner, "config", None)
    token = getattr(vlm, "image_token_id", None)
    wanted = "pixel_values" in params and TILE_MASK in params and "pixel_values" not in out
    if not wanted or not isinstance(token, int):
        return
    vision = getattr(vlm, "vision_config", None) or vlm
    image = torch.randn((BATCH, *_image_chw(vision)), generator=g)
    per_row = _image_tokens(model, image) // BATCH
    ids = out.get("input_ids")
    if not isinstance(ids, torch.Tensor):
        ids = torch.randint(3, top, (BATCH, SEQ), generator=g)
    ids = ids.masked_fill(ids == token, 3)  # the only placeholders are the ones made here
    placeholders = torch.full((ids.shape[0], per_row), token, dtype=torch.long)
    out["input_ids"] = torch.cat([ids[:, :1], placeholders, ids[:, 1:]], dim=1)
    out["pixel_values"] = image[:, None]
    out[TILE_MASK] = torch.ones((BATCH, 1), dtype=torch.bool)


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
    chunk = _audio_chunk(model.config)
    if chunk and x.ndim == 3:  # whole chunks of frames (Qwen3-ASR's 2 x n_window), both layouts
        others += [_whole_chunks(c, chunk) for c in (x, x.transpose(1, 2))]
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


#: a config field giving half the frames of the chunks an audio encoder cuts its features into
#: (Qwen3-ASR's ``n_window``: chunks of 2 x 50 mel frames, and it refuses features that are not a
#: whole number of them; its output-length formula is written for that chunk, so the chunk
#: stays and the features are padded to it)
AUDIO_CHUNK = "n_window"


def _audio_chunk(config) -> int:
    """Frames per chunk (`AUDIO_CHUNK`) of the config or any sub-config, else 0."""
    for c in (config, *(v for v in vars(config).values() if hasattr(v, "to_dict"))):
        half = getattr(c, AUDIO_CHUNK, None)
        if isinstance(half, int) and half > 0:
            return 2 * half
    return 0


def _whole_chunks(features, chunk: int):
    """``features`` [batch, bins, frames] with random frames added up to whole ``chunk``s."""
    import torch

    frames = features.shape[-1]
    more = -frames % chunk or (chunk if frames == 0 else 0)
    g = torch.Generator().manual_seed(4)
    pad = torch.randn((*features.shape[:-1], more), generator=g)
    return torch.cat([features, pad], dim=-1)


#: forward arguments masking an audio input's padding (per sample or per frame), which some
#: audio-LLMs read unconditionally (Qwen-Omni's ``feature_attention_mask``, Apertus-1.5's
#: ``padding_mask``): all ones, every frame real, over the layout's last axis or (features
#: [batch, frames, bins]: FunASR's) its second (`_fit_layout` tries both)
AUDIO_MASKS = ("feature_attention_mask", "padding_mask", "input_features_mask")


#: forward arguments giving each audio chunk's length in waveform samples, which an audio tower
#: reads unconditionally (dots3-note's ``chunk_sample_lengths``: its conv stem masks the frames
#: past length // ``hop_length``): the features' frames times the config's ``hop_length``
AUDIO_SAMPLE_LENGTHS = ("chunk_sample_lengths",)


#: a made-up waveform cut to this many samples, for a codec that takes only a whole number
#: of its frames (Muse-Spark's 96 samples; the processor pads to it): 15360 = 2**10 x 15, a
#: multiple of the common hops (96, 120, 128, 160, 240, 256, 320, 480, 512, 640...)
WAVE_CUT = 15360


def _place_audio(model, out: dict, key: str, axis: int | None = None) -> dict:
    """``out`` with as many audio placeholders per row (after its first id) as the model's
    ``get_audio_features`` gives rows for the audio ``out[key]``, where the config names an
    audio token and the ids carry none: an audio-LLM whose tower reads a waveform (OmniASR),
    which `tpkit.trace.inputs` does not count (it counts for ``input_features``). With an
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
    lengths = next((k for k in AUDIO_SAMPLE_LENGTHS if k in params), None)
    audio = getattr(config, "audio_config", None) or config
    hop = getattr(audio, "hop_length", None)
    if lengths is not None and lengths not in out and isinstance(hop, int) and out[key].ndim == 3:
        # every frame real: the waveform samples the features' last axis (frames) stands for
        samples = torch.full((out[key].shape[0],), out[key].shape[-1] * hop, dtype=torch.long)
        out = {**out, lengths: samples}
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
    if lengths is not None and lengths in out:  # required wherever the forward takes them
        extra[lengths] = out[lengths]
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
    streams = getattr(feats, INJECTED_FEATURES, None)
    feats = getattr(feats, "pooler_output", feats)
    if feats is None and isinstance(streams, list) and streams:
        feats = streams[0][1]  # (text layer, features): each stream fills the same positions
    parts = [feats] if isinstance(feats, torch.Tensor) else list(feats)
    return sum(t.numel() // t.shape[-1] for t in parts)


#: image features given as (text layer, features) pairs, one per stream injected into a text
#: layer, with no pooled output (Granite-4-Vision's deepstack and spatial streams)
INJECTED_FEATURES = "deepstack_features"


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
