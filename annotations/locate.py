"""Find each anchor's line in a vLLM source text with libcst.

Two small visitors, each filling one public mapping, composed by ``locate``:

* ``FunctionCollector`` -> ``functions``: qualified name -> ``FunctionSpan``;
* ``AnchorMatcher`` -> ``lines``: anchor key -> 1-based line.

Both read ``PositionProvider`` and ``QualifiedNameProvider`` through one
``MetadataWrapper`` and run in one batched pass over the tree. Only the top-level
definitions that hold anchors are given to libcst (the rest is blanked, line for
line, by ``keep_definitions``), which halves the time on vLLM's larger files. An anchor that
cannot be found (renamed function, edited expression, unparsable file) comes back as a ``Location`` with ``line=None``
and a reason; nothing here raises on a source it does not recognise.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider, QualifiedNameProvider, QualifiedNameSource

from annotations.anchors import Anchor, anchors_for

_WS = re.compile(r"\s+")


def normalize_code(code: str) -> str:
    """Code with whitespace, trailing commas before a closing bracket, and one
    pair of enclosing parentheses removed: the form anchors are compared in."""
    text = _WS.sub("", code)
    text = re.sub(r",([)\]}])", r"\1", text)
    if text.startswith("(") and text.endswith(")") and _outer_pair(text):
        text = text[1:-1]
    return text


def _outer_pair(text: str) -> bool:
    """True when ``text[0]`` and ``text[-1]`` are one matching bracket pair."""
    depth = 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0 and i != len(text) - 1:
                return False
    return depth == 0


@dataclass(frozen=True)
class FunctionSpan:
    """Where one function sits in the file (1-based, inclusive)."""

    qualname: str  #: e.g. ``FlashAttentionImpl.forward``
    def_line: int  #: the line of the ``def`` keyword's name (after decorators)
    end_line: int  #: last line of the body


@dataclass(frozen=True)
class Location:
    """Result of looking for one anchor."""

    anchor: Anchor
    line: int | None  #: 1-based line, None when not found
    reason: str = ""  #: why it was not found ("" when found)

    @property
    def found(self) -> bool:
        """Whether the anchor resolved to a line."""
        return self.line is not None


def _local_qualname(node: cst.CSTNode, names: Iterable) -> str | None:
    """Pick the module-local qualified name of a def (``Class.method``, ``f.<locals>.g``)."""
    local = sorted(q.name for q in names if q.source == QualifiedNameSource.LOCAL)
    return local[0] if local else None


class FunctionCollector(cst.BatchableCSTVisitor):
    """Collect every function definition's qualified name and line span."""

    METADATA_DEPENDENCIES = (PositionProvider, QualifiedNameProvider)

    def __init__(self) -> None:
        super().__init__()
        #: qualified name -> span; the first definition wins when a name repeats
        self.functions: dict[str, FunctionSpan] = {}

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        """Record the function's qualified name, ``def`` line and last line."""
        qualname = _local_qualname(node, self.get_metadata(QualifiedNameProvider, node, set()))
        if qualname is None:
            return
        def_line = self.get_metadata(PositionProvider, node.name).start.line
        end_line = self.get_metadata(PositionProvider, node).end.line
        self.functions.setdefault(qualname, FunctionSpan(qualname, def_line, end_line))


class AnchorMatcher(cst.BatchableCSTVisitor):
    """Find the first node matching each anchor inside the anchor's own function.

    "Inside" means the innermost enclosing function has the anchor's qualified
    name, so a same-named expression in a nested helper does not match.
    """

    METADATA_DEPENDENCIES = (PositionProvider, QualifiedNameProvider)

    def __init__(self, anchors: Sequence[Anchor]) -> None:
        super().__init__()
        self._by_function: dict[str, list[Anchor]] = {}
        for anchor in anchors:
            self._by_function.setdefault(anchor.qualname, []).append(anchor)
        self._patterns = {a.key: normalize_code(a.pattern) for a in anchors}
        self._stack: list[str | None] = []
        #: anchor key -> 1-based line of the first match
        self.lines: dict[str, int] = {}

    def _pending(self, mode: str) -> list[Anchor]:
        if not self._stack or self._stack[-1] is None:
            return []
        return [a for a in self._by_function.get(self._stack[-1], ()) if a.match == mode and a.key not in self.lines]

    def _line(self, node: cst.CSTNode) -> int:
        return self.get_metadata(PositionProvider, node).start.line

    def _code(self, node: cst.CSTNode) -> str:
        return normalize_code(cst.Module(body=[]).code_for_node(node))

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        """Enter a function: ``def`` anchors resolve to the name's line."""
        qualname = _local_qualname(node, self.get_metadata(QualifiedNameProvider, node, set()))
        self._stack.append(qualname)
        for anchor in self._pending("def"):
            self.lines[anchor.key] = self._line(node.name)

    def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
        """Leave a function."""
        self._stack.pop()

    def visit_Assign(self, node: cst.Assign) -> None:
        """``assign`` anchors: compare each target's code."""
        pending = self._pending("assign")
        if not pending:
            return
        targets = {self._code(t.target) for t in node.targets}
        for anchor in pending:
            if self._patterns[anchor.key] in targets:
                self.lines[anchor.key] = self._line(node)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        """``assign`` anchors also match annotated assignments (``x: int = ...``)."""
        pending = self._pending("assign")
        if not pending:
            return
        target = self._code(node.target)
        for anchor in pending:
            if self._patterns[anchor.key] == target:
                self.lines[anchor.key] = self._line(node)

    def visit_Call(self, node: cst.Call) -> None:
        """``call`` anchors compare the callee (a ``kernel[grid]`` launch matches ``kernel``)."""
        pending = self._pending("call")
        pending_expr = self._pending("expr")
        if pending:
            func = node.func
            callee = {self._code(func)}
            if isinstance(func, cst.Subscript):
                callee.add(self._code(func.value))
            for anchor in pending:
                if self._patterns[anchor.key] in callee:
                    self.lines[anchor.key] = self._line(node)
        if pending_expr:
            self._match_expr(node, pending_expr)

    def visit_Attribute(self, node: cst.Attribute) -> None:
        """``expr`` anchors on attribute accesses (``attn_metadata.use_cascade``)."""
        self._match_expr(node, self._pending("expr"))

    def visit_Subscript(self, node: cst.Subscript) -> None:
        """``expr`` anchors on subscripts (``kv_cache[0]``)."""
        self._match_expr(node, self._pending("expr"))

    def visit_Tuple(self, node: cst.Tuple) -> None:
        """``expr`` anchors on tuple displays (a returned shape)."""
        self._match_expr(node, self._pending("expr"))

    def _match_expr(self, node: cst.CSTNode, pending: list[Anchor]) -> None:
        if not pending:
            return
        code = self._code(node)
        for anchor in pending:
            if self._patterns[anchor.key] == code:
                self.lines[anchor.key] = self._line(node)


@dataclass(frozen=True)
class LocatedSource:
    """Everything ``locate`` found in one source text."""

    vllm_path: str
    sha256: str  #: of the text that was searched
    functions: dict[str, FunctionSpan]
    locations: dict[str, Location]  #: anchor key -> location, in anchor-table order
    error: str = ""  #: parse error, when the text is not valid Python

    @property
    def missing(self) -> list[Location]:
        """Anchors that did not resolve."""
        return [loc for loc in self.locations.values() if not loc.found]


def locate(source_text: str, vllm_path: str, anchors: Sequence[Anchor] | None = None) -> LocatedSource:
    """Find the line of each anchor of ``vllm_path`` (or of ``anchors``) in ``source_text``.

    Results are cached per (text, path) when ``anchors`` is None, so a report that
    annotates many steps parses each file once.
    """
    if anchors is None:
        return _locate_cached(source_text, vllm_path)
    return _locate(source_text, vllm_path, tuple(anchors))


@functools.lru_cache(maxsize=32)
def _locate_cached(source_text: str, vllm_path: str) -> LocatedSource:
    return _locate(source_text, vllm_path, anchors_for(vllm_path))


def keep_definitions(source_text: str, names: set[str]) -> str:
    """``source_text`` with every top-level statement other than the defs/classes in
    ``names`` blanked out, line for line, so line numbers are unchanged.

    Resolving ``QualifiedNameProvider`` costs time in proportion to the module;
    the anchors only need the definitions that hold them. Text the standard
    ``ast`` cannot parse comes back unchanged (libcst then reports the error).
    """
    try:
        tree = ast.parse(source_text)
    except (SyntaxError, ValueError):
        return source_text
    lines = source_text.split("\n")
    keep = [False] * len(lines)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name in names:
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            for i in range(start - 1, node.end_lineno or start):
                keep[i] = True
    return "\n".join(line if kept else "" for line, kept in zip(lines, keep, strict=False))


def _locate(source_text: str, vllm_path: str, anchors: tuple[Anchor, ...]) -> LocatedSource:
    sha = hashlib.sha256(source_text.encode("utf-8")).hexdigest()
    tops = {a.qualname.split(".", 1)[0] for a in anchors}
    try:
        wrapper = MetadataWrapper(cst.parse_module(keep_definitions(source_text, tops)))
    except cst.ParserSyntaxError as exc:
        reason = f"source does not parse: {str(exc).splitlines()[0]}"
        return LocatedSource(vllm_path, sha, {}, {a.key: Location(a, None, reason) for a in anchors}, reason)
    functions = FunctionCollector()
    matcher = AnchorMatcher(anchors)
    wrapper.visit_batched([functions, matcher])
    locations: dict[str, Location] = {}
    for anchor in anchors:
        line = matcher.lines.get(anchor.key)
        if line is not None:
            locations[anchor.key] = Location(anchor, line)
        elif anchor.qualname not in functions.functions:
            locations[anchor.key] = Location(anchor, None, f"function {anchor.qualname} not found")
        else:
            what = "def" if anchor.match == "def" else f"{anchor.match} `{anchor.pattern}`"
            locations[anchor.key] = Location(anchor, None, f"{what} not found in {anchor.qualname}")
    return LocatedSource(vllm_path, sha, functions.functions, locations)
