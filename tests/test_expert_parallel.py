"""Expert parallelism (issue 42): whole experts per rank, each routed pair computed where its
expert lives, against the unsharded model on tiny MoE configs: logits, router aux loss and every
gradient at ep=2 (world 2) and ep=4 / ep=2 x batch groups of 2 (world 4), both dispatches; a
model without a ``base_model_ep_plan`` (DBRX) and a user's own experts module found by the probe;
uneven experts exact; sizes EP cannot place refused before any collective."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.ep_checks import ep_greedy, ep_parity, ep_train_steps, tiny_moe


def _ok(results: list[dict], tol: float = 1e-5) -> None:
    for r in results:
        assert r["logits"] <= tol, r
        assert r["aux"] is None or r["aux"] <= tol, r
        assert r["grad"] <= tol * max(1.0, r["scale"]), r
        assert not r["missing"], r


@pytest.mark.parametrize(
    "model_type", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "olmoe", "dbrx"]
)
def test_parity_ep2(ranks2, model_type):
    for batch in (1, 2):  # all-to-all between two batches; all-reduce on a shared one
        r = ranks2.run(ep_parity, model_type, 2, batch, timeout=120)
        _ok(r)
        assert [x["held"] for x in r] == [0.5, 0.5], r
        want = "AllReduceDispatch" if batch == 2 else "AllToAllDispatch"
        assert r[0]["dispatch"] == [want], r


def test_all_to_all_on_a_shared_batch(ranks2):
    """Ranks holding the same tokens send disjoint slices of them (then gather the rows)."""
    _ok(ranks2.run(ep_parity, "qwen3_moe", 2, 2, "all_to_all", timeout=120))


def test_uneven_experts_exact(ranks2):
    r = ranks2.run(ep_parity, "qwen3_moe", 2, 1, "auto", {"num_experts": 5}, timeout=120)
    _ok(r)
    assert [x["held"] for x in r] == [0.6, 0.4], r  # torch.chunk: 3 + 2 experts


@pytest.mark.parametrize(
    ("model_type", "ep", "batch"),
    [("qwen3_moe", 4, 2), ("gpt_oss", 4, 1), ("dbrx", 4, 2), ("mixtral", 2, 2), ("olmoe", 4, 4)],
)
def test_parity_world4(ranks4, model_type, ep, batch):
    r = ranks4.run(ep_parity, model_type, ep, batch, timeout=120)
    _ok(r)
    assert all(x["held"] == 1 / ep for x in r), r


class _UserMoe(nn.Module):
    """A user's own routed experts (no transformers decorator, no ep plan): per expert, a
    two-layer MLP applied to the tokens routed there, weighted and summed per token."""

    def __init__(self, experts=4, width=8, inner=6, residual=False):
        super().__init__()
        self.n_experts_total = experts
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


def test_probe_finds_config_inferred_and_user_experts():
    from tpkit.plan.expert_placement import expert_modules

    entries, _ = expert_modules(tiny_moe("qwen3_moe"))
    assert {e.source for e in entries.values()} == {"config"}, entries
    assert all(e.count_attrs == ("num_experts",) for e in entries.values()), entries
    entries, _ = expert_modules(tiny_moe("dbrx"))  # no base_model_ep_plan
    assert [e.source for e in entries.values()] == ["inferred", "inferred"], entries
    entries, _ = expert_modules(nn.ModuleDict({"moe": _UserMoe()}))
    assert list(entries) == ["moe"], entries


def test_probe_refuses_what_is_not_a_sum_of_pairs():
    """A residual added inside the module is not a per-pair sum: EP would add it once per
    rank. The module stays with tensor parallelism, and the reason is kept."""
    from tpkit.plan.expert_placement import expert_modules

    entries, notes = expert_modules(nn.ModuleDict({"moe": _UserMoe(residual=True)}))
    assert not entries
    assert "moe" not in notes  # not named by an ep plan: nothing to explain


def test_sizes_ep_cannot_place_refused_before_any_collective():
    from tpkit.parallel.expert import check_expert_sizes
    from tpkit.plan.expert_placement import expert_modules

    model = tiny_moe("qwen3_moe", {"num_experts": 3})
    entries, _ = expert_modules(model)
    with pytest.raises(ValueError, match=r"3 experts over ep=4 gives ranks \[1, 1, 1, 0\]"):
        check_expert_sizes(model, entries, 4)
    dbrx = tiny_moe("dbrx", {"ffn_config.moe_num_experts": 5})  # [E * F, H]: 3 + 2 experts
    entries, _ = expert_modules(dbrx)  # would cut an expert's rows
    with pytest.raises(ValueError, match="ep=2 does not divide 5"):
        check_expert_sizes(dbrx, entries, 2)


@pytest.mark.parametrize(("ep", "batch"), [(2, 1), (2, 2)])
def test_greedy_tokens_equal(ranks2, ep, batch):
    assert all(ranks2.run(ep_greedy, "qwen3_moe", ep, batch, timeout=120))


def test_adamw_steps_equal_losses(ranks2):
    """Two AdamW steps on the causal-LM loss with the router aux loss: the same losses."""
    for losses in ranks2.run(ep_train_steps, "mixtral", 2, timeout=120):
        for want, got in losses:
            assert abs(want - got) <= 1e-5 * abs(want), losses
