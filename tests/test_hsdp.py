"""HSDP (dp_replicate x dp_shard [x tp]) and FSDP2's own settings, from every spelling, against
one plain process training the same model on the whole batch.

4-rank checks run on the session ``ranks4``; the 8-rank ones (dp_replicate=2 x dp_shard=2 x
tp=2) share one module group and as few ``group.run`` calls as possible.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.harness import RankGroup
from tests.models import batch, build, full

LOSS_REL, WEIGHT_ABS, STEPS = 1e-5, 1e-4, 3


def _dp_coords(model) -> tuple[int, int]:
    from tpkit import get_mesh, tp_state

    state = tp_state(model)
    dp_mesh = None if state is None else get_mesh(state.mesh, "dp")
    return (0, 1) if dp_mesh is None else (dp_mesh.get_local_rank(), dp_mesh.size())


def _reference(name: str, steps: int = STEPS) -> tuple[torch.nn.Module, list[float]]:
    """One process, the whole batch: the numbers every layout must give."""
    ref = build(name).train()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)
    losses = []
    for step in range(steps):
        x = batch(ref.config.vocab_size, shape=(8, 8), seed=step)
        opt.zero_grad()
        loss = ref(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return ref, losses


def train_steps(
    model, vocab: int, steps: int = STEPS, opt=None, first: int = 0, coords=None
) -> list[float]:
    """``steps`` AdamW steps, each data rank on its rows of the global (8 x 8) batch; returns the
    global mean loss of each step (every rank's loss averaged over the world). ``coords``: (data
    rank, data ranks) for a model tpkit did not split."""
    dp_rank, dp = coords or _dp_coords(model)
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    losses = []
    for step in range(first, first + steps):
        x = batch(vocab, shape=(8, 8), seed=step).chunk(dp)[dp_rank]
        opt.zero_grad()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        total = loss.detach().float().clone()
        if dist.is_initialized():
            dist.all_reduce(total)
        losses.append(total.item() / (dist.get_world_size() if dist.is_initialized() else 1))
    return losses


def _compare(model, ref, losses, ref_losses) -> dict:
    ref_params = dict(ref.named_parameters())
    some = next(
        p for n, p in model.named_parameters() if n.endswith("q_proj.weight") or "c_attn" in n
    )
    return {
        "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
        "weight_abs": max(
            (full(p).float() - ref_params[n].float()).abs().max().item()
            for n, p in model.named_parameters()
        ),
        "placements": [type(pl).__name__ for pl in some.placements],
        "mesh": (tuple(some.device_mesh.mesh_dim_names or ()), tuple(some.device_mesh.shape)),
        "losses": losses,
    }


def check_parity(name: str, **tp_kwargs) -> dict:
    """tensor_parallel(model, **tp_kwargs), STEPS AdamW steps, against one process."""
    import tpkit

    ref, ref_losses = _reference(name)
    model = tpkit.tensor_parallel(build(name).train(), **tp_kwargs)
    losses = train_steps(model, ref.config.vocab_size)
    return _compare(model, ref, losses, ref_losses)


def _assert_parity(results: list[dict], placements: list[str]) -> None:
    for r in results:
        assert r["loss_rel"] <= LOSS_REL and r["weight_abs"] <= WEIGHT_ABS, r
        assert r["placements"] == placements, r


# ---- 4 ranks: dp_replicate=2 x dp_shard=2 ------------------------------------------------------
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_hsdp_2x2_matches_one_process(ranks4, name):
    results = ranks4.run(check_parity, name, dp_replicate_size=2, dp_shard_size=2)
    _assert_parity(results, ["Replicate", "Shard"])


def test_replicas_alone_all_reduce_gradients(ranks4):
    """dp_replicate=4, dp_shard=1: FSDP2 over an (R, 1) mesh keeps whole replicas."""
    results = ranks4.run(check_parity, "llama", dp_replicate_size=4)
    _assert_parity(results, ["Replicate", "Shard"])


def test_hsdp_with_tp_on_four_ranks(ranks4):
    """dp_replicate=2 x tp=2 (dp_shard=1): TP weights under an (R, 1) data mesh."""
    results = ranks4.run(check_parity, "gpt2", dp_replicate_size=2, tp_size=2)
    _assert_parity(results, ["Replicate", "Shard", "_StridedShard"])


def test_hsdp_with_context_parallelism(ranks4):
    """dp_replicate=2 x cp=2 (tp=1): FSDP2 over (dp_replicate, dp_shard_cp), the cp ranks
    holding the same parameters (each replica's shards split over its cp pair)."""
    results = ranks4.run(check_parity, "llama", dp_replicate_size=2, cp_size=2)
    _assert_parity(results, ["Replicate", "Shard"])
    assert all(r["mesh"] == (("dp_replicate", "dp_shard_cp"), (2, 2)) for r in results), results


def _policies(kind: str) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return {
        "offload": {"cpu_offload": True},
        "mixed": {"mixed_precision": mixed},
        "both": {"cpu_offload": True, "mixed_precision": mixed},
    }[kind]


def check_policies_match_torch(kind: str) -> dict:
    """tpkit at dp_replicate=2 x dp_shard=2 with FSDP2's policies against torch's own
    ``fully_shard`` (each block, then the root) on the same (2, 2) mesh with the same ones."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    import tpkit

    asked = _policies(kind)
    model = tpkit.tensor_parallel(
        build("llama").train(), dp_replicate_size=2, dp_shard_size=2, **asked
    )
    seen = []  # the dtype up_proj computes in
    up = model.model.layers[0].mlp.up_proj
    up.register_forward_pre_hook(lambda m, a: seen.append(str(m.weight.dtype)))
    mine = train_steps(model, 101)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    theirs = build("llama").train()
    kwargs = {"mesh": mesh, "mp_policy": asked.get("mixed_precision", MixedPrecisionPolicy())}
    if asked.get("cpu_offload"):
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    # Llama's own FSDP plan (transformers' fsdp_plan), innermost first, then the root
    for layer in theirs.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(theirs.model.embed_tokens, **kwargs)
    fully_shard(theirs.model.norm, reshard_after_forward=False, **kwargs)
    fully_shard(theirs.lm_head, reshard_after_forward=False, **kwargs)
    fully_shard(theirs, **kwargs)
    reference = train_steps(theirs, 101, coords=(dist.get_rank(), 4))
    # torch keeps the policy on the unit's parameter group only (no public getter)
    group = model.model.layers[0]._get_fsdp_state()._fsdp_param_group
    return {
        "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(mine, reference)),
        "weights_abs": max(
            (full(p) - full(q)).abs().max().item()
            for p, q in zip(model.parameters(), theirs.parameters())
        ),
        "offload": type(group.offload_policy).__name__,
        "compute_dtype": seen[0],
        "param_dtype": str(up.weight.dtype),
        "losses": mine,
        "reference": reference,
    }


@pytest.mark.parametrize("kind", ["offload", "mixed", "both"])
def test_fsdp_policies_give_torchs_own_losses(ranks4, kind):
    for r in ranks4.run(check_policies_match_torch, kind):
        assert r["loss_rel"] <= LOSS_REL and r["weights_abs"] <= WEIGHT_ABS, r
        assert r["param_dtype"] == "torch.float32", r  # the sharded parameters stay float32
        offload = "CPUOffloadPolicy" if kind != "mixed" else "OffloadPolicy"
        compute = "torch.bfloat16" if kind != "offload" else "torch.float32"
        assert r["offload"] == offload and r["compute_dtype"] == compute, r


def _settings(model) -> dict:
    """What FSDP2 was given, read off the model: the offload policy and the dtype a layer's
    weight is gathered in (torch keeps both on the unit's parameter group only), and whether
    each unit kept its gathered weights after a forward (reshard_after_forward=False)."""
    from torch.distributed.tensor import DTensor

    group = model.model.layers[0]._get_fsdp_state()._fsdp_param_group
    with torch.no_grad():
        model(input_ids=batch(101, shape=(1, 4)))
    kept = {
        name: not isinstance(module.weight, DTensor)
        for name, module in (
            ("layer", model.model.layers[0].mlp.up_proj),
            ("head", model.lm_head),
            ("embed", model.model.embed_tokens),
        )
    }
    for m in model.modules():  # back to sharded, as a step would leave them
        if hasattr(m, "reshard"):
            m.reshard()
    return {
        "offload": type(group.offload_policy).__name__,
        "param_dtype": str(group.mp_policy.param_dtype),
        "kept": kept,
    }


def check_spellings(path: str) -> dict:
    """dp_replicate=2 x dp_shard=2 spelled as a transformers DistributedConfig and an accelerate
    ParallelismConfig (through tensor_parallel), and through from_pretrained with FSDP2's
    settings: the same numbers as tpkit's keywords."""
    from accelerate import ParallelismConfig
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from transformers.distributed import DistributedConfig

    import tpkit

    ref, ref_losses = _reference("llama")
    out = {}
    spellings = {
        "distributed_config": lambda: tpkit.tensor_parallel(
            build("llama").train(),
            distributed_config=DistributedConfig(dp_replicate_size=2, fsdp_size=2),
        ),
        "parallelism_config": lambda: tpkit.tensor_parallel(
            build("llama").train(),
            distributed_config=ParallelismConfig(dp_replicate_size=2, dp_shard_size=2),
        ),
        "from_pretrained": lambda: tpkit.from_pretrained(
            path, distributed_config=DistributedConfig(dp_replicate_size=2, fsdp_size=2)
        ).train(),
    }
    for name, make in spellings.items():
        model = make()
        out[name] = _compare(model, ref, train_steps(model, 101), ref_losses)
    plan = {"model.layers.*": "keep_full_weight"}
    config = DistributedConfig(
        dp_replicate_size=2,
        fsdp_size=2,
        fsdp_cpu_offload=True,
        fsdp_mixed_precision=True,
        fsdp_plan=plan,
    )
    loaded = tpkit.from_pretrained(path, distributed_config=config).train()
    keywords = tpkit.tensor_parallel(
        build("llama").train(),
        dp_replicate_size=2,
        dp_shard_size=2,
        cpu_offload=True,
        mixed_precision=MixedPrecisionPolicy(torch.bfloat16, torch.float32),
        fsdp_plan=plan,
    )
    out["settings"] = {"loaded": _settings(loaded), "keywords": _settings(keywords)}
    out["settings_losses"] = (train_steps(loaded, 101), train_steps(keywords, 101))
    return out


def test_every_spelling_of_hsdp(ranks4, tmp_path):
    build("llama").save_pretrained(tmp_path)
    for r in ranks4.run(check_spellings, str(tmp_path)):
        for name in ("distributed_config", "parallelism_config", "from_pretrained"):
            assert r[name]["loss_rel"] <= LOSS_REL and r[name]["weight_abs"] <= WEIGHT_ABS, r
            assert r[name]["placements"] == ["Replicate", "Shard"], (name, r[name])
        loaded, keywords = r["settings"]["loaded"], r["settings"]["keywords"]
        assert loaded == keywords, r["settings"]
        assert loaded["offload"] == "CPUOffloadPolicy", loaded
        assert loaded["param_dtype"] == "torch.bfloat16", loaded
        # the layers kept by the plan; Llama's own plan keeps the head, frees the embedding
        assert loaded["kept"] == {"layer": True, "head": True, "embed": False}, loaded
        mine, theirs = r["settings_losses"]
        assert mine == theirs, r["settings_losses"]


# ---- the FSDP plan -------------------------------------------------------------------------
def _units(name: str, plan=None) -> dict[str, bool]:
    from tpkit.parallel.fsdp_plan import fsdp_units

    return {u.name: u.keep for u in fsdp_units(build(name), plan)}


def test_units_follow_the_models_own_fsdp_plan():
    assert _units("llama") == {
        "model.layers.0": False,
        "model.layers.1": False,
        "model.embed_tokens": False,
        "model.norm": True,
        "lm_head": True,
    }


def test_a_plan_naming_no_module_gives_one_unit_per_block():
    """GPT-2's config carries transformers' config-wide default plan (embed_tokens, layers.*,
    norm), which names none of its modules: one unit per block, as without a plan."""
    assert _units("gpt2") == {"transformer.h.0": False, "transformer.h.1": False}


def test_tied_embedding_and_head_get_no_unit_of_their_own():
    """The tied weight falls to the root's unit, gathered for the whole forward."""
    assert _units("llama_tied") == {
        "model.layers.0": False,
        "model.layers.1": False,
        "model.norm": True,
    }


def test_a_users_plan_is_merged_over_the_models():
    units = _units(
        "llama", {"model.layers.*": "keep_full_weight", "model.norm": "free_full_weight"}
    )
    assert units["model.layers.0"] and units["model.layers.1"] and not units["model.norm"]
    assert units["lm_head"], units


def check_tied_and_kept(name: str) -> dict:
    """A tied model, and every unit kept from forward to backward, still train exactly."""
    return check_parity(name, dp_replicate_size=2, dp_shard_size=2, reshard_after_forward=False)


def test_tied_weights_and_reshard_after_forward_false_train_exactly(ranks4):
    _assert_parity(ranks4.run(check_tied_and_kept, "llama_tied"), ["Replicate", "Shard"])


# ---- bad input: one clear error on every rank, before any collective -----------------------
def check_refusals() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import tpkit

    user_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "tp"))
    cases = {
        "sizes": dict(dp_replicate_size=2, dp_shard_size=3),
        "offload_without_dp": dict(tp_size=4, cpu_offload=True),
        "settings_unsharded": dict(
            tp_size=2, dp_size=2, sharded=False, reshard_after_forward=False
        ),
        "style": dict(dp_shard_size=4, fsdp_plan={"model.layers.*": "shard_it"}),
        "pattern": dict(dp_shard_size=4, fsdp_plan={"model.blocks.*": "free_full_weight"}),
        "user_mesh": dict(mesh=user_mesh),
        "two_policies": dict(
            dp_shard_size=4,
            param_dtype=torch.bfloat16,
            mixed_precision=MixedPrecisionPolicy(torch.float16),
        ),
    }
    out = {}
    for case, kwargs in cases.items():
        model = build("llama")
        try:
            tpkit.tensor_parallel(model, **kwargs)
            out[case] = "accepted"
        except ValueError as exc:
            out[case] = str(exc)
        out[case + "_untouched"] = tpkit.tp_state(model) is None
    dist.barrier()  # every rank got here: no rank is waiting in a collective
    return out


def test_bad_input_is_one_clear_error_on_every_rank(ranks4):
    expected = {
        "sizes": "dp_replicate_size=2 x dp_shard_size=3 x tp_size=1 = 6 ranks, but the world",
        "offload_without_dp": "cpu_offload=True: FSDP2's settings, but FSDP2 is not applied",
        "settings_unsharded": "reshard_after_forward=False: FSDP2's settings, but FSDP2 is not",
        "style": "fsdp_plan['model.layers.*'] = 'shard_it'",
        "pattern": "fsdp_plan key 'model.blocks.*' names no module",
        "user_mesh": "HSDP needs the 2-D data mesh (dp_replicate, dp_shard)",
        "two_policies": "disagree; give FSDP2's mixed precision once",
    }
    results = ranks4.run(check_refusals)
    assert all(r == results[0] for r in results), "every rank raises alike"
    for case, text in expected.items():
        assert text in results[0][case], (case, results[0][case])
        assert results[0][case + "_untouched"], case


def check_quantized_offload(path: str) -> str:
    import tpkit
    from tests.test_quant import nf4

    try:
        tpkit.from_pretrained(
            path, quantization_config=nf4(), tp_size=2, dp_shard_size=2, cpu_offload=True
        )
    except ValueError as exc:
        dist.barrier()
        return str(exc)
    return "accepted"


def test_cpu_offload_of_a_quantized_base_is_refused(ranks4, tmp_path):
    """FSDP2 offloads what it shards; the packed 4-bit weights are buffers it never sees."""
    pytest.importorskip("bitsandbytes")
    import transformers as tf

    from tests.test_quant import _config

    torch.manual_seed(0)
    tf.LlamaForCausalLM(_config(256)).save_pretrained(tmp_path)
    for message in ranks4.run(check_quantized_offload, str(tmp_path)):
        assert "cpu_offload=True (FSDP2's CPUOffloadPolicy) with a bitsandbytes" in message


# ---- the stock Trainer with accelerate's ParallelismConfig -------------------------------------
TRAINER_REL = 1e-4


def train_with_trainer(out: str, per_device: int, sizes: dict | None = None, accumulate=1):
    """The stock Trainer on the tiny Llama; with ``sizes``, the model split with the same
    ``ParallelismConfig`` the TrainingArguments carry. Returns the loss curve and the first
    batch this rank's data loader gives."""
    from accelerate import ParallelismConfig
    from transformers import Trainer

    import tpkit
    from tests.test_trainer import ToyLM, losses, reset_accelerate, training_args
    from tpkit.integrations.trainer import patch_trainer, unpatch_trainer

    patch_trainer()
    reset_accelerate()
    try:
        model, config = build("llama").train(), None
        if sizes:
            config = ParallelismConfig(**sizes)
            model = tpkit.tensor_parallel(model, distributed_config=config)
        args = training_args(
            out, per_device, config, save_strategy="no", gradient_accumulation_steps=accumulate
        )
        trainer = Trainer(model=model, args=args, train_dataset=ToyLM())
        trainer.train()
        first = next(iter(trainer.get_train_dataloader()))["input_ids"]
        pc = trainer.accelerator.parallelism_config
        return {
            "losses": losses(trainer),
            "first": first,
            "config": pc and (pc.dp_replicate_size, pc.dp_shard_size, pc.tp_size),
        }
    finally:
        unpatch_trainer()
        reset_accelerate()


def check_trainer(out: str, sizes: dict) -> dict:
    """One sample per data rank; and 2 accumulated micro-batches of one sample."""
    return {
        "plain": train_with_trainer(out + "/a", 1, sizes),
        "accumulated": train_with_trainer(out + "/b", 1, sizes, accumulate=2),
    }


@pytest.fixture(scope="module")
def trainer_reference(tmp_path_factory):
    """One process, the stock Trainer, global batch 4 (and 8 = 4 x 2 accumulated)."""
    from tests.test_trainer import single_process

    out = str(tmp_path_factory.mktemp("trainer_ref"))
    return {
        "plain": single_process(train_with_trainer, out + "/a", 4),
        "accumulated": single_process(train_with_trainer, out + "/b", 4, None, 2),
    }


def _assert_trainer(results: list[dict], reference: dict, sizes: dict, tp: int) -> None:
    for kind in ("plain", "accumulated"):
        ref = reference[kind]["losses"]
        for r in results:
            mine = r[kind]["losses"]
            assert mine.keys() == ref.keys(), (mine, ref)
            for step, loss in ref.items():
                assert abs(mine[step] - loss) <= TRAINER_REL * abs(loss), (kind, mine, ref)
            expected = (sizes["dp_replicate_size"], sizes["dp_shard_size"], sizes.get("tp_size", 1))
            assert r[kind]["config"] == expected, r[kind]["config"]
    firsts = [r["plain"]["first"] for r in results]
    for rank, first in enumerate(firsts):  # TP partners share a batch, data ranks do not
        for other in range(len(firsts)):
            same = torch.equal(first, firsts[other])
            assert same == (rank // tp == other // tp), (rank, other)


def test_trainer_with_hsdp_parallelism_config_matches_one_process(
    ranks4, tmp_path, trainer_reference
):
    sizes = {"dp_replicate_size": 2, "dp_shard_size": 2}
    results = ranks4.run(check_trainer, str(tmp_path), sizes)
    _assert_trainer(results, trainer_reference, sizes, tp=1)


def check_hsdp_config_over_plain_fsdp(out: str) -> str:
    """A model FSDP2 shards over 4 data ranks, told it is 2 replicas x 2 shards."""
    from accelerate import ParallelismConfig
    from transformers import Trainer

    import tpkit
    from tests.test_trainer import ToyLM, reset_accelerate, training_args
    from tpkit.integrations.trainer import patch_trainer, unpatch_trainer

    patch_trainer()
    reset_accelerate()
    try:
        model = tpkit.tensor_parallel(build("llama"), dp_shard_size=4)
        config = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)
        try:
            Trainer(model=model, args=training_args(out, 1, config), train_dataset=ToyLM())
        except ValueError as exc:
            return str(exc)
        return "accepted"
    finally:
        unpatch_trainer()
        reset_accelerate()


def test_trainer_refuses_a_config_with_another_data_split(ranks4, tmp_path):
    for message in ranks4.run(check_hsdp_config_over_plain_fsdp, str(tmp_path)):
        assert "whose data ranks are dp_replicate_size=1 x dp_shard_size=4" in message, message


@pytest.mark.parametrize("order", ["peft_first", "tpkit_first"])
def test_lora_adapters_train_exactly_under_hsdp(ranks4, order, tmp_path):
    """A PEFT model split at dp_replicate=2 x dp_shard=2 x tp=1 (FSDP2 over the adapters too, or,
    adapters added after, replicated with their gradients averaged), against the unsharded PEFT
    model (tests/test_peft.py's check), and its saved adapter. At tp = 1 nothing is laid out on
    the TP mesh (that once made the embedding a DTensor facing plain token ids)."""
    from tests.test_peft import TOL
    from tests.test_peft import _assert_parity as assert_lora_parity
    from tests.test_peft import check_parity as lora_parity

    results = ranks4.run(
        lora_parity, "gpt2", order, save=str(tmp_path), dp_replicate_size=2, dp_shard_size=2
    )
    assert_lora_parity(results)
    assert all(r["saved"] <= TOL for r in results), results


# ---- the notebook pool --------------------------------------------------------------------
def pool_weights(model) -> dict[str, torch.Tensor]:
    """Run on every worker of a pool (full_tensor is a collective)."""
    return _weights(model)


POOL_SCRIPT = """
import json

import torch

import tpkit
from tests.models import batch, build
from tests.test_hsdp import _reference, pool_weights

ref, ref_losses = _reference("llama")
model = tpkit.tensor_parallel(
    build("llama").train(), dp_replicate_size=2, dp_shard_size=2, cpu_offload=True
)
opt = tpkit.optim(model, torch.optim.AdamW, lr=1e-3, eps=1e-6)
losses = []
for step in range(3):
    x = batch(101, shape=(8, 8), seed=step)
    opt.zero_grad()
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    losses.append(loss.item())
weights = model.run(pool_weights)
mine = dict(ref.named_parameters())
print("RESULT " + json.dumps({
    "world": model.world_size,
    "loss_rel": max(abs(a - b) / b for a, b in zip(losses, ref_losses)),
    "weight_abs": max((w - mine[n]).abs().max().item() for n, w in weights.items()),
}))
model.close()
"""


def test_the_notebook_pool_runs_hsdp(tmp_path):
    """Outside torchrun, the sizes start one worker per rank (every data rank gets the batch
    the caller passes: the mean of equal gradients is the one-process gradient)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    (tmp_path / "script.py").write_text(POOL_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), str(root)])
    proc = subprocess.run(
        [sys.executable, "script.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    import json

    r = json.loads(lines[-1][len("RESULT ") :])
    assert r["world"] == 4 and r["loss_rel"] <= LOSS_REL and r["weight_abs"] <= WEIGHT_ABS, r


# ---- 8 ranks: one group for the module ----------------------------------------------------------
@pytest.fixture(scope="module")
def ranks8():
    group = RankGroup(8)
    yield group
    group.close()


def _weights(model) -> dict[str, torch.Tensor]:
    return {n: full(p).detach().clone() for n, p in model.named_parameters()}


def check_checkpoint_across_layouts(name: str, path: str, hf_dir: str, **load_sizes) -> dict:
    """At dp_replicate=2 x dp_shard=2 x tp=2: 2 steps, a DCP checkpoint with the optimizer,
    save_pretrained, a third step (the uninterrupted run); then a fresh model at
    ``load_sizes`` loads the checkpoint and takes the third step."""
    import tpkit

    sizes = dict(dp_replicate_size=2, dp_shard_size=2, tp_size=2)
    model = tpkit.tensor_parallel(build(name).train(), **sizes)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    vocab = model.config.vocab_size
    train_steps(model, vocab, 2, opt)
    tpkit.save_checkpoint(path, model, opt, step=2)
    saved = _weights(model)
    model.save_pretrained(hf_dir)
    (uninterrupted,) = train_steps(model, vocab, 1, opt, first=2)
    return {"uninterrupted": uninterrupted, **check_resume(name, path, saved, **load_sizes)}


def check_resume(name: str, path: str, saved: dict | None = None, **sizes) -> dict:
    """A differently initialised model at ``sizes`` loads the checkpoint (model and optimizer)
    and takes step 3; its loaded weights are compared with ``saved`` where given."""
    import tpkit

    model = build(name, seed=7).train()
    if sizes:
        model = tpkit.tensor_parallel(model, **sizes)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    extra = tpkit.load_checkpoint(path, model, opt)
    loaded = _weights(model)
    diff = max((loaded[n] - saved[n]).abs().max().item() for n in saved) if saved else None
    step = train_steps(model, model.config.vocab_size, 1, opt, first=2)[0]
    return {"extra": extra, "loaded_diff": diff, "resumed": step, "weights": loaded}


def check_eight(path: str, hf_dir: str) -> dict:
    """Every 8-rank check of the core in one call: parity of Llama (the model's own FSDP plan)
    and GPT-2 (inferred TP plan, packed biases left out of FSDP) at dp_replicate=2 x
    dp_shard=2 x tp=2, and the checkpoint written there resumed at tp=4 x dp_shard=2."""
    sizes = dict(dp_replicate_size=2, dp_shard_size=2, tp_size=2)
    out = {name: check_parity(name, **sizes) for name in ("llama", "gpt2")}
    moved = check_checkpoint_across_layouts("gpt2", path, hf_dir, tp_size=4, dp_shard_size=2)
    if dist.get_rank():
        moved.pop("weights")  # rank 0's copy is enough for the other layouts' comparisons
    return {**out, "moved": moved}


@pytest.fixture(scope="module")
def eight(ranks8, tmp_path_factory):
    """The 8-rank core checks, run once (`check_eight`), and where they wrote."""
    root = tmp_path_factory.mktemp("hsdp8")
    path, hf_dir = str(root / "ck"), str(root / "hf")
    results = ranks8.run(check_eight, path, hf_dir, timeout=600)
    return {"results": results, "path": path, "hf_dir": hf_dir}


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_hsdp_2x2x2_matches_one_process(eight, name):
    # FSDP2 over (dp_replicate, dp_shard) outside TP's split: Llama's q_proj (Shard(0) on tp)
    # gets a strided dp shard of the same dim; GPT-2's c_attn (split on dim 1) a plain one
    placements = {
        "llama": ["Replicate", "_StridedShard", "Shard"],
        "gpt2": ["Replicate", "Shard", "_StridedShard"],
    }[name]
    _assert_parity([r[name] for r in eight["results"]], placements)


def _uninterrupted(eight) -> float:
    return eight["results"][0]["moved"]["uninterrupted"]


def _saved(eight) -> dict:
    return eight["results"][0]["moved"]["weights"]


def test_checkpoint_2x2x2_resumes_at_tp4_dp_shard2(eight):
    for r in eight["results"]:
        moved = r["moved"]
        assert moved["extra"] == {"step": 2} and moved["loaded_diff"] == 0.0, moved
        assert abs(moved["resumed"] - moved["uninterrupted"]) <= LOSS_REL * moved["uninterrupted"]


def test_checkpoint_2x2x2_resumes_at_tp2_alone(eight, ranks2):
    results = ranks2.run(check_resume, "gpt2", eight["path"], _saved(eight), tp_size=2)
    for r in results:
        assert r["extra"] == {"step": 2} and r["loaded_diff"] == 0.0, r
        assert abs(r["resumed"] - _uninterrupted(eight)) <= LOSS_REL * _uninterrupted(eight), r


def test_checkpoint_2x2x2_resumes_in_one_process(eight):
    r = check_resume("gpt2", eight["path"], _saved(eight))
    assert r["extra"] == {"step": 2} and r["loaded_diff"] == 0.0, r
    assert abs(r["resumed"] - _uninterrupted(eight)) <= LOSS_REL * _uninterrupted(eight), r


def test_save_pretrained_from_2x2x2_is_the_plain_checkpoint(eight):
    import transformers as tf

    plain = tf.AutoModelForCausalLM.from_pretrained(eight["hf_dir"])
    saved = _saved(eight)
    for n, p in plain.named_parameters():
        assert torch.equal(p.detach(), saved[n]), n


def test_trainer_at_2x2x2_matches_one_process(ranks8, tmp_path, trainer_reference):
    sizes = {"dp_replicate_size": 2, "dp_shard_size": 2, "tp_size": 2}
    results = ranks8.run(check_trainer, str(tmp_path), sizes, timeout=600)
    _assert_trainer(results, trainer_reference, sizes, tp=2)
