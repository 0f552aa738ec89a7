"""Configuration: every environment variable tpkit reads is read in `tpkit.config`, at call time,
parsed, and a bad value is one error naming the variable, its value and what is accepted.

The source rules are checked with ``ast`` (single process): no module but config.py reads
os.environ (the code that sets variables for child processes may write them), and the rooms
this issue cleaned keep no module-level mutable state but the caches that must be process-wide.
"""

from __future__ import annotations

import ast
import logging
import sys
from pathlib import Path

import pytest

from tpkit import config
from tpkit.config import ConfigurationError

SRC = Path(__file__).resolve().parents[1] / "src" / "tpkit"

# ---- every variable parsed ------------------------------------------------------------------

# (reader, variable, raw value -> expected); None as the raw value: the variable unset
PARSED = [
    (config.timeout_seconds, "TPKIT_TIMEOUT", None, 300.0),
    (config.timeout_seconds, "TPKIT_TIMEOUT", "", 300.0),
    (config.timeout_seconds, "TPKIT_TIMEOUT", "12.5", 12.5),
    (config.backend, "TPKIT_BACKEND", None, None),
    (config.backend, "TPKIT_BACKEND", "gloo", "gloo"),
    (config.backend, "TPKIT_BACKEND", "cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl"),
    (config.start_method, "TPKIT_START_METHOD", None, None),
    (config.start_method, "TPKIT_START_METHOD", "Fork", "fork"),
    (config.start_method, "TPKIT_START_METHOD", "forkserver", "forkserver"),
    (config.debug, "TPKIT_DEBUG", None, False),
    (config.debug, "TPKIT_DEBUG", "1", True),
    (config.debug, "TPKIT_DEBUG", "0", False),
    (config.debug, "TPKIT_DEBUG", "TRUE", True),
    (config.debug, "TPKIT_DEBUG", "off", False),
    (config.log_all_ranks, "TPKIT_LOG_ALL_RANKS", None, False),
    (config.log_all_ranks, "TPKIT_LOG_ALL_RANKS", "yes", True),
    (config.log_all_ranks, "TPKIT_LOG_ALL_RANKS", "no", False),
    (config.log_level, "TPKIT_LOG_LEVEL", None, logging.INFO),
    (config.log_level, "TPKIT_LOG_LEVEL", "debug", logging.DEBUG),
    (config.log_level, "TPKIT_LOG_LEVEL", "WARNING", logging.WARNING),
    (config.log_level, "TPKIT_LOG_LEVEL", "15", 15),
    (config.shm, "TPKIT_CPU_SHM_ALLREDUCE", None, True),
    (config.shm, "TPKIT_CPU_SHM_ALLREDUCE", "0", False),
    (config.shm, "TPKIT_CPU_SHM_ALLREDUCE", "false", False),
    (config.shm, "TPKIT_CPU_SHM_ALLREDUCE", "1", True),
    (config.rank, "RANK", None, 0),
    (config.rank, "RANK", "3", 3),
    (config.rank_given, "RANK", None, False),
    (config.rank_given, "RANK", "0", True),
    (config.world_size, "WORLD_SIZE", None, 1),
    (config.world_size, "WORLD_SIZE", "8", 8),
    (lambda: config.local_rank(default=5), "LOCAL_RANK", None, 5),
    (lambda: config.local_rank(default=5), "LOCAL_RANK", "1", 1),
    (lambda: config.local_world_size(default=2), "LOCAL_WORLD_SIZE", None, 2),
    (lambda: config.local_world_size(default=2), "LOCAL_WORLD_SIZE", "4", 4),
    (config.restart_count, "TORCHELASTIC_RESTART_COUNT", None, 0),
    (config.restart_count, "TORCHELASTIC_RESTART_COUNT", "2", 2),
    (config.under_torchelastic, "TORCHELASTIC_RESTART_COUNT", "0", True),
    (config.under_torchelastic, "TORCHELASTIC_RUN_ID", "abc", True),
    (config.under_torchelastic, "TORCHELASTIC_RUN_ID", None, False),
    (config.omp_num_threads, "OMP_NUM_THREADS", None, None),
    (config.omp_num_threads, "OMP_NUM_THREADS", "4", 4),
    (config.omp_num_threads, "OMP_NUM_THREADS", "4,2", 4),
    (config.cuda_visible_devices, "CUDA_VISIBLE_DEVICES", None, None),
    (config.cuda_visible_devices, "CUDA_VISIBLE_DEVICES", "", None),
    (config.cuda_visible_devices, "CUDA_VISIBLE_DEVICES", "2, 0", ["2", "0"]),
]

# every variable any reader looks at: cleared before each case, so the shell cannot leak in
_ALL = sorted({name for _, name, _, _ in PARSED} | {"TORCHELASTIC_RUN_ID"})


@pytest.fixture
def clean_env(monkeypatch):
    for name in _ALL:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize(("reader", "name", "raw", "expected"), PARSED)
def test_each_variable_is_parsed(clean_env, reader, name, raw, expected):
    if raw is not None:
        clean_env.setenv(name, raw)
    assert reader() == expected


BAD = [
    (config.timeout_seconds, "TPKIT_TIMEOUT", "5m", "seconds > 0"),
    (config.timeout_seconds, "TPKIT_TIMEOUT", "0", "seconds > 0"),
    (config.timeout_seconds, "TPKIT_TIMEOUT", "-3", "seconds > 0"),
    (config.timeout_seconds, "TPKIT_TIMEOUT", "nan", "seconds > 0"),
    (config.backend, "TPKIT_BACKEND", "glooo", "gloo"),
    (config.backend, "TPKIT_BACKEND", "cpu:", "gloo"),
    (config.start_method, "TPKIT_START_METHOD", "thread", "spawn, fork, forkserver"),
    (config.debug, "TPKIT_DEBUG", "maybe", "0, false"),
    (config.log_all_ranks, "TPKIT_LOG_ALL_RANKS", "2", "1, true"),
    (config.log_level, "TPKIT_LOG_LEVEL", "LOUD", "DEBUG, INFO"),
    (config.shm, "TPKIT_CPU_SHM_ALLREDUCE", "disabled", "0, false"),
    (config.rank, "RANK", "one", "whole number >= 0"),
    (config.rank, "RANK", "-1", "whole number >= 0"),
    (config.world_size, "WORLD_SIZE", "0", "whole number >= 1"),
    (lambda: config.local_rank(default=0), "LOCAL_RANK", "x", "whole number >= 0"),
    (lambda: config.local_world_size(default=1), "LOCAL_WORLD_SIZE", "2.0", ">= 1"),
    (config.restart_count, "TORCHELASTIC_RESTART_COUNT", "x", ">= 0"),
    (config.omp_num_threads, "OMP_NUM_THREADS", "all", "threads >= 1"),
    (config.omp_num_threads, "OMP_NUM_THREADS", "0", "threads >= 1"),
]


@pytest.mark.parametrize(("reader", "name", "raw", "accepted"), BAD)
def test_a_bad_value_names_variable_value_and_what_is_accepted(
    clean_env, reader, name, raw, accepted
):
    clean_env.setenv(name, raw)
    with pytest.raises(ConfigurationError) as info:
        reader()
    message = str(info.value)
    assert f"{name}={raw!r}" in message, message
    assert accepted in message, message
    assert isinstance(info.value, ValueError)  # callers that catch ValueError still do


def test_every_variable_is_read_at_call_time(clean_env):
    """Nothing is cached at import: a change of the environment applies to the next call."""
    clean_env.setenv("TPKIT_TIMEOUT", "7")
    assert config.timeout_seconds() == 7.0
    clean_env.setenv("TPKIT_TIMEOUT", "9")
    assert config.timeout_seconds() == 9.0
    clean_env.setenv("TPKIT_DEBUG", "1")
    from tpkit.guards.debug import debug_enabled

    assert debug_enabled()
    clean_env.setenv("TPKIT_DEBUG", "0")
    assert not debug_enabled()


def test_modules_ask_config_and_share_its_errors(clean_env):
    """The readers that moved here give config's named error where they used to give int()'s
    'invalid literal' (RANK) or took any text for on (TPKIT_LOG_ALL_RANKS='0')."""
    from tpkit.log import all_ranks_enabled
    from tpkit.parallel.mesh import dist_env
    from tpkit.parallel.timeouts import tpkit_timeout

    clean_env.setenv("RANK", "first")
    with pytest.raises(ConfigurationError, match="RANK='first'"):
        dist_env()
    clean_env.setenv("RANK", "1")
    clean_env.setenv("WORLD_SIZE", "2")
    assert dist_env().local_rank == 1  # LOCAL_RANK unset: the rank
    clean_env.setenv("TPKIT_TIMEOUT", "4")
    assert tpkit_timeout() == 4.0
    clean_env.setenv("TPKIT_LOG_ALL_RANKS", "0")
    assert not all_ranks_enabled()


def test_bad_log_all_ranks_never_raises_inside_a_log_call(clean_env):
    """A log call runs the rank filter on every rank but 0 only: a bad TPKIT_LOG_ALL_RANKS
    raising there would fail one rank in the middle of a collective and hang the others. It is
    refused where the logger is configured (import, every rank alike), and read as "every
    rank" by a log call."""
    import subprocess

    from tpkit.log import all_ranks_enabled, get_logger

    clean_env.setenv("RANK", "1")
    clean_env.setenv("WORLD_SIZE", "2")
    clean_env.setenv("TPKIT_LOG_ALL_RANKS", "maybe")
    assert all_ranks_enabled()
    get_logger("tpkit.test").warning("still logged on rank 1")  # raised before the fix
    record = logging.LogRecord("tpkit.test", logging.WARNING, __file__, 1, "m", None, None)
    handlers = logging.getLogger("tpkit").handlers
    assert handlers and all(h.filter(record) for h in handlers)  # let through on rank 1
    assert record.rank_prefix == "[tpkit rank 1/2]"
    run = subprocess.run(
        [sys.executable, "-c", "import tpkit"], capture_output=True, text=True, check=False
    )
    assert run.returncode != 0
    assert "TPKIT_LOG_ALL_RANKS='maybe'" in run.stderr


@pytest.mark.parametrize(("value", "one_line"), [("0", True), ("", True), ("1", False)])
def test_cli_traceback_follows_tpkit_debug(clean_env, capsys, tmp_path, value, one_line):
    """TPKIT_DEBUG=0 is off for the `tpkit` command as for the forward checks (it used to mean
    on there: any non-empty value showed the traceback)."""
    from tpkit.cli.main import main

    (tmp_path / "config.json").write_text("{not json")  # transformers raises an OSError
    clean_env.setenv("TPKIT_DEBUG", value)
    clean_env.setattr(sys, "argv", ["tpkit", "plan", str(tmp_path)])
    if not one_line:
        with pytest.raises((OSError, ValueError)):
            main()
        return
    with pytest.raises(SystemExit) as info:
        main()
    assert info.value.code == 1
    assert "tpkit: error:" in capsys.readouterr().err


def test_launch_reads_its_settings_from_config(clean_env):
    from tpkit.cli import launch

    assert not launch.inside_launched_rank()
    clean_env.setenv("TORCHELASTIC_RUN_ID", "x")
    assert launch.inside_launched_rank()
    clean_env.delenv("TORCHELASTIC_RUN_ID")
    clean_env.setenv("TPKIT_START_METHOD", "threads")
    with pytest.raises(ConfigurationError, match="TPKIT_START_METHOD='threads'"):
        launch.launch(print, nproc=1)  # refused before any process starts


# ---- the excepthook: installed by tpkit, and given back -------------------------------------


def test_timeout_report_hook_is_restorable(monkeypatch):
    from tpkit.parallel.timeouts import install_timeout_report, uninstall_timeout_report

    def mine(exc_type, exc, tb):
        pass

    monkeypatch.setattr(sys, "excepthook", mine)
    install_timeout_report()
    install_timeout_report()  # idempotent: one hook, not two chained
    assert sys.excepthook is not mine
    assert sys.excepthook.previous is mine
    assert uninstall_timeout_report() is True
    assert sys.excepthook is mine
    assert uninstall_timeout_report() is False  # nothing of tpkit's left to remove


def test_timeout_report_hook_passes_other_errors_through(monkeypatch):
    from tpkit.parallel.timeouts import install_timeout_report, uninstall_timeout_report

    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda *a: seen.append(a[0]))
    install_timeout_report()
    try:
        sys.excepthook(KeyError, KeyError("k"), None)
    finally:
        uninstall_timeout_report()
    assert seen == [KeyError]


# ---- the source rules -------------------------------------------------------------------------

# Functions that build the environment of a process tpkit starts: they copy os.environ for the
# child (reading nothing from it themselves).
CHILD_ENV_BUILDERS = {
    ("cli/launch.py", "torchrun_env"),
    ("pool/workers.py", "Pool.start"),
}
# Owned by another engineer during this change; its one read moves to config.shm() next.
PENDING: set[str] = set()

_WRITES = {"pop", "update", "setdefault", "clear", "popitem", "__setitem__", "__delitem__"}


def _functions(tree: ast.Module) -> dict[ast.AST, str]:
    """Each node -> the qualified name of the function it is in ('' at module level)."""
    owner: dict[ast.AST, str] = {}

    def visit(node: ast.AST, name: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = name
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = f"{name}.{child.name}" if name else child.name
            owner[child] = inner
            visit(child, inner)

    visit(tree, "")
    return owner


def _environ_reads(path: Path) -> list[str]:
    """Every use of os.environ / os.getenv in ``path`` that is not a write (``os.environ[k] = v``,
    ``del os.environ[k]``, ``os.environ.pop(...)``...), as 'line: code'."""
    tree = ast.parse(path.read_text(), str(path))
    parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    owner = _functions(tree)
    rel = path.relative_to(SRC).as_posix()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            bad = [a.name for a in node.names if a.name in ("environ", "environb", "getenv")]
            if bad:
                found.append(f"{node.lineno}: from os import {', '.join(bad)}")
            continue
        text = ast.unparse(node) if isinstance(node, ast.Attribute) else ""
        if text not in ("os.environ", "os.environb", "os.getenv"):
            continue
        parent = parents.get(node)
        if isinstance(parent, ast.Subscript) and isinstance(parent.ctx, (ast.Store, ast.Del)):
            continue  # os.environ[k] = v / del os.environ[k]: a write
        if isinstance(parent, ast.Attribute) and parent.attr in _WRITES:
            continue
        if (rel, owner.get(node, "")) in CHILD_ENV_BUILDERS:
            continue
        found.append(f"{node.lineno}: {ast.unparse(parent or node)}")
    return found


def test_only_config_reads_the_environment():
    """`grep os.environ src/tpkit` shows config.py and the code that sets variables for child
    processes: nothing else decides a setting from the environment on its own."""
    offenders = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel == "config.py" or rel in PENDING:
            continue
        reads = _environ_reads(path)
        if reads:
            offenders[rel] = reads
    assert not offenders, (
        f"os.environ read outside tpkit/config.py: {offenders}. Add a typed reader to "
        "config.py (with its row in docs/configuration.md) and call it."
    )


def test_the_environment_rule_sees_reads():
    """The scan itself works: config.py's reads are found, writes and child copies are not."""
    assert len(_environ_reads(SRC / "config.py")) >= 15
    assert _environ_reads(SRC / "cli" / "launch.py") == []
    assert {f for f, _ in CHILD_ENV_BUILDERS} <= {
        p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py")
    }


# module-level mutable objects that stay, and why (the rest of these rooms keeps none)
KEPT_STATE = {
    # the DeviceMesh cache: torch keeps process groups per process and its ProcessGroup objects
    # take no attributes, so the meshes built on them are cached per process too
    ("parallel/mesh.py", "_MESHES"),
    # guards torch's one DTensor dispatcher table while a handler is out of it
    ("training/init.py", "_FALLTHROUGH"),
    # a plan cache that cannot be used (corrupt file, folder not writable) warns once a process
    ("io/plans.py", "_warned"),
    # guards the depth count of nested planning calls, whose outermost one pauses the collector
    ("trace/gc_quiet.py", "_lock"),
}
STATE_ROOMS = (
    "config.py",
    "log.py",
    "parallel/mesh.py",
    "parallel/timeouts.py",
    "parallel/dims.py",
)
STATE_PACKAGES = ("cli/", "guards/debug.py", "io/", "pool/", "training/init.py")
# the analysis keeps none: what one stage learns reaches the next on its `Analysis` value
# (`tpkit.trace.analysis`). The style catalogue (plan/catalogue.py) is no analysis state but the
# registry `register_spec` extends, as extensions.py holds the registered extensions
ANALYSIS_ROOMS = ("trace/", "settle/", "sources/", "plan/")
ANALYSIS_REGISTRY = "plan/catalogue.py"
_MUTABLE_CALLS = {"dict", "list", "set", "defaultdict", "OrderedDict", "deque", "Counter",
                  "WeakKeyDictionary", "WeakValueDictionary", "WeakSet", "RLock", "Lock",
                  "bytearray"}  # fmt: skip


def _module_state(path: Path) -> list[str]:
    found = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        names = [ast.unparse(t) for t in targets]
        if names == ["__all__"]:
            continue
        displays = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
        called = isinstance(value, ast.Call) and (
            ast.unparse(value.func).rpartition(".")[2] in _MUTABLE_CALLS
        )
        if isinstance(value, displays) or called:
            found += names
    return found


def test_no_module_level_mutable_state_beyond_the_kept_caches():
    """Tables are read-only (frozenset, MappingProxyType); flags live on their objects (a mesh's
    random-init mark, the excepthook's previous hook); what remains is listed in KEPT_STATE."""
    extra = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        analysis = rel.startswith(ANALYSIS_ROOMS) and rel != ANALYSIS_REGISTRY
        if rel not in STATE_ROOMS and not rel.startswith(STATE_PACKAGES) and not analysis:
            continue
        extra += [f"{rel}: {n}" for n in _module_state(path) if (rel, n) not in KEPT_STATE]
    assert not extra, f"module-level mutable objects: {extra}"
