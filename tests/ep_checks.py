"""Rank-side checks of expert parallelism against the unsharded model (run by the harness's rank
groups): logits, router aux loss and every gradient of a tiny MoE with its experts placed over
an EP mesh the check builds itself."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

#: tiny configs of MoE architectures: (model_type, class, overrides making every layer MoE)
MOES = {
    "qwen3_moe": ("Qwen3MoeForCausalLM", {}),
    "mixtral": ("MixtralForCausalLM", {}),
    "deepseek_v3": ("DeepseekV3ForCausalLM", {"first_k_dense_replace": 0}),
    "gpt_oss": ("GptOssForCausalLM", {}),
    "olmoe": ("OlmoeForCausalLM", {}),
    "dbrx": ("DbrxForCausalLM", {}),
}


def tiny_moe(model_type: str, overrides: dict | None = None) -> torch.nn.Module:
    import transformers

    from tests.tiny import tiny_config

    class_name, fixed = MOES[model_type]
    config = tiny_config(model_type, class_name)
    for k, v in {**fixed, **(overrides or {})}.items():  # "sub.attr": a sub-config's field
        holder, _, attr = ("." + k).rpartition(".")
        setattr(getattr(config, holder[1:]) if holder else config, attr, v)
    torch.manual_seed(0)
    return getattr(transformers, class_name)(config).float()


_MESHES: dict[tuple[int, int], tuple] = {}


def meshes(ep: int, batch: int):
    """(EP mesh, batch mesh or None) over the world: EP groups of ``ep`` contiguous ranks, each
    of ``ep // batch`` batch groups of ``batch`` contiguous ranks (tp innermost). Built once per
    sizes: each mesh holds process groups."""
    if (ep, batch) not in _MESHES:
        _MESHES[ep, batch] = _meshes(ep, batch)
    return _MESHES[ep, batch]


def _meshes(ep: int, batch: int):
    world = dist.get_world_size()
    ep_mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("efsdp", "ep"))["ep"]
    if batch == 1:
        return ep_mesh, None
    batch_mesh = init_device_mesh("cpu", (world // batch, batch), mesh_dim_names=("dp", "b"))
    return ep_mesh, batch_mesh["b"]


def _out(model: torch.nn.Module, x: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    out = model(**x, output_router_logits=True)
    return out.logits, getattr(out, "aux_loss", None)


def ep_parity(
    model_type: str,
    ep: int,
    batch: int = 1,
    implementation: str = "auto",
    overrides: dict | None = None,
    train: bool = True,
) -> dict[str, Any]:
    """Run on every rank: the tiny model split by `expert_parallel` against the unsharded one on
    the same inputs: max |diff| of logits, aux loss and every gradient (an expert weight's
    gradient, summed over the ep / batch batches of its EP group, divided by their number),
    the share of expert weight elements this rank holds, and the dispatch used."""
    from tests.tiny import inputs
    from tpkit.parallel.expert import expert_parallel

    ref = tiny_moe(model_type, overrides)
    ref.train(train)
    model = copy.deepcopy(ref)
    ep_mesh, batch_mesh = meshes(ep, batch)
    styles = expert_parallel(model, ep_mesh, batch_mesh=batch_mesh, implementation=implementation)
    x = inputs(ref, "causal-lm")
    w = None
    outs = []
    for m in (ref, model):
        logits, aux = _out(m, x)
        w = (
            torch.randn(logits.shape, generator=torch.Generator().manual_seed(2))
            if w is None
            else w
        )
        loss = (logits * w).sum() + (aux if aux is not None else 0) * 3
        loss.backward()
        outs.append((logits.detach(), aux))
    want = dict(ref.named_parameters())
    grad = scale = 0.0
    held = total = 0
    missing = []
    batches = ep // batch
    for name, p in model.named_parameters():
        if (p.grad is None) != (want[name].grad is None):
            missing.append(name)
            continue
        if isinstance(p, DTensor):
            total += p.numel()
            held += p.to_local().numel()
        if p.grad is None:
            continue
        g = p.grad.full_tensor() / batches if isinstance(p.grad, DTensor) else p.grad
        grad = max(grad, (g - want[name].grad).abs().max().item())
        scale = max(scale, want[name].grad.abs().max().item())
    aux = [a for _, a in outs]
    return {
        "logits": (outs[0][0] - outs[1][0]).abs().max().item(),
        "aux": (aux[0] - aux[1]).abs().item() if aux[0] is not None else None,
        "grad": grad,
        "scale": scale,
        "missing": missing,
        "held": held / max(1, total),
        "experts": len(styles),
        "dispatch": sorted({type(s.dispatcher()).__name__ for s in styles.values()}),
    }
