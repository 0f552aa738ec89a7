"""Translate transformers' own TP plans (``config.base_model_tp_plan`` + the class ``_tp_plan``)
into a tpkit `Plan`.

transformers builds a model's plan on the instance (``init_parallel_plans``, run by each
``post_init``): a base model takes its config's ``base_model_tp_plan``, and every model takes its
class ``_tp_plan`` and each sub-model's plan with the sub-model's path in front. A VLM's plan is
thus its language model's text-config plan under ``model.language_model`` (and a vision tower's,
where its config ships one, under the tower's path). We rebuild that merge from the configs and
classes, so each entry keeps its source ("config" or "class"), with an ``nn.Embedding`` input
embedding vocab-parallel where no entry names it. Style strings keep their meaning; aliases are
mapped by `spec.canonical_style`.
"""

from __future__ import annotations

from torch import nn

from tpkit.plan.spec import Plan, Source, matches
from tpkit.trace.inputs import input_embeddings, output_embeddings

__all__ = ["hf_plan"]


def _config_plan(model: nn.Module) -> dict[str, str]:
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_tp_plan", None) if config is not None else None
    if not plan and config is not None and hasattr(config, "get_text_config"):
        plan = getattr(config.get_text_config(), "base_model_tp_plan", None)
    return dict(plan or {})


def _base_prefix(model: nn.Module, keys: list[str]) -> str:
    """Dotted path from ``model`` to its base model ("" when model is the base model).

    transformers finds the base model by ``base_model_prefix``; a class whose prefix names no
    attribute (Llama 4's causal LM says ``language_model``, its base model sits at ``model``)
    gets itself back, and its plan would match nothing. Then the prefix is the shallowest
    child under which the plan's keys name modules."""
    base = getattr(model, "base_model", model)
    names = [n for n, _ in model.named_modules()]
    if base is not model:
        return next((n for n, m in model.named_modules() if m is base), "")
    if any(matches(k, n) for k in keys for n in names):
        return ""
    for prefix, _ in model.named_children():
        inside = [n[len(prefix) + 1 :] for n in names if n.startswith(prefix + ".")]
        if any(matches(k, n) for k in keys for n in inside):
            return prefix
    return ""


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _sub_models(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of ``model`` and every transformers model inside it (a module with a
    ``config`` and a ``base_model_prefix``: a VLM's language model and vision tower), in model
    order: the models whose plans transformers' ``init_parallel_plans`` merges."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if hasattr(m, "base_model_prefix") and getattr(m, "config", None) is not None
    ]


def _config_plans(model: nn.Module) -> list[tuple[str, nn.Module, dict[str, str]]]:
    """(path, sub-model, ``base_model_tp_plan``) for every sub-model that is its own base model
    and whose config ships a plan naming something under it, as transformers joins them: a
    VLM's text-config plan lands under ``model.language_model``, not ``model`` (which left
    LLaVA's, Gemma-3's, Qwen2-VL's plans naming only the vocabulary). A plan none of whose keys
    names a module or parameter under its sub-model is skipped (Llama 4's causal LM is its own
    base model at the top, its plan's layers sit in ``model``, itself a base model). When no
    sub-model's plan names anything, the top config's (else its text config's) plan is joined
    where its keys name modules (`_base_prefix`), as before."""
    names = [n for n, _ in model.named_modules() if n]
    names += [n for n, _ in model.named_parameters(remove_duplicate=False)]
    found = []
    for path, sub in _sub_models(model):
        if getattr(sub, "base_model", None) is not sub:
            continue
        entries = dict(getattr(sub.config, "base_model_tp_plan", None) or {})
        if not entries:
            continue
        probe = Plan()  # indexed matching: linear in the model's names, not names x keys
        for key in entries:
            probe.set(_join(path, key), "replicate", Source.CONFIG)
        if any(probe.style_for(n) is not None for n in names):
            found.append((path, sub, entries))
    if found:
        return found
    entries = _config_plan(model)
    if not entries:
        return []
    return [(_base_prefix(model, list(entries)), model, entries)]


def _mla_tail(model: nn.Module, modules: dict[str, nn.Module], name: str) -> dict[str, int]:
    """transformers' ``mla_kv_a_proj`` is tpkit's ``tail_grad_allreduce`` over MLA's rope key:
    its width is the attention module's ``qk_rope_head_dim`` (else its (per-layer) config's,
    else the model config's), read as transformers reads it."""
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    parent = modules.get(name.rsplit(".", 1)[0] if "." in name else "")
    for src in (parent, getattr(parent, "config", None), config):
        try:
            value = getattr(src, "qk_rope_head_dim", None)
        except RuntimeError:  # a heterogeneous config refuses global reads of per-layer values
            value = None
        if isinstance(value, int):
            return {"tail": value}
    return {"tail": 0}


def hf_plan(model: nn.Module) -> Plan | None:
    """The model's transformers plan as a `Plan`, or None when it ships none.

    Each sub-model's config plan joined to its path (`_config_plans`), entries marked source
    "config"; each sub-model's class-level ``_tp_plan`` (``lm_head``) joined the same way,
    "class". The input embedding is sharded by vocab when the plan does not name it.
    """
    config_plans = _config_plans(model)
    if not config_plans:
        return None
    plan = Plan()
    embed = input_embeddings(model)
    named = {_join(prefix, k) for prefix, _, entries in config_plans for k in entries}
    if isinstance(embed, nn.Embedding):
        for name, module in model.named_modules():
            if module is embed and name not in named:
                plan.set(name, "vocab_parallel", Source.CONFIG)
                break
    modules = dict(model.named_modules())
    for prefix, sub, entries in config_plans:
        for key, style in entries.items():
            full = _join(prefix, key)
            if style == "colwise" and key.endswith("experts.gate_up_proj"):
                # Fused [gate; up] expert weights: every other plan says packed_colwise. A plain
                # colwise split gives rank 0 only gate rows, which the code's chunk(2) then
                # pairs with each other; transformers' loader hides it by sharding gate and up
                # before fusing them, a model built or loaded any other way computes garbage
                # (Inkling). Interleaved [g0, u0, g1, u1, ...] experts are right with colwise.
                owner = full.rsplit(".", 1)[0]
                if all(
                    m.__dict__.get("is_concatenated", True) is not False
                    for n, m in modules.items()
                    if matches(owner, n)
                ):
                    style = "packed_colwise"
            if style == "mla_kv_a_proj":  # one entry per module: the width may differ per layer
                for name in (n for n in modules if matches(full, n)):
                    plan.set(name, style, Source.CONFIG, _mla_tail(sub, modules, name))
                continue
            plan.set(full, style, Source.CONFIG)
    for prefix, sub in [("", model)] + [(p, m) for p, m in _sub_models(model) if p]:
        for cls in reversed(type(sub).__mro__):
            for key, style in (getattr(cls, "_tp_plan", None) or {}).items():
                if isinstance(key, str):
                    plan.set(_join(prefix, key), style, Source.CLASS)
    _gathered_head(model, plan, embed)
    for path, sub in _sub_models(model):  # a sub-model's own head (Nemotron-H Omni's text LM)
        if path:
            _gathered_head(model, plan, input_embeddings(sub), output_embeddings(sub))
    return plan


def _gathered_head(
    model: nn.Module, plan: Plan, embed: nn.Module | None, head: nn.Module | None = None
) -> None:
    """The output head (``model``'s, else ``head``: a sub-model's) split and gathered where the
    class ships no ``_tp_plan`` for it (Nemotron-H: a quarter of the model left whole; inside
    Nemotron-H Omni, whose wrapper has no head of its own, a fifth), as for the embedding
    above; a head tied to an embedding laid out otherwise is left to the plan."""
    head = output_embeddings(model) if head is None else head
    if not isinstance(head, nn.Linear):
        return
    names = {id(m): n for n, m in model.named_modules()}
    name = names.get(id(head))
    if name is None or plan.style_for(name) is not None:
        return
    if embed is not None and getattr(embed, "weight", None) is head.weight:
        hit = plan.style_for(names.get(id(embed), ""))
        if hit is None or hit[0] != "vocab_parallel":
            return
    plan.set(name, "colwise_gather_output", Source.CLASS)
