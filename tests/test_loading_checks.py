"""Loading that never leaves weights silently random (issue 25, items 4 and 6).

- `tpkit.from_pretrained` of a checkpoint that does not hold the model's weights (a Llama config
  over GPT-2 weights, a layer lost, a stray tensor) is one ValueError on every rank, before any
  collective, that counts the missing and unexpected weights and names examples, as
  transformers' loading report counts them.
- Weights meant to be new are an explicit opt-in (``allow_missing_keys`` /
  ``allow_unexpected_keys`` / ``ignore_mismatched_sizes``): a fresh classification head on a
  causal-LM checkpoint is initialised by ``_init_weights``, the same on every rank, with a
  warning; tied heads are never reported.
- A model built on meta and never loaded is refused at its first forward, generate or
  TPKIT_DEBUG forward before any collective of it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers as tf
from safetensors.torch import load_file, save_file

from tests.models import ATTN, batch, build, full

TOL = 1e-5
_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "reduce_scatter_tensor",
    "barrier",
    "new_group",
)


@contextlib.contextmanager
def _count_collectives():
    """Count c10d calls (torch.distributed's functions, as tpkit calls them) and tpkit's
    shared-memory collectives made inside the block."""
    from tpkit.parallel import shm

    calls: list[str] = []
    originals = {n: getattr(dist, n) for n in _COLLECTIVES}

    def wrap(name):
        def counted(*args, **kwargs):
            calls.append(name)
            return originals[name](*args, **kwargs)

        return counted

    before = sum(shm.shm_counts().values())
    for name in _COLLECTIVES:
        setattr(dist, name, wrap(name))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        calls.extend(["shm"] * (sum(shm.shm_counts().values()) - before))


def _outcome(fn) -> tuple[str, list[str]]:
    """(error message or 'no error', collectives made) of ``fn()``."""
    with _count_collectives() as calls:
        try:
            fn()
            msg = "no error"
        except Exception as exc:  # noqa: BLE001 - the message is what the tests compare
            msg = f"{type(exc).__name__}: {exc}"
    return msg, list(calls)


# ---- checkpoints (rank 0 writes, every rank waits) ---------------------------------------------
def _prepare(kind: str, path: str) -> None:
    if dist.get_rank() == 0:
        out = Path(path)
        shutil.rmtree(out, ignore_errors=True)
        if kind == "foreign":  # a Llama config over GPT-2 weights
            build("gpt2").save_pretrained(out / "gpt2")
            build("llama").save_pretrained(out / "llama")
            out.mkdir(exist_ok=True)
            shutil.copy(out / "gpt2" / "model.safetensors", out)
            shutil.copy(out / "llama" / "config.json", out)
        elif kind in ("missing_layer", "unexpected"):
            build("llama").save_pretrained(out)
            sd = load_file(out / "model.safetensors")
            if kind == "missing_layer":
                sd = {k: v for k, v in sd.items() if ".layers.1." not in k}
            else:
                sd["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(4, 4)
            save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
        else:  # a plain checkpoint of one of tests.models' factories
            build(kind).save_pretrained(out)
    dist.barrier()


def check_refusal(kind: str, path: str) -> dict:
    import tpkit

    _prepare(kind, path)
    msg, calls = _outcome(lambda: tpkit.from_pretrained(path, tp_size=2))
    return {"msg": msg, "collectives": calls}


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def check_fresh_head(name: str, path: str) -> dict:
    """A causal-LM checkpoint loaded as ...ForSequenceClassification: refused without the
    opt-in; with it, the head is fresh (the same on every rank) and the rest is the checkpoint."""
    import tpkit

    _prepare(name, path)
    cls = "LlamaForSequenceClassification"
    cfg = {"pad_token_id": 0}
    refused, refused_calls = _outcome(
        lambda: tpkit.from_pretrained(path, model_cls=cls, config_kwargs=cfg, tp_size=2)
    )
    records = _Records()
    logger = logging.getLogger("tpkit")
    logger.addHandler(records)
    try:
        model, info = tpkit.from_pretrained(
            path,
            model_cls=cls,
            config_kwargs=cfg,
            tp_size=2,
            allow_missing_keys=["score"],
            allow_unexpected_keys=["lm_head"],
            output_loading_info=True,
        )
    finally:
        logger.removeHandler(records)
    score = full(model.score.weight).detach().clone()
    # the reference: the unsharded classifier holding the checkpoint's body and the same head
    config = tf.AutoConfig.from_pretrained(path, **cfg)
    ref = tf.LlamaForSequenceClassification(config).float().eval()
    body = load_file(str(Path(path) / "model.safetensors"))
    state = {k: v for k, v in body.items() if not k.startswith("lm_head")}
    if "lm_head.weight" not in body:  # tied: the embedding is stored once
        state.setdefault("model.embed_tokens.weight", body["model.embed_tokens.weight"])
    state["score.weight"] = score
    missing, unexpected = ref.load_state_dict(state, strict=False)
    x = batch(config.vocab_size)
    with torch.no_grad():
        diff = (model(input_ids=x).logits - ref(input_ids=x).logits).abs().max().item()
    return {
        "refused": refused,
        "refused_collectives": refused_calls,
        "info": {k: sorted(map(str, v)) for k, v in info.items()},
        "score": score,
        "std": score.std().item(),
        "diff": diff,
        "ref_missing": missing,
        "ref_unexpected": unexpected,
        "warnings": records.lines,
    }


def check_tied_head_not_reported(path: str) -> dict:
    import tpkit

    _prepare("llama_tied", path)
    model, info = tpkit.from_pretrained(path, tp_size=2, output_loading_info=True)
    ref = build("llama_tied")
    x = batch(ref.config.vocab_size)
    with torch.no_grad():
        diff = (model(input_ids=x).logits - ref(input_ids=x).logits).abs().max().item()
    return {"info": {k: sorted(map(str, v)) for k, v in info.items()}, "diff": diff}


def check_mismatched_head(path: str) -> dict:
    """A 3-label classifier's checkpoint loaded with 2 labels: refused, or re-initialised with
    transformers' ``ignore_mismatched_sizes=True``."""
    import tpkit

    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        torch.manual_seed(0)
        config = tf.LlamaConfig(**ATTN, num_labels=3, pad_token_id=0)
        tf.LlamaForSequenceClassification(config).save_pretrained(path)
    dist.barrier()
    cfg = {"num_labels": 2}
    refused, _ = _outcome(lambda: tpkit.from_pretrained(path, tp_size=2, config_kwargs=cfg))
    model, info = tpkit.from_pretrained(
        path, tp_size=2, config_kwargs=cfg, ignore_mismatched_sizes=True, output_loading_info=True
    )
    return {
        "refused": refused,
        "mismatched": sorted(str(m) for m in info["mismatched_keys"]),
        "score": full(model.score.weight).detach().clone(),
    }


def check_meta_never_loaded(how: str) -> dict:
    """A Llama built on meta, split with ``fill_later=True`` (the weights to come), then run
    without loading: the error and the collectives the call made before it."""
    from accelerate import init_empty_weights

    import tpkit

    if how == "debug":
        os.environ["TPKIT_DEBUG"] = "1"
    try:
        with init_empty_weights():
            model = tf.LlamaForCausalLM(tf.LlamaConfig(**ATTN))
        model = tpkit.tensor_parallel(model, tp_size=2, fill_later=True)
    finally:
        os.environ.pop("TPKIT_DEBUG", None)
    x = batch(ATTN["vocab_size"])
    if how == "generate":
        msg, calls = _outcome(lambda: model.generate(x, max_new_tokens=2))
    elif how == "train":
        model.train()
        msg, calls = _outcome(lambda: model(input_ids=x, labels=x).loss.backward())
    else:
        msg, calls = _outcome(lambda: model(input_ids=x))
    # the from-scratch flow stays open: materialise and fill (alike on every rank), then it runs
    model.to_empty(device="cpu")
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            (t.to_local() if hasattr(t, "to_local") else t).fill_(0.01)
        out = model(input_ids=x).logits
    return {"msg": msg, "collectives": calls, "after_to_empty": tuple(out.shape)}


# ---- tests ------------------------------------------------------------------------------------
def _same_on_every_rank(results: list[dict], key: str = "msg") -> str:
    assert all(r[key] == results[0][key] for r in results), [r[key] for r in results]
    return results[0][key]


def test_llama_config_over_gpt2_weights_is_refused_with_counts(ranks2, tmp_path):
    results = ranks2.run(check_refusal, "foreign", str(tmp_path / "foreign"))
    msg = _same_on_every_rank(results)
    assert msg.startswith("ValueError"), msg
    # as transformers counts them: 21 Llama weights missing, 28 GPT-2 tensors unexpected
    assert "21 weight(s) in the model but not in the checkpoint (missing)" in msg, msg
    assert "28 tensor(s) in the checkpoint but not in the model (unexpected)" in msg, msg
    assert "model.embed_tokens.weight" in msg and "transformer.h.0.attn.c_attn.weight" in msg
    assert "allow_missing_keys" in msg and "... and 11 more" in msg, msg
    assert all(r["collectives"] == [] for r in results), results


def test_a_checkpoint_missing_one_layer_is_refused(ranks2, tmp_path):
    results = ranks2.run(check_refusal, "missing_layer", str(tmp_path / "ml"))
    msg = _same_on_every_rank(results)
    assert "ValueError" in msg and "9 weight(s) in the model but not in the checkpoint" in msg
    assert "model.layers.1.self_attn.q_proj.weight" in msg and "(unexpected)" not in msg, msg
    assert all(r["collectives"] == [] for r in results), results


def test_an_unexpected_tensor_is_refused(ranks2, tmp_path):
    results = ranks2.run(check_refusal, "unexpected", str(tmp_path / "ux"))
    msg = _same_on_every_rank(results)
    assert "ValueError" in msg and "1 tensor(s) in the checkpoint but not in the model" in msg
    assert "model.layers.0.mlp.extra_proj.weight" in msg and "(missing)" not in msg, msg
    assert all(r["collectives"] == [] for r in results), results


@pytest.mark.parametrize("name", ["llama", "llama_tied"])
def test_opt_in_loads_a_fresh_classification_head(ranks2, tmp_path, name):
    results = ranks2.run(check_fresh_head, name, str(tmp_path / name))
    r0 = results[0]
    # without the opt-in: refused, naming the head (and the unused untied lm_head)
    refused = _same_on_every_rank(results, "refused")
    assert "ValueError" in refused and "1 weight(s) in the model" in refused, refused
    assert "score.weight" in refused and all(r["refused_collectives"] == [] for r in results)
    assert ("lm_head.weight" in refused) == (name == "llama"), refused
    # with it: the same fresh head on every rank, initialised like _init_weights (std 0.02)
    assert torch.equal(results[0]["score"], results[1]["score"])
    assert 0.01 < r0["std"] < 0.03, r0["std"]
    assert r0["info"]["missing_keys"] == ["score.weight"], r0["info"]
    assert r0["info"]["unexpected_keys"] == (["lm_head.weight"] if name == "llama" else [])
    # the body is the checkpoint's: logits of the unsharded classifier with the same head
    assert r0["ref_missing"] == [] and r0["diff"] <= TOL, r0
    assert any("score.weight" in w and "_init_weights" in w for w in r0["warnings"]), r0


def test_tied_lm_head_is_not_reported(ranks2, tmp_path):
    for r in ranks2.run(check_tied_head_not_reported, str(tmp_path / "tied")):
        assert r["info"]["missing_keys"] == [] and r["info"]["unexpected_keys"] == [], r
        assert r["diff"] <= TOL, r


def test_mismatched_sizes_refused_unless_ignored(ranks2, tmp_path):
    r0, r1 = ranks2.run(check_mismatched_head, str(tmp_path / "mm"))
    assert r0["refused"] == r1["refused"] and "ValueError" in r0["refused"], r0["refused"]
    assert "score.weight (checkpoint (3, 64), model (2, 64))" in r0["refused"], r0["refused"]
    assert "ignore_mismatched_sizes=True" in r0["refused"]
    assert r0["mismatched"] == ["('score.weight', (3, 64), (2, 64))"], r0["mismatched"]
    assert torch.equal(r0["score"], r1["score"]) and r0["score"].shape == (2, 64)


@pytest.mark.parametrize("how", ["forward", "train", "generate", "debug"])
def test_meta_model_never_loaded_is_refused_before_any_collective(ranks2, how):
    results = ranks2.run(check_meta_never_loaded, how)
    msg = _same_on_every_rank(results)
    assert msg.startswith("RuntimeError") and "meta device" in msg, msg
    assert "from_pretrained" in msg and "to_empty" in msg, msg
    assert all(r["collectives"] == [] for r in results), [r["collectives"] for r in results]
    assert results[0]["after_to_empty"] == (2, 9, ATTN["vocab_size"]), results[0]
