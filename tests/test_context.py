"""Context parallelism: a 256-token batch split over cp ranks matches one process on the whole
sequence (loss, logits and every gradient), and each rank's attention sees only its queries."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import transformers as tf

from tests.models import full

T = 256
REL = 1e-5


def cp_model(name: str, attn: str = "sdpa"):
    """Tiny models for CP: GQA Llama, Qwen3 with a sliding-window layer, MQA Llama, GPT-2
    (learned positions), Falcon (ALiBi), BERT (encoder, bidirectional)."""
    torch.manual_seed(0)
    common = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=101, max_position_embeddings=512,
    )  # fmt: skip
    if name in ("llama", "llama_mqa"):
        kv = 1 if name == "llama_mqa" else 2
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**{**common, "num_key_value_heads": kv}))
    elif name == "qwen3":
        cfg = tf.Qwen3Config(
            **common, head_dim=16, use_sliding_window=True, sliding_window=48,
            max_window_layers=1, layer_types=["sliding_attention", "full_attention"],
        )  # fmt: skip
        model = tf.Qwen3ForCausalLM(cfg)
    elif name == "gpt2":
        cfg = tf.GPT2Config(
            n_embd=64, n_layer=2, n_head=4, vocab_size=101, n_positions=512, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, loss_type="ForCausalLM",
        )  # fmt: skip
        model = tf.GPT2LMHeadModel(cfg)
    elif name == "falcon":
        cfg = tf.FalconConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=101,
            alibi=True, new_decoder_architecture=False, multi_query=False, parallel_attn=False,
            bias=True, hidden_dropout=0.0, attention_dropout=0.0,
        )  # fmt: skip
        model = tf.FalconForCausalLM(cfg)
    else:
        cfg = tf.BertConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            vocab_size=101, max_position_embeddings=512, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        model = tf.BertForMaskedLM(cfg)
    model.set_attn_implementation(attn)
    return model.float()


def cp_batch(name: str, length: int = T):
    """Two rows; the second right-padded by 37 tokens (labels -100 there); BERT masks 70% of its
    targets as a masked LM does."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 101, (2, length), generator=g)
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, -37:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    if name == "bert":
        labels = labels.masked_fill(torch.rand(2, length, generator=g) > 0.3, -100)
    return ids, mask, labels


def _mesh(cp: int, tp: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (cp, tp), mesh_dim_names=("dp", "tp"))


def check_parity(
    name: str, attention: str, tp: int = 1, attn: str = "sdpa", loss_parallel: bool = False
) -> dict:
    """Loss, logits and every gradient of a cp (x tp) split against one process."""
    import tpkit
    from tpkit.parallel.context.apply import average_over_cp, context_parallel

    cp = dist.get_world_size() // tp
    ref = cp_model(name, attn)
    model = copy.deepcopy(ref)
    mesh = _mesh(cp, tp)
    if tp > 1:
        model = tpkit.tensor_parallel(model, mesh=mesh, sharded=False, loss_parallel=loss_parallel)
    ctx = context_parallel(model, mesh["dp"], attention=attention)
    ids, mask, labels = cp_batch(name)
    out_r = ref(input_ids=ids, attention_mask=mask, labels=labels)
    out_r.loss.backward()
    queries = []
    for m in model.modules():
        if type(m).__name__.endswith("Attention"):
            m.register_forward_pre_hook(
                lambda m, a, k: queries.append((a[0] if a else k["hidden_states"]).shape[1]),
                with_kwargs=True,
            )
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    average_over_cp(model, mesh["dp"].get_group())
    logits = ctx.gather(full(out.logits))
    grad_rel = grad_abs = 0.0
    refs = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        g, r = full(p.grad), refs[n].grad
        grad_abs = max(grad_abs, (g - r).abs().max().item())
        grad_rel = max(grad_rel, ((g - r).norm() / r.norm().clamp(min=1e-6)).item())
    return {
        "loss_rel": abs(out.loss.item() - out_r.loss.item()) / out_r.loss.item(),
        "logits": (logits - out_r.logits)[mask.bool()].abs().max().item(),
        "grad_rel": grad_rel,
        "grad_abs": grad_abs,
        "queries": sorted(set(queries)),
        "local": T // cp,
        "sharded_logits": type(out.logits).__name__ == "DTensor",
    }


CP2 = [
    ("llama", "allgather", "sdpa"),
    ("llama", "ring", "sdpa"),
    ("llama", "ulysses", "sdpa"),
    ("llama", "allgather", "eager"),
    ("llama", "ring", "eager"),
    ("llama_mqa", "ring", "sdpa"),
    ("qwen3", "allgather", "sdpa"),
    ("qwen3", "ring", "sdpa"),
    ("qwen3", "ulysses", "eager"),
    ("gpt2", "ring", "sdpa"),
    ("falcon", "auto", "eager"),
    ("bert", "allgather", "sdpa"),
    ("bert", "ring", "sdpa"),
]


def _assert_parity(r: dict) -> None:
    assert r["queries"] == [r["local"]], r  # measured: each attention saw T/cp queries
    assert r["loss_rel"] <= REL, r
    assert r["logits"] <= 1e-5, r
    assert r["grad_rel"] <= REL and r["grad_abs"] <= 1e-5, r


@pytest.mark.parametrize(("name", "attention", "attn"), CP2)
def test_cp2_matches_one_process(ranks2, name, attention, attn):
    for r in ranks2.run(check_parity, name, attention, 1, attn):
        _assert_parity(r)


CP2_TP2 = [
    ("llama", "allgather"),
    ("llama", "loss_parallel"),
    ("llama", "ring"),
    ("qwen3", "ring"),
    ("gpt2", "allgather"),
    ("bert", "allgather"),
]


@pytest.mark.parametrize(("name", "attention"), CP2_TP2)
def test_cp2_tp2_matches_one_process(ranks4, name, attention):
    lp = (
        attention == "loss_parallel"
    )  # vocab-sharded logits: the loss sums tpkit's vocab-parallel CE
    args = ("ring", 2, "sdpa", True) if lp else (attention, 2)
    for r in ranks4.run(check_parity, name, *args):
        assert r["sharded_logits"] == lp
        _assert_parity(r)


def check_packed_and_checkpointing(attention: str) -> dict:
    """Packed sequences (position ids restart, no mask: transformers' block-diagonal mask) with
    gradient checkpointing on (the recomputed attention gets the split again)."""
    from tpkit.parallel.context.apply import average_over_cp, context_parallel

    ref = cp_model("llama").train()
    ref.gradient_checkpointing_enable()
    model = copy.deepcopy(ref)
    mesh = _mesh(dist.get_world_size(), 1)
    context_parallel(model, mesh["dp"], attention=attention)
    ids, _, _ = cp_batch("llama")
    pos = torch.cat([torch.arange(100), torch.arange(T - 100)]).expand(2, T)
    out_r = ref(input_ids=ids, position_ids=pos, labels=ids)
    out_r.loss.backward()
    with torch.no_grad():  # the restart matters: transformers masks across it
        unpacked = ref(input_ids=ids, labels=ids).loss.item()
    out = model(input_ids=ids, position_ids=pos, labels=ids)
    out.loss.backward()
    average_over_cp(model, mesh["dp"].get_group())
    refs = dict(ref.named_parameters())
    grad = max(
        ((p.grad - refs[n].grad).norm() / refs[n].grad.norm().clamp(min=1e-6)).item()
        for n, p in model.named_parameters()
    )
    return {
        "loss_rel": abs(out.loss.item() - out_r.loss.item()) / out_r.loss.item(),
        "grad_rel": grad,
        "packing_matters": abs(unpacked - out_r.loss.item()) > 1e-4,
    }


@pytest.mark.parametrize("attention", ["allgather", "ring"])
def test_packed_sequences_with_checkpointing(ranks2, attention):
    for r in ranks2.run(check_packed_and_checkpointing, attention):
        assert r["packing_matters"] and r["loss_rel"] <= REL and r["grad_rel"] <= REL, r


def check_generate() -> list:
    """generate() passes a cache: it runs unsplit, token for token as one process."""
    from tpkit.parallel.context.apply import context_parallel

    ref = cp_model("qwen3").eval()
    model = copy.deepcopy(ref)
    context_parallel(model, _mesh(dist.get_world_size(), 1)["dp"])
    ids = cp_batch("qwen3")[0][:, :20]
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    return [model.generate(ids, **kw).tolist(), ref.generate(ids, **kw).tolist()]


def test_generate_runs_unsplit_and_exact(ranks2):
    for mine, ref in ranks2.run(check_generate):
        assert mine == ref


def _count_collectives():
    calls = []
    names = ("all_gather", "all_reduce", "broadcast", "all_to_all", "batch_isend_irecv")
    saved = {n: getattr(dist, n) for n in names}
    for n in names:
        setattr(dist, n, lambda *a, _n=n, **k: (calls.append(_n), saved[_n](*a, **k))[1])
    return calls, saved


def check_errors() -> dict:
    """Bad input: one ValueError on every rank, before any collective, naming the fix."""
    from tpkit.parallel.context.apply import context_parallel

    found = {}
    mesh = _mesh(dist.get_world_size(), 1)["dp"]
    model = cp_model("llama")
    context_parallel(model, mesh)
    ids, mask, labels = cp_batch("llama", length=250)
    mqa = cp_model("llama_mqa")
    context_parallel(mqa, mesh, attention="ulysses")
    cases = {
        "length": lambda: model(input_ids=ids, labels=labels),
        "input": lambda: model(input_ids=ids[:, : T - 2], pixel_values=torch.zeros(2, 3, 4, 4)),
        "ulysses": lambda: mqa(input_ids=cp_batch("llama")[0]),
    }
    for case, call in cases.items():
        calls, saved = _count_collectives()
        try:
            call()
        except ValueError as e:
            found[case] = (str(e), list(calls))
        finally:
            for n, f in saved.items():
                setattr(dist, n, f)
    flex = cp_model("llama")
    flex.config._attn_implementation_internal = "flex_attention"
    try:
        context_parallel(flex, mesh)
    except ValueError as e:
        found["kind"] = (str(e), [])
    own = cp_batch("llama")[0] + dist.get_rank()  # ranks disagree
    try:
        model(input_ids=own % 101)
    except ValueError as e:
        found["disagree"] = (str(e), [])
    return found


def test_bad_input_is_one_clear_error_before_any_collective(ranks2):
    for found in ranks2.run(check_errors):
        assert set(found) == {"length", "input", "ulysses", "kind", "disagree"}, found
        for case in ("length", "input", "ulysses"):
            assert found[case][1] == [], found[case]  # no collective ran
        assert "pad_to_multiple_of=4" in found["length"][0]
        assert "'pixel_values'" in found["input"][0]
        assert "1 key/value heads" in found["ulysses"][0] and "'allgather'" in found["ulysses"][0]
        assert "attn_implementation='sdpa'" in found["kind"][0]
        assert "cp ranks [1]" in found["disagree"][0]


def test_layout_zigzag_round_trip():
    from tpkit.parallel.context.layout import Layout

    x = torch.arange(16)[None]
    parts = [Layout(2, r, 16, True).split(x) for r in range(2)]
    assert parts[0].tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]  # chunks 0 and 3
    assert parts[1].tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]  # chunks 1 and 2
    assert torch.equal(Layout(2, 0, 16, True).natural(parts), x)
    assert Layout(2, 1, 16, False).local_index.tolist() == list(range(8, 16))
    with pytest.raises(ValueError, match="pad_to_multiple_of=4"):
        Layout(2, 0, 18, True)


def check_training(name: str, steps: int = 3, **sizes) -> dict:
    """`tpkit.tensor_parallel(cp_size=...)` (FSDP2 over dp_shard x cp by default) against one
    process: AdamW steps on the same global batch, each data rank its rows, every rank of a
    cp x tp block the same rows."""
    import tpkit
    from tpkit.parallel.mesh import get_mesh

    ref = cp_model(name).train()
    model = tpkit.tensor_parallel(copy.deepcopy(ref), **sizes).train()
    dp = get_mesh(model._tpkit.mesh, "dp")
    dp_rank, n_dp = (dp.get_local_rank(), dp.size()) if dp is not None else (0, 1)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    losses, ref_losses, norms, ref_norms = [], [], [], []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 101, (2 * n_dp, T), generator=g)
        opt_r.zero_grad()
        loss_r = ref(input_ids=ids, labels=ids).loss
        loss_r.backward()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9).item())
        opt_r.step()
        ref_losses.append(loss_r.item())
        opt.zero_grad()
        mine = ids.chunk(n_dp)[dp_rank]
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        norms.append(tpkit.clip_grad_norm_(model.parameters(), 1e9).item())  # AdamW hides scale
        opt.step()
        total = loss.detach().clone()
        if dp is not None:
            dist.all_reduce(total, group=dp.get_group())
        losses.append(total.item() / n_dp)
    refs = dict(ref.named_parameters())
    params = max(
        ((full(p) - refs[n]).norm() / refs[n].norm()).item() for n, p in model.named_parameters()
    )
    return {
        "loss_rel": max(abs(a - b) / b for a, b in zip(losses, ref_losses)),
        "norm_rel": max(abs(a - b) / b for a, b in zip(norms, ref_norms)),
        "param_rel": params,
    }


@pytest.mark.parametrize(
    "sizes",
    [{"cp_size": 2}, {"cp_size": 2, "sharded": False}, {"cp_size": 2, "cp_attention": "ring"}],
)
def test_tensor_parallel_cp2_trains_like_one_process(ranks2, sizes):
    for r in ranks2.run(check_training, "llama", **sizes):
        assert max(r["loss_rel"], r["norm_rel"], r["param_rel"]) <= REL, r


@pytest.mark.parametrize(
    "sizes",
    [{"cp_size": 2, "tp_size": 2}, {"cp_size": 2, "dp_replicate_size": 2}],
)
def test_tensor_parallel_cp_with_tp_and_hsdp_trains_like_one_process(ranks4, sizes):
    for r in ranks4.run(check_training, "qwen3", **sizes):
        assert max(r["loss_rel"], r["norm_rel"], r["param_rel"]) <= REL, r


def _trainer_losses(out: str, cp: int | None, tp: int | None = None) -> dict:
    """The stock Trainer on the tiny Llama, 256-token sequences: one process (``cp=None``) or
    ``tpkit.tensor_parallel(cp_size=cp)`` with ``ParallelismConfig(cp_size=cp)``."""
    from accelerate import ParallelismConfig
    from transformers import Trainer

    import tpkit
    from tests.test_trainer import ToyLM, losses, reset_accelerate, training_args
    from tpkit.integrations.trainer import patch_trainer, unpatch_trainer

    patch_trainer()
    reset_accelerate()
    try:
        model, config = cp_model("llama").train(), None
        if cp is not None:
            model = tpkit.tensor_parallel(model, cp_size=cp, tp_size=tp or 1)
            config = ParallelismConfig(cp_size=cp, tp_size=tp or 1)
        args = training_args(out, 2, config, save_strategy="no", max_steps=3)
        data = ToyLM(length=T)
        trainer = Trainer(
            model=model, args=args, train_dataset=data, eval_dataset=ToyLM(n=4, length=T)
        )
        trainer.train()
        evaluated = trainer.evaluate()["eval_loss"]
        norms = {h["step"]: h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h}
        return {
            "losses": losses(trainer),
            "norms": norms,  # the loss curve alone hides a gradient scale (AdamW, clipping)
            "eval": evaluated,
            "tokens": trainer.state.num_input_tokens_seen,
        }
    finally:
        unpatch_trainer()
        reset_accelerate()


def check_trainer(out: str, cp: int, tp: int | None = None) -> dict:
    return _trainer_losses(out, cp, tp)


@pytest.mark.parametrize("world", [2, 4])
def test_trainer_with_cp_size_matches_one_process(ranks2, ranks4, tmp_path, world):
    ref = _trainer_losses(str(tmp_path / "ref"), None)
    group, tp = (ranks2, None) if world == 2 else (ranks4, 2)
    for r in group.run(check_trainer, str(tmp_path / "cp"), 2, tp):
        assert r["losses"].keys() == ref["losses"].keys()
        for step, loss in ref["losses"].items():
            assert abs(r["losses"][step] - loss) / loss <= 1e-4, (step, r, ref)
            assert abs(r["norms"][step] - ref["norms"][step]) / ref["norms"][step] <= 1e-4, r
        assert abs(r["eval"] - ref["eval"]) / ref["eval"] <= 1e-4, (r, ref)
        assert r["tokens"] == ref["tokens"], (r, ref)


def test_tpkit_plan_explains_the_cp_axis(tmp_path, capsys):
    from tpkit.cli.main import main

    cp_model("qwen3").save_pretrained(tmp_path / "q")
    assert main(["plan", str(tmp_path / "q"), "--tp", "2", "--cp", "2"]) == 0
    out = capsys.readouterr().out
    assert "cp_size=2: every sequence split over 2 ranks, zigzag" in out
    assert "pad_to_multiple_of=4" in out and "tp_size=2, cp_size=2: valid" in out
    assert (
        main(["plan", str(tmp_path / "q"), "--tp", "2", "--cp", "2", "--cp-attention", "ulysses"])
        == 1
    )
    assert "cp_attention='ulysses'" in capsys.readouterr().err


POOL_SCRIPT = """
import sys, torch
sys.path.insert(0, {root!r})
import tpkit
from tests.test_context import cp_batch, cp_model

ref = cp_model("llama")
ids, mask, labels = cp_batch("llama")
handle = tpkit.tensor_parallel(cp_model("llama"), cp_size=2, cp_attention="ring")
try:
    out = handle(input_ids=ids, attention_mask=mask, labels=labels)
    out_r = ref(input_ids=ids, attention_mask=mask, labels=labels)
    loss_rel = abs(out.loss.item() - out_r.loss.item()) / out_r.loss.item()
    logits = (out.logits - out_r.logits)[mask.bool()].abs().max().item()
    print("RESULT", loss_rel, logits, tuple(out.logits.shape))
finally:
    handle.close()
"""


def test_notebook_pool_takes_cp_size(tmp_path):
    """Outside torchrun, ``cp_size=2`` starts two workers; the caller gets the model's outputs
    (whole logits) and the whole batch's loss."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    script = tmp_path / "pool_cp.py"
    script.write_text(POOL_SCRIPT.format(root=root))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([f"{root}/src", root])}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600
    )
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT")]
    assert line, done.stdout[-2000:] + done.stderr[-4000:]
    _, loss_rel, logits, shape = line[0].split(" ", 3)
    assert float(loss_rel) <= REL and float(logits) <= 1e-5 and shape == f"(2, {T}, 101)"
