"""Planning leaves the model as it found it (`tpkit.trace.kept_state`), and a weight scaled in
place outside its forward (RWKV's rescale) stays split: both checked on RWKV at a depth where
its rescale acts (``rescale_every`` layers and more)."""

from __future__ import annotations

import torch
from torch import nn

from tests.parity import assert_parity, tiny_parity
from tpkit.plan import derive_plan
from tpkit.trace.kept_state import kept_attributes

#: 12 layers, rescaled every 6: RWKV halves its hidden states after layers 6 and 12 in eval,
#: having divided its output weights at the first eval forward (a flag says it did)
RESCALED = {"num_hidden_layers": 12, "rescale_every": 6}


def _rwkv() -> nn.Module:
    import transformers

    from tests.tiny import tiny_config

    config = tiny_config("rwkv", "RwkvForCausalLM")
    for k, v in RESCALED.items():
        setattr(config, k, v)
    torch.manual_seed(0)
    return transformers.RwkvForCausalLM(config).eval()


def test_a_forward_inside_leaves_every_attribute_as_it_was():
    class Stateful(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.calls, self.tag = nn.Linear(2, 2), 0, "before"

        def forward(self, x):
            self.calls += 1
            self.tag, self.made = "after", torch.ones(1)
            return self.lin(x)

    model = nn.Sequential(Stateful())
    inner, tag = model[0], model[0].tag
    with kept_attributes(model):
        model(torch.ones(1, 2))
        assert inner.calls == 1 and inner.tag == "after" and hasattr(inner, "made")
    assert inner.calls == 0 and inner.tag is tag and not hasattr(inner, "made")
    assert isinstance(inner.lin, nn.Linear)  # the children and parameters are untouched


def test_planning_rwkv_keeps_its_rescale_flag_and_its_split():
    model = _rwkv()
    fresh = _rwkv()
    plan = derive_plan(model, "auto", 2)
    assert model.rwkv.layers_are_rescaled is False  # planning ran eval forwards: undone
    x = torch.randint(
        0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        assert torch.equal(model(x).logits, fresh(x).logits)
    # the rescale divides the output weights in place, outside their forwards: each shard alike
    split = {name for name, style in plan.items() if style != "replicate"}
    assert any(name.endswith("attention.output") for name in split), dict(plan)
    assert any(name.endswith("feed_forward.value") for name in split), dict(plan)


def test_rwkv_rescaled_at_tp2_matches_the_unsharded_model(ranks2):
    assert_parity(ranks2.run(tiny_parity, "rwkv", "RwkvForCausalLM", RESCALED, timeout=180))


def test_planning_leaves_bigbird_its_own_attention_modules():
    """BigBird's first forward on a short sequence swaps every block-sparse attention for a full
    one (a new submodule) and says so in ``attention_type``: after planning the user's model
    still holds its block-sparse ones, so a long sequence still runs block-sparse."""
    from tests.tiny import build

    model = build("big_bird", "BigBirdForCausalLM")
    before = [type(layer.attention.self) for layer in model.bert.encoder.layer]
    derive_plan(model, "auto", 2)
    assert [type(layer.attention.self) for layer in model.bert.encoder.layer] == before
    assert model.bert.attention_type == "block_sparse"


def test_bigbird_at_tp2_matches_the_unsharded_model(ranks2):
    assert_parity(ranks2.run(tiny_parity, "big_bird", "BigBirdForCausalLM", timeout=180))


def test_planning_leaves_no_hooks_behind_a_model_that_returns_hidden_states():
    """transformers installs its output-capturing hooks inside a forward that asks for hidden
    states (here: the config does) and sets a flag that it did: planning's forwards must take
    both away again, or the user's forward gets a second set and twice the hidden states."""
    from tests.tiny import build

    model = build("llama", "LlamaForCausalLM")
    model.config.output_hidden_states = True
    hooks = sum(len(m._forward_hooks) for m in model.modules())
    derive_plan(model, "auto", 2)
    assert sum(len(m._forward_hooks) for m in model.modules()) == hooks
    x = torch.randint(
        0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        states = model(x).hidden_states
    assert len(states) == model.config.num_hidden_layers + 1
