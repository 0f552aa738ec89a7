"""Expert parallelism (issue 42): whole experts per rank, each routed pair computed where its
expert lives, against the unsharded model on tiny MoE configs (logits, router aux loss and every
gradient): `tpkit.tensor_parallel(ep_size=...)` at ep=2 (world 2: tp=2, or tp=1 over two
batches) and at ep=2 x tp=2 x FSDP2 and ep=4 x tp=2 (world 4, each dp rank its own batch), both
dispatches, models with and without a ``base_model_ep_plan`` and experts that take rows grouped
by expert; greedy tokens and AdamW steps equal; a user's own experts module found by the probe;
uneven experts exact; what EP cannot place refused before any collective."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.ep_checks import compare_ep, ep_greedy, ep_train_steps, split_parity, tiny_moe

MOES = ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "olmoe", "dbrx"]


def _ok(results: list[dict], tol: float = 1e-5) -> None:
    for r in results:
        assert r["logits"] <= tol, r
        assert r["aux"] is None or r["aux"] <= tol, r
        assert r["grad"] <= tol * max(1.0, r["scale"]), r
        assert not r["missing"], r


@pytest.mark.parametrize("model_type", MOES)
def test_parity_ep2(ranks2, model_type):
    """tp=2 with the experts over the same two ranks (all-reduce, the default where ep == tp;
    all-to-all of row slices), and tp=1 with dp=2 (all-to-all between two batches)."""
    for options in ({}, {"ep_implementation": "all_to_all"}, {"tp_size": 1, "distinct": True}):
        r = ranks2.run(split_parity, model_type, ep_size=2, **options, timeout=180)
        _ok(r)
        assert [x["held"] for x in r] == [0.5, 0.5], r  # each rank half the expert weights
    assert r[0]["dispatch"] == ["AllToAllDispatch"], r


@pytest.mark.parametrize("model_type", MOES[:4])
def test_parity_ep2_tp2_fsdp(ranks4, model_type):
    """ep=2 x tp=2 x dp_shard=2 (transformers' ep=2 x tp=2 x fsdp=2): expert weights FSDP-sharded
    over the 2 ranks holding the same experts, each dp rank its own batch."""
    r = ranks4.run(split_parity, model_type, ep_size=2, tp_size=2, distinct=True, timeout=180)
    _ok(r)
    assert all(x["held"] == 0.25 for x in r), r


def test_parity_ep4_tp2(ranks4):
    """ep=4 over two TP groups of 2, two batches: all-to-all, row slices within each TP group."""
    r = ranks4.run(split_parity, "olmoe", ep_size=4, tp_size=2, distinct=True, timeout=180)
    _ok(r)
    assert all(x["held"] == 0.25 for x in r) and r[0]["dispatch"] == ["AllToAllDispatch"], r


def test_parity_replicas_without_fsdp(ranks4):
    """sharded=False: the expert weights' 2 replicas averaged by a gradient hook (the dense
    replicas are the caller's to average; here every rank has the same batch)."""
    r = ranks4.run(split_parity, "qwen3_moe", ep_size=2, tp_size=2, sharded=False, timeout=180)
    _ok(r)
    assert all(x["held"] == 0.5 for x in r), r


@pytest.mark.parametrize(
    ("model_type", "overrides"),
    [("qwen3_moe", {"num_experts": 5}), ("jetmoe", {}), ("llama4_text", {})],
)
def test_parity_uneven_and_grouped(ranks2, model_type, overrides):
    """5 experts over 2 ranks (3 + 2, torch.chunk); experts that take rows grouped by expert
    (JetMoE's grouped linears, Llama-4's per-expert blocks), with no ep plan."""
    for options in ({}, {"tp_size": 1, "distinct": True}):
        _ok(ranks2.run(split_parity, model_type, overrides, ep_size=2, **options, timeout=180))


def test_greedy_tokens_equal(ranks2):
    for options in ({}, {"tp_size": 1}):
        assert all(ranks2.run(ep_greedy, "qwen3_moe", ep_size=2, **options, timeout=180))


def test_adamw_steps_equal_losses(ranks4):
    """Two AdamW steps on the causal-LM loss with the router aux loss, at ep=2 x tp=2 x FSDP2."""
    for losses in ranks4.run(ep_train_steps, "mixtral", ep_size=2, tp_size=2, timeout=180):
        for want, got in losses:
            assert abs(want - got) <= 1e-5 * abs(want), losses


class _UserMoe(nn.Module):
    """A user's own routed experts (no transformers decorator, no ep plan): per expert, a
    two-layer MLP applied to the tokens routed there, weighted and summed per token."""

    def __init__(self, experts=4, width=8, inner=6, residual=False):
        super().__init__()
        self.num_experts = experts
        self.hidden_size = width
        self.residual = residual
        self.w_in = nn.Parameter(torch.randn(experts, width, inner) / 3)
        self.w_out = nn.Parameter(torch.randn(experts, inner, width) / 3)

    def forward(self, x, index, weights):
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            tok, k = (index == e).nonzero(as_tuple=True)
            y = torch.relu(x[tok] @ self.w_in[e]) @ self.w_out[e]
            out.index_add_(0, tok, y * weights[tok, k, None])
        return out + x if self.residual else out


class _Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.moe = _UserMoe()

    def forward(self, **x):
        return (self.moe(**x),)


def user_moe_parity() -> dict:
    """Run on every rank: a user's own experts module under `expert_parallel` (ep=2 over the
    world, each rank its own batch) against the unsharded module."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    ref = _Holder()
    x = {
        "x": torch.randn(6, 8, generator=g),
        "index": torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(6)]),
        "weights": torch.rand(6, 2, generator=g),
    }
    return compare_ep(ref, x, 2, 1)


def test_a_users_own_experts_module(ranks2):
    r = ranks2.run(user_moe_parity, timeout=120)
    for x in r:
        assert x["out"] <= 1e-5 and x["grad"] <= 1e-5 and x["held"] == 0.5, x


def test_probe_finds_config_inferred_and_user_experts():
    from tpkit.sources.expert_placement import expert_modules

    entries, _ = expert_modules(tiny_moe("qwen3_moe"))
    assert {e.source for e in entries.values()} == {"config"}, entries
    assert all(e.count_attrs == ("num_experts",) for e in entries.values()), entries
    entries, _ = expert_modules(tiny_moe("dbrx"))  # no base_model_ep_plan
    assert [e.source for e in entries.values()] == ["inferred", "inferred"], entries
    entries, _ = expert_modules(nn.ModuleDict({"moe": _UserMoe()}))
    assert list(entries) == ["moe"], entries


def test_probe_refuses_what_is_not_a_sum_of_pairs():
    """A residual added inside the module is not a per-pair sum: EP would add it once per
    rank. The module stays with tensor parallelism; named in an ep plan, the reason is kept."""
    from tpkit.sources.expert_placement import expert_modules

    model = nn.ModuleDict({"moe": _UserMoe(residual=True)})
    entries, notes = expert_modules(model, ["moe"])
    assert not entries and "do not add up" in notes["moe"], notes


def test_the_plan_places_experts_and_the_tensor_step_leaves_them():
    """DBRX's experts leave the TP plan with their fix-up (F divided by tp would be wrong for
    whole experts); the EP entry carries the numbers the style needs."""
    from tpkit.plan import Plan, derive_plan
    from tpkit.sources.expert_placement import place_experts

    model = tiny_moe("dbrx")
    tp_plan = derive_plan(model, "auto", 2)
    assert any("experts" in k for k in tp_plan.fixups), tp_plan.fixups
    plan = place_experts(model, tp_plan)
    assert plan["transformer.blocks.*.ffn.experts"] == "ep_experts", plan.to_dict()
    assert not any("experts" in k for k in plan.fixups), plan.fixups
    assert not any(k.startswith("transformer.blocks.*.ffn.experts.") for k in plan), plan
    args = plan.args_for("transformer.blocks.*.ffn.experts")
    assert args["num_experts"] == 4 and args["params"] == ["mlp.w1", "mlp.v1", "mlp.w2"], args
    assert place_experts(model, Plan()).to_dict() == {
        "transformer.blocks.*.ffn.experts": "ep_experts"
    }


def test_sizes_ep_cannot_place_refused_before_any_collective():
    from tpkit.plan import Plan
    from tpkit.sources.expert_placement import check_expert_sizes, place_experts

    model = tiny_moe("qwen3_moe", {"num_experts": 3})
    with pytest.raises(ValueError, match=r"3 experts over ep=4 gives ranks \[1, 1, 1, 0\]"):
        check_expert_sizes(model, place_experts(model, Plan()), 4)
    dbrx = tiny_moe("dbrx", {"ffn_config.moe_num_experts": 5})  # [E * F, H]: 3 + 2 experts
    with pytest.raises(ValueError, match="ep=2 does not divide 5"):  # would cut an expert
        check_expert_sizes(dbrx, place_experts(dbrx, Plan()), 2)


def split_refusals() -> list[str]:
    """Run on every rank: the errors `tensor_parallel` raises for what EP cannot do (a dense
    model, all-reduce over two batches), each before any collective."""
    import tpkit
    from tests.tiny import build

    out = []
    for model, options in (
        (build("llama", "LlamaForCausalLM"), {"ep_size": 2}),
        (tiny_moe("qwen3_moe"), {"ep_size": 2, "tp_size": 1, "ep_implementation": "all_reduce"}),
    ):
        try:
            tpkit.tensor_parallel(model, **options)
            out.append("no error")
        except ValueError as exc:
            out.append(str(exc))
    return out


def test_what_ep_cannot_do_is_refused_before_any_collective(ranks2):
    for said in ranks2.run(split_refusals, timeout=120):
        assert "no experts module expert parallelism can place" in said[0], said
        assert "ep_implementation='all_reduce' needs" in said[1], said


def test_tpkit_plan_shows_the_expert_placement(tmp_path, capsys):
    """``tpkit plan --ep 2`` places the experts as ``tensor_parallel(ep_size=2)`` does; with
    ``--cp`` it is refused as the split refuses it."""
    from tpkit.cli.main import main

    tiny_moe("qwen3_moe").save_pretrained(tmp_path / "q")
    assert main(["plan", str(tmp_path / "q"), "--tp", "2", "--ep", "2"]) == 0
    out = capsys.readouterr().out
    assert "ep_experts" in out and "tp_size=2, ep_size=2: valid" in out, out
    with pytest.raises(SystemExit) as exit_:
        main(["plan", str(tmp_path / "q"), "--tp", "2", "--ep", "2", "--cp", "2"])
    assert exit_.value.code == 2
    assert "--ep with --cp" in capsys.readouterr().err


def test_save_pretrained_from_pretrained_and_dcp(ranks2, tmp_path):
    """save_pretrained at ep=2 loads in plain transformers; from_pretrained with
    DistributedConfig(tp_size=2, ep_size=2) reads each rank's own experts (slices, not
    transformers' full load) from the per-expert keys transformers saved; DCP checkpoints
    reshard between ep=2 and no EP, both ways."""
    from tests.ep_checks import ep_save_and_load

    results = ranks2.run(ep_save_and_load, str(tmp_path), timeout=300)
    assert results[0]["plain_transformers"] <= 1e-5, results
    for r in results:
        assert r["from_pretrained"] <= 1e-5 and r["from_pretrained_held"] == 0.5, r
        assert r["loaded_from"] == "slices", r
        assert r["dcp_ep2_to_tp2"] <= 1e-5 and r["dcp_tp2_to_ep2"] <= 1e-5, r


def test_trainer_losses_match_single_process(ranks2, tmp_path):
    from tests.ep_checks import ep_trainer_losses
    from tests.test_trainer import single_process

    want = single_process(ep_trainer_losses, str(tmp_path / "ref"), None)
    assert sorted(want) == [1, 2, 3], want
    for got in ranks2.run(ep_trainer_losses, str(tmp_path / "ep"), 2, timeout=300):
        for step, loss in want.items():
            assert abs(got[step] - loss) <= 1e-5 * abs(loss), (got, want)


def test_lora_beside_experts_and_refused_on_them(ranks2):
    """LoRA on the attention of an EP model matches the same adapters unsharded; adapters on
    the experts' weights (peft's target_parameters) are refused by tpkit's peft integration,
    with the reason, under EP as under TP."""
    from tests.ep_checks import ep_lora

    for r in ranks2.run(ep_lora, "attention", timeout=300):
        assert r["logits"] <= 1e-5 and r["grad"] <= 1e-4 and r["n"] == 8, r
    for r in ranks2.run(ep_lora, "experts", timeout=300):
        assert "LoRA adapters only" in r.get("error", ""), r


POOL_SCRIPT = """
import json, sys
sys.path.insert(0, {root!r})
import torch
import tpkit
from tests.ep_checks import tiny_moe
ref = tiny_moe("qwen3_moe").eval()
model = tpkit.tensor_parallel(tiny_moe("qwen3_moe").eval(), ep_size=2)
x = torch.randint(3, 101, (2, 9), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    diff = (model(input_ids=x).logits - ref(input_ids=x).logits).abs().max().item()
kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
same = torch.equal(model.generate(x[:, :5], **kw), ref.generate(x[:, :5], **kw))
table = tpkit.explain(model)
model.close()
print("RESULT", json.dumps({{"type": type(model).__name__, "diff": diff, "same": same,
                            "ep": "ep_experts" in table}}))
"""


def test_the_notebook_pool_places_experts(tmp_path):
    """Outside torchrun, tensor_parallel(model, ep_size=2) starts 2 workers (ep ranks at least)
    that load the model's per-expert checkpoint keys as slices: logits, greedy tokens equal."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    (tmp_path / "script.py").write_text(POOL_SCRIPT.format(root=root))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(
        [sys.executable, "script.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    r = json.loads(lines[-1][len("RESULT ") :])
    assert r["type"] == "ModelHandle" and r["diff"] <= 1e-5 and r["same"] and r["ep"], r
