"""Whatever runs unsharded runs split with the same numbers (issue 28): a property test on random
transformer-like module graphs.

Each example is a random ``nn.Module`` built from a seed, on every rank alike: an input layer (a
token table or a linear), then a random body of linears (with and without bias), LayerNorm,
RMSNorm, activations, gated products (``a * silu(b)``, fused and split), reductions over the
features and over the sequence (mean, softmax, norm, max, top-k, cumsum), reshapes to heads
(attention with ``view`` / ``transpose`` / ``matmul``, per-head ops and ops across heads),
residual adds, summed and concatenated branches, ``chunk`` / ``split``, indexing, dropout (eval),
and the unusual: a parent reading a child's weight, bare ``nn.Parameter`` s, a module called
twice, a head tied to the token table. Then ``tpkit.tensor_parallel(model)`` with the automatic
plan, and the output and every parameter's gradient (full tensor) against the unsharded model
within 1e-5, at tp=2 (25 examples) and at tp=3 and tp=4 (8 each); one rank group per tp is
reused for every example. Hypothesis draws seeds only: the graph is rebuilt from its seed on
each rank (`random_net`), so a failing example is reproduced by its seed alone:
``RankGroup(2).run(graph_parity, seed)``.
"""

from __future__ import annotations

import copy
import math
import os
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

from tests.harness import RankGroup
from tests.parity import Residual, module_parity

TOL = 1e-5

#: generated features left out (xfail-like: the rest of the property still runs), each naming the
#: bug that makes its split differ from the unsharded model; delete an entry once its bug is fixed
#: and the property covers it again. Reproducers: the report of issue 28's property test.
EXCLUDED: dict[str, str] = {}
if os.environ.get("TPKIT_PROPERTY_ALL") == "1":  # every feature: to check a fix of the above
    EXCLUDED = {}


# -- the graph's pieces (module-level: every rank builds them from the seed) --------------------
class Branch(nn.Module):
    """Two branches on one input, summed or concatenated on the features."""

    def __init__(self, a: nn.Module, b: nn.Module, cat: bool):
        super().__init__()
        self.a, self.b, self.cat = a, b, cat

    def forward(self, x):
        return torch.cat([self.a(x), self.b(x)], -1) if self.cat else self.a(x) + self.b(x)


class Reduce(nn.Module):
    """A reduction, normalisation, selection or scan over one dim (-1: the features, 1: the
    sequence), combined with its input so the gradient flows through both."""

    def __init__(self, kind: str, dim: int):
        super().__init__()
        self.kind, self.dim = kind, dim

    def forward(self, x):
        d = self.dim
        if self.kind == "mean":
            return x - x.mean(d, keepdim=True)
        if self.kind == "softmax":
            return torch.softmax(x, d)
        if self.kind == "norm":
            return x / (x.norm(dim=d, keepdim=True) + 1.0)
        if self.kind == "max":
            return x - x.max(d, keepdim=True).values
        if self.kind == "amax":
            return x * torch.sigmoid(x.amax(d, keepdim=True))
        if self.kind == "topk":
            return x + x.topk(2, d).values.sum(d, keepdim=True)
        if self.kind == "cumsum":
            return x.cumsum(d) * 0.5
        if self.kind == "logsumexp":
            return x - torch.logsumexp(x, d, keepdim=True)
        return x * x.var(d, keepdim=True)  # var


class Gated(nn.Module):
    """A gated MLP: ``down(silu(gate(x)) * up(x))`` with the gate and up projections separate,
    fused and ``chunk`` ed, or fused and ``split`` into uneven parts."""

    def __init__(self, c: int, h: int, mode: str, bias: bool, act: str):
        super().__init__()
        self.mode, self.h, self.act = mode, h, act
        if mode == "separate":
            self.gate = nn.Linear(c, h, bias=bias)
            self.up = nn.Linear(c, h, bias=bias)
        elif mode == "chunk":
            self.gate_up = nn.Linear(c, 2 * h, bias=bias)
        else:  # "split": [h, h + 2] then the extra 2 dropped
            self.gate_up = nn.Linear(c, 2 * h + 2, bias=bias)
        self.down = nn.Linear(h, c, bias=bias)

    def forward(self, x):
        if self.mode == "separate":
            a, b = self.gate(x), self.up(x)
        elif self.mode == "chunk":
            a, b = self.gate_up(x).chunk(2, dim=-1)
        else:
            a, b = torch.split(self.gate_up(x), [self.h, self.h + 2], dim=-1)
            b = b[..., : self.h]
        return self.down(getattr(F, self.act)(a) * b)


class MLP(nn.Module):
    def __init__(self, c: int, h: int, bias: bool, act: str):
        super().__init__()
        self.fc1 = nn.Linear(c, h, bias=bias)
        self.fc2 = nn.Linear(h, c, bias=bias)
        self.act = act

    def forward(self, x):
        return self.fc2(getattr(F, self.act)(self.fc1(x)))


class Attention(nn.Module):
    """Multi-head attention by hand: q/k/v (separate or fused and split), ``view`` to heads,
    ``transpose``, per-head RMSNorm on q and k (Qwen3) or not, KV heads fewer than the query
    heads (repeated), ``matmul`` scores with a causal mask or ``scaled_dot_product_attention``,
    back to [B, T, H * D] and an output projection."""

    def __init__(self, c: int, heads: int, kv: int, dim: int, fused: bool, qk_norm: bool, **kw):
        super().__init__()
        self.heads, self.kv, self.dim, self.fused = heads, kv, dim, fused
        self.causal, self.sdpa = kw["causal"], kw["sdpa"]
        bias = kw["bias"]
        if fused:
            self.qkv = nn.Linear(c, (heads + 2 * kv) * dim, bias=bias)
        else:
            self.q = nn.Linear(c, heads * dim, bias=bias)
            self.k = nn.Linear(c, kv * dim, bias=bias)
            self.v = nn.Linear(c, kv * dim, bias=bias)
        self.q_norm = nn.RMSNorm(dim) if qk_norm else None
        self.k_norm = nn.RMSNorm(dim) if qk_norm else None
        self.o = nn.Linear(heads * dim, c, bias=bias)

    def forward(self, x):
        b, t, _ = x.shape
        if self.fused:
            sizes = [self.heads * self.dim, self.kv * self.dim, self.kv * self.dim]
            q, k, v = self.qkv(x).split(sizes, dim=-1)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        q = q.view(b, t, -1, self.dim).transpose(1, 2)
        k = k.view(b, t, -1, self.dim).transpose(1, 2)
        v = v.view(b, t, -1, self.dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        groups = self.heads // self.kv
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        if self.sdpa:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        else:
            scores = q @ k.transpose(-1, -2) / math.sqrt(self.dim)
            if self.causal:
                mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
                scores = scores.masked_fill(mask, float("-inf"))
            out = torch.softmax(scores, dim=-1) @ v
        return self.o(out.transpose(1, 2).reshape(b, t, -1))


class PerHead(nn.Module):
    """A projection viewed as heads, an op per head (softmax, RMSNorm over the head dim) or
    across heads (a mean or softmax over the heads dim), flattened back and projected."""

    def __init__(self, c: int, heads: int, dim: int, kind: str, bias: bool):
        super().__init__()
        self.heads, self.dim, self.kind = heads, dim, kind
        self.up = nn.Linear(c, heads * dim, bias=bias)
        self.norm = nn.RMSNorm(dim) if kind == "rmsnorm" else None
        self.down = nn.Linear(heads * dim, c, bias=bias)

    def forward(self, x):
        b, t, _ = x.shape
        y = self.up(x).view(b, t, self.heads, self.dim)
        if self.kind == "rmsnorm":
            y = self.norm(y)
        elif self.kind == "softmax":
            y = torch.softmax(y, -1)
        elif self.kind == "across_mean":
            y = y - y.mean(2, keepdim=True)
        else:  # across_softmax
            y = y * torch.softmax(y, 2)
        return self.down(y.flatten(2))


class Index(nn.Module):
    """A projection to twice the width, then indexing on the features (the first / last half,
    every other feature) or a token read from the sequence and broadcast."""

    def __init__(self, c: int, kind: str, bias: bool):
        super().__init__()
        self.c, self.kind = c, kind
        self.proj = nn.Linear(c, 2 * c, bias=bias)

    def forward(self, x):
        y = self.proj(x)
        if self.kind == "first":
            return y[..., : self.c]
        if self.kind == "last":
            return y[..., self.c :]
        if self.kind == "stride":
            return y[..., ::2]
        return y[..., : self.c] + y[:, -1:, self.c :]  # token: the last position's second half


class ChildWeight(nn.Module):
    """A parent reading its child's weight: calling it through ``F.linear`` (bypassing the
    child's forward), or scaling the child's output by a statistic of its weight."""

    def __init__(self, c: int, out: int, kind: str, bias: bool):
        super().__init__()
        self.kind = kind
        self.proj = nn.Linear(c, out, bias=bias)

    def forward(self, x):
        if self.kind == "functional":
            return F.linear(x, self.proj.weight, self.proj.bias)
        return self.proj(x) * self.proj.weight.abs().mean()


class BareParam(nn.Module):
    """Bare ``nn.Parameter`` s: a matrix applied with ``@`` and a per-feature gain."""

    def __init__(self, c: int, out: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(c, out) / math.sqrt(c))
        self.g = nn.Parameter(torch.rand(out) + 0.5)

    def forward(self, x):
        return (x @ self.w) * self.g


class Scale(nn.Module):
    """A layer scale: a bare per-feature parameter."""

    def __init__(self, c: int):
        super().__init__()
        self.g = nn.Parameter(torch.rand(c) + 0.5)

    def forward(self, x):
        return x * self.g


class Twice(nn.Module):
    """One linear called twice (its weight used at two places of the graph)."""

    def __init__(self, c: int, bias: bool):
        super().__init__()
        self.lin = nn.Linear(c, c, bias=bias)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


class Net(nn.Module):
    """The input layer (registered first: the trace sizes its made-up input from it), the body,
    an optional head (tied to the token table or not)."""

    def __init__(self, inp: nn.Module, body: list[nn.Module], head: nn.Module | None):
        super().__init__()
        self.inp = inp
        self.body = nn.Sequential(*body)
        self.head = head

    def forward(self, x):
        h = self.body(self.inp(x))
        return self.head(h) if self.head is not None else h


# -- the generator ----------------------------------------------------------------------------
WIDTHS = (8, 12, 16, 24, 10)  # 10: uneven at tp=3 and 4
ACTS = ("gelu", "silu", "relu")
REDUCTIONS = ("mean", "softmax", "norm", "max", "amax", "topk", "cumsum", "logsumexp", "var")


def _op(rng: random.Random, c: int, depth: int, used: list[str]) -> tuple[nn.Module, int]:
    """One random layer on [B, T, c]; its output width."""
    ops = [
        "linear",
        "mlp",
        "gated",
        "attention",
        "layernorm",
        "rmsnorm",
        "act",
        "reduce",
        "perhead",
        "index",
        "child_weight",
        "bare_param",
        "scale",
        "twice",
        "dropout",
    ]
    if depth < 2:
        ops += ["residual", "residual", "branch", "cat", "gated", "attention"]
    ops = [o for o in ops if o not in EXCLUDED]
    op = rng.choice(ops)
    bias = rng.random() < 0.5
    act = rng.choice(ACTS)
    tag, out = op, c
    if op == "linear":
        out = rng.choice(WIDTHS)
        mod: nn.Module = nn.Linear(c, out, bias=bias)
    elif op == "mlp":
        mod = MLP(c, rng.choice((16, 24, 32, 20)), bias, act)
    elif op == "gated":
        mode = rng.choice(
            [m for m in ("separate", "chunk", "split") if f"gated_{m}" not in EXCLUDED]
        )
        tag = f"gated_{mode}"
        mod = Gated(c, rng.choice((12, 16, 24)), mode, bias, act)
    elif op == "attention":
        heads = rng.choice((2, 4, 6))
        kv = rng.choice([k for k in (1, 2, heads) if heads % k == 0])
        fused, qk_norm = rng.random() < 0.4, rng.random() < 0.4
        fused = fused and not (kv < heads and "attention_fused_gqa" in EXCLUDED)
        kw = {"causal": rng.random() < 0.5, "sdpa": rng.random() < 0.3, "bias": bias}
        tag = "attention" + "_fused" * fused + "_gqa" * (kv < heads) + "_qknorm" * qk_norm
        mod = Attention(c, heads, kv, rng.choice((4, 6)), fused, qk_norm, **kw)
    elif op == "layernorm":
        mod = nn.LayerNorm(c, elementwise_affine=rng.random() < 0.8)
    elif op == "rmsnorm":
        mod = nn.RMSNorm(c)
    elif op == "act":
        mod = {"gelu": nn.GELU(), "silu": nn.SiLU(), "relu": nn.ReLU()}[act]
    elif op == "reduce":
        kind, dim = rng.choice(REDUCTIONS), rng.choice((-1, -1, 1))
        tag = f"reduce_{kind}_{'features' if dim == -1 else 'sequence'}"
        mod = Reduce(kind, dim)
    elif op == "perhead":
        kind = rng.choice(("rmsnorm", "softmax", "across_mean", "across_softmax"))
        tag = f"perhead_{kind}"
        mod = PerHead(c, rng.choice((2, 3, 4)), rng.choice((4, 6)), kind, bias)
    elif op == "index":
        kind = rng.choice(("first", "last", "stride", "token"))
        tag = f"index_{kind}"
        mod = Index(c, kind, bias)
    elif op == "child_weight":
        kinds = ("functional", "statistic")
        kind = rng.choice([k for k in kinds if f"child_weight_{k}" not in EXCLUDED])
        tag = f"child_weight_{kind}"
        out = rng.choice(WIDTHS)
        mod = ChildWeight(c, out, kind, bias)
    elif op == "bare_param":
        out = rng.choice(WIDTHS)
        mod = BareParam(c, out)
    elif op == "scale":
        mod = Scale(c)
    elif op == "twice":
        mod = Twice(c, bias)
    elif op == "dropout":
        mod = nn.Dropout(0.1)  # the model runs in eval: an identity
    elif op == "residual":
        inner, _ = _chain(rng, c, depth + 1, used, keep=True)
        mod = Residual(nn.Sequential(*inner))
    else:  # branch / cat
        a, _ = _chain(rng, c, depth + 1, used, keep=True)
        b, _ = _chain(rng, c, depth + 1, used, keep=True)
        mod = Branch(nn.Sequential(*a), nn.Sequential(*b), op == "cat")
        out = 2 * c if op == "cat" else c
    used.append(tag)
    return mod, out


def _chain(
    rng: random.Random, c: int, depth: int, used: list[str], keep: bool
) -> tuple[list[nn.Module], int]:
    """1-3 layers from ``c`` features; ``keep``: a linear back to ``c`` at the end."""
    layers, start = [], c
    for _ in range(rng.randint(1, 3)):
        mod, c = _op(rng, c, depth, used)
        layers.append(mod)
    if keep and c != start:
        layers.append(nn.Linear(c, start, bias=rng.random() < 0.5))
        c = start
    return layers, c


VOCAB = 37  # odd: uneven vocab shards


def random_net(seed: int) -> tuple[Net, torch.Tensor, list[str]]:
    """The graph of ``seed``, its input ([2, 7] token ids or [2, 7, d] floats) and the
    features it used. The weights come from ``torch.manual_seed(seed)``: every rank the same."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    used: list[str] = []
    c = rng.choice(WIDTHS[:4])
    g = torch.Generator().manual_seed(seed + 1)
    tokens = rng.random() < 0.6
    if tokens:
        inp: nn.Module = nn.Embedding(VOCAB, c)
        x = torch.randint(0, VOCAB, (2, 7), generator=g)
        used.append("embedding")
    else:
        d = rng.choice((6, 8, 12))
        inp = nn.Linear(d, c, bias=rng.random() < 0.5)
        x = torch.randn(2, 7, d, generator=g)
    body: list[nn.Module] = []
    for _ in range(rng.randint(1, 3)):
        layers, c = _chain(rng, c, 0, used, keep=False)
        body += layers
    head = None
    if tokens and rng.random() < 0.7:
        if c != inp.embedding_dim:
            body.append(nn.Linear(c, inp.embedding_dim, bias=False))
            c = inp.embedding_dim
        head = nn.Linear(c, VOCAB, bias=False)
        if rng.random() < 0.5 and "tied_head" not in EXCLUDED:
            head.weight = inp.weight
            used.append("tied_head")
        else:
            used.append("head")
    elif rng.random() < 0.5:
        head = nn.Linear(c, rng.choice((5, 9)), bias=rng.random() < 0.5)
        used.append("head")
    return Net(inp, body, head).float().eval(), x, used


# -- the check, on every rank -----------------------------------------------------------------
def graph_parity(seed: int) -> dict:
    """Run on every rank: ``tensor_parallel(random_net(seed))`` (plan "auto") against the
    unsharded graph (`module_parity`), with the styles its plan gave and the features used."""
    import tpkit
    from tpkit.state import tp_state

    ref, x, used = random_net(seed)
    model = tpkit.tensor_parallel(copy.deepcopy(ref))
    r = module_parity(ref, model, x)
    plan = tp_state(model).plan if tp_state(model) is not None else None
    styles = {} if plan is None else {t.name: t.style for t in plan.resolve(model)}
    return {**r, "seed": seed, "used": used, "styles": styles}


def _assert(results: list[dict]) -> dict:
    for r in results:
        assert r["out"] <= TOL * max(1.0, r["out_scale"]), r
        assert r["grad"] <= TOL * max(1.0, r["scale"]), r
        assert not r["missing"], r
    return results[0]


_SEEN: dict[str, int] = {"examples": 0, "sharded": 0}


def _check(group: RankGroup, seed: int) -> None:
    r = _assert(group.run(graph_parity, seed))
    _SEEN["examples"] += 1
    _SEEN["sharded"] += r["sharded"]


# -- settings (tp=2, 3 and 4 run on the session's rank groups, `tests.conftest`) --------------
_SETTINGS = dict(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


# -- tests --------------------------------------------------------------------------------------
@settings(max_examples=25, **_SETTINGS)
@given(seed=st.integers(0, 10**6))
def test_random_graphs_tp2(ranks2, seed):
    """Whatever random transformer-like graph runs unsharded runs split with the same output
    and gradients at tp=2."""
    _check(ranks2, seed)


@settings(max_examples=8, **_SETTINGS)
@given(seed=st.integers(0, 10**6))
def test_random_graphs_tp3(ranks3, seed):
    """The same at tp=3: widths and heads tp does not divide."""
    _check(ranks3, seed)


@settings(max_examples=8, **_SETTINGS)
@given(seed=st.integers(0, 10**6))
def test_random_graphs_tp4(ranks4, seed):
    """The same at tp=4."""
    _check(ranks4, seed)


def test_random_graphs_shard_something():
    """The property is not vacuous: its graphs had parameters split across the ranks."""
    if not _SEEN["examples"]:
        pytest.skip("run with test_random_graphs_*")
    assert _SEEN["sharded"] > 0, _SEEN


def test_generator_covers_every_feature():
    """The seeds the tests draw from reach every feature the generator knows (cheap: no
    ranks), so a feature left out by accident shows here."""
    seen: set[str] = set()
    for seed in range(300):
        seen.update(random_net(seed)[2])
    base = {t.split("_")[0] for t in seen}
    for feature in ("attention", "gated", "reduce", "perhead", "index", "child", "bare", "twice"):
        assert feature in base, sorted(seen)
    assert "tied_head" in seen and "embedding" in seen, sorted(seen)
