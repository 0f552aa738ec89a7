"""Training: TP, FSDP2 x TP, sequence and loss parallelism match a single-process reference."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from tests.models import batch, build, full

REL = 1e-5
STEPS = 5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp(min=1e-12)).item()


def _dp_coords(model) -> tuple[int, int]:
    state = getattr(model, "_tpkit", None)
    if state is None:
        return 0, 1
    from tpkit.parallel.mesh import get_mesh

    dp_mesh = get_mesh(state.mesh, "dp")  # None at dp = 1
    return (0, 1) if dp_mesh is None else (dp_mesh.get_local_rank(), dp_mesh.size())


def check_training(name: str, accum: int = 1, **tp_kwargs) -> dict:
    """STEPS AdamW steps with grad clipping on the same global batch (4 x 8 tokens).

    AdamW's eps is 1e-6 rather than 1e-8: with eps=1e-8, gradient elements below ~1e-8 (tiny
    random models have many in gate_proj) turn summation-order noise of 1e-7 relative into
    update differences of the order of the learning rate, in any two runs that sum in a different
    order (1.3e-5 relative after 5 steps, measured), whether or not they are tensor-parallel.
    """
    import tpkit

    ref = build(name).train()
    model = tpkit.tensor_parallel(copy.deepcopy(ref), **tp_kwargs).train()
    dp_rank, dp = _dp_coords(model)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    losses, ref_losses, norms, ref_norms = [], [], [], []
    for step in range(STEPS):
        x = batch(ref.config.vocab_size, shape=(4, 8), seed=step)
        opt_r.zero_grad()
        loss_r = ref(input_ids=x, labels=x).loss
        loss_r.backward()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0).item())
        opt_r.step()
        ref_losses.append(loss_r.item())

        opt.zero_grad()
        mine = x.chunk(dp)[dp_rank]  # dp groups get different rows, TP ranks the same
        total = 0.0
        for micro in mine.chunk(accum):
            loss = model(input_ids=micro, labels=micro).loss / accum
            loss.backward()
            total += loss.detach()
        norms.append(tpkit.clip_grad_norm_(model.parameters(), 1.0).item())
        opt.step()
        total = torch.as_tensor(total).clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    ref_params = dict(ref.named_parameters())
    return {
        "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
        "param_rel": max(_rel(full(p), ref_params[n]) for n, p in model.named_parameters()),
        "norm_rel": max(abs(a - b) / b for a, b in zip(norms, ref_norms)),
        "losses": losses,
    }


def check_dropout_replicas_agree(name: str, **tp_kwargs) -> dict:
    """With dropout on, each block's (replicated) output is bitwise equal across the TP group,
    while the attention dropout masks inside the TP region differ across ranks."""
    import transformers as tf

    import tpkit

    torch.manual_seed(0)
    if name == "gpt2":
        cfg = tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=101, n_positions=64)
        cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.3
        model = tf.GPT2LMHeadModel(cfg)
    else:
        model = tf.LlamaForCausalLM(
            tf.LlamaConfig(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=4,
                vocab_size=101,
                attention_dropout=0.3,
            )
        )
    model = tpkit.tensor_parallel(model, **tp_kwargs).train()
    outs = []
    blocks = model.transformer.h if name == "gpt2" else model.model.layers
    for b in blocks:
        b.register_forward_hook(
            lambda m, a, o: outs.append((o[0] if isinstance(o, tuple) else o).detach())
        )
    x = batch(101, shape=(2, 8))
    model(input_ids=x, labels=x).loss.backward()
    equal = []
    for o in outs:
        parts = [torch.empty_like(o) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, o.contiguous())
        equal.append(all(torch.equal(parts[0], p) for p in parts))
    # the per-rank stream really differs: one draw inside a region, compared across ranks
    from tpkit.training.rng import rng_state as _get

    region = blocks[0].attn if name == "gpt2" else blocks[0].self_attn
    seen = []
    handle = region.register_forward_pre_hook(
        lambda m, a: seen.append(torch.rand(4)), prepend=False
    )
    model(input_ids=x)
    handle.remove()
    parts = [torch.empty_like(seen[0]) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, seen[0])
    _get()
    return {"blocks_equal": equal, "region_draws_differ": not torch.equal(parts[0], parts[1])}


def check_bf16_fsdp(name: str) -> dict:
    import tpkit

    ref = build(name).train()
    model = tpkit.tensor_parallel(
        copy.deepcopy(ref), tp_size=2, dp_size=2, param_dtype=torch.bfloat16
    ).train()
    dp_rank, dp = _dp_coords(model)
    x = batch(ref.config.vocab_size, shape=(4, 8))
    loss = model(input_ids=x.chunk(dp)[dp_rank], labels=x.chunk(dp)[dp_rank]).loss
    loss.backward()
    grad_dtypes = {full(p.grad).dtype for p in model.parameters()}
    param_dtypes = {p.dtype for p in model.parameters()}
    total = loss.detach().float().clone()
    dist.all_reduce(total)
    ref_loss = ref(input_ids=x, labels=x).loss.item()
    return {
        "loss_rel": abs(total.item() / 4 - ref_loss) / ref_loss,
        "grad_dtypes": sorted(map(str, grad_dtypes)),
        "param_dtypes": sorted(map(str, param_dtypes)),
    }


def _assert_match(results):
    for r in results:
        assert r["loss_rel"] <= REL and r["param_rel"] <= REL and r["norm_rel"] <= REL, r


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_tp2_training_matches_single_process(ranks2, name):
    _assert_match(ranks2.run(check_training, name))


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_sequence_parallel_matches_single_process(ranks2, name):
    _assert_match(ranks2.run(check_training, name, sequence_parallel=True))


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_loss_parallel_matches_single_process(ranks2, name):
    _assert_match(ranks2.run(check_training, name, loss_parallel=True))


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_fsdp_dp2_tp2_matches_single_process(ranks4, name):
    _assert_match(ranks4.run(check_training, name, tp_size=2, dp_size=2))


def test_all_options_with_gradient_accumulation(ranks4):
    _assert_match(
        ranks4.run(
            check_training,
            "llama",
            accum=2,
            tp_size=2,
            dp_size=2,
            sequence_parallel=True,
            loss_parallel=True,
        )
    )


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_dropout_keeps_replicas_equal(ranks2, name):
    for r in ranks2.run(check_dropout_replicas_agree, name):
        assert all(r["blocks_equal"]) and r["region_draws_differ"], r


def test_dropout_with_sequence_parallel_keeps_replicas_equal(ranks2):
    for r in ranks2.run(check_dropout_replicas_agree, "gpt2", sequence_parallel=True):
        assert r["region_draws_differ"], r
        assert r["blocks_equal"][-1], r  # the last block's output is gathered: whole again


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_bf16_mixed_precision_with_fsdp(ranks4, name):
    for r in ranks4.run(check_bf16_fsdp, name):
        assert r["loss_rel"] < 2e-2, r
        assert r["param_dtypes"] == ["torch.float32"] and r["grad_dtypes"] == ["torch.float32"], r


def test_sequence_parallel_rejects_encoder_decoder():
    import transformers as tf

    from tpkit.plan import derive_plan, problems

    model = tf.T5ForConditionalGeneration(
        tf.T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=4, d_kv=8, vocab_size=64)
    )
    found = problems(model, derive_plan(model), 2, sequence_parallel=True)
    assert found and "decoder-only" in found[0]


def test_sequence_parallel_rejects_gathered_pairs_inside_blocks():
    """BitNet's MLP and attention are gathered pairs (a norm over the split features between the
    layers): their code runs on whole activations, which a sequence chunk is not, so SP refuses
    them by name instead of failing on a shape inside attention (or summing chunks silently)."""
    from tests.tiny import build
    from tpkit.plan import derive_plan, problems

    model = build("bitnet", "BitNetForCausalLM")
    plan = derive_plan(model, tp_size=2)
    found = [p for p in problems(model, plan, 2, sequence_parallel=True) if "gathered" in p]
    assert len(found) == 1, found
    assert "model.layers.0." in found[0] and "sequence_parallel=False" in found[0], found
    assert not [p for p in problems(model, plan, 2) if "gathered" in p]  # without SP: fine


def check_clip_arguments(name: str) -> dict:
    """torch's clip_grad_norm_ arguments on a tp=2 model: every norm type (0 counts the gradients
    with a nonzero entry, as torch does), ``foreach`` on and off, ``error_if_nonfinite``."""
    import tpkit

    ref = build(name).train()
    model = tpkit.tensor_parallel(copy.deepcopy(ref), tp_size=2).train()
    x = batch(ref.config.vocab_size, shape=(2, 8))
    ref(input_ids=x, labels=x).loss.backward()
    model(input_ids=x, labels=x).loss.backward()
    next(ref.parameters()).grad.zero_()  # a gradient with no nonzero entry, for norm_type=0
    first = next(model.parameters()).grad
    (first.to_local() if hasattr(first, "to_local") else first).zero_()
    rels = {}
    for norm_type in (0, 1, 2, 3.5, float("inf")):
        for foreach in (None, True, False):
            want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9, norm_type=norm_type)
            got = tpkit.clip_grad_norm_(
                model.parameters(), 1e9, norm_type=norm_type, foreach=foreach
            )
            rels[f"{norm_type}/{foreach}"] = abs(got.item() - want.item()) / want.item()
    clipped = tpkit.clip_grad_norm_(model.parameters(), 0.5, foreach=True)
    after = tpkit.clip_grad_norm_(model.parameters(), 1e9)
    grad = next(p for p in model.parameters() if p.grad is not None and p.grad.numel() > 1).grad
    local = grad.to_local() if hasattr(grad, "to_local") else grad
    local.view(-1)[0] = float("nan")
    try:
        tpkit.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
        nonfinite = "no error"
    except RuntimeError as exc:
        nonfinite = str(exc)
    return {
        "rels": rels,
        "clipped": clipped.item(),
        "after": after.item(),
        "nonfinite": nonfinite,
    }


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_clip_grad_norm_takes_torchs_arguments(ranks2, name):
    for r in ranks2.run(check_clip_arguments, name):
        assert max(r["rels"].values()) < 1e-5, r["rels"]
        assert r["clipped"] > 0.5 and abs(r["after"] - 0.5) < 1e-4, r
        assert "non-finite" in r["nonfinite"], r
