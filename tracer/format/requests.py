"""Requests as a trace saw them: each request's steps, blocks and (when known) tokens.

The step records hold one block-table row per request and step; this module turns them
around, per request: when it was scheduled, how many tokens it brought and had, which
physical blocks it held and which slots it wrote. ``session.json`` (what ``pagedtrace
run`` writes) adds the prompt and output token ids; a trace without it (``vllm serve``)
has no tokens, and what needs them says so.

The prefix-cache explainer (:mod:`tracer.format.prefix`), the trace diff
(:mod:`tracer.format.diff`) and the timeline (:mod:`tracer.format.timeline`) read traces
through here; the metadata checks (:mod:`tracer.format.metadata`) and the block words
(:mod:`tracer.format.words`) read each request's tokens (:func:`known_tokens`). Standard
library only.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tracer.format.records import StepRecord, TraceError
from tracer.format.store import SESSION, Trace

__all__ = [
    "Appearance",
    "RequestView",
    "Tokens",
    "known_tokens",
    "request_layer",
    "request_views",
    "session_id_of",
    "session_tokens",
]

#: Request id -> its tokens (prompt, then generated), as ``session.json`` records them.
Tokens = Mapping[str, Sequence[int]]


@dataclass(frozen=True)
class Appearance:
    """One request in one recorded step (one block-table row)."""

    step: int  #: 0-based step index
    row: int  #: 0-based row of the step's block table
    query_len: int  #: tokens computed for this request in this step
    seq_len: int  #: tokens in its KV cache after the step
    blocks: tuple[int, ...]  #: physical block ids, logical order
    slots: tuple[int, ...]  #: ``slot_mapping`` entries of its new tokens (-1: padding)

    @property
    def context_len(self) -> int:
        """Tokens already in the cache before this step: ``seq_len - query_len``."""
        return self.seq_len - self.query_len


@dataclass
class RequestView:
    """Everything the trace says about one request."""

    request_id: str  #: the engine's id, as the block table's ``request_ids`` name it
    session_index: int | None = None  #: index into ``session.json``'s prompts, when matched
    prompt: tuple[int, ...] | None = None  #: prompt token ids (None: the trace has none)
    output: tuple[int, ...] = ()  #: generated token ids
    appearances: list[Appearance] = field(default_factory=list)

    @property
    def tokens(self) -> tuple[int, ...] | None:
        """Prompt then output: token ``p`` is the one whose K/V sits at position ``p``."""
        return None if self.prompt is None else self.prompt + self.output

    @property
    def first(self) -> Appearance:
        """The step it was first scheduled in."""
        return self.appearances[0]

    @property
    def last(self) -> Appearance:
        """The last recorded step it ran in."""
        return self.appearances[-1]

    @property
    def label(self) -> str:
        """A short name: the session index when known (``#0``), else the engine id."""
        return f"#{self.session_index}" if self.session_index is not None else self.request_id


def request_layer(trace: Trace) -> str:
    """The layer whose records describe the requests (the first recorded one; all layers share a step's table)."""
    layers = [r.layer for r in trace.records if r.kind == "request"]
    if not layers:
        raise TraceError(f"{trace.path}: no request steps recorded")
    return layers[0]


def session_tokens(trace: Trace) -> dict[str, Any] | None:
    """``session.json``'s prompts, outputs and request ids, checked; None when the trace has no session."""
    data = trace.read_json(SESSION)
    if data is None:
        return None
    ok = isinstance(data, dict) and all(isinstance(data.get(k), list) for k in ("prompts", "outputs", "request_ids"))
    if not ok or not all(isinstance(p, list) for p in data["prompts"] + data["outputs"]):
        raise TraceError(f"{trace.path / SESSION}: expected lists 'prompts', 'outputs' and 'request_ids'")
    return data


def session_id_of(request_id: str, session_ids: Collection[str]) -> str | None:
    """The id among ``session_ids`` (what ``pagedtrace run`` asked for) that the engine's ``request_id`` is.

    vLLM 0.26 appends a random suffix to the ids the frontend gave (``0`` -> ``0-a0c640ce``).
    """
    if request_id in session_ids:
        return request_id
    head, sep, _suffix = request_id.rpartition("-")
    return head if sep and head in session_ids else None


def known_tokens(session: Any) -> dict[str, tuple[int, ...]] | None:
    """Request id -> prompt + generated tokens, from ``session.json``'s object; None if it has none.

    ``pagedtrace run`` writes ``prompts``, ``outputs`` and ``request_ids`` in the same order.
    A session without them (or of another shape) means the prompts are unknown.
    """
    if not isinstance(session, dict):
        return None
    prompts, outputs, ids = session.get("prompts"), session.get("outputs"), session.get("request_ids")
    if not (isinstance(prompts, list) and isinstance(ids, list) and len(prompts) == len(ids)):
        return None
    if not isinstance(outputs, list) or len(outputs) != len(ids):
        outputs = [[] for _ in ids]
    out: dict[str, tuple[int, ...]] = {}
    for rid, prompt, generated in zip(ids, prompts, outputs, strict=True):
        if not isinstance(prompt, list) or not isinstance(generated, list):
            return None
        if not all(type(t) is int for t in (*prompt, *generated)):
            return None  # not token ids (a float, a string, infinity): the prompts are unknown
        out[str(rid)] = (*prompt, *generated)
    return out


def _session_index(request_id: str, session_ids: list[str]) -> int | None:
    matched = session_id_of(request_id, session_ids)
    return None if matched is None else session_ids.index(matched)


def _rows(record: StepRecord) -> list[tuple[str, Appearance]]:
    q = record.query_start_loc
    out = []
    for row, request_id in enumerate(record.request_ids):
        slots = record.slot_mapping[q[row] : q[row + 1]] if row + 1 < len(q) else ()
        out.append(
            (
                request_id,
                Appearance(
                    step=record.step,
                    row=row,
                    query_len=q[row + 1] - q[row],
                    seq_len=record.seq_lens[row],
                    blocks=tuple(record.block_table[row]),
                    slots=tuple(slots),
                ),
            )
        )
    return out


def request_views(trace: Trace, layer: str | None = None) -> dict[str, RequestView]:
    """Every request of the trace's request steps, in order of first appearance.

    Args:
        trace: an opened trace.
        layer: whose records to read (default :func:`request_layer`).
    """
    layer = layer or request_layer(trace)
    session = session_tokens(trace)
    session_ids = [str(x) for x in session["request_ids"]] if session else []
    views: dict[str, RequestView] = {}
    for record in sorted(trace.steps(kind="request", layer=layer), key=lambda r: r.step):
        for request_id, appearance in _rows(record):
            view = views.get(request_id)
            if view is None:
                view = views[request_id] = RequestView(request_id)
                index = _session_index(request_id, session_ids) if session else None
                if session and index is not None and index < len(session["prompts"]):
                    view.session_index = index
                    view.prompt = tuple(session["prompts"][index])
                    view.output = tuple(session["outputs"][index]) if index < len(session["outputs"]) else ()
            view.appearances.append(appearance)
    return views
