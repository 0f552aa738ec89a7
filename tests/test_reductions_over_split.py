"""A statistic over split features is never computed on a rank's part only (issue 25, item 1).

Between a column layer and its row layer, tp splits the intermediate features; a reduction or
selection over them (a mean, a norm, softmax, top-k, a cumulative sum, a ``.tolist()``...) on
one rank's part is a wrong number with no error. Plan inference finds every such op in its
trace and sends the pair to the gathered form (columns all-gathered, the op on whole features,
rows slicing their input): logits and every gradient match the unsharded model at tp=2, and the
plan says why. A plain GELU between the same layers still splits as a column/row pair, and
transformers' own plan for Gemma-3n (whose MLP keeps the top of each token's gate activations
by a mean and a standard deviation over the features) is gathered where the model reduces.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from tests.parity import assert_parity, tiny_parity
from tests.tiny import tiny_config

TOL = 1e-5
DIM, HIDDEN = 16, 64


def _top8(h: torch.Tensor) -> torch.Tensor:
    idx = h.topk(8, dim=-1).indices
    return h * torch.zeros_like(h).scatter(-1, idx, 1.0)


def _sorted(h: torch.Tensor) -> torch.Tensor:
    s = h.sort(dim=-1).values
    return h * (h >= s[..., -8:-7])


def _one_hot(h: torch.Tensor, pick) -> torch.Tensor:
    return h + h * F.one_hot(pick(h), h.shape[-1]).to(h.dtype)


def _tolist(h: torch.Tensor) -> torch.Tensor:
    peak = torch.tensor([[max(t) for t in row] for row in h.detach().tolist()], device=h.device)
    return h - peak[..., None]


#: op name in the plan's note -> what the module computes between its two linears
OPS = {
    "mean": lambda h: h - h.mean(-1, keepdim=True),
    "var": lambda h: h / (1 + torch.var(h, dim=-1, keepdim=True)),
    "std": lambda h: h / (1 + h.std(-1, keepdim=True)),
    "norm": lambda h: h / (1 + torch.norm(h, dim=-1, keepdim=True)),
    "linalg_vector_norm": lambda h: h / (1 + torch.linalg.vector_norm(h, dim=-1, keepdim=True)),
    "normalize": lambda h: F.normalize(h, dim=-1),
    "softmax": lambda h: F.softmax(h, dim=-1),
    "log_softmax": lambda h: torch.log_softmax(h, -1),
    "logsumexp": lambda h: h - torch.logsumexp(h, -1, keepdim=True),
    "topk": _top8,
    "sort": _sorted,
    "max": lambda h: h - h.max(dim=-1, keepdim=True).values,
    "min": lambda h: h - torch.min(h, -1, keepdim=True).values,
    "amax": lambda h: h - h.amax(-1, keepdim=True),
    "amin": lambda h: h - torch.amin(h, dim=-1, keepdim=True),
    "argmax": lambda h: _one_hot(h, lambda t: t.argmax(-1)),
    "argmin": lambda h: _one_hot(h, lambda t: torch.argmin(t, dim=-1)),
    "cumsum": lambda h: h.cumsum(-1) / HIDDEN,
    "cumprod": lambda h: torch.cumprod(torch.sigmoid(h), dim=-1),
    "quantile": lambda h: h - torch.quantile(h, 0.5, dim=-1, keepdim=True),
    "median": lambda h: h - h.median(dim=-1, keepdim=True).values,
    "sum": lambda h: h / (1 + h.abs().sum(-1, keepdim=True)),
    "prod": lambda h: h * (1 + 0.2 * torch.tanh(h)).prod(-1, keepdim=True),
    "any": lambda h: h * (h > 1.0).any(-1, keepdim=True),
    "all": lambda h: h * (h > -1.0).all(-1, keepdim=True),
    "tolist": _tolist,
}


class ReducingMLP(nn.Module):
    """Linear up -> ``OPS[op]`` over the intermediate features -> Linear down."""

    def __init__(self, op: str):
        super().__init__()
        self.op = op
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        h = F.gelu(h) if self.op == "gelu" else OPS[self.op](h)
        return self.down(h)


# ---- checks (run on every rank) --------------------------------------------------------------
def check_reduction(op: str) -> dict:
    """tensor_parallel of a `ReducingMLP` vs the unsharded one: logits and gradients, and the
    styles and notes of its plan."""
    import tpkit

    torch.manual_seed(0)
    ref = ReducingMLP(op).float()
    model = tpkit.tensor_parallel(copy.deepcopy(ref))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, DIM, generator=g)
    w = torch.randn(2, 5, DIM, generator=g)
    y_r, y = ref(x), model(x)
    (y_r * w).sum().backward()
    (y * w).sum().backward()
    ref_params = dict(ref.named_parameters())
    grad = 0.0
    for name, p in model.named_parameters():
        got = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grad = max(grad, (got - ref_params[name].grad).abs().max().item())
    plan = model._tpkit.plan
    return {
        "logits": (y - y_r).abs().max().item(),
        "grad": grad,
        "styles": {m: plan.style_for(m)[0] for m in ("up", "down")},
        "notes": {m: plan.notes.get(m, "") for m in ("up", "down")},
        "sharded": [n for n, p in model.named_parameters() if p.placements[0].is_shard()],
    }


# ---- tests -----------------------------------------------------------------------------------
@pytest.mark.parametrize("op", sorted(OPS))
def test_a_reduction_over_split_features_gathers_its_pair(ranks2, op):
    r = ranks2.run(check_reduction, op)[0]
    assert r["logits"] <= TOL and r["grad"] <= TOL, r
    assert r["styles"] == {"up": "colwise_gather_output", "down": "rowwise_split_input"}, r
    # fake tensors run tolist() as unbind() row by row, then item()
    said = "unbind() reads its split features" if op == "tolist" else f"{op}() reads across"
    assert said in r["notes"]["up"] and said in r["notes"]["down"], r["notes"]
    assert {"up.weight", "down.weight"} <= set(r["sharded"]), r  # the weights stay split


def test_a_plain_gelu_still_splits_as_a_column_row_pair(ranks2):
    r = ranks2.run(check_reduction, "gelu")[0]
    assert r["logits"] <= TOL and r["grad"] <= TOL, r
    assert r["styles"] == {"up": "colwise", "down": "rowwise"}, r
    assert r["notes"] == {"up": "", "down": ""}, r


def test_reduced_dims_reads_each_op_as_torch_does():
    from tpkit.trace.reductions import reduced_dims

    assert reduced_dims("mean", (None, -1), {}, 3) == {2}
    assert reduced_dims("mean", (None,), {"dim": (0, 1)}, 3) == {0, 1}
    assert reduced_dims("sum", (None,), {}, 3) == {0, 1, 2}  # no dim: every dim
    assert reduced_dims("std", (None, False), {}, 3) == {0, 1, 2}  # std(x, unbiased)
    assert reduced_dims("max", (None, torch.ones(1)), {}, 3) is None  # max(a, b): elementwise
    assert reduced_dims("topk", (None, 4), {}, 3) == {2}  # dim defaults to -1
    assert reduced_dims("softmax", (None,), {}, 3) == {0}  # F.softmax's implicit dim
    assert reduced_dims("normalize", (None,), {}, 3) == {1}  # F.normalize: dim=1
    assert reduced_dims("layer_norm", (None, [8]), {}, 3) == {2}
    assert reduced_dims("norm", (None, 2, 1), {}, 3) == {1}  # x.norm(p, dim)
    assert reduced_dims("item", (None,), {}, 1) == {0}
    assert reduced_dims("gelu", (None,), {}, 3) is None


# Gemma-3n: the published model keeps the top of each token's gate activations in its first 10
# layers (activation_sparsity_pattern 0.95), by a mean and a std over the intermediate features
GEMMA3N = {
    "num_hidden_layers": 3,
    "intermediate_size": [128, 128, 128],
    "activation_sparsity_pattern": [0.95, 0.95, 0.0],
}


def _gemma3n_overrides() -> dict:
    config = tiny_config("gemma3n_text", "Gemma3nForCausalLM")
    kinds = list(config.layer_types)
    return {**GEMMA3N, "layer_types": (kinds + kinds)[:3]}


def check_gemma3n_plan() -> dict:
    import tpkit

    config = tiny_config("gemma3n_text", "Gemma3nForCausalLM")
    for k, v in _gemma3n_overrides().items():
        setattr(config, k, v)
    import transformers

    torch.manual_seed(0)
    model = tpkit.tensor_parallel(transformers.Gemma3nForCausalLM(config).float())
    plan = model._tpkit.plan
    return {
        f"{i}.{m}": (
            plan.style_for(f"model.layers.{i}.mlp.{m}")[0],
            plan.notes.get(f"model.layers.{i}.mlp.{m}", ""),
        )
        for i in range(3)
        for m in ("gate_proj", "up_proj", "down_proj")
    }


def test_gemma3n_activation_sparsity_matches_unsharded(ranks2):
    results = ranks2.run(tiny_parity, "gemma3n_text", "Gemma3nForCausalLM", _gemma3n_overrides())
    assert_parity(results)


def test_gemma3n_gathers_only_the_layers_that_reduce(ranks2):
    styles = ranks2.run(check_gemma3n_plan)[0]
    for i in (0, 1):
        assert styles[f"{i}.gate_proj"][0] == "colwise_gather_output", styles
        assert styles[f"{i}.up_proj"][0] == "colwise_gather_output", styles
        assert styles[f"{i}.down_proj"][0] == "rowwise_split_input", styles
        assert "mean() reads across its split features" in styles[f"{i}.down_proj"][1], styles
    assert styles["2.gate_proj"][0] == "colwise", styles  # no sparsity: split as before
    assert styles["2.down_proj"][0] == "rowwise", styles
