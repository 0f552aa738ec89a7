"""Reading one rank's slice of a safetensors tensor straight into its shard (`tpkit.io.safetensors`).

Behaviour: every slice kind (whole, dim-0 runs, strided dims, packed parts, scalars) equals the
slice of the tensor, in the stored dtype or converted, into a fresh tensor or a given ``out``, with
blocks smaller than a row; and reading a shard costs about the shard in RSS (a loose bound).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

import tpkit.io.safetensors as sio
from tpkit.io.safetensors import CheckpointIndex


@pytest.fixture
def ckpt(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "w": torch.randn(12, 10, generator=g),
        "b16": torch.randn(6, 4, 5, generator=g).to(torch.bfloat16),
        "v": torch.randn(9, generator=g),
        "s": torch.tensor(3.5),
        "i": torch.arange(8, dtype=torch.int64),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return CheckpointIndex(tmp_path), tensors


CASES = [
    ("w", 0, None),
    ("w", 0, [(3, 7)]),
    ("w", 0, [(0, 2), (6, 8)]),  # packed parts: one run per part
    ("w", 1, [(5, 10)]),
    ("w", 1, [(0, 2), (5, 7)]),
    ("b16", 1, [(1, 3)]),
    ("b16", 2, [(0, 2), (3, 5)]),
    ("v", 0, [(4, 9)]),
    ("i", 0, [(2, 5)]),
]


def _expected(t, dim, ranges):
    if ranges is None:
        return t
    return torch.cat([t.narrow(dim, a, b - a) for a, b in ranges], dim)


@pytest.mark.parametrize("block", [sio.BLOCK_BYTES, 16, 1])
@pytest.mark.parametrize("key, dim, ranges", CASES)
def test_slices_equal_the_tensors_slice(ckpt, monkeypatch, block, key, dim, ranges):
    monkeypatch.setattr(sio, "BLOCK_BYTES", block)  # 16 / 1 bytes: blocks shorter than a row
    index, tensors = ckpt
    want = _expected(tensors[key], dim, ranges)
    got = index.read(key, dim, ranges)
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert index.local_shape(key, dim, ranges) == tuple(want.shape)
    if want.is_floating_point():
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            out = torch.full(want.shape, float("nan"), dtype=dtype)
            assert index.read(key, dim, ranges, out=out) is out
            assert torch.equal(out, want.to(dtype)), (dtype, out, want)
            assert torch.equal(index.read(key, dim, ranges, dtype=dtype), want.to(dtype))


def test_scalars_and_non_contiguous_out(ckpt):
    index, tensors = ckpt
    assert torch.equal(index.read("s"), tensors["s"])
    out = torch.empty(10, 12).t()  # not contiguous: read through one copy
    assert torch.equal(index.read("w", out=out), tensors["w"])
    with pytest.raises(ValueError, match="shape"):
        index.read("w", 0, [(0, 3)], out=torch.empty(4, 10))


def test_the_read_buffer_stays_within_a_block(ckpt, monkeypatch):
    monkeypatch.setattr(sio, "BLOCK_BYTES", 64)
    index, _ = ckpt
    for key, dim, ranges in CASES:
        index.read(key, dim, ranges, dtype=torch.float16 if key != "i" else None)
    assert index._scratch.numel() <= 64


RSS_SCRIPT = """
import os, sys, torch
from safetensors.torch import save_file
sys.path.insert(0, {src!r})
from tpkit.io.safetensors import CheckpointIndex
path = {path!r}
save_file({{"w": torch.randn(4096, 4096)}}, path)  # 64 MiB
def rss():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) * 1024
index = CheckpointIndex(path)
open("/proc/self/clear_refs", "w").write("5")
base = rss()
shards = [index.read("w", 1, [(0, 2048)]), index.read("w", 0, [(0, 2048)], dtype=torch.bfloat16)]
peak = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) * 1024
print((peak - base) / 2**20)
"""


def test_reading_a_shard_costs_about_the_shard(tmp_path):
    """Two shards (32 MiB fp32 strided, 16 MiB bf16 converted): the peak stays near their 48 MiB,
    not the tensor's 64 MiB again (loose: the bound is 48 + 24 MiB)."""
    code = RSS_SCRIPT.format(
        src=str(sio.__file__).rsplit("/tpkit/", 1)[0], path=str(tmp_path / "a")
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.split()[-1]) <= 48 + 24, out.stdout
