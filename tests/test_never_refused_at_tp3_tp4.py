"""Never refuse at tp=3 and tp=4 (issue 28): what tests/test_never_refused.py checks at tp=2.

CodeGen's ``qkv_proj`` output is 4 fixed groups of [q | v | k] (``mp_num = 4``) whatever the
heads. At tp=3 each rank's third of it is 4/3 of a group, so transformers' plan (and the
inferred one) cannot run split; the inferred plan used to divide ``embed_dim`` too, which makes
the view fit every shard while cutting each rank's groups into smaller ones (q, v and k read
each other's features: no error, wrong numbers, at any tp). The dry run now compares its
reshapes with the unsplit model's (`tpkit.settle.dryrun`), so the attention is gathered at tp=3
(weights still split, its qkv output all-gathered), the MLP stays split, and the plan's notes
say why; at tp=2 and tp=4 transformers' plan splits the attention by whole groups, exactly.

Parity at tp=3 and tp=4 (the session's ``ranks3`` / ``ranks4``, every case in one call):
models traced on inputs made up from the model (ViT, a bare Llama layer: no
``example_inputs``) and models that take the per-layer fallback (a forward the trace cannot
run, convolutions nothing pairs): every output and every gradient equal to the unsharded
model's, and something split.
"""

from __future__ import annotations

import time
import traceback

import pytest
import torch

TOL = 1e-5
CODEGEN = ("codegen", "CodeGenForCausalLM")
#: 12 heads of 16 (3 per fixed qkv group): every head count divides tp=3, the groups do not
CODEGEN_SIZES = {"n_head": 12, "n_embd": 192}
#: tests/test_never_refused.py's builders: traced on made-up inputs, and per-layer fallback
TRACED = ["vit", "llama_layer"]  # (Whisper: as vit here, 4x the time)
FALLBACK = ["untraceable", "conv_seq", "conv2d_bias"]
CASES = ["codegen", *TRACED, *FALLBACK]
#: conv2d_bias's layers have fewer than 2 channels / features per rank at tp=4: all whole
CASES4 = [c for c in CASES if c != "conv2d_bias"]


def _codegen_meta():
    import transformers

    from tests.tiny import tiny_config

    config = tiny_config(*CODEGEN)
    for k, v in CODEGEN_SIZES.items():
        setattr(config, k, v)
    with torch.device("meta"):
        return transformers.CodeGenForCausalLM(config)


def run_cases(names: list[str]) -> dict[str, dict | str]:
    """Run on every rank: each case's parity against the unsharded model, or its traceback
    (so one failing case does not hide the others)."""
    from tests.parity import tiny_parity
    from tests.test_never_refused import parity

    out: dict[str, dict | str] = {}
    times = out.setdefault("seconds", {})
    for name in names:
        start = time.perf_counter()
        try:
            if name == "codegen":
                r = tiny_parity(*CODEGEN, CODEGEN_SIZES)
                out[name] = {**r, "out": r["logits"], "split": r["share"] > 0}
            else:
                out[name] = parity(name)
        except Exception:  # noqa: BLE001 - reported by the test that owns the case
            out[name] = traceback.format_exc()
        times[name] = round(time.perf_counter() - start, 1)
    return out


def _check(results: list[dict], name: str) -> dict:
    for rank, per_rank in enumerate(results):
        r = per_rank[name]
        assert not isinstance(r, str), f"rank {rank}:\n{r}"
        assert r["out"] <= TOL, r
        assert r["grad"] <= TOL * max(1.0, r["grad_scale"]), r  # float32 sums in another order
        assert not r["missing"], r
        assert r["split"], r  # something was split, not everything kept whole
    return results[0][name]


@pytest.fixture(scope="module")
def tp3_results(ranks3):
    return ranks3.run(run_cases, CASES)


@pytest.fixture(scope="module")
def tp4_results(ranks4):
    return ranks4.run(run_cases, CASES4)


@pytest.fixture(scope="module")
def codegen():
    return _codegen_meta()


def test_codegen_tp3_gathers_attention_splits_mlp(codegen):
    """tp=3 used to be refused ("transformer.h.0.attn cannot run on its shards (its mp_num=4
    ...)"): now transformers' plan gives way to the inferred one, its attention gathered and
    its MLP split, the reason in the notes, and validation passes."""
    from tpkit.plan import derive_plan, validate

    plan = derive_plan(codegen, "auto", 3)
    validate(codegen, plan, 3)
    assert plan.style_for("transformer.h.0.attn.qkv_proj")[0] == "colwise_gather_output"
    assert plan.style_for("transformer.h.0.attn.out_proj")[0] == "rowwise_split_input"
    assert plan.style_for("transformer.h.0.mlp.fc_in")[0] == "colwise"
    assert plan.style_for("transformer.h.0.mlp.fc_out")[0] == "rowwise"
    assert "its split fails a dry run" in plan.notes["CodeGenForCausalLM"], plan.notes
    note = plan.notes["transformer.h.*.attn.qkv_proj"]
    assert "cuts the split features inside their blocks" in note, note


@pytest.mark.parametrize("tp", [2, 4])
def test_codegen_tp2_tp4_split_attention(codegen, tp):
    """tp=2 and tp=4 cut the 4 groups into whole groups per rank: transformers' plan, the
    attention split (parity at tp=4 below)."""
    from tpkit.plan import derive_plan, validate

    plan = derive_plan(codegen, "auto", tp)
    validate(codegen, plan, tp)
    assert plan.style_for("transformer.h.0.attn.qkv_proj")[0] == "colwise"
    assert plan.style_for("transformer.h.0.attn.out_proj")[0] == "rowwise"


def test_codegen_inferred_plan_never_cuts_groups(codegen):
    """The inferred plan divided ``embed_dim``, so ``view(-1, 3 * embed_dim // 4)`` fit every
    shard with groups of the wrong size: its dry run passed at any tp and the numbers were
    wrong. The dry run now fails it, and inference gathers the attention instead."""
    from tpkit.plan import derive_plan, validate
    from tpkit.plan.spec import Plan
    from tpkit.settle.dryrun import dry_run

    cut = Plan.from_dict(
        {"transformer.h.*.attn.qkv_proj": "colwise", "transformer.h.*.attn.out_proj": "rowwise"}
    )
    cut.fixups["transformer.h.*.attn"] = {"divide": ["num_attention_heads", "embed_dim"]}
    for tp in (2, 3, 4):
        error = dry_run(codegen, cut, None, tp)
        assert error is not None and "cuts the split features inside their blocks" in error, error
    plan = derive_plan(codegen, "infer", 2)
    validate(codegen, plan, 2)
    assert plan.style_for("transformer.h.0.attn.qkv_proj")[0] == "colwise_gather_output"


@pytest.mark.parametrize("name", CASES)
def test_parity_tp3(tp3_results, name):
    r = _check(tp3_results, name)
    if name in FALLBACK:
        assert any(n.startswith("per-layer fallback") for n in r["notes"].values()), r["notes"]


@pytest.mark.parametrize("name", CASES4)
def test_parity_tp4(tp4_results, name):
    r = _check(tp4_results, name)
    if name in FALLBACK:
        assert any(n.startswith("per-layer fallback") for n in r["notes"].values()), r["notes"]
