"""HF Trainer with tpkit models: loss parity with single-process Trainer, resume, save_model.

One tp=2 run (4 AdamW steps, checkpoints at steps 2 and 4, ``save_model`` at the end) is shared
by several tests; the single-process reference runs in the pytest process.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist

from tests.models import batch, build

REL = 1e-5
STEPS, GLOBAL_BATCH = 4, 4


class ToyLM(torch.utils.data.Dataset):
    """32 fixed random sequences; labels = inputs (causal LM)."""

    def __init__(self, vocab: int = 101, n: int = 32, length: int = 9):
        g = torch.Generator().manual_seed(3)
        self.x = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def training_args(out: str, per_device: int, parallelism_config=None, **kw):
    from transformers import TrainingArguments

    defaults = dict(
        output_dir=out,
        max_steps=STEPS,
        per_device_train_batch_size=per_device,
        learning_rate=1e-2,
        max_grad_norm=1.0,
        logging_steps=1,
        save_steps=2,
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        include_num_input_tokens_seen="all",
        parallelism_config=parallelism_config,
    )
    defaults.update(kw)
    return TrainingArguments(**defaults)


class PlainLM(torch.nn.Module):
    """Not a transformers model: Trainer only needs a dict with a loss."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(101, 32)
        self.up, self.down = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)
        self.head = torch.nn.Linear(32, 101)

    def forward(self, input_ids, labels):
        h = self.emb(input_ids)
        logits = self.head(h + self.down(torch.relu(self.up(h))))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {"loss": loss, "logits": logits}


def _train_plain(out, tp=None) -> dict[int, float]:
    from accelerate import ParallelismConfig
    from transformers import Trainer

    import tpkit
    from tpkit.integrations.trainer import patch_trainer, unpatch_trainer

    patch_trainer()
    reset_accelerate()
    try:
        torch.manual_seed(0)
        model, config = PlainLM(), None
        if tp is not None:
            model = tpkit.tensor_parallel(model, plan={"up": "colwise", "down": "rowwise"})
            config = ParallelismConfig(tp_size=tp)
        args = training_args(out, GLOBAL_BATCH, config, save_strategy="no")
        trainer = Trainer(model=model, args=args, train_dataset=ToyLM())
        trainer.train()
        return losses(trainer)
    finally:
        unpatch_trainer()
        reset_accelerate()


def check_train_plain(out, tp) -> dict[int, float]:
    return _train_plain(out, tp)


def reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def losses(trainer) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def has_fsdp() -> bool:
    """Whether core tpkit composes FSDP2 over dp (``tensor_parallel(..., sharded=True)``)."""
    return has_options("sharded")


def has_options(*names: str) -> bool:
    import inspect

    import tpkit

    return set(names) <= set(inspect.signature(tpkit.tensor_parallel).parameters)


def _parallelize(model, tp: int, sharded: bool = False, **options):
    import tpkit

    if has_fsdp():
        return tpkit.tensor_parallel(model, tp_size=tp, sharded=sharded, **options)
    assert not sharded, "this tpkit has no sharded=True (FSDP2 over dp)"
    return tpkit.tensor_parallel(model, tp_size=tp, **options)


def _train(
    out,
    per_device,
    tp=None,
    dp=1,
    resume=None,
    save_final=None,
    sharded=False,
    length=9,
    options=None,
    **args_kw,
):
    """Train the tiny Llama with Trainer; return losses by step (and final logits on rank 0)."""
    from accelerate import ParallelismConfig
    from transformers import Trainer

    from tpkit.integrations.trainer import patch_trainer, unpatch_trainer

    patch_trainer()
    reset_accelerate()
    try:
        model = build("llama").train()
        if tp is not None:
            model = _parallelize(model, tp, sharded, **(options or {}))
        config = ParallelismConfig(tp_size=tp, dp_shard_size=dp) if tp else None
        args = training_args(out, per_device, config, **args_kw)
        trainer = Trainer(model=model, args=args, train_dataset=ToyLM(length=length))
        trainer.train(resume_from_checkpoint=resume)
        result = {"losses": losses(trainer), "tokens": trainer.state.num_input_tokens_seen}
        if save_final:
            trainer.save_model(save_final)
            model.eval()
            with torch.no_grad():
                result["logits"] = model(input_ids=batch(101)).logits
        return result
    finally:
        unpatch_trainer()
        reset_accelerate()


# ---- checks (run on every rank) ------------------------------------------------------------------
def check_train(out, per_device, tp, dp=1, resume=None, save_final=None, **kw):
    result = _train(out, per_device, tp, dp, resume, save_final, **kw)
    if dist.get_rank() != 0:
        result.pop("logits", None)
    return result


def _eval(out, tp=None) -> dict:
    """evaluate() and predict() on 10 samples in batches of 4 (a short last batch)."""
    from transformers import Trainer

    import tpkit
    from tpkit.integrations.trainer import patch_trainer, unpatch_trainer

    patch_trainer()
    reset_accelerate()
    try:
        model = build("llama")
        if tp is not None:
            model = tpkit.tensor_parallel(model, tp_size=tp)
        data = ToyLM(n=10)
        trainer = Trainer(
            model=model, args=training_args(out, 4, save_strategy="no"), eval_dataset=data
        )
        loss = trainer.evaluate()["eval_loss"]
        predicted = trainer.predict(data)
        return {"loss": loss, "logits": torch.as_tensor(predicted.predictions)}
    finally:
        unpatch_trainer()
        reset_accelerate()


def check_eval(out, tp) -> dict:
    return _eval(out, tp)


def check_load_full_weights(checkpoint) -> float:
    """A Trainer checkpoint's gathered model.safetensors and its DCP copy load to the same shards."""
    from tests.models import full
    from tpkit.integrations.trainer import DCP_DIR, load_full_weights
    from tpkit.io.checkpoint import load_checkpoint

    a = _parallelize(build("llama", seed=5), 2)
    b = _parallelize(build("llama", seed=6), 2)
    load_full_weights(a, checkpoint)
    load_checkpoint(os.path.join(checkpoint, DCP_DIR), b)
    ref = dict(b.named_parameters())
    return max((full(p) - full(ref[n])).abs().max().item() for n, p in a.named_parameters())


def check_first_batches(out, tp) -> dict:
    """The batch each rank gets first from the Trainer's data loader (no parallelism_config: tpkit
    fills it in from the model)."""
    from transformers import Trainer

    import tpkit
    from tpkit.integrations.trainer import patch_trainer, unpatch_trainer

    patch_trainer()
    reset_accelerate()
    try:
        model = tpkit.tensor_parallel(build("llama").train(), tp_size=tp)
        trainer = Trainer(model=model, args=training_args(out, 2), train_dataset=ToyLM())
        first = next(iter(trainer.get_train_dataloader()))["input_ids"]
        pc = trainer.accelerator.parallelism_config
        return {"first": first, "tp": pc.tp_size, "dp": pc.dp_shard_size}
    finally:
        unpatch_trainer()
        reset_accelerate()


def check_mismatched_config_raises(out) -> str:
    from accelerate import ParallelismConfig
    from transformers import Trainer

    import tpkit
    from tpkit.integrations.trainer import patch_trainer, unpatch_trainer

    patch_trainer()
    reset_accelerate()
    try:
        model = tpkit.tensor_parallel(build("llama"), tp_size=2)
        bad = ParallelismConfig(dp_shard_size=2)  # the right world size, the wrong split
        try:
            Trainer(model=model, args=training_args(out, 2, bad), train_dataset=ToyLM())
        except ValueError as exc:
            return str(exc)
        return ""
    finally:
        unpatch_trainer()
        reset_accelerate()


# ---- the shared runs ------------------------------------------------------------------------------
def single_process(fn, *args):
    saved = {k: os.environ.pop(k, None) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    try:
        return fn(*args)
    finally:
        os.environ.update({k: v for k, v in saved.items() if v is not None})


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Single-process Trainer (this process), same seed and global batch."""
    return single_process(_train, str(tmp_path_factory.mktemp("ref")), GLOBAL_BATCH)


@pytest.fixture(scope="module")
def tp2_run(ranks2, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp2")
    r0, r1 = ranks2.run(check_train, str(out), GLOBAL_BATCH, 2, save_final=str(out / "final"))
    return {"out": out, "r0": r0, "r1": r1}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


# ---- tests --------------------------------------------------------------------------------------
def test_tp2_losses_match_single_process_trainer(tp2_run, reference):
    ref = reference["losses"]
    assert sorted(ref) == list(range(1, STEPS + 1)), ref
    for r in (tp2_run["r0"], tp2_run["r1"]):
        assert sorted(r["losses"]) == sorted(ref), r
        for step, loss in ref.items():
            assert _rel(r["losses"][step], loss) <= REL, (step, r["losses"], ref)
    assert len(set(ref.values())) > 1  # the model did train
    assert tp2_run["r0"]["tokens"] == reference["tokens"] == STEPS * GLOBAL_BATCH * 9


def test_checkpoint_layout(tp2_run):
    ck = tp2_run["out"] / "checkpoint-2"
    assert (ck / "tpkit_dcp" / ".metadata").exists()
    assert (ck / "scheduler.pt").exists() and (ck / "trainer_state.json").exists()
    assert (ck / "model.safetensors").exists()  # the gathered full model, as for any Trainer run
    assert not (ck / "optimizer.pt").exists()  # optimizer state lives in the DCP checkpoint


def test_save_model_loads_in_plain_transformers(tp2_run):
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(str(tp2_run["out"] / "final")).eval()
    assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in plain.parameters())
    with torch.no_grad():
        logits = plain(input_ids=batch(101)).logits
    tp_logits = tp2_run["r0"]["logits"]
    assert (logits - tp_logits).abs().max().item() <= 1e-5 * max(1.0, tp_logits.abs().max().item())
    ref = build("llama")
    assert any(  # and it is the trained model, not the initial one
        not torch.equal(p, q) for p, q in zip(plain.parameters(), ref.parameters())
    )


def test_full_weights_load_like_the_dcp_checkpoint(ranks2, tp2_run):
    for diff in ranks2.run(check_load_full_weights, str(tp2_run["out"] / "checkpoint-2")):
        assert diff == 0.0, diff


def test_resume_from_step2_reproduces_steps_3_and_4(ranks2, tp2_run, tmp_path):
    ck = str(tp2_run["out"] / "checkpoint-2")
    r0, r1 = ranks2.run(check_train, str(tmp_path), GLOBAL_BATCH, 2, resume=ck)
    full = tp2_run["r0"]["losses"]
    for r in (r0, r1):
        assert r["losses"][3] == full[3] and r["losses"][4] == full[4], (r, full)


def _resume_on_dp2(ranks4, tp2_run, tmp_path, sharded: bool) -> None:
    """The tp=2 checkpoint of step 2 resumed on 4 ranks (dp=2 x tp=2), same global batch of 4 as
    1 sample per rank x 2 accumulated micro-batches: steps 3-4 match the uninterrupted run."""
    ck = str(tp2_run["out"] / "checkpoint-2")
    results = ranks4.run(
        check_train,
        str(tmp_path),
        1,
        2,
        2,
        resume=ck,
        save_final=str(tmp_path / "final"),
        sharded=sharded,
        gradient_accumulation_steps=2,
    )
    full = tp2_run["r0"]["losses"]
    for r in results:
        for step in (3, 4):
            assert _rel(r["losses"][step], full[step]) <= REL, (step, r["losses"], full)
    assert (tmp_path / "final" / "model.safetensors").exists()


def test_resume_tp2_checkpoint_on_dp2_tp2_replicated(ranks4, tp2_run, tmp_path):
    _resume_on_dp2(ranks4, tp2_run, tmp_path, sharded=False)


def test_resume_tp2_checkpoint_on_dp2_tp2_fsdp(ranks4, tp2_run, tmp_path):
    if not has_fsdp():
        pytest.skip("tensor_parallel(..., sharded=True) (FSDP2 over dp) has not landed")
    _resume_on_dp2(ranks4, tp2_run, tmp_path, sharded=True)


def test_sequence_and_loss_parallel_under_trainer(ranks2, tmp_path):
    """tpkit's training options change nothing Trainer sees: same losses as single-process."""
    if not has_options("sequence_parallel", "loss_parallel"):
        pytest.skip("tensor_parallel(..., sequence_parallel=, loss_parallel=) has not landed")
    kw = dict(length=10, save_strategy="no")  # sequence parallel: length divisible by tp
    ref = single_process(functools.partial(_train, **kw), str(tmp_path / "ref"), GLOBAL_BATCH)[
        "losses"
    ]
    options = {"sequence_parallel": True, "loss_parallel": True}
    for r in ranks2.run(check_train, str(tmp_path / "tp"), GLOBAL_BATCH, 2, options=options, **kw):
        for step, loss in ref.items():
            assert _rel(r["losses"][step], loss) <= REL, (step, r["losses"], ref)


def test_plain_torch_module_under_trainer(ranks2, tmp_path):
    ref = single_process(_train_plain, str(tmp_path / "ref"))
    for losses in ranks2.run(check_train_plain, str(tmp_path / "tp"), 2):
        for step, loss in ref.items():
            assert _rel(losses[step], loss) <= REL, (step, losses, ref)


def test_evaluate_and_predict_match_single_process(ranks2, tmp_path):
    """TP partners hold the same predictions: they are gathered once, the short batch trimmed."""
    ref = single_process(_eval, str(tmp_path / "ref"))
    for r in ranks2.run(check_eval, str(tmp_path / "tp"), 2):
        assert _rel(r["loss"], ref["loss"]) <= REL, (r["loss"], ref["loss"])
        assert r["logits"].shape == ref["logits"].shape == (10, 9, 101), r["logits"].shape
        assert (r["logits"] - ref["logits"]).abs().max().item() <= 1e-5


def test_data_ranks_follow_the_mesh(ranks4, tmp_path):
    """dp=2 x tp=2 on 4 ranks: TP partners get the same batch, dp groups different ones."""
    r = ranks4.run(check_first_batches, str(tmp_path), 2)
    assert all(x["tp"] == 2 and x["dp"] == 2 for x in r)
    assert torch.equal(r[0]["first"], r[1]["first"]) and torch.equal(r[2]["first"], r[3]["first"])
    assert not torch.equal(r[0]["first"], r[2]["first"])


def test_parallelism_config_must_describe_the_model(ranks2, tmp_path):
    for msg in ranks2.run(check_mismatched_config_raises, str(tmp_path)):
        assert "does not describe the tpkit model (tp_size=2, dp_size=1)" in msg, msg
