"""The calls users already know, typed as they type them, on tpkit models.

No ``patch_*`` call, no tpkit-specific import beyond ``tpkit.tensor_parallel`` itself: plain
``save_pretrained``, ``peft.get_peft_model`` / ``PeftModel.from_pretrained`` in both orders and
on dp x tp, the stock HF ``Trainer`` on CPU without ``use_cpu``, accelerate's
``load_checkpoint_in_model`` with ``init_empty_weights``, ``tpkit.launch`` from stdin and the
``tpkit`` command's input checks. Each result is compared with the unsharded model's.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.models import batch, build, full
from tests.test_peft import _copy_adapters, _lora_grads, _safetensors, lora_config

TOL = 1e-5
ROOT = Path(__file__).resolve().parents[1]


def _fresh_user() -> None:
    """Undo every patch earlier checks in this rank may have left: tpkit must apply its own."""
    from tpkit.integrations.peft import unpatch_peft
    from tpkit.integrations.trainer import unpatch_trainer

    unpatch_peft()
    unpatch_trainer()


def _max(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# ---- save_pretrained -----------------------------------------------------------------------------
def check_plain_save_pretrained(name: str, out: str) -> dict:
    from transformers import AutoModelForCausalLM

    import tpkit

    ref = build(name)
    model = tpkit.tensor_parallel(build(name))
    model.save_pretrained(out)  # every rank calls it, as in any torchrun script
    x = batch(101)
    with torch.no_grad():
        after = _max(model(input_ids=x).logits, ref(input_ids=x).logits)  # the ranks go on
    plain = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        loaded = _max(plain(input_ids=x).logits, ref(input_ids=x).logits)
    with tpkit.save_tensor_parallel(model):  # the context manager still gives full tensors
        sd = model.state_dict()
    return {
        "after": after,
        "loaded": loaded,
        "files": sorted(os.listdir(out)),
        "state_dict_full": all(
            tuple(v.shape) == tuple(ref.state_dict()[k].shape) for k, v in sd.items()
        ),
    }


@pytest.mark.parametrize("name", ["llama_tied", "gpt2"])
def test_plain_save_pretrained_gathers(ranks2, tmp_path, name):
    for r in ranks2.run(check_plain_save_pretrained, name, str(tmp_path / name)):
        assert r["after"] <= TOL and r["loaded"] <= TOL, r
        assert "model.safetensors" in r["files"] and r["state_dict_full"], r


# ---- peft, both orders, and dp x tp -----------------------------------------------------------------
def check_plain_peft(name: str, tmp: str) -> dict:
    import peft

    import tpkit

    _fresh_user()
    torch.manual_seed(0)
    ref = peft.get_peft_model(build(name), lora_config(name))
    x = batch(101, shape=(2, 8))
    ref_dir = os.path.join(tmp, f"{name}_ref")
    if dist.get_rank() == 0:
        ref.save_pretrained(ref_dir)
    dist.barrier()
    out_r = ref(input_ids=x, labels=x)
    out_r.loss.backward()
    ref_grads = _lora_grads(ref)
    result = {}
    for order in ("peft_first", "tpkit_first"):
        if order == "peft_first":
            torch.manual_seed(0)
            model = tpkit.tensor_parallel(peft.get_peft_model(build(name), lora_config(name)))
        else:
            model = peft.get_peft_model(tpkit.tensor_parallel(build(name)), lora_config(name))
            _copy_adapters(ref, model)
        o = model(input_ids=x, labels=x)
        o.loss.backward()
        grads = _lora_grads(model)
        saved = os.path.join(tmp, f"{name}_{order}")
        model.save_pretrained(saved)
        a, b = _safetensors(saved), _safetensors(ref_dir)
        result[order] = {
            "logits": _max(o.logits, out_r.logits),
            "grad": max(_max(grads[n], ref_grads[n]) for n in ref_grads),
            "same_grad_keys": sorted(grads) == sorted(ref_grads),
            "saved": max(_max(a[k], b[k]) for k in b) if sorted(a) == sorted(b) else None,
        }
    loaded = peft.PeftModel.from_pretrained(tpkit.tensor_parallel(build(name)), ref_dir)
    with torch.no_grad():
        result["from_pretrained"] = _max(loaded(input_ids=x).logits, out_r.logits)
    return result


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_plain_peft_calls_in_both_orders(ranks2, tmp_path, name):
    for r in ranks2.run(check_plain_peft, name, str(tmp_path)):
        for order in ("peft_first", "tpkit_first"):
            o = r[order]
            assert o["same_grad_keys"] and o["saved"] is not None, r
            assert o["logits"] <= TOL and o["grad"] <= TOL and o["saved"] <= TOL, r
        assert r["from_pretrained"] <= TOL, r


def check_plain_peft_dp_tp(tmp: str) -> dict:
    """dp=2 x tp=2, FSDP2 over dp (the default): each dp rank its half of the batch."""
    import peft

    import tpkit

    _fresh_user()
    torch.manual_seed(0)
    ref = peft.get_peft_model(build("llama"), lora_config("llama"))
    ref_dir = os.path.join(tmp, "ref")
    if dist.get_rank() == 0:
        ref.save_pretrained(ref_dir)
    dist.barrier()
    x = batch(101, shape=(4, 8))
    out_r = ref(input_ids=x, labels=x)
    out_r.loss.backward()
    ref_grads = _lora_grads(ref)
    dp_rank = dist.get_rank() // 2
    mine = x.chunk(2)[dp_rank]
    result = {}
    for how in ("from_pretrained", "get_peft_model"):
        base = tpkit.tensor_parallel(build("llama"), tp_size=2, dp_size=2)
        if how == "from_pretrained":
            model = peft.PeftModel.from_pretrained(base, ref_dir, is_trainable=True)
        else:
            model = peft.get_peft_model(base, lora_config("llama"))
            _copy_adapters(ref, model)
        o = model(input_ids=mine, labels=mine)
        o.loss.backward()  # each dp half's mean loss: the dp average is the full batch's
        grads = _lora_grads(model)
        result[how] = {
            "logits": _max(o.logits, out_r.logits.chunk(2)[dp_rank]),
            "grad": max(_max(grads[n], ref_grads[n]) for n in ref_grads),
        }
    return result


def test_plain_peft_on_dp2_tp2(ranks4, tmp_path):
    for r in ranks4.run(check_plain_peft_dp_tp, str(tmp_path)):
        for how in ("from_pretrained", "get_peft_model"):
            assert r[how]["logits"] <= TOL and r[how]["grad"] <= TOL, r


# ---- Trainer -----------------------------------------------------------------------------------
def _plain_trainer(out: str, tp: int | None) -> dict:
    """The stock Trainer as a user writes it: no patch call, no use_cpu."""
    from accelerate import ParallelismConfig
    from transformers import Trainer, TrainingArguments

    import tpkit
    from tests.test_trainer import ToyLM, losses, reset_accelerate

    _fresh_user()
    reset_accelerate()
    try:
        torch.manual_seed(0)
        model = build("llama").train()
        if tp:
            model = tpkit.tensor_parallel(model)
        args = TrainingArguments(
            output_dir=out,
            max_steps=3,
            per_device_train_batch_size=4,
            learning_rate=1e-2,
            logging_steps=1,
            report_to=[],
            disable_tqdm=True,
            seed=0,
            save_strategy="no",
            use_cpu=tp is None,  # the single-process reference on this (GPU-less) machine
            parallelism_config=ParallelismConfig(tp_size=tp) if tp else None,
        )
        trainer = Trainer(model=model, args=args, train_dataset=ToyLM())
        trainer.train()
        return {"losses": losses(trainer), "cpu": args.use_cpu}
    finally:
        reset_accelerate()


def check_plain_trainer(out: str) -> dict:
    return _plain_trainer(out, 2)


def test_plain_trainer_on_cpu(ranks2, tmp_path):
    from tests.test_trainer import single_process

    ref = single_process(_plain_trainer, str(tmp_path / "ref"), None)["losses"]
    assert sorted(ref) == [1, 2, 3] and len(set(ref.values())) > 1, ref
    for r in ranks2.run(check_plain_trainer, str(tmp_path / "tp")):
        assert r["cpu"] and sorted(r["losses"]) == sorted(ref), r
        for step, loss in ref.items():
            assert abs(r["losses"][step] - loss) <= TOL * abs(loss), (step, r, ref)


# ---- accelerate's loading flow ---------------------------------------------------------------------
def check_accelerate_loading(ckpt: str, **tp_kwargs) -> dict:
    """accelerate's documented empty-model flow, with tensor_parallel outside or inside
    ``init_empty_weights``; ``tp_kwargs`` also gives dp x tp (FSDP2's two-level shards)."""
    import accelerate
    from transformers import AutoModelForCausalLM

    import tpkit

    ref = build("llama_tied")
    if dist.get_rank() == 0:
        ref.save_pretrained(ckpt)
    dist.barrier()
    x = batch(101)
    with torch.no_grad():
        expected = ref(input_ids=x).logits
    out = {}
    for where in ("outside", "inside"):
        # accelerate's own advice for an empty model: tie_weights() before loading (outside the
        # context, whose register_parameter makes a new parameter of every assignment)
        if where == "inside":  # tensor_parallel inside init_empty_weights
            with accelerate.init_empty_weights():
                model = tpkit.tensor_parallel(
                    AutoModelForCausalLM.from_config(ref.config), **tp_kwargs
                )
            model.tie_weights()
        else:
            with accelerate.init_empty_weights():
                model = AutoModelForCausalLM.from_config(ref.config)
            model.tie_weights()
            model = tpkit.tensor_parallel(model, fill_later=True, **tp_kwargs)
        device_map = tpkit.infer_sharded_device_map(model)
        accelerate.load_checkpoint_in_model(model, ckpt, device_map=device_map)
        with torch.no_grad():
            logits = model(input_ids=x).logits
        emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        out[where] = {
            "diff": _max(logits, expected),
            "tied": emb is head,
            "sharded": emb.to_local().shape[0] <= -(-emb.shape[0] // dist.get_world_size()),
            "no_meta": not any(p.is_meta or full(p).is_meta for p in model.parameters()),
        }
    return out


def test_accelerate_load_checkpoint_in_model(ranks2, tmp_path):
    for r in ranks2.run(check_accelerate_loading, str(tmp_path / "ck")):
        for where in ("outside", "inside"):
            o = r[where]
            assert o["diff"] <= TOL and o["tied"] and o["sharded"] and o["no_meta"], r


def test_accelerate_load_checkpoint_in_model_dp2_tp2(ranks4, tmp_path):
    """On dp x tp each rank keeps its FSDP2 part of its TP shard (before: the TP slice only, a
    size mismatch at the first forward)."""
    for r in ranks4.run(check_accelerate_loading, str(tmp_path / "ck"), tp_size=2, dp_size=2):
        for where in ("outside", "inside"):
            o = r[where]
            assert o["diff"] <= TOL and o["tied"] and o["sharded"] and o["no_meta"], r


def test_libraries_imported_after_tpkit_are_patched_on_import():
    """``import peft`` after the first split still gets the patch (the post-import hook), and
    ``import tpkit`` itself imports none of peft, transformers' Trainer or accelerate."""
    script = textwrap.dedent(
        """
        import sys
        import tpkit
        from tpkit.integrations.autopatch import ensure_patched

        print("IMPORTED", [m for m in ("peft", "transformers.trainer") if m in sys.modules])
        ensure_patched()  # what the first tensor_parallel does
        import peft
        from transformers import Trainer
        import accelerate.utils.modeling as modeling

        print("PATCHED", bool(getattr(peft.PeftModel.save_pretrained, "__wrapped__", None)),
              getattr(Trainer.__init__, "_tpkit_patch", False),
              getattr(modeling.set_module_tensor_to_device, "_tpkit_patch", False))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-"], input=script, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "IMPORTED []" in out and "PATCHED True True True" in out, out


# ---- tpkit.launch from stdin ---------------------------------------------------------------------
def test_launch_from_stdin_with_the_group_up():
    script = textwrap.dedent(
        """
        import torch, torch.distributed as dist, tpkit

        def fn(x):
            dist.init_process_group("gloo")  # the user's own line: harmless, the group is up
            t = torch.tensor([dist.get_rank() + x])
            dist.all_reduce(t)
            return dist.get_world_size(), int(t)

        print("RESULT", tpkit.launch(fn, 10, nproc=2))
        print("ONE", tpkit.launch(dist.get_world_size, nproc=1))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-"],
        input=script,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "RESULT (2, 21)" in out and "ONE 1" in out, out


# ---- the tpkit command ---------------------------------------------------------------------------
def _tpkit(*argv: str) -> subprocess.CompletedProcess:
    """The ``tpkit`` command as a user types it: its own interpreter, ``python -m tpkit.cli``."""
    return subprocess.run(
        [sys.executable, "-m", "tpkit.cli", *argv],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.fixture
def tpkit_cmd(monkeypatch, capfd):
    """The ``tpkit`` command run in this process, as from the shell: ``main()`` reads
    ``sys.argv`` (so errors take the one-line shell path, not the raising Python one) and its
    exit status and both streams (file-descriptor level: a launched torchrun's too) come back
    as a `subprocess.CompletedProcess`. Each subprocess costs ~5 s of imports (torch,
    transformers) on 2 cores; `test_cli_entry_point_is_the_shell_command` runs the real one."""
    from tpkit.cli.main import main

    def launch(*args, **kwargs):  # would replace this pytest worker with torchrun
        pytest.fail(f"an in-process tpkit command tried to launch ranks: {args}")

    monkeypatch.setattr("tpkit.cli.launch.run_script", launch)

    def run(*argv: str) -> subprocess.CompletedProcess:
        monkeypatch.setattr(sys, "argv", ["tpkit", *argv])
        monkeypatch.delenv("TPKIT_DEBUG", raising=False)
        capfd.readouterr()
        try:
            code = main()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        out, err = capfd.readouterr()
        return subprocess.CompletedProcess(["tpkit", *argv], code, out, err)

    return run


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    for name in ("llama", "gpt2", "t5"):
        build(name).save_pretrained(d / name)
    # a user plan splitting the 4 attention heads by heads: never rewritten, so tp=3 is refused
    (d / "heads.yaml").write_text(
        "plan:\n"
        + "".join(
            f"  model.layers.*.self_attn.{n}: {s}\n"
            for n, s in (("q_proj", "colwise"), ("k_proj", "colwise"), ("v_proj", "colwise"))
        )
        + "  model.layers.*.self_attn.o_proj: rowwise\n"
    )
    return d


def _assert_one_line_error(argv: tuple[str, ...], proc, expected: str) -> None:
    err = proc.stdout + proc.stderr
    assert proc.returncode in (1, 2), (argv, err)
    assert expected in err, (argv, err)
    assert "Traceback" not in err and "torchrun" not in err, (argv, err)
    assert len(err.strip().splitlines()) <= 12, (argv, err)


def test_cli_entry_point_is_the_shell_command(checkpoints):
    """``python -m tpkit.cli`` in its own process: the exit status and the one-line error."""
    argv = ("generate", str(checkpoints / "llama"), "1 5000")
    _assert_one_line_error(argv, _tpkit(*argv), "0 <= id < vocab_size (101)")


def test_cli_inputs_checked_before_any_rank(checkpoints, tpkit_cmd):
    llama = str(checkpoints / "llama")
    cases = {
        ("plan", llama, "--tp", "0"): "--tp must be >= 1, got 0",
        ("plan", str(checkpoints / "missing")): "does not exist",
        ("generate", str(checkpoints / "missing"), "1 2"): "does not exist",
        ("generate", llama, "1 2", "--tp", "0"): "--tp must be >= 1",
        ("generate", llama, "hello"): "has no tokenizer: give the prompt as token ids",
        ("generate", llama, "1 5000"): "0 <= id < vocab_size (101)",
        ("plan", llama, "--tp", "3", "--plan", str(checkpoints / "heads.yaml")): (
            "tp_size=3 does not divide num_attention_heads=4"
        ),
    }
    for argv, expected in cases.items():
        _assert_one_line_error(argv, tpkit_cmd(*argv), expected)


def test_cli_plan_collapses_layers_and_says_tp1_splits_nothing(checkpoints, tpkit_cmd):
    heads = str(checkpoints / "heads.yaml")
    proc = tpkit_cmd("plan", str(checkpoints / "llama"), "--tp", "3", "--plan", heads)
    assert proc.returncode == 1
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("- ")]
    assert lines and all("layers.0." not in ln and "layers.1." not in ln for ln in lines), lines
    assert any("layers.*." in ln for ln in lines), lines
    assert "global -> local" not in proc.stdout  # no table of shapes that cannot exist
    one = tpkit_cmd("plan", str(checkpoints / "llama"), "--tp", "1")
    assert one.returncode == 0 and "nothing is split" in one.stdout, one.stdout
    # without the user plan, tp=3 runs: the attention gathered, with the reason printed
    three = tpkit_cmd("plan", str(checkpoints / "llama"), "--tp", "3")
    assert three.returncode == 0 and "tp_size=3: valid" in three.stdout, three.stdout
    assert "does not divide num_attention_heads=4" in three.stdout, three.stdout


def testcollapse_layers_counts_repeats():
    from tpkit.cli.main import collapse_layers

    msg = "Cannot apply:\n- a of m.layers.0.q (x)\n- a of m.layers.1.q (x)\n- b of m.head"
    assert collapse_layers(msg).splitlines() == [
        "Cannot apply:",
        "- a of m.layers.*.q (x) (x2)",
        "- b of m.head",
    ]


@pytest.mark.parametrize("name", ["gpt2", "t5"])
def test_cli_generate_with_token_ids_and_no_tokenizer(checkpoints, name):
    prompt = [1, 15, 27]
    proc = _tpkit("generate", str(checkpoints / name), "1 15 27", "--tp", "1")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    lines = [ln for ln in proc.stdout.splitlines() if re.match(r"\[\d", ln)]
    assert len(lines) == 1, out
    tokens = ast.literal_eval(lines[0])
    model = build(name)
    with torch.no_grad():
        ids = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=32,
            min_new_tokens=32,
            do_sample=False,
            pad_token_id=0,
        )[0]
    expected = ids[1:] if model.config.is_encoder_decoder else ids[len(prompt) :]
    assert tokens == expected.tolist() and len(tokens) == 32, (tokens, expected)
