"""Random initialisation after the split draws the unsharded values (`tpkit.training.init`).

The from-scratch flow: build on meta, split, ``to_empty``, initialise. Under the same seed every
shard must hold exactly its slice of what the unsharded model draws (no twin shards), and the
generator must end where the unsharded run's does, so the next draws match too.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import transformers as tf
from torch import nn

from tests.models import ATTN, FACTORIES, batch, full

TOL = 1e-5


def _meta(name: str) -> nn.Module:
    with torch.device("meta"):
        return FACTORIES[name]()


def _initialise(model: nn.Module, how: str) -> None:
    if how == "apply":
        with torch.no_grad():
            model.apply(model._init_weights)
    else:
        model.init_weights()


def _mismatches(ref: nn.Module, model: nn.Module) -> list[str]:
    """Names of parameters whose whole value differs from the reference's (exact equality)."""
    ref_params = dict(ref.named_parameters())
    return [
        n
        for n, p in model.named_parameters()
        if not torch.equal(full(p.detach()), ref_params[n].detach())
    ]


def _twins(model: nn.Module) -> list[str]:
    """Randomly filled sharded parameters whose two halves are identical (the bug: every rank
    drew the same numbers for its shard)."""
    from torch.distributed.tensor import DTensor

    out = []
    for n, p in model.named_parameters():
        if isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements):
            whole = p.full_tensor()
            dim = next(pl.dim for pl in p.placements if pl.is_shard())
            half = whole.shape[dim] // 2
            a, b = whole.narrow(dim, 0, half), whole.narrow(dim, half, half)
            if torch.equal(a, b) and whole.unique().numel() > 1:  # not a constant fill
                out.append(n)
    return out


def _losses(model: nn.Module, steps: int = 3) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = batch(ATTN["vocab_size"])
    out = []
    model.train()
    for _ in range(steps):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


# ---- the Llama from-scratch flow ----------------------------------------------------------------
def check_llama_from_scratch(name: str, how: str, tp_kwargs: dict) -> dict:
    import tpkit

    torch.manual_seed(0)
    ref = _meta(name)
    ref.to_empty(device="cpu")
    _initialise(ref, how)
    ref_next = torch.randn(7)

    torch.manual_seed(0)
    model = tpkit.tensor_parallel(_meta(name), fill_later=True, **tp_kwargs)
    model.to_empty(device="cpu")
    _initialise(model, how)
    next_draw = torch.randn(7)
    return {
        "mismatches": _mismatches(ref, model),
        "twins": _twins(model),
        "next_draw_equal": torch.equal(ref_next, next_draw),
        "losses": (_losses(ref), _losses(model)),
    }


def _assert_from_scratch(results: list[dict]) -> None:
    for r in results:
        assert r["mismatches"] == [] and r["twins"] == [], r
        assert r["next_draw_equal"], "the generator after init differs from the unsharded run's"
        ref, tp = r["losses"]
        assert max(abs(a - b) for a, b in zip(ref, tp, strict=True)) <= TOL, r["losses"]


@pytest.mark.parametrize(
    ("name", "how"),
    # (tied embeddings differ for a reason other than the draw: torch's to_empty unties the
    # unsharded model's meta parameters but keeps a DTensor tie; see random_init's docstring)
    [("llama", "apply"), ("llama", "init_weights")],
)
def test_llama_from_scratch_init_matches_unsharded(ranks2, name, how):
    _assert_from_scratch(ranks2.run(check_llama_from_scratch, name, how, {}))


def test_llama_from_scratch_init_matches_unsharded_under_fsdp2(ranks4):
    """tp=2 x dp=2: FSDP2 splits the TP shards again (strided over dp) before the init."""
    _assert_from_scratch(
        ranks4.run(check_llama_from_scratch, "llama", "init_weights", {"tp_size": 2, "dp_size": 2})
    )


# ---- nn.init.* on a split nn.Linear -------------------------------------------------------------
INITS = {
    "normal_": lambda w: nn.init.normal_(w, 0.5, 2.0),
    "uniform_": lambda w: nn.init.uniform_(w, -3.0, 1.0),
    "trunc_normal_": lambda w: nn.init.trunc_normal_(w, std=0.7),
    "kaiming_uniform_": lambda w: nn.init.kaiming_uniform_(w, a=math.sqrt(5)),
    "kaiming_normal_": lambda w: nn.init.kaiming_normal_(w, mode="fan_out"),
    "xavier_uniform_": nn.init.xavier_uniform_,
    "xavier_normal_": nn.init.xavier_normal_,
    "zeros_": nn.init.zeros_,
    "ones_": nn.init.ones_,
    "constant_": lambda w: nn.init.constant_(w, 0.25),
    "bernoulli_": lambda w: w.bernoulli_(0.3),
    "exponential_": lambda w: w.exponential_(2.0),
    "log_normal_": lambda w: w.log_normal_(),
    "cauchy_": lambda w: w.cauchy_(),
    "geometric_": lambda w: w.geometric_(0.4),
    "random_": lambda w: w.random_(0, 10),
    "reset_parameters": None,  # nn.Linear's own
}


class _MLP(nn.Module):
    """Column then row linear, widths tp=2 divides, and one left whole (replicated)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(12, 40)
        self.down = nn.Linear(40, 12)
        self.head = nn.Linear(12, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(torch.relu(self.up(x))))


MLP_PLAN = {"up": "colwise", "down": "rowwise", "head": "replicate"}


def _init_all(model: nn.Module, kind: str, generator: torch.Generator | None) -> None:
    with torch.no_grad():
        for module in (model.up, model.down, model.head):
            if kind == "reset_parameters":
                module.reset_parameters()
                continue
            for p in (module.weight, module.bias):
                if p.ndim < 2 and ("kaiming" in kind or "xavier" in kind):
                    continue  # fans need a matrix
                if generator is not None and kind in ("normal_", "uniform_"):
                    getattr(nn.init, kind)(p, generator=generator)
                else:
                    INITS[kind](p)


def check_init_kinds(kinds: list[str], with_generator: bool) -> dict:
    import tpkit

    out = {}
    for kind in kinds:
        torch.manual_seed(5)
        ref = _MLP()
        model = tpkit.tensor_parallel(copy.deepcopy(ref), plan=MLP_PLAN)
        states = []
        for m in (ref, model):
            torch.manual_seed(11)
            g = torch.Generator().manual_seed(3) if with_generator else None
            _init_all(m, kind, g)
            states.append((torch.get_rng_state(), g.get_state() if g is not None else None))
        (ref_state, ref_g), (state, g) = states
        out[kind] = {
            "mismatches": _mismatches(ref, model),
            "rng_equal": torch.equal(ref_state, state) and (ref_g is None or torch.equal(ref_g, g)),
        }
    return out


@pytest.mark.parametrize("with_generator", [False, True], ids=["default_rng", "generator"])
def test_nn_init_kinds_on_split_linear_match_unsharded(ranks2, with_generator):
    kinds = ["normal_", "uniform_"] if with_generator else list(INITS)
    for r in ranks2.run(check_init_kinds, kinds, with_generator):
        bad = {k: v for k, v in r.items() if v["mismatches"] or not v["rng_equal"]}
        assert not bad, bad


def check_init_unsharded() -> dict:
    """Inits DTensor cannot follow op by op, run on the whole tensor by `init_unsharded`."""
    import tpkit
    from tpkit.training.init import init_unsharded

    torch.manual_seed(5)
    ref = _MLP()
    model = tpkit.tensor_parallel(copy.deepcopy(ref), plan=MLP_PLAN)
    out = {}
    for name, fn, args in (
        ("orthogonal_", nn.init.orthogonal_, (0.5,)),
        ("sparse_", nn.init.sparse_, (0.5,)),
    ):
        for m in (ref, model):
            torch.manual_seed(13)
            for module in (m.up, m.down, m.head):
                init_unsharded(module.weight, fn, *args)
            m.next = torch.rand(3)
        out[name] = {
            "mismatches": _mismatches(ref, model),
            "next_equal": torch.equal(ref.next, model.next),
        }
    return out


def test_init_unsharded_runs_whole_tensor_inits(ranks2):
    for r in ranks2.run(check_init_unsharded):
        assert all(v == {"mismatches": [], "next_equal": True} for v in r.values()), r


# ---- a user's module with its own reset_parameters ----------------------------------------------
class _Gated(nn.Module):
    """A user block: its own replicated parameter and a custom init of its linears."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(16, 32, bias=False)
        self.proj = nn.Linear(32, 16, bias=False)
        self.scale = nn.Parameter(torch.empty(16))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            nn.init.trunc_normal_(self.gate.weight, std=0.02, a=-0.04, b=0.04)
            nn.init.kaiming_normal_(self.proj.weight)
            self.scale.uniform_(0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.relu(self.gate(x))) * self.scale


class _UserModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Gated() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return x


USER_PLAN = {"blocks.*.gate": "colwise", "blocks.*.proj": "rowwise"}


def check_user_reset_parameters() -> dict:
    import tpkit

    torch.manual_seed(0)
    with torch.device("meta"):
        ref = _UserModel()
    model = tpkit.tensor_parallel(copy.deepcopy(ref), plan=USER_PLAN, fill_later=True)
    draws = []
    for m in (ref, model):
        m.to_empty(device="cpu")
        torch.manual_seed(21)
        for b in m.blocks:
            b.reset_parameters()
        draws.append(torch.rand(3))
    return {"mismatches": _mismatches(ref, model), "next_equal": torch.equal(*draws)}


def test_user_reset_parameters_matches_unsharded(ranks2):
    for r in ranks2.run(check_user_reset_parameters):
        assert r["mismatches"] == [] and r["next_equal"], r


# ---- LoRA B re-initialised on a split adapter ---------------------------------------------------
def check_lora_normal_init(order: str) -> dict:
    import peft

    import tpkit
    from tpkit.integrations import peft as tp_peft

    targets = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0)
    torch.manual_seed(0)
    ref = peft.get_peft_model(tf.LlamaForCausalLM(tf.LlamaConfig(**ATTN)), config)
    torch.manual_seed(0)
    if order == "peft_first":  # adapters made whole, then laid out by the split
        model = tp_peft.tensor_parallel(copy.deepcopy(ref))
    else:  # adapters added to the split model
        base = tpkit.tensor_parallel(tf.LlamaForCausalLM(tf.LlamaConfig(**ATTN)))
        model = tp_peft.get_peft_model(base, config)
    for m in (ref, model):
        torch.manual_seed(9)
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "lora_B" in n or "lora_A" in n:
                    nn.init.normal_(p, std=0.1)
    return {
        "mismatches": [n for n in _mismatches(ref, model) if "lora_" in n],
        "lora_B": sum("lora_B" in n for n, _ in model.named_parameters()),
    }


@pytest.mark.parametrize("order", ["tp_first", "peft_first"])
def test_lora_normal_init_on_split_adapters_matches_unsharded(ranks2, order):
    for r in ranks2.run(check_lora_normal_init, order):
        assert r["lora_B"] == 10 and r["mismatches"] == [], r


# ---- scope: other meshes keep torch's behaviour -------------------------------------------------
def check_foreign_mesh_untouched() -> dict:
    """A DTensor on a mesh tpkit never saw draws as torch does (its local shard from the local
    generator), even after tpkit installed its handler."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import tpkit
    from tpkit.training.init import is_registered_mesh

    tpkit.tensor_parallel(_MLP(), plan=MLP_PLAN)  # installs the handler
    mesh = DeviceMesh("cpu", list(range(dist.get_world_size())), mesh_dim_names=("other",))
    dt = distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)], src_data_rank=None)
    torch.manual_seed(1)
    dt.normal_()
    torch.manual_seed(1)
    local = torch.empty(dt.to_local().shape).normal_()
    return {"registered": is_registered_mesh(mesh), "torch": torch.equal(dt.to_local(), local)}


def test_foreign_mesh_dtensors_keep_torch_behaviour(ranks2):
    for r in ranks2.run(check_foreign_mesh_untouched):
        assert r == {"registered": False, "torch": True}, r
