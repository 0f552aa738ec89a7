"""Build a transformers model from a config, without its weights: on meta for planning and
streaming loads, for `tpkit plan`, `tpkit export` and `from_pretrained`.

One place decides which class a checkpoint's config means (``architectures``, else an Auto
class) and how to instantiate it from a config alone (``_from_config`` where transformers has
it, so the dtype and attention implementation are set as ``from_pretrained`` would).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["SkipMetaFills", "build_on_meta", "instantiate", "model_class"]

#: in-place ops that only write values (what weight initialisers call)
_FILLS = frozenset(
    [
        "normal_",
        "uniform_",
        "zero_",
        "fill_",
        "copy_",
        "mul_",
        "add_",
        "sub_",
        "div_",
        "clamp_",
        "clamp_min_",
        "clamp_max_",
        "erfinv_",
        "exponential_",
        "random_",
        "bernoulli_",
        "cauchy_",
        "log_normal_",
        "geometric_",
        "abs_",
        "neg_",
        "sqrt_",
        "masked_fill_",
        "index_fill_",
        "fill_diagonal_",
        "trunc_normal_",
        # torch.nn.init's, which take the tensor as ``tensor=`` (see `SkipMetaFills`)
        "zeros_",
        "ones_",
        "constant_",
        "eye_",
        "dirac_",
        "xavier_uniform_",
        "xavier_normal_",
        "kaiming_uniform_",
        "kaiming_normal_",
        "orthogonal_",
        "sparse_",
    ]
)


class SkipMetaFills(TorchFunctionMode):
    """Skip the value-writing in-place ops (`_FILLS`) on meta tensors while a model is built.

    A model built under accelerate's ``init_empty_weights`` (parameters on meta, buffers real:
    what ``from_pretrained`` splits) still runs its weight initialisation, and on meta tensors
    torch runs each ``normal_`` through its Python reference (``torch._refs``): 0.1 s of a
    57M Llama's build, for values a meta tensor does not have. transformers skips the whole
    initialisation under a ``torch.device("meta")`` context, which would skip the real buffers'
    too; this skips only what writes nothing. ``torch.nn.init``'s functions reach a mode with
    the tensor as the keyword ``tensor`` and no positional argument (how transformers'
    ``_init_weights`` calls them): read there too, or every ``normal_`` of the build ran."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in _FILLS:
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


def model_class(config, model_cls: type | str | None = None):
    """``model_cls`` (a class or a transformers class name), else the config's first known
    ``architectures`` entry, else ``AutoModelForCausalLM`` (which also builds a hub
    repository's own code, named in the config's ``auto_map``, when that code is trusted)."""
    import transformers

    if model_cls is not None:
        return getattr(transformers, model_cls) if isinstance(model_cls, str) else model_cls
    for name in getattr(config, "architectures", None) or []:
        if hasattr(transformers, name):
            return getattr(transformers, name)
    return transformers.AutoModelForCausalLM


def instantiate(
    cls, config, dtype: torch.dtype | None = None, trust_remote_code: bool | None = None
) -> nn.Module:
    """A model of ``cls`` (a concrete class or an Auto class) from ``config``, no weights read.
    ``trust_remote_code`` goes to an Auto class, which then builds a hub repository's own
    model code (``auto_map``) as transformers' ``from_pretrained`` would."""
    kwargs: dict = {"dtype": dtype} if dtype is not None else {}
    if hasattr(cls, "_from_config"):
        return cls._from_config(config, **kwargs)
    if trust_remote_code is not None:
        kwargs["trust_remote_code"] = trust_remote_code
    return cls.from_config(config, **kwargs)


def build_on_meta(path: str, model_cls: str | None = None) -> nn.Module:
    """A model from a checkpoint directory or its config.json, on the meta device: the classes
    the config names, then causal-LM, seq2seq and base Auto classes, the first that builds."""
    import transformers

    p = Path(path)
    config = transformers.AutoConfig.from_pretrained(str(p.parent if p.is_file() else p))
    names = [model_cls] if model_cls else list(getattr(config, "architectures", None) or [])
    classes = [getattr(transformers, n) for n in names if hasattr(transformers, n)]
    classes += [
        transformers.AutoModelForCausalLM,
        transformers.AutoModelForSeq2SeqLM,
        transformers.AutoModel,
    ]
    errors = []
    with torch.device("meta"):
        for cls in classes:
            try:
                return instantiate(cls, config)
            except (ValueError, KeyError, TypeError) as exc:
                errors.append(f"{getattr(cls, '__name__', cls)}: {exc}")
    raise ValueError(f"Could not build a model for {path}:\n" + "\n".join(errors))
