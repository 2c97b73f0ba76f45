"""The shape of the house: every import in the packages points down, never sideways or up, and
no module imports one that imports it back.

::

    pagedtrace (the CLI) ──> reports ──> annotations ──> tracer.format (the bottom layer)
    tracer (hooks, plugin, loader, session) ──────────────> tracer.format
    reference_impl (torch) ───────────────────────────────> tracer.format

Every ``.py`` file of the packages is parsed with :mod:`ast`; all of its imports count:
module-level ones, function-level lazy ones, ``if TYPE_CHECKING:`` ones, relative ones and
``importlib.import_module("...")`` with a literal name. Nothing is imported, so the test runs
on a machine without torch or vLLM.

Rooms keep imports pointing down between packages; inside one, the import graph of the modules
must have no cycle either (a lazy or ``TYPE_CHECKING`` import closes a circle as surely as a
module-level one: it only hides it from the interpreter). And no module of the packages is
longer than :data:`MAX_MODULE_LINES`: a module that grows past it is cut along what its parts do.
"""

from __future__ import annotations

import ast
import itertools
import sys
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: The rooms, most specific first: a module belongs to the first room its name starts with.
ROOMS = ("tracer.format", "tracer", "reference_impl", "annotations", "reports", "pagedtrace")

#: First-party edges: room -> the other rooms it may import (a room may always import itself).
ALLOWED: dict[str, frozenset[str]] = {
    "pagedtrace": frozenset({"reports", "annotations", "reference_impl", "tracer", "tracer.format"}),
    "reports": frozenset({"annotations", "tracer.format"}),
    "annotations": frozenset({"tracer.format"}),
    "tracer": frozenset({"tracer.format"}),
    "reference_impl": frozenset({"tracer.format"}),
    "tracer.format": frozenset(),
}

#: Third-party packages a room must not import (anywhere, lazily or not).
FORBIDDEN_THIRD_PARTY: dict[str, frozenset[str]] = {
    "pagedtrace": frozenset({"vllm"}),
    "reports": frozenset({"vllm", "torch"}),
    "annotations": frozenset({"vllm", "torch"}),
    "reference_impl": frozenset({"vllm"}),
    "tracer": frozenset(),
}

#: The bottom layer imports the standard library only, except these (file, package) pairs,
#: and those only inside a function: the store reads and writes tensors when asked to.
BOTTOM_LAYER_LAZY = frozenset(
    {
        ("tracer/format/store.py", "safetensors"),
        ("tracer/format/store.py", "torch"),
        ("tracer/format/ranks.py", "torch"),
        ("tracer/format/writelog.py", "safetensors"),
        ("tracer/format/writelog.py", "torch"),
    }
)

#: Packages the tracer imports only inside functions (the hook installer), never at module
#: level: ``import tracer`` must work, and be cheap, without vLLM.
TRACER_LAZY_ONLY = frozenset({"vllm"})

#: ``import tracer.format`` runs ``tracer/__init__.py`` first: so every room that stands on
#: the bottom layer also runs that file, whose module-level imports must stay in the bottom layer.
TRACER_INIT = "tracer/__init__.py"


@dataclass(frozen=True)
class Import:
    """One import statement (or ``import_module`` call) found in a file."""

    line: int  #: 1-based
    module: str  #: absolute dotted name, relative imports resolved
    lazy: bool  #: inside a function (runs only when called)
    type_checking: bool  #: under ``if TYPE_CHECKING:`` (never runs)


@dataclass(frozen=True)
class Violation:
    """A forbidden edge, with where it is."""

    path: str  #: relative to the repository root, ``/``-separated
    line: int
    edge: str  #: e.g. ``reports -> reference_impl``
    module: str  #: the imported module

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: forbidden edge {self.edge} (imports {self.module})"


def module_name(path: str) -> str:
    """``tracer/format/store.py`` -> ``tracer.format.store``; ``reports/__init__.py`` -> ``reports``."""
    parts = path.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def room_of(module: str) -> str | None:
    """The room a first-party module belongs to, or None for anything else."""
    for room in ROOMS:
        if module == room or module.startswith(room + "."):
            return room
    return None


def _is_first_party_module(name: str) -> bool:
    """Whether ``name`` is a module or package of the repository (``tracer.format``, ``reports.build``)."""
    if room_of(name) is None:
        return False
    path = ROOT.joinpath(*name.split("."))
    return path.is_dir() or path.with_suffix(".py").is_file()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _ImportCollector(ast.NodeVisitor):
    """Collect every import of one module, knowing whether it is lazy or type-checking only."""

    def __init__(self, module: str, is_package: bool) -> None:
        self.package = module if is_package else module.rpartition(".")[0]
        self.imports: list[Import] = []
        self._depth = 0
        self._type_checking = 0

    def _add(self, node: ast.stmt | ast.expr, module: str) -> None:
        self.imports.append(Import(node.lineno, module, self._depth > 0, self._type_checking > 0))

    def _function(self, node: ast.AST) -> None:
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            self._type_checking += 1
            for child in node.body:
                self.visit(child)
            self._type_checking -= 1
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(node, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.package.split(".")
            base = base[: len(base) - (node.level - 1)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        if prefix == "__future__":
            return
        # ``from tracer import format`` imports the module tracer.format, not just ``tracer``.
        for alias in node.names:
            sub = f"{prefix}.{alias.name}"
            self._add(node, sub if _is_first_party_module(sub) else prefix)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name in ("import_module", "__import__") and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                self._add(node, arg.value)
        self.generic_visit(node)


def imports_of(source: str, path: str) -> list[Import]:
    """Every import in ``source``, the text of the file at ``path`` (relative, ``/``-separated)."""
    collector = _ImportCollector(module_name(path), path.endswith("__init__.py"))
    collector.visit(ast.parse(source, filename=path))
    return collector.imports


def check_source(source: str, path: str) -> list[Violation]:
    """The forbidden imports of one file of the packages."""
    room = room_of(module_name(path))
    assert room is not None, f"{path} is in no room"
    out = []
    for imp in imports_of(source, path):
        top = imp.module.split(".")[0]
        target = room_of(imp.module)

        def bad(edge: str, imp: Import = imp) -> None:
            out.append(Violation(path, imp.line, edge, imp.module))

        if target is not None:
            if target != room and target not in ALLOWED[room]:
                bad(f"{room} -> {target}")
            elif path == TRACER_INIT and target != "tracer.format" and not imp.lazy:
                bad(f"{room} -> {target} at module level of {TRACER_INIT}")
        elif room == "tracer.format":
            if top not in sys.stdlib_module_names:
                if (path, top) not in BOTTOM_LAYER_LAZY:
                    bad(f"tracer.format -> {top} (the bottom layer imports the standard library only)")
                elif not imp.lazy and not imp.type_checking:
                    bad(f"tracer.format -> {top} at module level (allowed only inside a function)")
        elif top in FORBIDDEN_THIRD_PARTY[room]:
            bad(f"{room} -> {top}")
        elif room == "tracer" and top in TRACER_LAZY_ONLY and not imp.lazy and not imp.type_checking:
            bad(f"tracer -> {top} at module level (import it inside the hook installer)")
    return out


def package_files() -> list[str]:
    """Every ``.py`` file of the packages, relative to the repository root."""
    tops = sorted({room.split(".")[0] for room in ROOMS})
    return sorted(p.relative_to(ROOT).as_posix() for top in tops for p in (ROOT / top).rglob("*.py"))


def tree_violations() -> list[Violation]:
    """The forbidden imports of the whole tree."""
    out = []
    for path in package_files():
        out.extend(check_source((ROOT / path).read_text(encoding="utf-8"), path))
    return out


#: Module -> {first-party module it imports: 1-based line of the first such import}.
ImportGraph = dict[str, dict[str, int]]


def import_graph(sources: Mapping[str, str]) -> ImportGraph:
    """The import graph of ``sources`` (path relative to the root -> text), every kind of import counted.

    An import names the module it loads: ``from tracer.format import Trace`` the package
    ``tracer.format``, ``from tracer.format.store import Trace`` the module. Python also runs
    each parent package's ``__init__`` first; that edge is the interpreter's, not the file's,
    and is not counted (a package importing its own submodules would otherwise close a cycle
    with each of them).
    """
    modules = {module_name(path) for path in sources}
    graph: ImportGraph = {}
    for path, source in sources.items():
        here = module_name(path)
        edges = graph.setdefault(here, {})
        for imp in imports_of(source, path):
            target = imp.module
            while target not in modules and "." in target:  # ``from reports.build import X``: X is no module
                target = target.rpartition(".")[0]
            if target in modules and target != here:
                edges.setdefault(target, imp.line)
    return graph


def _tangles(graph: ImportGraph) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan), each sorted, in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                members.append(w)
                if w == v:
                    break
            if len(members) > 1:
                out.append(sorted(members))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def _shortest_cycle(graph: ImportGraph, members: list[str]) -> list[str]:
    """A shortest cycle through the first of ``members`` (a tangle), as modules, first one repeated last."""
    start, inside = members[0], set(members)
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph[v]):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if w in inside and w not in came_from:
                came_from[w] = v
                queue.append(w)
    raise AssertionError(f"{members} is not a tangle")


def import_cycles(sources: Mapping[str, str]) -> list[str]:
    """One cycle per tangle of ``sources``' modules, each edge with the file and line that makes it.

    E.g. ``tracer.format.a -> tracer.format.b -> tracer.format.a (tracer/format/a.py:3 imports
    tracer.format.b; tracer/format/b.py:9 imports tracer.format.a)``.
    """
    path_of = {module_name(path): path for path in sources}
    graph = import_graph(sources)
    out = []
    for members in _tangles(graph):
        cycle = _shortest_cycle(graph, members)
        edges = "; ".join(f"{path_of[a]}:{graph[a][b]} imports {b}" for a, b in itertools.pairwise(cycle))
        out.append(f"{' -> '.join(cycle)} ({edges})")
    return out


def tree_sources() -> dict[str, str]:
    """Every file of the packages: path relative to the root -> text."""
    return {path: (ROOT / path).read_text(encoding="utf-8") for path in package_files()}


def test_every_import_points_down():
    violations = tree_violations()
    assert not violations, "imports against the house's direction:\n" + "\n".join(map(str, violations))


def test_no_module_imports_one_that_imports_it_back():
    cycles = import_cycles(tree_sources())
    assert not cycles, "import cycles (each module imports the next):\n" + "\n".join(cycles)


#: The longest a module of the packages may be, in lines.
MAX_MODULE_LINES = 500


def modules_over_the_line_bar(sources: Mapping[str, str], limit: int = MAX_MODULE_LINES) -> list[str]:
    """``path: N lines`` for each of ``sources`` (path -> text) longer than ``limit`` lines, longest first."""
    lengths = {path: len(text.splitlines()) for path, text in sources.items()}
    over = sorted((n, path) for path, n in lengths.items() if n > limit)
    return [f"{path}: {n} lines" for n, path in reversed(over)]


def test_no_module_is_over_the_line_bar():
    over = modules_over_the_line_bar(tree_sources())
    assert not over, f"modules over {MAX_MODULE_LINES} lines (cut each along what its parts do):\n" + "\n".join(over)


def test_the_line_bar_names_each_long_module():
    sources = {"tracer/a.py": "x = 1\n" * 3, "tracer/b.py": "x = 1\n" * 5, "reports/c.py": "x = 1\n" * 4}
    assert modules_over_the_line_bar(sources, limit=3) == ["tracer/b.py: 5 lines", "reports/c.py: 4 lines"]
    assert modules_over_the_line_bar(sources, limit=5) == []


def test_the_packages_are_all_checked():
    files = package_files()
    assert len(files) > 20
    for expected in (
        "tracer/format/records.py",
        "tracer/manifest.py",
        "reference_impl/kernel.py",
        "annotations/locate.py",
        "reports/viewmodel.py",
        "pagedtrace/cli.py",
    ):
        assert expected in files
    assert {room_of(module_name(f)) for f in files} == set(ROOMS)


def test_every_room_has_a_row():
    assert set(ALLOWED) == set(ROOMS)
    assert set(FORBIDDEN_THIRD_PARTY) == set(ROOMS) - {"tracer.format"}
    for room, targets in ALLOWED.items():
        assert "pagedtrace" not in targets, f"{room} may not import the CLI"
        assert targets <= set(ROOMS)


# The checker itself, on synthetic sources: it must see each kind of import.


@pytest.mark.parametrize(
    "path, source, edge",
    [
        ("reports/page.py", "from reference_impl import kernel\n", "reports -> reference_impl"),
        ("reports/page.py", "def f():\n    import reference_impl.layouts as L\n", "reports -> reference_impl"),
        (
            "reports/page.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n",
            "reports -> torch",
        ),
        ("annotations/x.py", "from reports.build import write_report\n", "annotations -> reports"),
        ("annotations/x.py", "import torch.nn\n", "annotations -> torch"),
        ("tracer/format/records.py", "from tracer import install\n", "tracer.format -> tracer"),
        ("tracer/format/records.py", "from .. import session\n", "tracer.format -> tracer"),
        (
            "tracer/format/records.py",
            "import jinja2\n",
            "tracer.format -> jinja2 (the bottom layer imports the standard library only)",
        ),
        (
            "tracer/format/store.py",
            "import torch\n",
            "tracer.format -> torch at module level (allowed only inside a function)",
        ),
        (
            "tracer/format/layouts.py",
            "def f():\n    import torch\n",
            "tracer.format -> torch (the bottom layer imports the standard library only)",
        ),
        ("tracer/install.py", "from reference_impl.layouts import cpu_layout_for\n", "tracer -> reference_impl"),
        ("tracer/install.py", "import vllm\n", "tracer -> vllm at module level (import it inside the hook installer)"),
        (
            "tracer/__init__.py",
            "from tracer.install import Tracer\n",
            "tracer -> tracer at module level of tracer/__init__.py",
        ),
        ("reference_impl/kernel.py", "from tracer.session import run_session\n", "reference_impl -> tracer"),
        (
            "reference_impl/kernel.py",
            "import importlib\nimportlib.import_module('vllm.config')\n",
            "reference_impl -> vllm",
        ),
        ("reference_impl/kernel.py", "from annotations import locate\n", "reference_impl -> annotations"),
        ("reports/page.py", "import pagedtrace.cli\n", "reports -> pagedtrace"),
        ("tracer/session.py", "from pagedtrace.presets import load\n", "tracer -> pagedtrace"),
    ],
)
def test_the_checker_catches_a_forbidden_import(path, source, edge):
    violations = check_source(source, path)
    assert [v.edge for v in violations] == [edge]
    assert str(violations[0]).startswith(f"{path}:{violations[0].line}: forbidden edge {edge} (imports ")


@pytest.mark.parametrize(
    "path, source",
    [
        ("pagedtrace/cli.py", "import torch\nfrom reference_impl import replay\nfrom reports import build_report\n"),
        ("reports/page.py", "import jinja2\nfrom annotations import locate\nfrom tracer.format import Trace\n"),
        ("reports/page.py", "from . import viewmodel\nfrom .viewmodel import Site\n"),
        ("annotations/x.py", "import libcst as cst\nfrom tracer import format\n"),
        ("tracer/format/store.py", "import json\ndef load():\n    from safetensors.torch import load_file\n"),
        ("tracer/format/store.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n"),
        ("tracer/format/__init__.py", "from . import records\nfrom .records import RunInfo\n"),
        ("tracer/install.py", "import torch\nfrom tracer.format import StepRecord\ndef install():\n    import vllm\n"),
        (
            "tracer/__init__.py",
            "from tracer.format import Trace\ndef start():\n    from tracer.install import Tracer\n",
        ),
        ("reference_impl/kernel.py", "import torch\nfrom reference_impl.common import cdiv\n"),
    ],
)
def test_the_checker_lets_allowed_imports_pass(path, source):
    assert check_source(source, path) == []


def test_relative_imports_are_resolved():
    found = imports_of(
        "from . import records\nfrom ..install import Tracer\nfrom .store import Trace\n", "tracer/format/selection.py"
    )
    assert [i.module for i in found] == ["tracer.format.records", "tracer.install", "tracer.format.store"]
    found = imports_of("from .records import RunInfo\n", "tracer/format/__init__.py")
    assert [i.module for i in found] == ["tracer.format.records"]


# The cycle finder, on synthetic sources.


def test_the_cycle_finder_names_each_edge_of_a_cycle():
    sources = {
        "tracer/format/a.py": (
            "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from tracer.format.b import B\n"
        ),
        "tracer/format/b.py": "import json\n\n\ndef f():\n    from .a import A\n",
    }
    assert import_cycles(sources) == [
        "tracer.format.a -> tracer.format.b -> tracer.format.a "
        "(tracer/format/a.py:4 imports tracer.format.b; tracer/format/b.py:5 imports tracer.format.a)"
    ]


def test_the_cycle_finder_follows_a_cycle_through_a_package_and_a_third_module():
    sources = {
        "reports/__init__.py": "from reports.build import build_report\n",
        "reports/build.py": "from reports.pages import render\n",
        "reports/pages.py": "from reports import build_report\n",
        "reports/common.py": "from reports.pages import render\n",  # imports into the circle, not part of it
    }
    cycles = import_cycles(sources)
    assert len(cycles) == 1
    assert cycles[0].startswith("reports -> reports.build -> reports.pages -> reports (")


def test_the_cycle_finder_does_not_count_a_parent_package_or_a_chain():
    sources = {
        "tracer/format/__init__.py": "from tracer.format.store import Trace\n",
        "tracer/format/store.py": "from tracer.format.writelog import WriteLogReader\n",
        "tracer/format/writelog.py": "from tracer.format.records import StepRecord\n",
        "tracer/format/records.py": "import json\n",
        "reports/build.py": "from tracer.format import Trace\nimport tracer.format.store\n",
    }
    assert import_cycles(sources) == []
