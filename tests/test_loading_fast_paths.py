"""What makes `from_pretrained` fast changes no number: runs of the file mapped copy-on-write,
shards in their own populated (or huge-page) mappings, the meta build's fills skipped, the files prefetched while the model is
split."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch
import transformers as tf
from safetensors.torch import save_file

from tests.models import ATTN, batch, build
from tpkit.io.build import SkipMetaFills
from tpkit.io.safetensors import CheckpointIndex
from tpkit.io.stream import prefetch
from tpkit.parallel import shard_memory
from tpkit.parallel.shard_memory import empty_shard


@pytest.mark.parametrize("huge", ["0", "1"])
def test_a_mapped_shard_is_an_ordinary_tensor(monkeypatch, huge):
    monkeypatch.setenv("TPKIT_HUGE_PAGES", huge)  # populated ordinary pages, or huge pages
    t = empty_shard((1024, 1024), torch.float32, torch.device("cpu"))  # 4 MiB: the mapped path
    assert t.shape == (1024, 1024) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.untyped_storage().nbytes() == 4 << 20  # its own mapping, not the allocator's
    t.fill_(2.0)
    t[3, 5] = 7.0
    assert float(t.sum()) == 2.0 * 1024 * 1024 + 5.0
    clone = t.clone()
    t.share_memory_()  # what a worker pool or a DataLoader does with CPU tensors
    assert t.is_shared() and torch.equal(t, clone)
    small = empty_shard((3, 4), torch.bfloat16, torch.device("cpu"))
    assert small.shape == (3, 4) and small.dtype == torch.bfloat16


def test_a_run_of_the_file_is_mapped_copy_on_write(tmp_path):
    f = tmp_path / "w.safetensors"
    w = torch.arange(24, dtype=torch.float32).view(6, 4)
    save_file({"a": torch.ones(3, dtype=torch.bfloat16), "w": w, "s": torch.tensor(2.0)}, f)
    digest = hashlib.sha256(f.read_bytes()).hexdigest()
    index = CheckpointIndex(f)
    whole, rows = index.mapped("w"), CheckpointIndex(f).mapped("w", 0, [(2, 5)])
    assert torch.equal(whole, w) and torch.equal(rows, w[2:5]) and index.mapped("s").item() == 2.0
    assert whole.untyped_storage().nbytes() == os.path.getsize(f)  # a view of the file, not read
    assert index.mapped("w") is None  # viewed once already: a second parameter gets its own copy
    fresh = CheckpointIndex(f)
    assert fresh.mapped("w", 1, [(0, 2)]) is None  # strided: read, never the whole tensor mapped
    assert fresh.mapped("w", 0, [(0, 1), (3, 4)]) is None  # two runs: read
    rows.mul_(10)  # written: its pages are copied, the file and other mappings keep their bytes
    assert torch.equal(rows, w[2:5] * 10) and torch.equal(whole, w)
    assert hashlib.sha256(f.read_bytes()).hexdigest() == digest
    tmp = tmp_path / "new.safetensors"  # an atomic save over it: a new inode, the view unchanged
    save_file({"a": torch.zeros(3, dtype=torch.bfloat16), "w": -w, "s": torch.tensor(0.0)}, tmp)
    os.replace(tmp, f)
    assert torch.equal(whole[:2], w[:2]) and torch.equal(CheckpointIndex(f).read("w"), -w)


def test_the_meta_build_skips_only_what_writes_nothing():
    from accelerate import init_empty_weights

    config = tf.LlamaConfig(**ATTN)
    with init_empty_weights(include_buffers=False):
        plain = tf.LlamaForCausalLM(config)
    with init_empty_weights(include_buffers=False), SkipMetaFills():
        fast = tf.LlamaForCausalLM(config)
    assert all(p.is_meta for p in fast.parameters())
    buffers = dict(plain.named_buffers())
    for name, b in fast.named_buffers():
        assert not b.is_meta and torch.equal(b, buffers[name]), name
    real = torch.zeros(3)
    with SkipMetaFills():
        real.normal_()  # a real tensor is filled as always
        meta = torch.empty(3, device="meta").normal_()
    assert float(real.abs().sum()) > 0 and meta.is_meta


def test_init_functions_given_the_tensor_by_keyword_skip_meta_too(monkeypatch):
    """transformers' ``_init_weights`` calls ``torch.nn.init.normal_`` and friends, which reach
    a mode with the tensor as ``tensor=``: on meta each ran torch's Python ``normal_`` (0.08 s
    of a 57M Llama's build), on a real tensor it must still fill."""
    calls = []
    fill = torch.Tensor.normal_

    def counted(self, *args, **kwargs):
        calls.append(self.device.type)
        return fill(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "normal_", counted)
    meta, real = torch.empty(4, 4, device="meta"), torch.zeros(4, 4)
    with SkipMetaFills():
        for init in (torch.nn.init.normal_, torch.nn.init.kaiming_uniform_):
            assert init(meta) is meta
        torch.nn.init.zeros_(meta)
        torch.nn.init.normal_(real)
    assert calls == ["cpu"] and float(real.abs().sum()) > 0


def test_prefetch_never_fails(tmp_path):
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"\0" * 4096)
    prefetch([f])
    prefetch([f], budget_bytes=0)  # over the budget: nothing asked
    prefetch([tmp_path / "missing"])  # gone: nothing, no error


# ---- on ranks: the mapped path for every shard, tp and dp x tp (FSDP2 after the load) ----------
def load_in_mapped_shards(path: str, tp_size: int, huge: str) -> dict:
    import torch.distributed as dist

    import tpkit

    if dist.get_rank() == 0:
        build("llama").save_pretrained(path)
    dist.barrier()
    file = os.path.join(path, "model.safetensors")
    digest = hashlib.sha256(Path(file).read_bytes()).hexdigest()
    saved = shard_memory.MAPPED_MIN_BYTES, os.environ.get("TPKIT_HUGE_PAGES")
    shard_memory.MAPPED_MIN_BYTES = 1  # every shard read into its own mapping
    os.environ["TPKIT_HUGE_PAGES"] = huge
    try:
        model = tpkit.from_pretrained(path, tp_size=tp_size)
    finally:
        shard_memory.MAPPED_MIN_BYTES = saved[0]
        if saved[1] is None:
            del os.environ["TPKIT_HUGE_PAGES"]
        else:
            os.environ["TPKIT_HUGE_PAGES"] = saved[1]
    size = os.path.getsize(file)
    local = [getattr(p, "_local_tensor", p) for p in model.parameters()]
    mapped = sum(t.untyped_storage().nbytes() == size for t in local)
    ref = build("llama")
    x = batch(ref.config.vocab_size)
    out = model(input_ids=x, labels=x)
    with torch.no_grad():
        diff = (out.logits - ref(input_ids=x).logits).abs().max().item()
    out.loss.backward()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()  # in place on the mapped shards (or FSDP2's own copies)
    after = model(input_ids=x, labels=x).loss.item()
    dist.barrier()
    same = hashlib.sha256(Path(file).read_bytes()).hexdigest() == digest
    return {"diff": diff, "loss": out.loss.item(), "after": after, "mapped": mapped, "same": same}


@pytest.mark.parametrize("huge", ["0", "1"])
def test_mapped_shards_load_and_train(ranks2, tmp_path, huge):
    for r in ranks2.run(load_in_mapped_shards, str(tmp_path / "m"), 2, huge):
        assert r["diff"] <= 1e-5 and r["after"] < r["loss"], r
        # column-split weights, vocabulary-split embeddings and norms are views of the file;
        # the step wrote to them and the file is as it was (copy-on-write)
        assert r["mapped"] > 0 and r["same"], r


def test_huge_page_shards_under_fsdp(ranks4, tmp_path):
    for r in ranks4.run(load_in_mapped_shards, str(tmp_path / "m"), 2, "1"):
        assert r["diff"] <= 1e-5 and r["after"] < r["loss"], r
