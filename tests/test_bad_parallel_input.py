"""Bad input for the parallelisms tpkit lays out: sizes, a user's mesh and its axis names, a model
built on meta and never loaded. Each case is one clear error on every rank before any
collective (counted: torch.distributed's functions wherever a module imported them, process
groups and meshes included), or a correct result (logits and every gradient against the
unsharded model). Cases of checkpoint files: test_loading_checks.py, test_checkpoint.py."""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
import transformers as tf

from tests.models import ATTN, batch, build

TOL = 1e-5
#: torch.distributed functions that talk to other ranks (a new group or mesh included)
_COLLECTIVES = (
    "init_process_group",
    "new_group",
    "split_group",
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "reduce_scatter_tensor",
    "scatter",
    "gather",
    "barrier",
    "monitored_barrier",
)


@contextlib.contextmanager
def counted_collectives() -> Iterator[list[str]]:
    """Count every call of `_COLLECTIVES` made inside the block, wherever the function was
    imported from (``dist.X``, ``torch.distributed.distributed_c10d.X``, a name another module
    imported, as torch's DeviceMesh does), and tpkit's shared-memory collectives."""
    from tpkit.parallel import shm

    c10d = dist.distributed_c10d
    originals = {n: getattr(c10d, n) for n in _COLLECTIVES}
    calls: list[str] = []

    def counted(name: str) -> Callable:
        def call(*args, **kwargs):
            calls.append(name)
            return originals[name](*args, **kwargs)

        return call

    wrappers = {n: counted(n) for n in originals}
    patched: list[tuple[object, str, object]] = []
    for module in list(sys.modules.values()):
        for name, fn in originals.items():
            if getattr(module, name, None) is fn:
                patched.append((module, name, fn))
                setattr(module, name, wrappers[name])
    before = sum(shm.shm_counts().values())
    try:
        yield calls
    finally:
        for module, name, fn in patched:
            setattr(module, name, fn)
        calls.extend(["shm"] * (sum(shm.shm_counts().values()) - before))


def _outcome(fn: Callable[[], object]) -> dict:
    """The error ``fn()`` raised ('Type: message', or 'no error') and the collectives it made."""
    with counted_collectives() as calls:
        try:
            fn()
            msg = "no error"
        except Exception as exc:  # noqa: BLE001 - the message is what the tests compare
            msg = f"{type(exc).__name__}: {exc}"
    return {"msg": msg, "collectives": list(calls)}


def _mesh(shape: tuple[int, ...], names: tuple[str, ...] | None):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _meta_llama() -> tf.LlamaForCausalLM:
    with torch.device("meta"):
        return tf.LlamaForCausalLM(tf.LlamaConfig(**ATTN))


# ---- one clear error on every rank, before any collective (4 ranks) ---------------------------
def _split(name: str = "llama", **kwargs) -> Callable[[], Callable[[], object]]:
    """A case: split a fresh tiny model (``"meta"``: a Llama built on meta, never loaded) with
    these keywords; a ``distributed_config`` is given as a function that makes it."""

    def setup() -> Callable[[], object]:
        model = _meta_llama() if name == "meta" else build(name)
        options = dict(kwargs)
        if "distributed_config" in options:
            options["distributed_config"] = options["distributed_config"]()
        return lambda: _tp(model, **options)

    return setup


def _on_mesh(shape: tuple[int, ...], names: tuple[str, ...] | None, **kwargs):
    """A case: split a tiny Llama on a user's mesh (built outside the count: the user's
    collective, not tpkit's)."""

    def setup() -> Callable[[], object]:
        mesh = _mesh(shape, names)
        model = build("llama")
        return lambda: _tp(model, mesh=mesh, **kwargs)

    return setup


def _accelerate_config(**sizes):
    from accelerate.parallelism_config import ParallelismConfig

    return ParallelismConfig(**sizes)


#: case -> (its setup, a part of the message every rank must raise)
REFUSALS: dict[str, tuple[Callable[[], Callable[[], object]], str]] = {
    # issue 46, item 4: a user's mesh with other axis names
    "mesh_cp_tp_with_sp": (
        _on_mesh((2, 2), ("cp", "tp"), sequence_parallel=True),
        "sequence_parallel=True with cp_size > 1 is not supported yet",
    ),
    "mesh_foo_tp": (
        _on_mesh((2, 2), ("foo", "tp")),
        "the mesh's dimensions ('foo', 'tp') are not tpkit's: name them among "
        "('dp_replicate', 'dp_shard', 'cp', 'tp', 'dp')",
    ),
    "mesh_tp_outermost": (
        _on_mesh((2, 2), ("tp", "dp_shard")),
        "the mesh's 'tp' dimension must be the innermost",
    ),
    "mesh_unnamed_2d": (_on_mesh((2, 2), None), "a 2-D mesh without dimension names"),
    "mesh_dp_twice": (
        _on_mesh((1, 2, 2), ("dp", "dp_shard", "tp")),
        "('dp', 'dp_shard', 'tp') are not tpkit's",
    ),
    "mesh_sizes_disagree": (
        _on_mesh((2, 2), ("dp_shard", "tp"), tp_size=4),
        "tp_size=4 disagree with the mesh (tp_size=2, dp_size=2, dp_shard_size=2)",
    ),
    # issue 46, item 3: built on meta, never loaded
    "meta_never_loaded": (
        _split("meta"),
        "LlamaForCausalLM has 21 parameter(s) on the meta device",
    ),
    # issue 46, item 5: sizes of the new parallelisms
    "sizes_do_not_multiply": (
        _split(tp_size=2, dp_size=3),
        "dp_shard_size=3 x tp_size=2 = 6 ranks, but the world size is 4",
    ),
    "tp_does_not_divide_world": (
        _split(tp_size=3),
        "tp_size=3 does not divide the world size 4; use a tp_size among [1, 2, 4]",
    ),
    "cp_unknown_attention": (
        _split(tp_size=2, cp_size=2, cp_attention="flash"),
        "cp_attention='flash': choose one of",
    ),
    "cp_encoder_decoder": (
        _split("t5", tp_size=2, cp_size=2),
        "context parallelism: T5ForConditionalGeneration is an encoder-decoder",
    ),
    "cp_does_not_divide": (
        _split(tp_size=2, cp_size=3),
        "cp_size=3 x tp_size=2 = 6 ranks, but the world size is 4",
    ),
    "ep_with_cp": (
        _split("qwen3_moe", tp_size=2, cp_size=2, ep_size=2),
        "ep_size=2 with cp_size=2: expert and context parallelism are not built together yet",
    ),
    "ep_without_experts": (
        _split("llama", tp_size=2, dp_size=2, ep_size=2),
        "ep_size=2: LlamaForCausalLM has no experts module expert parallelism can place",
    ),
    "ep_all_reduce_over_two_batches": (
        _split("qwen3_moe", tp_size=1, dp_size=4, ep_size=2, ep_implementation="all_reduce"),
        "ep_implementation='all_reduce' needs every rank of an expert-parallel group to hold "
        "the same tokens (ep_size == tp_size); got ep_size=2, tp_size=1",
    ),
    "ep_unknown_implementation": (
        _split("qwen3_moe", tp_size=2, dp_size=2, ep_size=2, ep_implementation="deepep"),
        "ep_implementation='deepep': use one of",
    ),
    "ep_not_a_multiple_of_tp": (
        _split("qwen3_moe", tp_size=2, dp_size=2, ep_size=3),
        "ep_size=3 must be a multiple of tp_size=2 and divide dp_shard_size x tp_size = 4",
    ),
    "ep_larger_than_dp_shard_x_tp": (
        _split("qwen3_moe", tp_size=2, dp_size=2, ep_size=8),
        "ep_size=8 must be a multiple of tp_size=2 and divide dp_shard_size x tp_size = 4",
    ),
    "dp_spellings_disagree": (
        _split(dp_size=4, dp_replicate_size=2, dp_shard_size=1),
        "dp_size=4 is dp_replicate_size x dp_shard_size, but those are 2 x 1 = 2",
    ),
    "pipeline_asked": (
        _split(distributed_config=lambda: tf.DistributedConfig(tp_size=2, pp_size=2)),
        "DistributedConfig(pp_size=2): tpkit has no pipeline parallelism",
    ),
    "ulysses_asked": (
        _split(distributed_config=lambda: _accelerate_config(sp_size=2)),
        "ParallelismConfig(sp_size=2): tpkit runs Ulysses sequence parallelism as a kind of "
        "context parallelism; pass cp_size (with cp_attention='ulysses') instead.",
    ),
    "config_disagrees": (
        _split(tp_size=4, distributed_config=lambda: _accelerate_config(tp_size=2)),
        "tp_size=4 disagrees with ParallelismConfig's tp_size=2",
    ),
}


def _tp(model, **kwargs):
    import tpkit

    return tpkit.tensor_parallel(model, **kwargs)


def check_refusal(case: str) -> dict:
    """Run one case on this rank: its error and the collectives made before it."""
    import tpkit  # noqa: F401 - imported before the count: its import makes no collective

    call = REFUSALS[case][0]()  # what the case brings (a model, a mesh), outside the count
    return _outcome(call)


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_bad_input_is_one_clear_error_before_any_collective(ranks4, case):
    results = ranks4.run(check_refusal, case, timeout=120)
    msgs = [r["msg"] for r in results]
    assert all(m == msgs[0] for m in msgs), msgs  # every rank alike
    assert msgs[0].startswith("ValueError") and REFUSALS[case][1] in msgs[0], msgs[0]
    assert all(r["collectives"] == [] for r in results), [r["collectives"] for r in results]


# ---- a user's mesh with tpkit's axis names runs (issue 46, item 4) ----------------------------
def check_user_mesh(shape: tuple[int, ...], names: tuple[str, ...], kwargs: dict) -> dict:
    """``tensor_parallel(model, mesh=...)`` against the unsharded model: logits, the loss and
    every gradient (identical batches on every rank, so FSDP's averaged gradients are the
    unsharded ones)."""
    from torch.distributed.tensor import DTensor

    from tpkit.parallel.context import gather_sequence

    mesh = _mesh(shape, names)
    ref = build("llama").train()
    model = _tp(copy.deepcopy(ref), mesh=mesh, **kwargs).train()
    x = batch(101, (2, 16))  # cp_size=2 splits a sequence in 4 zigzag chunks
    out, want = model(input_ids=x, labels=x), ref(input_ids=x, labels=x)
    out.loss.backward()
    want.loss.backward()
    grads = dict(ref.named_parameters())
    grad = 0.0
    for n, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grad = max(grad, (g - grads[n].grad).abs().max().item())
    logits = out.logits.full_tensor() if isinstance(out.logits, DTensor) else out.logits
    logits = gather_sequence(model, logits)  # this rank's tokens under cp, else all of them
    state = model._tpkit
    return {
        "logits": (logits - want.logits).abs().max().item(),
        "loss": abs(out.loss.item() - want.loss.item()),
        "grad": grad,
        "same_mesh": state.mesh is mesh,
        "sizes": state.dims.shape,
    }


USER_MESHES = {
    "dp_shard_tp": ((2, 2), ("dp_shard", "tp"), {}, {"dp_shard": 2, "tp": 2}),
    "dp_tp": ((2, 2), ("dp", "tp"), {}, {"dp_shard": 2, "tp": 2}),
    "dp_tp_replicas": ((2, 2), ("dp", "tp"), {"sharded": False}, {"dp_replicate": 2, "tp": 2}),
    "cp_tp": ((2, 2), ("cp", "tp"), {}, {"cp": 2, "tp": 2}),
    "hsdp_tp1": (
        (2, 2, 1),
        ("dp_replicate", "dp_shard", "tp"),
        {},
        {"dp_replicate": 2, "dp_shard": 2, "tp": 1},
    ),
    "hsdp_tp2": (
        (1, 2, 2),
        ("dp_replicate", "dp_shard", "tp"),
        {},
        {"dp_shard": 2, "tp": 2},
    ),
}


@pytest.mark.parametrize("case", sorted(USER_MESHES))
def test_a_user_mesh_with_tpkits_axes_matches_unsharded(ranks4, case):
    shape, names, kwargs, sizes = USER_MESHES[case]
    for r in ranks4.run(check_user_mesh, shape, names, kwargs, timeout=180):
        assert r["logits"] <= TOL and r["grad"] <= TOL and r["loss"] <= TOL, r
        assert r["same_mesh"], r
        want = {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, **sizes}
        assert r["sizes"] == want, r


# ---- a meta model: refused unless its weights come after the split (issue 46, item 3) ---------
def check_meta_fill_later(how: str) -> dict:
    """A meta Llama split with ``fill_later=True`` (or inside accelerate's init_empty_weights,
    the old package's flow) is split, and runs once filled: every rank alike."""
    from accelerate import init_empty_weights

    if how == "inside_init_empty_weights":
        with init_empty_weights():
            outcome = _outcome(lambda: _tp(tf.LlamaForCausalLM(tf.LlamaConfig(**ATTN))))
        model = None
    else:
        model = _meta_llama()
        outcome = _outcome(lambda: _tp(model, fill_later=True))
    if model is not None:
        model.to_empty(device="cpu")
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                (t.to_local() if hasattr(t, "to_local") else t).fill_(0.01)
        outcome["shape"] = tuple(model(input_ids=batch(101)).logits.shape)
    return outcome


@pytest.mark.parametrize("how", ["fill_later", "inside_init_empty_weights"])
def test_a_meta_model_whose_weights_come_later_is_split(ranks2, how):
    for r in ranks2.run(check_meta_fill_later, how):
        assert r["msg"] == "no error", r
        assert r["collectives"], r  # it was split: the mesh, its groups
        if how == "fill_later":
            assert r["shape"] == (2, 9, 101), r


def check_meta_single_process() -> str:
    """World size 1 refuses the same way (a script is written once for 1 or N ranks)."""
    return _outcome(lambda: _tp(_meta_llama()))["msg"]


def test_a_meta_model_is_refused_in_one_process_too():
    msg = check_meta_single_process()
    assert msg.startswith("ValueError") and "fill_later=True" in msg, msg
    assert "tpkit.from_pretrained(path)" in msg and "to_empty" in msg, msg
