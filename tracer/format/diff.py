"""Did two engines run the same attention on the same blocks? ``pagedtrace diff A B``.

Two traces are aligned by request (the same prompt tokens when both have ``session.json``,
else the same frontend id, else the order of first appearance) and, per request, by
step: the steps that brought it to the same number of cached tokens (``seq_len``) are
paired, so a prefill split differently (prefix caching on vs off) still lines up.

For every pair, what differs: query and context lengths (prefix-cache hits), the block
row compared by content and sharing pattern (physical ids are expected to differ: only
the number of blocks, the tokens they hold and which other requests share them count),
the slots written and their in-block offsets, and replay's verdicts. The run itself is
compared field by field (layout, block size, backend, ...). Output tensors are compared
by :mod:`reference_impl.trace_diff`, which fills :attr:`TraceDiff.outputs`.

Standard library only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from tracer.format.records import StepRecord, TraceError
from tracer.format.requests import Appearance, RequestView, request_layer, request_views, session_tokens
from tracer.format.store import REPLAY, Trace
from tracer.format.verdicts import ReplayReport
from tracer.format.words import Words

__all__ = ["CACHED_FACT", "FieldDiff", "OutputDiff", "PairDiff", "RequestDiff", "TraceDiff", "diff_traces"]

#: The fact compared only when both traces were replayed.
REPLAY_FACT = "replay verdict"
#: The fact that tells a prefix-cache hit: tokens already in the cache when the step ran.
CACHED_FACT = "context_len (cached before the step)"


@dataclass(frozen=True)
class FieldDiff:
    """One quantity on both sides (only kept when the two differ)."""

    name: str
    a: Any
    b: Any


@dataclass(frozen=True)
class PairDiff:
    """One request at the same ``seq_len`` in both traces."""

    seq_len: int
    step_a: int
    step_b: int
    differences: tuple[FieldDiff, ...]


@dataclass(frozen=True)
class RequestDiff:
    """One request, aligned across the traces."""

    label: str  #: the A side's label (``#0`` or the engine id)
    id_a: str
    id_b: str
    pairs: tuple[PairDiff, ...]
    only_a: tuple[int, ...]  #: seq_lens reached in a step of A but of no step of B
    only_b: tuple[int, ...]
    text: str | None = None  #: the A side's prompt in words (None: A records no token text)

    @property
    def same(self) -> bool:
        """No difference at any aligned step, and the same steps on both sides."""
        return not self.only_a and not self.only_b and all(not p.differences for p in self.pairs)


@dataclass(frozen=True)
class OutputDiff:
    """vLLM's outputs of one request's common query positions in one layer, A against B."""

    label: str
    seq_len: int
    step_a: int
    step_b: int
    layer: str
    positions: tuple[int, int]  #: token positions compared, half-open
    max_abs: tuple[float, ...]  #: per query head: max |out_a - out_b|
    bar: tuple[float, ...]  #: per query head: tol_a + tol_b, each ``k * err(bf16 math) + eps``

    @property
    def ok(self) -> bool:
        """Every head within its bar."""
        return all(e <= t for e, t in zip(self.max_abs, self.bar, strict=True))


@dataclass(frozen=True)
class TraceDiff:
    """The whole comparison; ``to_json`` is what ``pagedtrace diff --json`` prints."""

    a: str
    b: str
    matched_by: str  #: ``prompt tokens``, ``request ids`` or ``order``
    run: tuple[FieldDiff, ...]
    requests: tuple[RequestDiff, ...]
    unmatched_a: tuple[str, ...]
    unmatched_b: tuple[str, ...]
    outputs: tuple[OutputDiff, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def same(self) -> bool:
        """Nothing differs that the diff looked at."""
        return (
            not self.run
            and not self.unmatched_a
            and not self.unmatched_b
            and all(r.same for r in self.requests)
            and all(o.ok for o in self.outputs)
        )

    def with_outputs(self, outputs: tuple[OutputDiff, ...], notes: tuple[str, ...] = ()) -> TraceDiff:
        """A copy carrying the output comparison."""
        return replace(self, outputs=outputs, notes=self.notes + notes)

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict; adds ``same`` and each output's ``ok``."""
        data = asdict(self)
        data["same"] = self.same
        for out, o in zip(data["outputs"], self.outputs, strict=True):
            out["ok"] = o.ok
        return data


def _run_fields(trace: Trace) -> dict[str, Any]:
    run, kv, model = trace.run, trace.run.kv_cache, trace.run.model
    fields: dict[str, Any] = {
        "vllm_version": run.vllm_version,
        "device": run.device,
        "attention_backend": run.attention_backend,
        "flash_attn_version": run.flash_attn_version,
        "cudagraph_mode": run.cudagraph_mode,
    }
    if kv is not None:
        fields.update(
            layout=kv.layout,
            block_size=kv.block_size,
            num_blocks=kv.num_blocks,
            kv_dtype=kv.dtype,
            cache_dtype=kv.cache_dtype,
            kv_shape=list(kv.shape[1:]),
            kv_stride=list(kv.stride),
        )
    if model is not None:
        fields.update(model=model.name, heads=[model.num_attention_heads, model.num_kv_heads, model.head_size])
    session = session_tokens(trace)
    if session and isinstance(session.get("config"), dict):
        fields["prefix_caching"] = bool(session["config"].get("prefix_caching", True))
    return fields


def _match(a: dict[str, RequestView], b: dict[str, RequestView]) -> tuple[str, list[tuple[RequestView, RequestView]]]:
    """Pair the requests: prompt tokens, else frontend ids, else first-appearance order."""
    if all(v.prompt is not None for v in (*a.values(), *b.values())):
        by_prompt: dict[tuple[int, ...], list[RequestView]] = {}
        for v in b.values():
            assert v.prompt is not None
            by_prompt.setdefault(v.prompt, []).append(v)
        pairs = []
        for v in a.values():
            assert v.prompt is not None
            if by_prompt.get(v.prompt):
                pairs.append((v, by_prompt[v.prompt].pop(0)))
        return "prompt tokens", pairs
    labels_b = {v.label: v for v in b.values()}
    if any(v.label in labels_b for v in a.values()):
        return "request ids", [(v, labels_b[v.label]) for v in a.values() if v.label in labels_b]
    return "order", list(zip(a.values(), b.values(), strict=False))


def _shared(record: StepRecord, row: int, block_size: int, names: dict[str, str]) -> tuple[int, list[str]]:
    """Tokens of ``row`` in blocks other rows hold too, and those rows' request names."""
    mine = record.block_table[row]
    partners: set[str] = set()
    tokens = 0
    for j, block in enumerate(mine):
        others = {record.request_ids[r] for r, other in enumerate(record.block_table) if r != row and block in other}
        if others:
            tokens += min(block_size, record.seq_lens[row] - j * block_size)
            partners |= {names.get(o, o) for o in others}
    return tokens, sorted(partners)


def _verdicts(trace: Trace) -> dict[int, tuple[bool, float]]:
    """Per step: all layers ok, and the worst max abs error, from ``replay.json``."""
    data = trace.read_json(REPLAY)
    if data is None:
        return {}
    report = ReplayReport.from_json(data)
    out: dict[int, tuple[bool, float]] = {}
    for s in report.steps:
        ok, worst = out.get(s.step, (True, 0.0))
        out[s.step] = (ok and s.ok, max(worst, s.max_abs))
    return out


class _Side:
    """One trace, read for the diff."""

    def __init__(self, trace: Trace):
        self.trace = trace
        self.layer = request_layer(trace)
        self.views = request_views(trace, self.layer)
        self.records = {r.step: r for r in trace.steps(kind="request", layer=self.layer)}
        assert trace.run.kv_cache is not None
        self.block_size = trace.run.kv_cache.block_size
        self.verdicts = _verdicts(trace)

    def facts(self, view: RequestView, app: Appearance, names: dict[str, str]) -> dict[str, Any]:
        record = self.records[app.step]
        shared_tokens, partners = _shared(record, app.row, self.block_size, names)
        facts: dict[str, Any] = {
            "query_len": app.query_len,
            CACHED_FACT: app.context_len,
            "blocks": len(app.blocks),
            "shared tokens (blocks other requests hold)": shared_tokens,
            "shared with": partners,
            "slots written": len(app.slots),
            "padding slots (-1)": sum(1 for s in app.slots if s < 0),
            "first slot's offset in its block": (app.slots[0] % self.block_size) if app.slots else None,
            "step's slot_mapping length": len(record.slot_mapping),
            "step's requests": record.num_reqs,
        }
        if view.tokens is not None:
            facts["tokens"] = list(view.tokens[: app.seq_len])
        if app.step in self.verdicts:
            ok, worst = self.verdicts[app.step]
            facts[REPLAY_FACT] = f"{'match' if ok else 'MISMATCH'} (worst {worst:.3g})"
        return facts


def _worded(token: Any, words: Words | None) -> Any:
    """A token id, as ``504 ('The')`` where the trace records its text."""
    return f"{token} ({words.text([token])!r})" if words is not None and isinstance(token, int) else token


def _pair(
    side_a: _Side,
    side_b: _Side,
    va: RequestView,
    vb: RequestView,
    names: tuple[dict, dict],
    words: tuple[Words | None, Words | None] = (None, None),
) -> RequestDiff:
    by_seq_b = {app.seq_len: app for app in vb.appearances}
    seq_a = {app.seq_len for app in va.appearances}
    pairs = []
    for app in va.appearances:
        other = by_seq_b.get(app.seq_len)
        if other is None:
            continue
        fa, fb = side_a.facts(va, app, names[0]), side_b.facts(vb, other, names[1])
        diffs = []
        # A verdict on one side only (B not replayed) says nothing about what differs.
        keys = (
            fa.keys() | fb.keys()
            if REPLAY_FACT in fa and REPLAY_FACT in fb
            else (fa.keys() | fb.keys()) - {REPLAY_FACT}
        )
        for key in keys:
            if fa.get(key) != fb.get(key):
                a_value, b_value = fa.get(key), fb.get(key)
                if key == "tokens" and a_value is not None and b_value is not None:
                    n = next(i for i, (x, y) in enumerate(zip(a_value, b_value, strict=False)) if x != y)
                    key, a_value, b_value = f"token at position {n}", a_value[n], b_value[n]
                    a_value, b_value = _worded(a_value, words[0]), _worded(b_value, words[1])
                diffs.append(FieldDiff(key, a_value, b_value))
        pairs.append(PairDiff(app.seq_len, app.step, other.step, tuple(sorted(diffs, key=lambda d: d.name))))
    return RequestDiff(
        label=va.label,
        id_a=va.request_id,
        id_b=vb.request_id,
        pairs=tuple(pairs),
        only_a=tuple(sorted(seq_a - by_seq_b.keys())),
        only_b=tuple(sorted(by_seq_b.keys() - seq_a)),
        text=words[0].text(va.prompt) if words[0] is not None and va.prompt is not None else None,
    )


def diff_traces(a: Trace, b: Trace) -> TraceDiff:
    """Compare two traces request by request and step by step (records only; no tensors).

    Raises:
        TraceError: a trace has no request steps or no KV-cache spec.
    """
    for t in (a, b):
        if t.run.kv_cache is None:
            raise TraceError(f"{t.path}: the manifest has no KV-cache spec")
    side_a, side_b = _Side(a), _Side(b)
    run_a, run_b = _run_fields(a), _run_fields(b)
    run = tuple(
        FieldDiff(k, run_a.get(k), run_b.get(k)) for k in run_a.keys() | run_b.keys() if run_a.get(k) != run_b.get(k)
    )
    matched_by, pairs = _match(side_a.views, side_b.views)
    # Sharing partners are named by the A side's label on both sides, so the patterns compare.
    names_a = {va.request_id: va.label for va, _ in pairs}
    names_b = {vb.request_id: va.label for va, vb in pairs}
    words = (Words.of(a), Words.of(b))
    requests = tuple(_pair(side_a, side_b, va, vb, (names_a, names_b), words) for va, vb in pairs)
    paired_a, paired_b = {va.request_id for va, _ in pairs}, {vb.request_id for _, vb in pairs}
    notes = []
    if matched_by != "prompt tokens":
        notes.append(f"requests matched by {matched_by}: a trace has no session.json with prompts")
    return TraceDiff(
        a=str(a.path),
        b=str(b.path),
        matched_by=matched_by,
        run=tuple(sorted(run, key=lambda d: d.name)),
        requests=requests,
        unmatched_a=tuple(v for v in side_a.views if v not in paired_a),
        unmatched_b=tuple(v for v in side_b.views if v not in paired_b),
        notes=tuple(notes),
    )
