"""Split extensions in one explicit order, the plan derived once, and one door for patches.

- `tpkit.extensions`: the built-in extensions come in one fixed order whatever a script
  imports first (checked in fresh interpreters), user extensions after them.
- A quantized load (``from_pretrained(..., quantization_config=...)``) and ``tensor_parallel``
  of a bitsandbytes model derive their plan once (it used to be twice: once for the
  quantization checks, once for the split), and still give the single-process logits.
- `tpkit.integrations.patching`: patching Trainer, peft and accelerate, calling through the
  patches, then ``unpatch_all()`` leaves every original in place, by identity, in every
  module that held it (accelerate's function is bound by name in several modules).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 150


def _python(script: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-"],
        input=textwrap.dedent(script),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return proc.stdout


# ---- one ordered list -----------------------------------------------------------------------------
IMPORT_ORDERS = {
    "package": "import tpkit",
    "quant first": "import tpkit.quant; import tpkit.integrations.autopatch",
    "integrations first": "import tpkit.integrations.peft; import tpkit.quant.extension",
    "core only": "import tpkit.parallelize",
    # importing a module again used to register its extension again, after the integrations
    "reloaded": "import importlib, tpkit.quant; importlib.reload(tpkit.quant)",
}


@pytest.mark.parametrize("order", list(IMPORT_ORDERS))
def test_extension_order_does_not_depend_on_import_order(order):
    out = _python(
        IMPORT_ORDERS[order]
        + """
from tpkit.extensions import SplitExtension, register_split_extension, split_extensions
from tpkit.parallelize import register_split_extension as via_parallelize

class Mine(SplitExtension):
    pass

mine = Mine()
register_split_extension(mine)
via_parallelize(mine)  # the same function: a second registration is a no-op
print("ORDER", [type(e).__name__ for e in split_extensions()])
"""
    )
    assert "ORDER ['QuantExtension', 'Integrations', 'Mine']" in out, out


# ---- the plan derived once ------------------------------------------------------------------------
def _count_derive_plan(calls: list) -> None:
    """Count every call of `derive_plan`, under whatever name a module imported it."""
    import tpkit.plan.derive as derive

    real = derive.derive_plan

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("tpkit") and (
            module.__dict__.get("derive_plan") is real
        ):
            module.derive_plan = counted


def check_quantized_plan_derived_once(path: str) -> dict:
    import tpkit
    from tests.test_quant import inputs, nf4, rel, single

    calls: list = []
    _count_derive_plan(calls)
    ref = single(path, nf4())
    model = tpkit.from_pretrained(path, tp_size=2, quantization_config=nf4())
    out = {"from_pretrained": len(calls)}
    with torch.no_grad():
        out["logits"] = rel(model(inputs()).logits, ref(inputs()).logits)
    calls.clear()
    bnb_model = single(path, nf4())
    tpkit.tensor_parallel(bnb_model)
    out["tensor_parallel"] = len(calls)
    with torch.no_grad():
        out["sliced"] = rel(bnb_model(inputs()).logits, ref(inputs()).logits)
    return out


def test_quantized_load_derives_the_plan_once(ranks2, tmp_path):
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")
    from transformers import LlamaForCausalLM

    from tests.test_quant import _config

    torch.manual_seed(0)
    LlamaForCausalLM(_config(256)).save_pretrained(tmp_path)
    for r in ranks2.run(check_quantized_plan_derived_once, str(tmp_path), timeout=TIMEOUT):
        assert r["from_pretrained"] == 1 and r["tensor_parallel"] == 1, r
        assert r["logits"] <= 1e-5 and r["sliced"] <= 1e-5, r


# ---- one patching module --------------------------------------------------------------------------
def test_patch_then_unpatch_all_restores_every_original():
    """Trainer (13 attributes), peft and accelerate (its function in every module that binds
    it, also one that imported it after the patch): patched, called, patched again (a no-op),
    then ``unpatch_all`` puts back each original object."""
    out = _python(
        """
        import sys, types
        import torch
        from torch import nn
        import accelerate.utils.modeling as modeling
        import accelerate, accelerate.utils, accelerate.big_modeling
        import peft
        from peft import PeftModel
        from peft.tuners import tuners_utils
        from accelerate.parallelism_config import ParallelismConfig
        from transformers import Trainer

        import tpkit
        from tpkit.integrations.accelerate_loading import patch_accelerate
        from tpkit.integrations.patching import applied, unpatch_all
        from tpkit.integrations.peft import patch_peft
        from tpkit.integrations.trainer import patch_trainer

        def snapshot():
            seen = {}
            for owner in (Trainer, ParallelismConfig, PeftModel, tuners_utils):
                for name, value in vars(owner).items():
                    seen[(id(owner), name)] = value
            for mod_name, mod in list(sys.modules.items()):
                if mod_name.startswith("accelerate") and mod is not None:
                    f = mod.__dict__.get("set_module_tensor_to_device")
                    if f is not None:
                        seen[(mod_name, "set_module_tensor_to_device")] = f
            return seen

        before = snapshot()
        holders = [k for k in before if k[1] == "set_module_tensor_to_device"]
        patch_trainer(); patch_peft(); patch_accelerate()
        by_group = {g: len(applied(g)) for g in ("trainer", "peft", "accelerate")}
        first = snapshot()
        patch_trainer(); patch_peft(); patch_accelerate()  # again: nothing changes
        again = snapshot()
        print("IDEMPOTENT", all(again[k] is first[k] for k in first))
        print("GROUPS", by_group)
        patched = [k for k in before if first.get(k) is not before[k]]
        print("HOLDERS", len(holders),
              all(getattr(first[k], "_tpkit_patch", False) for k in holders))

        # a module that imports the function by name after the patch
        late = types.ModuleType("accelerate.tpkit_test_late")
        late.set_module_tensor_to_device = modeling.set_module_tensor_to_device
        sys.modules[late.__name__] = late

        # calls through the patches, on a model tpkit did not split: the original behaviour
        lin = nn.Linear(2, 3)
        modeling.set_module_tensor_to_device(lin, "weight", "cpu", value=torch.ones(3, 2))
        print("CALLED", bool((lin.weight == 1).all()),
              tuners_utils._get_in_out_features(nn.Linear(4, 5)))

        undone = unpatch_all()
        after = snapshot()
        restored = all(after.get(k) is before[k] for k in before)
        print("RESTORED", undone, len(patched) > 0, restored,
              late.set_module_tensor_to_device is before[holders[0]], applied() == [])
        """
    )
    assert "IDEMPOTENT True" in out, out
    assert "GROUPS {'trainer': 15, 'peft': " in out and "'accelerate': 1}" in out, out
    holders = next(line for line in out.splitlines() if line.startswith("HOLDERS"))
    assert int(holders.split()[1]) >= 3 and holders.endswith("True"), out
    assert "CALLED True (4, 5)" in out, out
    restored = next(line for line in out.splitlines() if line.startswith("RESTORED"))
    assert restored.endswith("True True True True"), out


def test_patch_checks_versions_and_refuses_a_missing_attribute(monkeypatch):
    from tpkit.integrations import patching

    class Owner:
        def f(self):
            return "original"

    monkeypatch.setitem(patching.TESTED, "tpkit-test-library", ">=1,<2")
    with pytest.warns(RuntimeWarning, match=r"tpkit-test-library unknown.*>=1,<2"):
        done = patching.wrap(
            Owner, "f", lambda f: lambda self: "patched", versions="tpkit-test-library"
        )
    assert done and Owner().f() == "patched"
    assert not patching.patch(Owner, "f", lambda self: "again", versions="tpkit-test-library")
    assert patching.original(Owner, "f")(Owner()) == "original"
    with pytest.raises(RuntimeError, match=r"Owner\.g.*tpkit-test-library"):
        patching.patch(Owner, "g", lambda self: None, versions="tpkit-test-library")
    assert not patching.patch(
        Owner, "g", lambda self: None, versions="tpkit-test-library", required=False
    )
    assert patching.unpatch_all("tpkit-test-library") == 1
    assert Owner().f() == "original" and "g" not in vars(Owner)
