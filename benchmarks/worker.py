"""One rank of a benchmark run: ``torchrun ... -m benchmarks.worker SPEC.json``.

Started by `benchmarks.cli`, never by hand. Rank 0 writes ``{suite: rows}`` to ``spec["out"]``.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common import DTYPES, error_text
from benchmarks.suites import all_suites
from benchmarks.systems import LOADERS, Ctx


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group(
            "gloo", timeout=datetime.timedelta(seconds=spec.get("pg_timeout", 300))
        )
    rank = dist.get_rank() if world > 1 else 0
    ctx = Ctx(
        spec=spec,
        tp=world,
        rank=rank,
        dtype=DTYPES[spec["dtype"]],
        dtype_name=spec["dtype"],
        sync=dist.barrier if world > 1 else (lambda: None),
    )
    suites = all_suites()
    path = Path(spec["checkpoint"])
    results: dict[str, list] = {}
    if spec["isolated"]:
        (name,), (system,) = spec["suites"], spec["systems"]
        try:
            results[name] = suites[name].run(ctx, system, path)
        except Exception as e:  # noqa: BLE001 - recorded in the row
            results[name] = [{**ctx.base_row(system), "status": error_text(e)}]
    else:
        systems: dict = {}
        for name in spec["systems"]:
            try:
                systems[name] = LOADERS[name](ctx, path)
            except Exception as e:  # noqa: BLE001 - recorded in the row
                systems[name] = "load failed: " + error_text(e)
        for name in spec["suites"]:
            try:
                results[name] = suites[name].run(ctx, systems)
            except Exception as e:  # noqa: BLE001 - recorded in the row
                results[name] = [
                    {**ctx.base_row(s), "status": "suite failed: " + error_text(e)}
                    for s in spec["systems"]
                ]
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps(results, indent=1, default=str))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
