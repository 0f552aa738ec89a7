"""What makes `from_pretrained` fast changes no number: shards in huge pages, the meta build's
fills skipped, the files prefetched while the model is split."""

from __future__ import annotations

import torch
import transformers as tf

from tests.models import ATTN, batch, build
from tpkit.io import stream
from tpkit.io.build import SkipMetaFills
from tpkit.io.stream import empty_shard, prefetch


def test_a_huge_page_shard_is_an_ordinary_tensor():
    t = empty_shard((1024, 1024), torch.float32, torch.device("cpu"))  # 4 MiB: the mapped path
    assert t.shape == (1024, 1024) and t.dtype == torch.float32 and t.is_contiguous()
    t.fill_(2.0)
    t[3, 5] = 7.0
    assert float(t.sum()) == 2.0 * 1024 * 1024 + 5.0
    clone = t.clone()
    t.share_memory_()  # what a worker pool or a DataLoader does with CPU tensors
    assert t.is_shared() and torch.equal(t, clone)
    small = empty_shard((3, 4), torch.bfloat16, torch.device("cpu"))
    assert small.shape == (3, 4) and small.dtype == torch.bfloat16


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


def test_prefetch_never_fails(tmp_path):
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"\0" * 4096)
    prefetch([f])
    prefetch([f], budget_bytes=0)  # over the budget: nothing asked
    prefetch([tmp_path / "missing"])  # gone: nothing, no error


# ---- on ranks: the huge-page path for every shard, tp and dp x tp (FSDP2 after the load) --------
def load_in_huge_pages(path: str, tp_size: int) -> dict:
    import torch.distributed as dist

    import tpkit

    if dist.get_rank() == 0:
        build("llama").save_pretrained(path)
    dist.barrier()
    saved, stream.HUGE_MIN_BYTES = stream.HUGE_MIN_BYTES, 1  # every shard mapped
    try:
        model = tpkit.from_pretrained(path, tp_size=tp_size)
    finally:
        stream.HUGE_MIN_BYTES = saved
    ref = build("llama")
    x = batch(ref.config.vocab_size)
    out = model(input_ids=x, labels=x)
    with torch.no_grad():
        diff = (out.logits - ref(input_ids=x).logits).abs().max().item()
    out.loss.backward()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()  # in place on the mapped shards (or FSDP2's own copies)
    after = model(input_ids=x, labels=x).loss.item()
    return {"diff": diff, "loss": out.loss.item(), "after": after}


def test_huge_page_shards_load_and_train(ranks2, tmp_path):
    for r in ranks2.run(load_in_huge_pages, str(tmp_path / "m"), 2):
        assert r["diff"] <= 1e-5 and r["after"] < r["loss"], r


def test_huge_page_shards_under_fsdp(ranks4, tmp_path):
    for r in ranks4.run(load_in_huge_pages, str(tmp_path / "m"), 2):
        assert r["diff"] <= 1e-5 and r["after"] < r["loss"], r
