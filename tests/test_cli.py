"""The tpkit command: generate launches its own ranks; export needs no process group."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from tests.models import build
from tests.test_load import check_save_for_export

ROOT = Path(__file__).resolve().parents[1]


def test_generate_launches_itself_and_matches_unsharded(tmp_path):
    model = build("llama")
    model.save_pretrained(tmp_path / "m")
    prompt = [1, 5, 9, 12]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tpkit.cli",
            "generate",
            str(tmp_path / "m"),
            " ".join(map(str, prompt)),
            "--tp",
            "2",
            "--max-new-tokens",
            "6",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    # the token list rank 0 printed (torchrun prefixes every line with its rank)
    lines = [ln[len("[rank0]:") :] for ln in out.splitlines() if re.match(r"\[rank0\]:\[\d", ln)]
    assert len(lines) == 1, out
    tokens = ast.literal_eval(lines[0].strip())
    with torch.no_grad():
        expected = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=6,
            min_new_tokens=6,
            do_sample=False,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    assert tokens == expected
    assert "tokens/s (tp=2)" in out


def test_export_cli_writes_a_plain_checkpoint(ranks2, tmp_path):
    from transformers import AutoModelForCausalLM

    from tpkit.cli.main import main

    ranks2.run(check_save_for_export, "llama", str(tmp_path / "ck"))
    assert main(["export", str(tmp_path / "ck"), str(tmp_path / "hf")]) == 0
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ref = build("llama")
    for (n, p), (n2, p2) in zip(plain.named_parameters(), ref.named_parameters()):
        assert n == n2 and torch.equal(p, p2), n
