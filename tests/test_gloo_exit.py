"""A finished gloo job exits 0 (`tpkit.parallel.gloo_exit`): the race of torch's bug, made certain.

The script below stages what a loaded machine does by chance: the main thread keeps the GIL from
a collective's start (``sys.setswitchinterval``) to exit, so the gloo worker that finished the
collective waits for the GIL to release the work's tensors; an object freed during finalization
then gives the GIL up. Unfenced, the worker takes it during finalization and the process aborts
("terminate called without an active exception"); fenced, the worker is done before exit.
One process, a one-rank gloo group: no torchrun, a few seconds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import tpkit
from tpkit.parallel.gloo_exit import settle_gloo_workers

SCRIPT = textwrap.dedent(
    """
    import sys
    import time

    import torch
    import torch.distributed as dist

    if sys.argv[1] == "fenced":
        from tpkit.parallel.gloo_exit import install_exit_fence

        install_exit_fence()


    class GivesUpTheGil:
        # freed as finalization clears __main__: a thread waiting for the GIL takes it now
        def __del__(self):
            time.sleep(0.2)


    dist.init_process_group("gloo", store=dist.FileStore(sys.argv[2], 1), rank=0, world_size=1)
    numel = 1 << 25  # 128 MiB: the worker copies for tens of ms, long after `del work`
    out = [torch.zeros(numel)]
    sys.setswitchinterval(3600)  # from here the main thread gives up the GIL only by itself
    work = dist.all_gather(out, torch.ones(numel), async_op=True)
    del work  # the worker holds the last reference: releasing it takes the GIL
    end = time.perf_counter() + 1.0
    while time.perf_counter() < end:  # the worker finishes the collective, then waits
        pass
    late = GivesUpTheGil()
    """
)


def _run(mode: str, tmp_path: Path) -> subprocess.CompletedProcess:
    src = str(Path(tpkit.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    script = tmp_path / "exit_race.py"
    script.write_text(SCRIPT)
    store = tmp_path / f"store-{mode}"
    return subprocess.run(
        [sys.executable, str(script), mode, str(store)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_fenced_gloo_job_exits_zero(tmp_path):
    done = _run("fenced", tmp_path)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "terminate called" not in done.stderr


def test_unfenced_gloo_job_aborts_at_exit_on_this_torch(tmp_path):
    """The control: without the fence the same script dies of SIGABRT. If this fails, torch (or
    CPython: 3.14 hangs such a thread instead of ending it) no longer has the bug, and
    `tpkit.parallel.gloo_exit` can go."""
    done = _run("unfenced", tmp_path)
    assert done.returncode == -6, (done.returncode, done.stderr[-2000:])
    assert "terminate called without an active exception" in done.stderr


def test_settling_without_gloo_workers_returns_at_once():
    start = time.monotonic()
    assert settle_gloo_workers(timeout_s=5.0)
    assert time.monotonic() - start < 1.0
