"""A live tensor-parallel model in a process that is not a rank (`tpkit.pool`): from a plain
``python`` script and from a real Jupyter kernel (nbclient), against the unsharded model.

Each test runs its own interpreter, as a user would: nothing of pytest's process (its rank
groups, its imports) is shared with the pool. A small module of helpers sits next to the script
or notebook, which is how functions reach the workers (``model.run``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

HELPERS = '''
import os
import time

import torch
import transformers as tf


def tiny(path):
    """A tiny Llama, saved (the weights every check starts from)."""
    config = tf.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=101, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    tf.LlamaForCausalLM(config).save_pretrained(path)
    return tf.LlamaForCausalLM.from_pretrained(path).eval()


def train_step(model, opt, x, grads):
    """One AdamW step (the same calls on a handle or a plain model): the loss before and after
    it, and the gradients ``grads(model)`` reads before the step."""
    model.train()
    out = model(input_ids=x, labels=x)
    out.loss.backward()
    seen = grads(model)
    opt.step()
    opt.zero_grad()
    first = out.loss.item()
    with torch.no_grad():
        after = model(input_ids=x, labels=x).loss.item()
    model.eval()
    return first, after, seen


def whole(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def full_grads(model):
    """Every parameter's whole gradient (run on every worker: full_tensor is a collective)."""
    return {n: whole(p.grad) for n, p in model.named_parameters()}


def full_state(model):
    return {n: whole(p.detach()) for n, p in model.named_parameters()}


def dict_diff(a, b):
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def max_diff(a, b):
    return dict_diff(a.state_dict(), b.state_dict())


def who(model, k):
    import torch.distributed as dist

    return {"rank": dist.get_rank(), "k": k, "local": model.lm_head.weight.to_local().shape[0]}


def boom(model):
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    return "rank 0 was fine"


def die(model):
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(3)
    time.sleep(30)


def nap(model):
    time.sleep(60)


def children():
    """Live child processes of this one (zombies count: nobody reaped them)."""
    me, kids = os.getpid(), []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if pid.isdigit() and int(fields[1]) == me:
            kids.append(int(pid))
    return kids
'''

SCRIPT = """
import copy, json, os, signal, threading, time

import torch
import transformers as tf

import tpkit
from nbhelpers import boom, children, dict_diff, die, full_grads, full_state, nap, tiny, train_step, who

# Ctrl-C raises KeyboardInterrupt, as in a terminal or a notebook, whatever the test runner's
# process left behind (a SIGINT ignored there is ignored in its children, and Python then never
# installs its own handler)
signal.signal(signal.SIGINT, signal.default_int_handler)
r = {}
ref = tiny("tiny")
model = tpkit.tensor_parallel(tf.LlamaForCausalLM.from_pretrained("tiny").eval(), ["cpu", "cpu"])
r["type"] = type(model).__name__
r["pids"] = model.pids
r["config"] = type(model.config).__name__
r["device"] = str(model.device)
r["repr"] = "ColwiseStyle" in repr(model) or "colwise" in repr(model).lower()
r["explain"] = "tp_size=2" in tpkit.explain(model)

x = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    want = ref(input_ids=x).logits
r["logits"] = (model(input_ids=x).logits - want).abs().max().item()
r["generate"] = torch.equal(
    model.generate(x, max_new_tokens=6, do_sample=False),
    ref.generate(x, max_new_tokens=6, do_sample=False),
)

trained = copy.deepcopy(ref)
*mine, grads = train_step(
    model, tpkit.optim(model, torch.optim.AdamW, lr=1e-2), x, lambda m: m.run(full_grads)
)
*theirs, ref_grads = train_step(
    trained, torch.optim.AdamW(trained.parameters(), lr=1e-2), x, full_grads
)
r["loss"] = [mine, theirs]
r["grads"] = dict_diff(grads, ref_grads)

model.save_pretrained("saved")
saved = dict(tf.LlamaForCausalLM.from_pretrained("saved").named_parameters())
r["saved"] = dict_diff(saved, model.run(full_state))
r["trained"] = dict_diff(saved, full_state(trained))

r["run"] = model.run(who, 7)
try:
    model.run(boom)
except ValueError as e:
    r["boom"] = str(e) + " | " + " ".join(getattr(e, "__notes__", []))
r["after_boom"] = (model(input_ids=x).logits - trained(input_ids=x).logits).abs().max().item()

pids = model.pids
pressed = threading.Event()


def ctrl_c():  # pressed again later if the first landed where Python drops it (a finalizer)
    for delay in (3, 20, 20):
        if pressed.wait(delay):
            return
        os.kill(os.getpid(), signal.SIGINT)


threading.Thread(target=ctrl_c, daemon=True).start()
try:
    model.run(nap)
except KeyboardInterrupt:
    pressed.set()
    r["interrupted"] = True
r["gone_after_interrupt"] = not any(p in children() for p in pids)
try:
    model(input_ids=x)
except tpkit.PoolError as e:
    r["stopped"] = str(e)

model.restart()
r["restarted"] = (model(input_ids=x).logits - want).abs().max().item()

try:
    model.run(die)
except tpkit.PoolError as e:
    r["died"] = str(e)

model.close()
r["children"] = children()
print("RESULT " + json.dumps(r))
"""


def _run_script(folder: Path, timeout: float = 600) -> dict:
    (folder / "nbhelpers.py").write_text(HELPERS)
    (folder / "script.py").write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(folder)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)
    proc = subprocess.run(
        [sys.executable, "script.py"],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


def test_live_model_from_a_plain_python_script(tmp_path):
    r = _run_script(tmp_path)
    assert r["type"] == "ModelHandle" and len(r["pids"]) == 2, r
    assert r["config"] == "LlamaConfig" and r["device"] == "cpu"
    assert r["repr"] and r["explain"]
    assert r["logits"] <= 1e-5, r["logits"]
    assert r["generate"]
    (mine_first, mine_after), (ref_first, ref_after) = r["loss"]
    assert abs(mine_first - ref_first) <= 1e-5 and abs(mine_after - ref_after) <= 1e-5, r["loss"]
    assert mine_after < mine_first  # the step happened
    assert r["grads"] <= 1e-5, r["grads"]
    assert r["saved"] == 0.0, r["saved"]  # the checkpoint is the workers' weights, exactly
    # Adam's first step moves each weight by about lr * sign(grad): float noise in a gradient
    # near zero moves its weight by up to lr, so the weights get 10x the gradients' tolerance
    assert r["trained"] <= 1e-4, r["trained"]
    assert r["run"] == {"rank": 0, "k": 7, "local": 51}, r["run"]  # 101 rows: rank 0 has 51
    assert "boom on rank 1" in r["boom"] and "rank 1" in r["boom"].split("|")[1], r["boom"]
    assert r["after_boom"] <= 1e-5  # an error every worker answered leaves the pool usable
    assert r["interrupted"] and r["gone_after_interrupt"]
    assert "interrupted" in r["stopped"] and "restart()" in r["stopped"], r["stopped"]
    assert r["restarted"] <= 1e-5
    assert "rank 1 exited with code 3" in r["died"], r["died"]
    assert r["children"] == [], r["children"]


# tpkit.from_pretrained here, tensor_parallel in the script: both entry points start a pool
NOTEBOOK = [
    "import torch, transformers as tf\nimport tpkit\n"
    "from nbhelpers import children, dict_diff, full_state, tiny",
    "ref = tiny('tiny')\nmodel = tpkit.from_pretrained('tiny', tp_size=2)\nmodel",
    "x = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(1))\n"
    "tokens = model.generate(x, max_new_tokens=5, do_sample=False)\n"
    "assert torch.equal(tokens, ref.generate(x, max_new_tokens=5, do_sample=False))",
    "opt = model.optimizer(torch.optim.AdamW, lr=1e-2)\nmodel.train()\n"
    "out = model(input_ids=x, labels=x)\nout.loss.backward()",
    "opt.step()\nopt.zero_grad()\nmodel.save_pretrained('saved')",
    "ref.train()\nref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)\n"
    "ref_loss = ref(input_ids=x, labels=x).loss\nref_loss.backward()\nref_opt.step()\n"
    "assert abs(ref_loss.item() - out.loss.item()) <= 1e-5\n"
    "saved = dict(tf.LlamaForCausalLM.from_pretrained('saved').named_parameters())\n"
    "exact = dict_diff(saved, model.run(full_state))\n"
    "diff = dict_diff(saved, full_state(ref))  # Adam: see the script test\n"
    "assert exact == 0 and diff <= 1e-4, (exact, diff)\nprint('DIFF', exact, diff)",
    "pids = model.pids\nmodel.close()\nassert not set(pids) & set(children())\nprint('CLOSED')",
]


def test_live_model_in_a_jupyter_kernel(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    (tmp_path / "nbhelpers.py").write_text(HELPERS)
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(textwrap.dedent(c)) for c in NOTEBOOK]
    client = nbclient.NotebookClient(
        nb,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT)])
    client.execute(env=env)
    shown = "".join(
        o.get("data", {}).get("text/plain", "") + o.get("text", "") for o in nb.cells[1].outputs
    )
    assert "tpkit ModelHandle: split over 2 worker processes" in shown, shown
    assert "DIFF 0.0" in "".join(o.get("text", "") for o in nb.cells[5].outputs)
    assert "CLOSED" in "".join(o.get("text", "") for o in nb.cells[6].outputs)
