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
    "jetmoe": ("JetMoeForCausalLM", {}),  # grouped linears, no ep plan
    "llama4_text": ("Llama4ForCausalLM", {}),  # per-expert blocks of every token, no ep plan
}


#: config fields that keep some layers dense (or the MoE block off), and the value that makes
#: a 2-layer tiny model have MoE layers, by field name (never by architecture name)
MOE_ON = {
    "first_k_dense_replace": 1,
    "num_dense_layers": 1,
    "first_dense_layers": 1,
    "dense_layers": 1,
    "moe_layer_start_index": 0,
    "decoder_sparse_step": 1,
    "encoder_sparse_step": 1,
    "moe_layer_freq": 1,
    "mlp_only_layers": [],
    "is_moe": True,
    "enable_moe_block": True,
}


def _configs(config, seen: set | None = None):
    """``config`` and every sub-config under it."""
    seen = set() if seen is None else seen
    if id(config) in seen:
        return
    seen.add(id(config))
    yield config
    for k in list(vars(config)):
        v = config.__dict__.get(k)
        if hasattr(v, "to_dict") and hasattr(v, "model_type"):
            yield from _configs(v, seen)


def moe_on(config) -> list[str]:
    """Set `MOE_ON`'s fields where ``config`` (or a sub-config) has them (a count lowered, never
    raised); what changed."""
    changed = []
    for c in _configs(config):
        for k, v in MOE_ON.items():
            if k not in c.__dict__:
                continue
            cur = c.__dict__[k]
            counts = isinstance(cur, int) and not isinstance(cur, bool) and not isinstance(v, bool)
            new = min(cur, v) if counts else v
            if cur != new:
                setattr(c, k, new)
                changed.append(f"{k}: {cur} -> {new}")
    return changed


def is_moe(config) -> bool:
    """Does ``config`` (or a sub-config) count more than one expert?"""
    from tpkit.sources.experts import EXPERT_ATTRS

    for c in _configs(config):
        for a in (*EXPERT_ATTRS, "moe_num_experts"):
            v = c.__dict__.get(a)
            if isinstance(v, int) and not isinstance(v, bool) and v > 1:
                return True
        ffn = c.__dict__.get("ffn_config")  # DBRX keeps its experts in a sub-config of its own
        if ffn is not None and getattr(ffn, "moe_num_experts", 0) > 1:
            return True
    return False


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


def first_output(out: Any) -> torch.Tensor:
    """A model's first output: logits, else its first tensor."""
    return out.logits if hasattr(out, "logits") else out[0]


def compare_ep(
    ref: torch.nn.Module,
    x: dict,
    ep: int,
    batch: int = 1,
    implementation: str = "auto",
    seed: int = 1234,
) -> dict[str, Any]:
    """Run on every rank: a copy of ``ref`` split by `expert_parallel` (EP groups of ``ep``
    ranks, batch groups of ``batch``) against ``ref`` on inputs ``x``: max |diff| of the first
    output and of every gradient (backward of a fixed random projection of it; an expert
    weight's gradient is the average over the ep / batch batches of its EP group, all alike
    here), the largest reference values, parameters with a gradient on one side only, the
    share of expert-parallel weight elements this rank holds and the dispatches used."""
    from tpkit.parallel.expert.apply import expert_parallel

    model = copy.deepcopy(ref)
    ep_mesh, batch_mesh = meshes(ep, batch)
    styles = expert_parallel(model, ep_mesh, batch_mesh=batch_mesh, implementation=implementation)
    outs = []
    w = None
    for m in (ref, model):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        y = first_output(m(**x))
        if w is None:
            w = torch.randn(y.shape, generator=torch.Generator().manual_seed(2))
        (y * w).sum().backward()
        outs.append(y.detach())
    want = dict(ref.named_parameters())
    grad = scale = 0.0
    held = total = 0
    missing = []
    for name, p in model.named_parameters():
        if (p.grad is None) != (want[name].grad is None):
            missing.append(name)
            continue
        if isinstance(p, DTensor):
            total += p.numel()
            held += p.to_local().numel()
        if p.grad is None or p.numel() == 0:
            continue
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grad = max(grad, (g - want[name].grad).abs().max().item())
        scale = max(scale, want[name].grad.abs().max().item())
    return {
        "out": (outs[0] - outs[1]).abs().max().item(),
        "out_scale": outs[0].abs().max().item(),
        "grad": grad,
        "scale": scale,
        "missing": missing[:3],
        "held": held / max(1, total),
        "experts": len(styles),
        "kinds": sorted({s.name for s in styles.values()}),
        "dispatch": sorted({type(s.dispatcher()).__name__ for s in styles.values()}),
    }


def compare_split(ref: torch.nn.Module, x: dict, seed: int = 1234, **options: Any) -> dict:
    """Run on every rank: a copy of ``ref`` split by ``tpkit.tensor_parallel(**options)``
    against ``ref`` on inputs ``x`` (the same on every rank): `compare_ep`'s figures."""
    import tpkit
    from tpkit.parallel.expert.apply import expert_styles

    model = tpkit.tensor_parallel(copy.deepcopy(ref), **options)
    outs, w = [], None
    for m in (ref, model):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        y = first_output(m(**x))
        if w is None:
            w = torch.randn(y.shape, generator=torch.Generator().manual_seed(2))
        (y * w).sum().backward()
        outs.append(y.detach())
    want = dict(ref.named_parameters())
    grad = scale = 0.0
    missing = []
    for name, p in model.named_parameters():
        if (p.grad is None) != (want[name].grad is None):
            missing.append(name)
        elif p.grad is not None and p.numel():
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            grad = max(grad, (g - want[name].grad).abs().max().item())
            scale = max(scale, want[name].grad.abs().max().item())
    styles = expert_styles(model)
    return {
        "out": (outs[0] - outs[1]).abs().max().item(),
        "out_scale": outs[0].abs().max().item(),
        "grad": grad,
        "scale": scale,
        "missing": missing[:3],
        "held": _expert_share(model),
        "experts": len(styles),
        "kinds": sorted({s.name for s in styles.values()}),
        "dispatch": sorted({type(s.dispatcher()).__name__ for s in styles.values()}),
    }


def _out(model: torch.nn.Module, x: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    out = model(**x, output_router_logits=True)
    return out.logits, getattr(out, "aux_loss", None)


def ep_greedy(model_type: str, **options: Any) -> bool:
    """Run on every rank: 6 greedy tokens after a 5-token prompt, KV cache on, of the tiny
    model and of a copy split by ``tpkit.tensor_parallel(**options)``: the same tokens?"""
    import tpkit
    from tests.tiny import inputs

    ref = tiny_moe(model_type).eval()
    ref.config.use_cache = True
    model = tpkit.tensor_parallel(copy.deepcopy(ref), **options)
    prompt = inputs(ref, "causal-lm")["input_ids"][:, :5]
    kw = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        return torch.equal(ref.generate(prompt, **kw), model.generate(prompt, **kw))


def ep_train_steps(model_type: str, steps: int = 2, **options: Any) -> list[tuple[float, float]]:
    """Run on every rank: (unsharded loss, split loss) of ``steps`` AdamW steps on the
    causal-LM loss with the router aux loss, the model split by ``tpkit.tensor_parallel(
    **options)`` (FSDP2 over dp where dp > 1), every rank the same batch."""
    import tpkit
    from tests.tiny import inputs

    ref = tiny_moe(model_type, {"output_router_logits": True}).train()
    model = tpkit.tensor_parallel(copy.deepcopy(ref), **options).train()
    x = inputs(ref, "causal-lm")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, model)]
    losses = []
    for _ in range(steps):
        pair = []
        for m, opt in zip((ref, model), opts):
            opt.zero_grad()
            loss = m(**x, labels=x["input_ids"]).loss
            loss.backward()
            opt.step()
            pair.append(loss.item())
        losses.append(tuple(pair))
    return losses


def _expert_share(model: torch.nn.Module) -> float:
    """The share of the expert weights' elements this rank holds."""
    from tpkit.parallel.expert.apply import expert_styles

    held = total = 0
    for name in expert_styles(model):
        for p in model.get_submodule(name).parameters():
            total += p.numel()
            held += p.to_local().numel() if isinstance(p, DTensor) else p.numel()
    return held / max(1, total)


def _batch(ref: torch.nn.Module, seed: int) -> dict:
    from tests.tiny import SEQ, VOCAB

    g = torch.Generator().manual_seed(seed)
    vocab = min(VOCAB, ref.get_input_embeddings().num_embeddings)
    return {"input_ids": torch.randint(3, vocab, (2, SEQ), generator=g)}


def split_parity(
    model_type: str, overrides: dict | None = None, distinct: bool = False, **options: Any
) -> dict:
    """Run on every rank: ``tpkit.tensor_parallel(model, **options)`` (``ep_size`` among them)
    against the unsharded model: max |diff| of logits, aux loss and every gradient (full
    tensors; FSDP2's and the experts' data-parallel averaging as tpkit does it), the share of
    the expert weights this rank holds, and the dispatches used. ``distinct``: each dp rank
    its own batch (the unsharded gradients then the mean over the dp batches, its logits and
    aux loss this rank's batch's), else every rank the same one."""
    import tpkit
    from tpkit.parallel.expert.apply import expert_styles

    ref = tiny_moe(model_type, overrides)
    model = tpkit.tensor_parallel(copy.deepcopy(ref), **options)
    dims = model._tpkit.dims
    dp_rank = dist.get_rank() // (dims.tp * dims.cp)
    x = _batch(ref, 10 + (dp_rank if distinct else 0))
    w = torch.randn((2, x["input_ids"].shape[1], ref.config.vocab_size),
                    generator=torch.Generator().manual_seed(2))  # fmt: skip
    batches = [_batch(ref, 10 + r) for r in range(dims.dp)] if distinct else [x]
    for b in batches:  # the unsharded model: the mean over the dp batches
        logits, aux = _out(ref, b)
        (((logits * w).sum() + (aux if aux is not None else 0) * 3) / len(batches)).backward()
    with torch.no_grad():
        want_logits, want_aux = _out(ref, x)
    logits, aux = _out(model, x)
    ((logits * w).sum() + (aux if aux is not None else 0) * 3).backward()
    outs = [(want_logits, want_aux), (logits.detach(), aux)]
    want = dict(ref.named_parameters())
    grad = scale = 0.0
    missing = []
    for name, p in model.named_parameters():
        if (p.grad is None) != (want[name].grad is None):
            missing.append(name)
        elif p.grad is not None:
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            grad = max(grad, (g - want[name].grad).abs().max().item())
            scale = max(scale, want[name].grad.abs().max().item())
    aux = [a for _, a in outs]
    styles = expert_styles(model)
    return {
        "logits": (outs[0][0] - outs[1][0]).abs().max().item(),
        "aux": (aux[0] - aux[1]).abs().item() if aux[0] is not None else None,
        "grad": grad,
        "scale": scale,
        "missing": missing,
        "held": _expert_share(model),
        "experts": len(styles),
        "dispatch": sorted({type(s.dispatcher()).__name__ for s in styles.values()}),
    }


def ep_save_and_load(root: str) -> dict[str, Any]:
    """Run on every rank (world 2): a tiny Qwen3-MoE split at ep=2 (tp=2) saved with
    ``save_pretrained`` and loaded by plain transformers (rank 0) and by `tpkit.from_pretrained`
    with ``DistributedConfig(tp_size=2, ep_size=2)``; a DCP checkpoint saved at ep=2 loaded at
    tp=2 without EP, and one saved without EP loaded at ep=2: max |logits diff| of each against
    the unsharded model, and the loaded model's share of the expert weights."""
    from pathlib import Path

    import transformers
    from transformers.distributed import DistributedConfig

    import tpkit
    from tests.tiny import inputs
    from tpkit.io.checkpoint import load_checkpoint, save_checkpoint

    ref = tiny_moe("qwen3_moe").eval()
    x = inputs(ref, "causal-lm")
    with torch.no_grad():
        want = ref(**x).logits

    def diff(m: torch.nn.Module) -> float:
        with torch.no_grad():
            return (m(**x).logits - want).abs().max().item()

    root_path = Path(root)
    out: dict[str, Any] = {}
    model = tpkit.tensor_parallel(copy.deepcopy(ref), ep_size=2)
    model.save_pretrained(root_path / "hf")
    dist.barrier()
    if dist.get_rank() == 0:
        plain = transformers.AutoModelForCausalLM.from_pretrained(root_path / "hf").eval()
        out["plain_transformers"] = diff(plain)
    loaded = tpkit.from_pretrained(
        root_path / "hf", distributed_config=DistributedConfig(tp_size=2, ep_size=2)
    )
    out["from_pretrained"] = diff(loaded)
    out["from_pretrained_held"] = _expert_share(loaded)
    out["loaded_from"] = loaded._tpkit.loaded_from
    save_checkpoint(root_path / "dcp_ep2", model)
    other = tiny_moe("qwen3_moe", {"initializer_range": 0.5}).eval()  # other weights
    no_ep = tpkit.tensor_parallel(other, tp_size=2)
    load_checkpoint(root_path / "dcp_ep2", no_ep)
    out["dcp_ep2_to_tp2"] = diff(no_ep)
    save_checkpoint(root_path / "dcp_tp2", no_ep)
    again = tpkit.tensor_parallel(tiny_moe("qwen3_moe", {"initializer_range": 0.5}), ep_size=2)
    load_checkpoint(root_path / "dcp_tp2", again)
    out["dcp_tp2_to_ep2"] = diff(again)
    return out


def ep_trainer_losses(out: str, ep: int | None, **options: Any) -> dict[int, float]:
    """The HF Trainer's losses by step on the tiny Qwen3-MoE (router aux loss in the loss),
    the model split by ``tensor_parallel(ep_size=ep)`` (None: unsharded, one process), 3 AdamW
    steps of a global batch of 4 with gradient clipping. (Later steps drift apart at 1e-5 by
    Adam alone, tensor parallelism's too: its first step moves every weight by about lr x the
    sign of its gradient, so float noise in a gradient near zero moves that weight by up to lr;
    a top-k routing near a tie then flips.)"""
    from transformers import Trainer

    import tpkit
    from tests.test_trainer import (
        ToyLM,
        losses,
        reset_accelerate,
        training_args,
    )
    from tpkit.integrations.trainer import patch_trainer, unpatch_trainer

    patch_trainer()
    reset_accelerate()
    try:
        model = tiny_moe("qwen3_moe", {"output_router_logits": True}).train()
        if ep is not None:
            model = tpkit.tensor_parallel(model, ep_size=ep, **options)
        args = training_args(out, 4, save_strategy="no", max_steps=3)
        trainer = Trainer(model=model, args=args, train_dataset=ToyLM())
        trainer.train()
        return losses(trainer)
    finally:
        unpatch_trainer()
        reset_accelerate()


def ep_lora(target: str) -> dict[str, Any]:
    """Run on every rank (world 2): LoRA on ``target`` ("attention": q_proj and v_proj, beside
    experts placed by EP; "experts": peft's ``target_parameters`` on the experts' weights) of
    the tiny Qwen3-MoE at ep=2 against the same adapters on the unsharded model: max |diff|
    of the logits and of the adapters' gradients, or the error the combination raises."""
    import peft

    import tpkit
    from tests.tiny import inputs
    from tpkit.integrations.peft import get_peft_model

    if target == "attention":
        config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    else:
        config = peft.LoraConfig(
            r=4, target_modules=[], target_parameters=["mlp.experts.down_proj"],
            init_lora_weights=False,
        )  # fmt: skip
    base = tiny_moe("qwen3_moe")
    torch.manual_seed(1)
    ref = peft.get_peft_model(copy.deepcopy(base), config)
    try:
        torch.manual_seed(1)
        model = get_peft_model(tpkit.tensor_parallel(copy.deepcopy(base), ep_size=2), config)
    except Exception as exc:  # noqa: BLE001 - reported: what holds for adapters on experts
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    x = inputs(base, "causal-lm")
    outs = []
    for m in (ref, model):
        y = m(**x).logits
        (y * y.detach().sign()).sum().backward()
        outs.append(y.detach())
    want = {n: p for n, p in ref.named_parameters() if p.requires_grad}
    grad = 0.0
    for n, p in model.named_parameters():
        if p.requires_grad and n in want:
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            grad = max(grad, (g - want[n].grad).abs().max().item())
    trainable = sum(1 for p in model.parameters() if p.requires_grad)
    return {"logits": (outs[0] - outs[1]).abs().max().item(), "grad": grad, "n": trainable}
