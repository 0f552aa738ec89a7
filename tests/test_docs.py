"""The manual held to the tree: docs/architecture.md names every module and states import rules
that hold, the flow it draws is the order parallelize.py calls, every environment variable the
code reads has its row in docs/configuration.md, and every relative link in README.md and docs/
points at a file. Single process, no torch import: a page that drifts fails here, not in review.
"""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "tpkit"
DOCS = ROOT / "docs"
ARCH = DOCS / "architecture.md"

# rooms outside the core: the core never imports them (the package __init__ wires them in)
OUTER = ("tpkit.integrations", "tpkit.cli")
# the analysis: pure, in the order of its table in architecture.md
ANALYSIS = ("plan", "trace", "settle", "sources")
# the subpackages (a room each)
ROOMS = (*ANALYSIS, "styles", "quant", "integrations", "cli", "parallel", "training", "guards",
         "io", "pool")  # fmt: skip
# what the analysis may import beyond the standard library (yaml: Plan.from_yaml parses plans)
PLAN_THIRD_PARTY = {"torch", "yaml"}
# the parallel runtime (the floor under every parallelism) and the parallelisms themselves
RUNTIME = ("dims", "mesh", "timeouts", "gloo_exit", "comm", "shm", "shard_memory", "expert.comm")
# the layers, lowest first: an import goes to a lower layer, or sideways inside one room
LAYERS = (
    ("floor", ("tpkit.compat", "tpkit.config", "tpkit.log")),
    ("runtime", tuple(f"tpkit.parallel.{m}" for m in RUNTIME)),
    ("analysis", (*(f"tpkit.{r}" for r in ANALYSIS), "tpkit.extensions")),
    ("styles", ("tpkit.styles", "tpkit.state")),
    ("rooms", ("tpkit.training", "tpkit.guards", "tpkit.io")),
    ("parallelisms", ("tpkit.quant", "tpkit.parallel")),
    ("split", ("tpkit.parallelize",)),
    ("loader", ("tpkit.pretrained",)),
    ("pool", ("tpkit.pool",)),
    ("outer", OUTER),
    ("face", ("tpkit",)),
)


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


class _Import:
    """One imported thing: the tpkit module it comes from, the name taken (None for a whole
    module), the top-level package for a third-party import, and its line."""

    def __init__(self, module: str, name: str | None, line: int) -> None:
        self.module, self.name, self.line = module, name, line

    @property
    def top(self) -> str:
        return self.module.split(".")[0]


def _imports(path: Path, known: set[str]) -> list[_Import]:
    """Every import in ``path`` (lazy ones inside functions too), relative ones resolved;
    ``from tpkit import atomic`` is the module ``tpkit.atomic``, not a name of ``tpkit``."""
    name = _module_name(path)
    package = name if _is_package(path) else name.rpartition(".")[0]
    found: list[_Import] = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            found += [_Import(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([module] if module else []))
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                if sub in known:
                    found.append(_Import(sub, None, node.lineno))
                else:
                    found.append(_Import(module, alias.name, node.lineno))
    return found


def _room(module: str) -> str:
    """The subpackage a module lives in (plan, styles, parallel, ...), package, or core."""
    if module == "tpkit":
        return "package"
    parts = module.split(".")
    if len(parts) > 2 or parts[1] in ROOMS:
        return parts[1]
    return "core"


def _layer(module: str) -> tuple[int, str]:
    """(layer index, the layer's prefix that holds ``module``): the most specific prefix."""
    best = (-1, "", "")
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if _under(module, prefix) and len(prefix) > len(best[2]):
                best = (i, prefix, prefix)
    return best[0], best[1]


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _violations(rule) -> list[str]:
    modules = _modules()
    known = set(modules)
    out = []
    for name, path in modules.items():
        for imp in _imports(path, known):
            problem = rule(name, imp)
            if problem:
                out.append(f"{path.relative_to(ROOT)}:{imp.line}: {problem}")
    return out


def _section(text: str, heading: str) -> str:
    """The body of the ``## heading`` section (up to the next ``## ``)."""
    match = re.search(rf"^## {re.escape(heading)}\b.*?$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"docs/architecture.md has no '## {heading}' section"
    return match.group(1)


# --- every module is named ---------------------------------------------------------------


def test_architecture_names_every_module():
    """Each module, as its path under src/tpkit in backticks (`apply.py`, `plan/derive.py`)."""
    text = ARCH.read_text()
    missing = [
        str(p.relative_to(SRC))
        for p in sorted(SRC.rglob("*.py"))
        if not _is_package(p) and f"`{p.relative_to(SRC).as_posix()}`" not in text
    ]
    assert not missing, (
        f"docs/architecture.md does not name {missing}: add each to the Rooms tables, as its "
        "path under src/tpkit in backticks, with one line on its concern."
    )


def test_architecture_tables_have_one_line_cells():
    """A cell says one thing; the module's docstring says the rest."""
    long = [
        cell.strip()[:60]
        for line in ARCH.read_text().splitlines()
        if line.startswith("|")
        for cell in line.strip("|").split("|")
        if len(cell.strip()) > 120
    ]
    assert not long, f"docs/architecture.md has table cells over 120 characters: {long}"


def test_architecture_names_no_module_that_is_gone():
    rooms = _section(ARCH.read_text(), "Rooms")
    named = set(re.findall(r"`((?:[a-z_]+/)?[a-z_]+\.py)`", rooms))
    gone = sorted(n for n in named if not (SRC / n).is_file())
    assert not gone, f"docs/architecture.md's Rooms name modules that do not exist: {gone}"


# --- the import rules it states ------------------------------------------------------------


def test_analysis_imports_no_core_module():
    def rule(name: str, imp: _Import) -> str | None:
        if _room(name) not in ANALYSIS:
            return None
        if imp.top == "tpkit":
            if any(_under(imp.module, f"tpkit.{r}") for r in ANALYSIS):
                return None
            if imp.module == "tpkit.compat":
                return None
            return f"the analysis imports {imp.module} (only its own rooms and tpkit.compat)"
        if imp.top in sys.stdlib_module_names or imp.top in PLAN_THIRD_PARTY | {"__future__"}:
            return None
        return f"the analysis imports {imp.module} (only torch, yaml and the standard library)"

    assert not _violations(rule), "\n".join(_violations(rule))


def _analysis_order() -> list[str]:
    table = _section(ARCH.read_text(), "Rooms").split("### styles/")[0]
    rooms = "|".join(ANALYSIS)
    return [
        f"tpkit.{room}.{m}"
        for room, m in re.findall(rf"^\| `({rooms})/([a-z_]+)\.py`", table, re.M)
    ]


def test_analysis_stages_import_only_stages_above_them():
    """The analysis table in architecture.md is the order of the stages: each imports only
    modules above it in the table (a package __init__ re-exports its own)."""
    order = _analysis_order()
    assert len(order) >= 20, f"no analysis table found in docs/architecture.md: {order}"
    rank = {m: i for i, m in enumerate(order)}

    def rule(name: str, imp: _Import) -> str | None:
        if name not in rank or imp.module not in rank:
            return None
        if rank[imp.module] >= rank[name]:
            return f"{name} imports {imp.module}, listed at or below it in the analysis table"
        return None

    assert not _violations(rule), "\n".join(_violations(rule))


def test_analysis_table_lists_every_analysis_module():
    listed = set(_analysis_order())
    actual = {
        n
        for n, p in _modules().items()
        if _room(n) in ANALYSIS and not _is_package(p) and n.count(".") == 2
    }
    assert listed == actual, f"missing: {sorted(actual - listed)}; gone: {sorted(listed - actual)}"


def test_styles_import_only_plan_comm_and_compat():
    allowed = (
        "tpkit.plan",
        "tpkit.styles",
        "tpkit.parallel.comm",
        "tpkit.parallel.expert.comm",
        "tpkit.parallel.shard_memory",
        "tpkit.compat",
    )

    def rule(name: str, imp: _Import) -> str | None:
        if _room(name) != "styles" or imp.top != "tpkit":
            return None
        if any(_under(imp.module, a) for a in allowed):
            return None
        return (
            f"styles/ imports {imp.module} (only plan/, the runtime's collectives and shard "
            "memory, compat.py)"
        )

    assert not _violations(rule), "\n".join(_violations(rule))


def _graph() -> dict[str, set[str]]:
    """Module -> the tpkit modules it imports, as a structure drawing sees them: TYPE_CHECKING
    blocks (never run) and a package's imports of its own modules (re-exports) aside."""
    modules = _modules()
    known = set(modules)
    graph: dict[str, set[str]] = {n: set() for n in modules}
    for name, path in modules.items():
        typing_only = {
            node.lineno
            for block in ast.walk(_tree(path))
            if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
            for node in ast.walk(block)
            if hasattr(node, "lineno")
        }
        for imp in _imports(path, known):
            if imp.top != "tpkit" or imp.module == name or imp.line in typing_only:
                continue
            if _is_package(path) and _under(imp.module, name):
                continue
            graph[name].add(imp.module if imp.module in known else imp.module.rpartition(".")[0])
    return graph


def test_no_circles_between_modules():
    graph = _graph()
    seen: dict[str, int] = {}  # 1: on the path, 2: done
    circles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        seen[node] = 1
        for nxt in sorted(graph.get(nxt_ := node, ())):
            if seen.get(nxt) == 1:
                circles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in seen:
                visit(nxt, [*path, nxt])
        seen[nxt_] = 2

    for start in sorted(graph):
        if start not in seen:
            visit(start, [start])
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_every_import_goes_down_the_layers():
    """An import goes to a lower layer of "What may import what", or stays inside its room;
    training/, guards/ and io/ share a layer and never import one another."""
    problems = []
    for name, imports in _graph().items():
        mine, my_prefix = _layer(name)
        assert mine >= 0, f"{name} is in no layer of tests/test_docs.py's LAYERS"
        for target in imports:
            theirs, their_prefix = _layer(target)
            sideways_ok = my_prefix == their_prefix or LAYERS[mine][0] != "rooms"
            if theirs < mine or (theirs == mine and sideways_ok):
                continue
            problems.append(f"{name} imports {target} ({LAYERS[theirs][0]} from {LAYERS[mine][0]})")
    assert not problems, "\n".join(sorted(problems))


def test_split_and_loader_never_import_the_pool():
    def rule(name: str, imp: _Import) -> str | None:
        if name in ("tpkit.parallelize", "tpkit.pretrained") and _under(imp.module, "tpkit.pool"):
            return f"{name} imports {imp.module}: the package face decides rank or pool"
        return None

    assert not _violations(rule), "\n".join(_violations(rule))


def test_core_never_imports_integrations_or_cli():
    def rule(name: str, imp: _Import) -> str | None:
        if _room(name) in ("integrations", "cli", "package"):
            return None
        if any(_under(imp.module, outer) for outer in OUTER):
            return f"core module {name} imports {imp.module}"
        return None

    assert not _violations(rule), "\n".join(_violations(rule))


def test_no_module_imports_a_private_name_of_another():
    """``from tpkit.x import _y`` and ``x._y`` on an imported tpkit module (what ruff's PLC2701
    sees, plus the attribute form it does not)."""

    def rule(name: str, imp: _Import) -> str | None:
        private = imp.name and imp.name.startswith("_") and not imp.name.startswith("__")
        if imp.top == "tpkit" and imp.module != name and private:
            return f"{name} imports the private name {imp.module}.{imp.name}"
        return None

    problems = _violations(rule)
    modules = _modules()
    for name, path in modules.items():
        tree = _tree(path)
        bound = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tpkit"):
                for a in node.names:
                    if f"{node.module}.{a.name}" in modules:
                        bound[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("tpkit.") and a.asname:
                        bound[a.asname] = a.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in bound
                and bound[node.value.id] != name
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                problems.append(
                    f"{path.relative_to(ROOT)}:{node.lineno}: {name} uses the private "
                    f"{bound[node.value.id]}.{node.attr}"
                )
    assert not problems, "\n".join(problems)


def test_every_module_has_all():
    lacking = [
        str(p.relative_to(ROOT))
        for p in sorted(SRC.rglob("*.py"))
        if not any(
            isinstance(n, (ast.Assign, ast.AnnAssign))
            and any(
                isinstance(t, ast.Name) and t.id == "__all__"
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            )
            for n in _tree(p).body
        )
    ]
    assert not lacking, f"modules without __all__: {lacking}"


# --- the flow is the order parallelize.py calls ----------------------------------------------


class _CallOrder(ast.NodeVisitor):
    """The functions a body calls, in evaluation order (arguments before the call), with the
    module's own functions expanded in place: the steps as they run."""

    def __init__(self, functions: dict[str, ast.FunctionDef]) -> None:
        self.functions, self.calls, self.stack = functions, [], []

    def visit_Call(self, node: ast.Call) -> None:
        self.generic_visit(node)
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name is None:
            return
        self.calls.append(name)
        if name in self.functions and name not in self.stack:
            self.stack.append(name)
            for stmt in self.functions[name].body:
                self.visit(stmt)
            self.stack.pop()


def test_flow_is_the_order_parallelize_calls():
    tree = ast.parse((SRC / "parallelize.py").read_text())
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    order = _CallOrder(functions)
    order.stack.append("parallelize")
    for stmt in functions["parallelize"].body:
        order.visit(stmt)
    flow = _section(ARCH.read_text(), "The flow")
    block = re.search(r"```\n(.*?)```", flow, re.S)
    assert block, "no flow block in docs/architecture.md"
    steps = [
        line.split()[1].removesuffix("()").rpartition(".")[2]
        for line in block.group(1).splitlines()
        if line.strip() and not line[0].isspace() and not line.startswith("step")
    ]
    assert len(steps) >= 10, steps
    position = 0
    for step in steps:
        assert step in order.calls[position:], (
            f"docs/architecture.md's flow has {step}() after {steps[: steps.index(step)][-1:]}, "
            f"but parallelize calls, in order: {order.calls}"
        )
        position = order.calls.index(step, position) + 1


# --- configuration: one table of every variable -----------------------------------------------


def _environment_variables() -> set[str]:
    """Names read through os.environ / os.getenv anywhere in src/, and every TPKIT_* literal."""
    names: set[str] = set()
    for path in SRC.rglob("*.py"):
        for node in ast.walk(_tree(path)):
            literal = isinstance(node, ast.Constant) and isinstance(node.value, str)
            if literal and re.fullmatch(r"TPKIT_[A-Z0-9_]+", node.value):
                names.add(node.value)
            key = None
            if isinstance(node, ast.Call) and node.args:
                text = ast.unparse(node.func)
                if text in ("os.environ.get", "os.getenv", "os.environ.setdefault"):
                    key = node.args[0]
            elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ":
                key = node.slice
            elif isinstance(node, ast.Compare) and any(
                ast.unparse(c) == "os.environ" for c in node.comparators
            ):
                key = node.left
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                names.add(key.value)
    return names


def test_configuration_lists_every_environment_variable():
    page = (DOCS / "configuration.md").read_text()
    rows = set(re.findall(r"^\| `([A-Z][A-Z0-9_]+)`", page, re.M))
    read = _environment_variables()
    assert {"TPKIT_TIMEOUT", "RANK"} <= read, read  # the scan itself works
    missing = sorted(read - rows)
    assert not missing, f"docs/configuration.md has no row for {missing}: add one each."


# --- links --------------------------------------------------------------------------------------


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def _relative_links(text: str) -> list[str]:
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    links = re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text)
    links += re.findall(r"^\[[^\]]+\]:\s*(\S+)", text, re.M)
    return [
        link
        for link in links
        if not re.match(r"^[a-z][a-z0-9+.-]*:", link) and not link.startswith("#")
    ]


def test_every_relative_link_points_to_a_file():
    broken = []
    for page in _pages():
        for link in _relative_links(page.read_text()):
            target = (page.parent / link.split("#")[0]).resolve()
            if not target.exists():
                broken.append(f"{page.relative_to(ROOT)}: {link}")
    assert not broken, f"links to files that do not exist: {broken}"


def test_docs_links_stay_inside_docs():
    """mkdocs --strict rejects a link out of docs/: name such files as code spans instead."""
    outside = [
        f"{page.relative_to(ROOT)}: {link}"
        for page in sorted(DOCS.rglob("*.md"))
        for link in _relative_links(page.read_text())
        if DOCS.resolve() not in (page.parent / link.split("#")[0]).resolve().parents
    ]
    assert not outside, f"docs/ pages link outside docs/: {outside}"


def test_every_page_is_in_the_nav():
    config = (ROOT / "mkdocs.yml").read_text()
    nav = set(re.findall(r"^\s*- (?:[^:\n]+: )?([\w/-]+\.md)\s*$", config, re.M))
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert nav == pages, f"in nav, no page: {sorted(nav - pages)}; pages not in nav: " + str(
        sorted(pages - nav)
    )


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail into docs/"
    head = "\n".join(lines[:8])
    assert "make demo" in head and "make test" in head


# --- the API page builds and shows every public name ----------------------------------------------


MKDOCS = Path(sys.executable).parent / "mkdocs"


def test_api_page_documents_every_public_name(tmp_path):
    """The site builds with --strict (what `make docs` runs), and its API page has an entry for
    every name in ``tpkit.__all__``: as ``tpkit.NAME``, or as ``tpkit....NAME.NAME`` where a
    function shares its module's name (`tpkit.cli.launch.launch`) and docs/api.md lists it by hand."""
    proc = subprocess.run(
        [str(MKDOCS), "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": str(Path(sys.executable).parent)},
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stderr[-3000:]}"
    html = (tmp_path / "site" / "api" / "index.html").read_text()
    anchors = set(re.findall(r'id="(tpkit\.[\w.]+)"', html))
    public = re.search(r"__all__ = \[(.*?)\]", (SRC / "__init__.py").read_text(), re.S)
    names = re.findall(r'"(\w+)"', public.group(1))
    missing = [
        n
        for n in names
        if f"tpkit.{n}" not in anchors and not any(a.endswith(f".{n}.{n}") for a in anchors)
    ]
    assert not missing, f"docs/api.md renders no entry for tpkit.{missing}"
