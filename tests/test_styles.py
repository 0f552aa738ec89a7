"""The style catalogue and the classes bound to it: one record per style, users can add one."""

from __future__ import annotations

import copy

import pytest

from tests.models import batch, build, forward_backward_diffs


def test_every_catalogued_style_has_a_class_and_its_aliases_resolve():
    import tpkit.styles  # noqa: F401 - binds the built-in classes
    from tpkit.plan import all_specs, canonical_style
    from tpkit.plan.catalogue import implementation

    for s in all_specs():
        assert implementation(s.name).name == s.name
        for alias in s.aliases:
            assert canonical_style(alias) == s.name


def test_roles_answer_what_used_to_be_lists_of_column_styles():
    from tpkit.plan import style_spec

    columns = {"colwise", "packed_colwise", "packed_qkv_colwise", "colwise_embedding"}
    assert {n for n in columns if style_spec(n).splits_output} == columns
    assert style_spec("rowwise").splits_input and style_spec("packed_rowwise").packed_parts == 2
    assert not style_spec("colwise_gather_output").splits_output  # gathered: whole output
    assert style_spec("vocab_parallel").uneven_ok and style_spec("colwise").uneven_ok
    assert style_spec("packed_colwise").uneven_ok  # each part in torch.chunk sizes
    assert not style_spec("packed_qkv_colwise").uneven_ok  # whole heads per rank
    assert style_spec("mla_kv_a_proj").name == "tail_grad_allreduce"  # transformers' name


def test_a_style_name_cannot_be_taken_twice():
    from tpkit import StyleSpec, register_style
    from tpkit.styles import ColwiseStyle

    class Dup(ColwiseStyle):
        name = "colwise"

    with pytest.raises(ValueError, match="already in the catalogue"):
        register_style(StyleSpec("colwise", "column", "again", shard="out"), Dup)


def test_register_style_refuses_a_class_that_is_not_a_style():
    from tpkit import StyleSpec, register_style

    with pytest.raises(TypeError, match="TPStyle subclass"):
        register_style(StyleSpec("mine", "column", "x", shard="out"), object)


def _register_counting_colwise() -> None:
    """A user style: colwise that counts its calls (registered in each rank's process)."""
    from tpkit import StyleSpec, register_style
    from tpkit.styles import ColwiseStyle

    class CountingColwise(ColwiseStyle):
        name = "counting_colwise"
        calls = 0

        def _prepare_input(self, module, args, kwargs):
            type(self).calls += 1
            return super()._prepare_input(module, args, kwargs)

    spec = StyleSpec("counting_colwise", "column", "colwise, counting calls", shard="out")
    register_style(spec, CountingColwise, replace=True)


def check_registered_style_in_a_plan() -> dict:
    import tpkit
    from tpkit.plan.catalogue import implementation

    _register_counting_colwise()
    ref = build("llama")
    plan = {"model.layers.*.mlp.up_proj": "counting_colwise"}
    model = tpkit.tensor_parallel(copy.deepcopy(ref), plan=plan)
    diffs = forward_backward_diffs(ref, model, batch(101))
    up = model.model.layers[0].mlp.up_proj
    return {
        **diffs,
        "calls": implementation("counting_colwise").calls,
        "local": tuple(up.weight.to_local().shape),
        "repr": repr(up),
    }


def test_a_registered_style_splits_and_matches_the_unsharded_model(ranks2):
    for r in ranks2.run(check_registered_style_in_a_plan):
        assert r["logits"] <= 1e-5 and r["grad"] <= 1e-5, r
        assert r["calls"] == 2 and r["local"] == (64, 64), r  # 2 layers, 128 rows / 2


def check_print_shows_styles_and_local_shapes() -> dict:
    import tpkit

    model = tpkit.tensor_parallel(build("llama"))
    return {"text": repr(model), "down": repr(model.model.layers[0].mlp.down_proj)}


def test_print_shows_each_layers_style_and_local_shape(ranks2):
    r = ranks2.run(check_print_shows_styles_and_local_shapes)[0]
    assert (
        "in_features=64, out_features=128, bias=False, tp=colwise, weight: local (64, 64)"
        in (r["text"])
    )
    assert "tp=vocab_parallel, weight: local (51, 64)" in r["text"]  # 101 rows: 51 + 50
    assert r["down"].endswith("tp=rowwise, weight: local (64, 64))"), r["down"]


def check_a_layer_whose_config_is_not_a_config() -> dict:
    import tpkit

    ref = build("llama")
    ref.model.layers[0].mlp.up_proj.config = 0.1  # IDEFICS keeps its dropout under that name
    model = tpkit.tensor_parallel(copy.deepcopy(ref))
    return forward_backward_diffs(ref, model, batch(101))


def test_a_layer_whose_config_attribute_is_not_a_config_is_split(ranks2):
    """Applying a style read ``module.config.__dict__`` to choose the experts' matmul: IDEFICS's
    gated cross-attention layer keeps a float as ``config`` (AttributeError, no split)."""
    for r in ranks2.run(check_a_layer_whose_config_is_not_a_config):
        assert r["logits"] <= 1e-5 and r["grad"] <= 1e-5, r
