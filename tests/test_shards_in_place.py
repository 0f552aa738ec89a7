"""A shard that is one contiguous run of its weight stays in the weight's memory when the module
was the weight's only holder (`tpkit.parallel.shard_memory.keep_in_place`): no fresh memory, no
copy, the rest of its pages given back. Whoever else holds the weight (a user's handle, a
state_dict's tensor, a tie) keeps it whole and as it was: the shard is then a copy."""

from __future__ import annotations

import io
import mmap

import torch
from torch import nn

from tpkit.compat import storage_holders
from tpkit.parallel.shard_memory import IN_PLACE_MIN_BYTES, give_back, keep_in_place


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


def test_the_kept_run_is_a_view_with_a_storage_of_its_own_bytes():
    whole = torch.randn(256, 1024)  # 1 MiB
    want = whole[64:128].clone()
    base = whole.data_ptr()
    kept = keep_in_place(whole, 64 * 1024, (64, 1024))
    del whole
    assert kept is not None and torch.equal(kept, want)
    assert kept.data_ptr() == base + 64 * 1024 * 4  # where it was: nothing copied
    assert kept.untyped_storage().nbytes() == kept.nbytes
    buf = io.BytesIO()
    torch.save(kept, buf)  # writes the shard, not the weight around it
    assert kept.nbytes <= len(buf.getvalue()) < kept.nbytes + 4096
    kept.mul_(2)  # an ordinary tensor: written in place, kept alive by its own storage
    assert torch.equal(kept, want * 2)


def test_the_rest_of_the_pages_go_back_to_the_kernel():
    whole = torch.ones(16 << 20)  # 64 MiB, every page touched
    before = rss()
    kept = keep_in_place(whole, 4 << 20, (4 << 20,))  # a quarter kept
    del whole
    assert kept is not None and bool((kept == 1).all())
    assert before - rss() > 40 << 20  # about 48 MiB given back


def test_what_cannot_stay_in_place_says_so():
    big = torch.randn(256, 1024)
    assert keep_in_place(big.t(), 0, (512, 256)) is None  # not contiguous
    small = torch.randn(IN_PLACE_MIN_BYTES // 8)
    assert keep_in_place(small, 0, (small.numel(),)) is None
    assert keep_in_place(torch.empty(256, 1024, device="meta"), 0, (8, 1024)) is None
    assert keep_in_place(big, 255 * 1024, (2, 1024)) is None  # past the end
    assert keep_in_place(big, 0, (0, 1024)) is None


def test_storage_holders_counts_tensors_on_the_memory(monkeypatch):
    t = torch.empty(8)
    assert storage_holders(t) == 1
    view = t[2:]
    assert storage_holders(t) == 2
    del view
    assert storage_holders(t) == 1
    monkeypatch.delattr(torch._C, "_storage_Use_Count")  # a torch without the count
    assert storage_holders(t) > 1  # never taken as held alone


# ---- on ranks: which shards stay where they were, and nothing anyone else holds changes ------
class Four(nn.Module):
    """Four 256 x 512 layers (512 KiB weights): a column split stays in place, a row split is
    copied; the third is held by a user's handle, the fourth by a state_dict's tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(512, 256), nn.Linear(256, 512)
        self.c, self.d = nn.Linear(512, 256), nn.Linear(256, 512)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(self.c(self.b(self.a(x)).relu()).relu())


PLAN = {"a": "colwise", "b": "rowwise", "c": "colwise", "d": "rowwise"}


def split_in_place() -> dict:
    import torch.distributed as dist

    import tpkit

    torch.manual_seed(0)
    ref, model = Four(), Four()
    model.load_state_dict(ref.state_dict())
    where = {n: (p.data_ptr(), p.data_ptr() + p.nbytes) for n, p in model.named_parameters()}
    handle = model.c.weight  # a user's handle on a weight: kept whole, unchanged
    held = model.state_dict()["d.weight"]  # a state_dict's tensor on another
    handle_was, held_was = handle.detach().clone(), held.clone()
    x = torch.randn(3, 512)
    model = tpkit.tensor_parallel(model, plan=PLAN)
    inside = {}
    for n, p in model.named_parameters():
        local = p.to_local()
        lo, hi = where[n]
        inside[n] = lo <= local.data_ptr() < hi
        assert local.untyped_storage().nbytes() == local.nbytes or not inside[n], n
    out = model(x)
    diff = (out - ref(x)).abs().max().item()
    out.square().sum().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()  # writes the kept shards in place
    after = model(x)
    dist.barrier()
    return {
        "inside": inside,
        "diff": diff,
        "moved": (after - out).abs().max().item(),
        "handle": torch.equal(handle.detach(), handle_was),
        "held": torch.equal(held, held_was),
    }


def test_a_weight_held_only_by_its_module_keeps_its_shard_in_place(ranks2):
    for r in ranks2.run(split_in_place):
        assert r["diff"] <= 1e-5 and r["moved"] > 0, r
        assert r["handle"] and r["held"], r  # what others hold is as it was
        inside = r["inside"]
        assert inside["a.weight"] and inside["a.bias"] is False, r  # bias: 1 KiB, copied
        assert not inside["b.weight"], r  # a row split is strided: copied
        assert not inside["c.weight"] and not inside["d.weight"], r  # held elsewhere: copied


def test_give_back_returns_the_pages_of_a_weight_copied_out():
    whole = torch.ones(16 << 20)  # 64 MiB, every page touched
    before = rss()
    give_back(whole)
    assert before - rss() > 60 << 20
    assert float(whole[1 << 20]) == 0.0  # anonymous memory given back reads as zeros


def split_a_loaded_checkpoint(path: str) -> dict:
    """A model transformers loaded is a view of its checkpoint, mapped copy-on-write: shards kept
    in place stay in that mapping, a training step writes them, and the file is as it was."""
    import hashlib
    import os

    import torch.distributed as dist
    import transformers as tf

    import tpkit
    from tests.models import batch, build

    ref = build("llama")
    if dist.get_rank() == 0:
        ref.save_pretrained(path)
    dist.barrier()
    file = os.path.join(path, "model.safetensors")
    with open(file, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    from tpkit.parallel import shard_memory

    saved, shard_memory.IN_PLACE_MIN_BYTES = shard_memory.IN_PLACE_MIN_BYTES, 1  # tiny weights
    try:
        model = tpkit.tensor_parallel(tf.AutoModelForCausalLM.from_pretrained(path))
    finally:
        shard_memory.IN_PLACE_MIN_BYTES = saved
    with open("/proc/self/maps") as f:
        spans = [
            tuple(int(v, 16) for v in line.split()[0].split("-"))
            for line in f
            if line.rstrip().endswith(file)
        ]
    mapped = sum(
        any(lo <= p.to_local().data_ptr() < hi for lo, hi in spans) for p in model.parameters()
    )
    x = batch(ref.config.vocab_size)
    out = model(input_ids=x, labels=x)
    with torch.no_grad():
        diff = (out.logits - ref(input_ids=x).logits).abs().max().item()
    out.loss.backward()
    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    after = model(input_ids=x, labels=x).loss.item()
    dist.barrier()
    with open(file, "rb") as f:
        same = hashlib.sha256(f.read()).hexdigest() == digest
    return {"diff": diff, "mapped": mapped, "loss": out.loss.item(), "after": after, "same": same}


def test_shards_kept_in_a_loaded_checkpoint_train_and_leave_the_file_alone(ranks2, tmp_path):
    for r in ranks2.run(split_a_loaded_checkpoint, str(tmp_path / "m")):
        assert r["diff"] <= 1e-5 and r["after"] < r["loss"], r
        assert r["mapped"] > 0 and r["same"], r
