"""The shape of the house: every import in the packages points down, never sideways or up.

::

    pagedtrace (the CLI) ──> reports ──> annotations ──> tracer.format (the bottom layer)
    tracer (hooks, plugin, loader, session) ──────────────> tracer.format
    reference_impl (torch) ───────────────────────────────> tracer.format

Every ``.py`` file of the packages is parsed with :mod:`ast`; all of its imports count:
module-level ones, function-level lazy ones, ``if TYPE_CHECKING:`` ones, relative ones and
``importlib.import_module("...")`` with a literal name. Nothing is imported, so the test runs
on a machine without torch or vLLM.
"""

from __future__ import annotations

import ast
import sys
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
        ("tracer/format/kvlog.py", "safetensors"),
        ("tracer/format/kvlog.py", "torch"),
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


def test_every_import_points_down():
    violations = tree_violations()
    assert not violations, "imports against the house's direction:\n" + "\n".join(map(str, violations))


def test_the_packages_are_all_checked():
    files = package_files()
    assert len(files) > 20
    for expected in (
        "tracer/format/records.py",
        "tracer/hooks.py",
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
        ("tracer/format/records.py", "from tracer import hooks\n", "tracer.format -> tracer"),
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
        ("tracer/hooks.py", "from reference_impl.layouts import cpu_layout_for\n", "tracer -> reference_impl"),
        ("tracer/hooks.py", "import vllm\n", "tracer -> vllm at module level (import it inside the hook installer)"),
        (
            "tracer/__init__.py",
            "from tracer.hooks import Tracer\n",
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
        ("tracer/hooks.py", "import torch\nfrom tracer.format import StepRecord\ndef install():\n    import vllm\n"),
        ("tracer/__init__.py", "from tracer.format import Trace\ndef start():\n    from tracer.hooks import Tracer\n"),
        ("reference_impl/kernel.py", "import torch\nfrom reference_impl.common import cdiv\n"),
    ],
)
def test_the_checker_lets_allowed_imports_pass(path, source):
    assert check_source(source, path) == []


def test_relative_imports_are_resolved():
    found = imports_of(
        "from . import records\nfrom ..hooks import Tracer\nfrom .store import Trace\n", "tracer/format/selection.py"
    )
    assert [i.module for i in found] == ["tracer.format.records", "tracer.hooks", "tracer.format.store"]
    found = imports_of("from .records import RunInfo\n", "tracer/format/__init__.py")
    assert [i.module for i in found] == ["tracer.format.records"]
