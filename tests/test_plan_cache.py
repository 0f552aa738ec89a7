"""The plan cache: a stored plan comes back exactly as derived, under a key that misses on any
change, and the cache never fails a job (corrupt file, folder not writable, jobs racing)."""

from __future__ import annotations

import json
import logging
import os
import threading

import pytest
import torch
import torch.distributed as dist

from tests.models import batch, build
from tpkit.io import plans
from tpkit.plan import Group, Plan, Source, derive_plan
from tpkit.plan.cache import (
    NotCacheable,
    PlanFileError,
    decode,
    encode,
    key_digest,
    plan_differences,
    plan_from_data,
    plan_key,
    plan_to_data,
    read_plan,
    write_plan,
)


def _meta(name: str):
    with torch.device("meta"):
        return build(name)


def _round_trip(plan: Plan) -> Plan:
    return plan_from_data(json.loads(json.dumps(plan_to_data(plan))))


# ---- exact round trip --------------------------------------------------------------------------
def test_values_come_back_with_their_types():
    value = {
        "a": (1, 2.5, "x", None, True),
        "b": [1, [2, (3,)]],
        "c": {0: "int key", (1, 2): "tuple key"},
        "__d": float("inf"),
        "e": float("-inf"),
    }
    back = decode(json.loads(json.dumps(encode(value))))
    assert back == value
    assert type(back["a"]) is tuple and type(back["b"][1][1]) is tuple
    assert list(back["c"]) == [0, (1, 2)]
    for bad in (Source.USER, torch.tensor(1), {1, 2}):
        with pytest.raises(NotCacheable):
            encode(bad)


def test_every_field_round_trips_exactly():
    plan = Plan()
    plan.set("model.layers.*.self_attn.q_proj", "colwise", Source.CONFIG)
    plan.set("model.layers.*.mlp.up_proj", "colwise", Source.INFERRED, {"tail": 64})
    plan.set("lm_head", "colwise_gather_output", Source.CLASS)
    plan.set("model.embed_tokens", "vocab_parallel", Source.USER)
    plan.set("model.norm", "replicate", Source.FALLBACK)
    plan.fixups["model.layers.*.self_attn"] = {"divide": ["num_heads"], "head_inputs": {"k": 1}}
    plan.notes["model.norm"] = "whole: read outside"
    plan.groups.append(Group(("a", "b"), ("a",), {"heads of a": 4}))
    plan.groups.append(Group(("c",)))
    back = _round_trip(plan)
    assert plan_differences(plan, back) == []
    assert [back.source(p) for p in back] == [plan.source(p) for p in plan]
    assert back.groups == plan.groups and back.args == plan.args


def test_a_difference_in_any_field_is_found():
    plan = Plan({"a": "colwise", "b": "rowwise"}, Source.INFERRED)
    for change in (
        lambda p: p.set("a", "colwise", Source.USER),
        lambda p: p.args.update(a={"tail": 1}),
        lambda p: p.fixups.update(a={"divide": ("num_heads",)}),
        lambda p: p.notes.update(b="why"),
        lambda p: p.groups.append(Group(("a", "b"))),
    ):
        other = plan.copy()
        change(other)
        assert plan_differences(plan, other), change


@pytest.mark.parametrize(("name", "tp"), [("llama", 2), ("gpt2", 2), ("qwen3_moe", 2), ("t5", 3)])
def test_derived_plans_round_trip_exactly(name, tp):
    model = _meta(name)
    plan = derive_plan(model, "auto", tp)
    assert plan_differences(plan, _round_trip(plan)) == []


# ---- the key -----------------------------------------------------------------------------------
def test_key_misses_on_config_sizes_plan_and_versions(monkeypatch):
    import transformers as tf

    from tests.models import ATTN
    from tpkit.plan import cache

    def llama(**overrides):
        with torch.device("meta"):
            return tf.LlamaForCausalLM(tf.LlamaConfig(**{**ATTN, **overrides}))

    base = plan_key(llama(), "auto", 2)
    assert plan_key(llama(), "auto", 2) == base  # deterministic
    others = [
        plan_key(llama(rope_theta=5.0), "auto", 2),  # a config field the structure ignores
        plan_key(llama(num_key_value_heads=2), "auto", 2),
        plan_key(llama(), "auto", 4),
        plan_key(llama(), "infer", 2),
        plan_key(llama(), {"lm_head": "replicate"}, 2),
    ]
    changed = llama()
    changed.model.layers[0].self_attn.head_dim = 8  # an attribute the code reads
    others.append(plan_key(changed, "auto", 2))
    monkeypatch.setattr(cache, "_versions", lambda: {"transformers": "0.0"})
    others.append(plan_key(llama(), "auto", 2))
    digests = {key_digest(k) for k in [base, *others]}
    assert len(digests) == len(others) + 1
    with pytest.raises(NotCacheable):
        plan_key(llama(), "auto", 2, example_inputs=(torch.zeros(1, 2, dtype=torch.long),))


def test_key_misses_on_training_mode():
    model = _meta("llama")
    model.eval()
    evaluating = plan_key(model, "auto", 2)
    model.model.layers[0].train()  # one module's code may branch on self.training
    assert key_digest(plan_key(model, "auto", 2)) != key_digest(evaluating)


def test_key_holds_the_registered_styles_not_those_derived_on_first_use(monkeypatch):
    """Deriving DBRX-like experts registers ``packed_colwise_x<k>`` on first use. The key must
    not change with it: a plan saved by a process that had derived one (`tpkit plan --save`
    after other plans) would never match a fresh rank's key. A style the user registers does
    change the key."""
    from dataclasses import replace

    from tpkit.plan import catalogue

    model = _meta("llama")
    before = key_digest(plan_key(model, "auto", 2))
    names = {s.name for s in catalogue.all_specs()}
    parts = next(k for k in range(37, 99) if f"packed_colwise_x{k}" not in names)
    catalogue.canonical_style(f"packed_colwise_x{parts}")  # registered on first use
    assert f"packed_colwise_x{parts}" in {s.name for s in catalogue.all_specs()}
    assert key_digest(plan_key(model, "auto", 2)) == before
    mine = replace(catalogue.style_spec("colwise"), name="my_colwise", aliases=())
    monkeypatch.setitem(catalogue._SPECS, "my_colwise", mine)
    assert key_digest(plan_key(model, "auto", 2)) != before


def test_a_config_attribute_that_is_no_config_is_keyed():
    """IDEFICS keeps a float as a layer's ``config``: keyed by its value, never an error."""
    keys = []
    for value in (0.1, 0.2):
        model = _meta("llama")
        model.model.layers[0].mlp.up_proj.config = value
        keys.append(key_digest(plan_key(model, "auto", 2)))
    assert keys[0] != keys[1]


def test_every_option_is_keyed_or_applied_after_the_plan():
    """A new TPOptions field, or a new derive_plan argument, must be placed: in the key (the
    plan depends on it) or after the plan (validate checks it against any plan)."""
    import dataclasses
    import inspect

    from tpkit.state import TPOptions

    keyed, after = set(plans.OPTIONS_IN_THE_KEY), set(plans.OPTIONS_AFTER_THE_PLAN)
    assert not keyed & after
    assert {f.name for f in dataclasses.fields(TPOptions)} == keyed | after
    # ``analysis`` caches dry runs on the model for validation to reuse; it changes no plan
    derive_reads = [p for p in inspect.signature(derive_plan).parameters if p != "analysis"]
    assert derive_reads == ["model", "plan", "tp_size", "example_inputs"], (
        "derive_plan reads more: put it in plan_key (tpkit.plan.cache) and plan_for"
    )
    assert list(inspect.signature(plan_key).parameters) == derive_reads


def test_a_plan_edited_or_damaged_on_disk_is_never_used(counting, tmp_path):
    model = _meta("llama")
    key = plan_key(model, "auto", 2)
    path = tmp_path / "cache" / f"{key_digest(key)}.json"
    fresh = derive_plan(_meta("llama"), "auto", 2)
    write_plan(path, key, fresh)
    data = json.loads(path.read_text())
    entries = data["plan"]["entries"]
    i = next(i for i, e in enumerate(entries) if e[1] != "replicate")
    entries[i][1] = "replicate"  # still valid JSON, a valid style, the right key: a wrong plan
    path.write_text(json.dumps(data))
    with pytest.raises(PlanFileError) as damaged:
        read_plan(path, key)
    assert not damaged.value.stale and "checksum" in str(damaged.value)
    plan = plans.plan_for(model, "auto", 2)
    assert counting.calls == 1
    assert plan_differences(plan, fresh) == []
    assert plan_differences(read_plan(path, key), fresh) == []  # the fresh plan replaced it


def test_stale_and_corrupt_files_are_told_apart(tmp_path):
    model = _meta("llama")
    key, other = plan_key(model, "auto", 2), plan_key(model, "auto", 4)
    path = tmp_path / "p.json"
    assert read_plan(path, key) is None
    write_plan(path, key, Plan({"lm_head": "colwise"}))
    with pytest.raises(PlanFileError) as stale:
        read_plan(path, other)
    assert stale.value.stale and "tp" in str(stale.value)
    path.write_text('{"key": ')
    with pytest.raises(PlanFileError) as corrupt:
        read_plan(path, key)
    assert not corrupt.value.stale


# ---- plan_for: hit, miss, stale, corrupt, unwritable ------------------------------------------
class _Counting:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return derive_plan(*args, **kwargs)


@pytest.fixture
def counting(monkeypatch, tmp_path):
    monkeypatch.setenv("TPKIT_PLAN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(plans, "_warned", set())
    derive = _Counting()
    monkeypatch.setattr(plans, "derive_plan", derive)
    return derive


def test_a_cached_plan_is_the_fresh_plan_and_skips_planning(counting, tmp_path):
    fresh = plans.plan_for(_meta("llama"), "auto", 2)
    assert counting.calls == 1
    assert len(list((tmp_path / "cache").glob("*.json"))) == 1
    cached = plans.plan_for(_meta("llama"), "auto", 2)
    assert counting.calls == 1  # no planning at all
    assert plan_differences(fresh, cached) == []
    assert plan_differences(derive_plan(_meta("llama"), "auto", 2), cached) == []
    plans.plan_for(_meta("llama"), "auto", 4)  # another size: planned, never reused
    assert counting.calls == 2


def test_a_stale_file_replans(counting, tmp_path):
    model = _meta("llama")
    key = plan_key(model, "auto", 2)
    stale = {**key, "versions": {"tpkit": "0.0.0"}}
    path = tmp_path / "cache" / f"{key_digest(key)}.json"
    write_plan(path, stale, Plan({"lm_head": "replicate"}))  # planted under the live name
    plan = plans.plan_for(model, "auto", 2)
    assert counting.calls == 1
    assert plan_differences(plan, derive_plan(_meta("llama"), "auto", 2)) == []
    assert read_plan(path, key) is not None  # replaced by the fresh plan


def test_a_corrupt_file_replans_with_one_warning(counting, tmp_path, caplog):
    model = _meta("llama")
    path = tmp_path / "cache" / f"{key_digest(plan_key(model, 'auto', 2))}.json"
    path.parent.mkdir(parents=True)
    path.write_text("not json")
    with caplog.at_level(logging.WARNING, logger="tpkit"):
        logging.getLogger("tpkit").addHandler(caplog.handler)
        try:
            plans.plan_for(model, "auto", 2)
            path.write_text("not json")
            plans.plan_for(_meta("llama"), "auto", 2)
        finally:
            logging.getLogger("tpkit").removeHandler(caplog.handler)
    assert counting.calls == 2
    warnings = [r for r in caplog.records if "corrupt" in r.getMessage()]
    assert len(warnings) == 1, caplog.text


def test_an_unwritable_cache_never_fails_a_job(counting, monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("TPKIT_PLAN_CACHE", str(blocker / "plans"))  # a folder under a file
    plan = plans.plan_for(_meta("llama"), "auto", 2)
    plans.plan_for(_meta("llama"), "auto", 2)
    assert counting.calls == 2 and len(plan) > 0
    assert len(plans._warned) == 1


def test_off_reads_and_writes_nothing(counting, monkeypatch, tmp_path):
    monkeypatch.setenv("TPKIT_PLAN_CACHE", "off")
    plans.plan_for(_meta("llama"), "auto", 2)
    plans.plan_for(_meta("llama"), "auto", 2)
    assert counting.calls == 2
    assert not (tmp_path / "cache").exists()


def test_writers_racing_on_one_key_leave_a_whole_file(tmp_path):
    model = _meta("llama")
    key = plan_key(model, "auto", 2)
    plan = derive_plan(model, "auto", 2)
    path = tmp_path / "p.json"
    write_plan(path, key, plan)
    seen, stop = [], threading.Event()

    def reader():
        while not stop.is_set():
            seen.append(plan_differences(plan, read_plan(path, key)))

    def writer():
        for _ in range(20):
            write_plan(path, key, plan)

    threads = [threading.Thread(target=reader)] + [
        threading.Thread(target=writer) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join()
    stop.set()
    threads[0].join()
    assert seen and all(d == [] for d in seen)
    assert sorted(os.listdir(tmp_path)) == ["p.json"]  # no temporary file left


# ---- on ranks: rank 0 plans, every rank gets its plan or its error ------------------------------
def split_twice(cache_dir: str) -> dict:
    """tensor_parallel of the same model twice with the cache at ``cache_dir``: rank 0 derives
    and stores, then reads; no other rank plans; both splits match the unsharded model."""
    import tpkit

    os.environ["TPKIT_PLAN_CACHE"] = cache_dir
    calls = _Counting()
    saved = plans.derive_plan
    plans.derive_plan = calls
    try:
        first = tpkit.tensor_parallel(build("llama"), tp_size=2)
        after_first = calls.calls
        second = tpkit.tensor_parallel(build("llama"), tp_size=2)
    finally:
        plans.derive_plan = saved
        os.environ["TPKIT_PLAN_CACHE"] = "off"
    ref = build("llama")
    x = batch(ref.config.vocab_size)
    with torch.no_grad():
        diff = (second(input_ids=x).logits - ref(input_ids=x).logits).abs().max().item()
    return {
        "after_first": after_first,
        "after_second": calls.calls,
        "same": plan_differences(first._tpkit.plan, second._tpkit.plan),
        "fresh": plan_differences(derive_plan(_meta("llama"), "auto", 2), second._tpkit.plan),
        "diff": diff,
    }


def test_rank0_stores_once_then_every_rank_reads_it(ranks2, tmp_path):
    results = ranks2.run(split_twice, str(tmp_path / "cache"))
    assert [(r["after_first"], r["after_second"]) for r in results] == [(1, 1), (0, 0)]
    for r in results:
        assert r["same"] == [] and r["fresh"] == [] and r["diff"] <= 1e-5, r
    assert len(list((tmp_path / "cache").glob("*.json"))) == 1


class _Unpicklable(Exception):
    def __init__(self, message: str, extra: object) -> None:
        super().__init__(message)
        self.extra = extra

    def __reduce__(self):
        raise TypeError("cannot pickle")


def _refuse(kind: str):
    def derive(*args, **kwargs):
        if kind == "value":
            raise ValueError("rank 0 refuses this plan")
        raise _Unpicklable("rank 0 refuses this plan", object())

    return derive


def rank0_refuses(kind: str) -> str:
    """rank 0's planning raises (rank 1 would not plan at all): every rank raises, none hangs."""
    import tpkit

    saved = plans.derive_plan
    if dist.get_rank() == 0:
        plans.derive_plan = _refuse(kind)
    try:
        tpkit.tensor_parallel(build("llama"), tp_size=2)
    except Exception as exc:  # noqa: BLE001 - the error each rank raised is the result
        return f"{type(exc).__name__}: {exc}"
    finally:
        plans.derive_plan = saved
    return "no error"


@pytest.mark.parametrize("kind", ["value", "unpicklable"])
def test_rank0s_planning_error_is_every_ranks(ranks2, kind):
    errors = ranks2.run(rank0_refuses, kind)
    assert all("rank 0 refuses this plan" in e for e in errors), errors
    if kind == "value":
        assert errors[0] == errors[1] == "ValueError: rank 0 refuses this plan"


def different_models() -> str:
    """Each rank builds another model: every rank raises the same error, none hangs."""
    import transformers as tf

    import tpkit
    from tests.models import ATTN

    torch.manual_seed(0)
    heads = 4 if dist.get_rank() == 0 else 2
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**{**ATTN, "num_key_value_heads": heads}))
    try:
        tpkit.tensor_parallel(model, tp_size=2)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_ranks_given_different_models_fail_alike(ranks2):
    errors = ranks2.run(different_models)
    assert errors[0] == errors[1] and "different models on different ranks" in errors[0]


def different_plans() -> str:
    """Rank 1 asks for another plan than rank 0: the same error on every rank, none hangs (nor
    does rank 1 silently take rank 0's plan)."""
    import tpkit

    torch.manual_seed(0)
    plan = "auto" if dist.get_rank() == 0 else {"lm_head": "replicate"}
    try:
        tpkit.tensor_parallel(build("llama"), tp_size=2, plan=plan)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_ranks_asking_for_different_plans_fail_alike(ranks2):
    errors = ranks2.run(different_plans)
    assert errors[0] == errors[1] and "different plans on different ranks" in errors[0], errors


def fingerprint_fails_on_rank1() -> str:
    """Rank 1 cannot fingerprint its model: every rank raises, none waits for it."""
    import tpkit

    saved = plans.model_fingerprint

    def broken(model):
        raise RuntimeError("config.to_dict failed")

    if dist.get_rank() == 1:
        plans.model_fingerprint = broken
    try:
        tpkit.tensor_parallel(build("llama"), tp_size=2)
    except ValueError as exc:
        return str(exc)
    finally:
        plans.model_fingerprint = saved
    return "no error"


def test_a_rank_that_cannot_fingerprint_fails_every_rank(ranks2):
    errors = ranks2.run(fingerprint_fails_on_rank1)
    assert errors[0] == errors[1] and "rank 1 could not read its model" in errors[0], errors
    assert "config.to_dict failed" in errors[0]


# ---- tpkit plan --save: the checkpoint carries its plan ------------------------------------------
def load_counting(path: str) -> dict:
    """from_pretrained at tp=2 with the plan cache off: how often rank 0 derived, and parity."""
    import tpkit

    calls = _Counting()
    saved = plans.derive_plan
    plans.derive_plan = calls
    try:
        model = tpkit.from_pretrained(path, tp_size=2)
    finally:
        plans.derive_plan = saved
    ref = build("llama")
    x = batch(ref.config.vocab_size)
    with torch.no_grad():
        diff = (model(input_ids=x).logits - ref(input_ids=x).logits).abs().max().item()
    fresh = derive_plan(_meta("llama"), "auto", 2)
    return {"calls": calls.calls, "diff": diff, "same": plan_differences(fresh, model._tpkit.plan)}


def test_plan_save_is_read_by_from_pretrained(ranks2, tmp_path, capsys):
    from tpkit.cli.main import main

    path = tmp_path / "m"
    build("llama").save_pretrained(path)
    assert main(["plan", str(path), "--tp", "4", "--save"]) == 0  # another tp: not this load's
    first = ranks2.run(load_counting, str(path))
    assert [r["calls"] for r in first] == [1, 0]
    assert main(["plan", str(path), "--tp", "2", "--save"]) == 0
    assert "saved:" in capsys.readouterr().out
    assert len(list((path / plans.SAVED_DIR).glob("*.json"))) == 2
    for r in ranks2.run(load_counting, str(path)):
        assert r["calls"] == 0 and r["diff"] <= 1e-5 and r["same"] == [], r


# ---- a mesh over some of the ranks: each stage plans its own model --------------------------------
def stages_split_their_own_models() -> dict:
    """Ranks {0, 1} and {2, 3} each split another model over their own tp mesh (a pipeline's
    stages): no world-wide plan exchange (it would compare different models, or wait for ranks
    that never plan), each stage matches its unsharded model."""
    import copy

    import transformers as tf
    from torch.distributed.device_mesh import init_device_mesh

    import tpkit
    from tests.models import ATTN

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    stage = dist.get_rank() // 2
    torch.manual_seed(stage)
    ref = tf.LlamaForCausalLM(tf.LlamaConfig(**{**ATTN, "num_hidden_layers": 1 + stage})).eval()
    model = tpkit.tensor_parallel(copy.deepcopy(ref), mesh=mesh["tp"])
    x = batch(ref.config.vocab_size)
    with torch.no_grad():
        diff = (model(input_ids=x).logits - ref(input_ids=x).logits).abs().max().item()
    return {"stage": stage, "diff": diff, "layers": len(model.model.layers)}


def test_a_mesh_over_some_ranks_plans_on_its_own(ranks4):
    results = ranks4.run(stages_split_their_own_models)
    assert [(r["stage"], r["layers"]) for r in results] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert all(r["diff"] <= 1e-5 for r in results), results
