"""``index.html``: run summary, KV-cache layout, the step list with its gaps, the annotated files."""

from __future__ import annotations

from dataclasses import dataclass

from annotations.anchors import ANNOTATED_FILES
from annotations.annotate import file_role, on_path
from annotations.locate import LocatedSource
from annotations.values import fmt_list
from reports.common import Row, Verdict, first_records, range_text, source_file_page, step_page
from reports.layout_view import LayoutView, layout_view
from reports.verdicts import ReplayData, step_verdict
from tracer.format import GapRecord, KVCacheSpec, StepRecord, Trace
from tracer.format.summary import tensors_absent


@dataclass(frozen=True)
class StepRow:
    """One line of the index's step list: a recorded step or a gap."""

    step: int
    kind: str
    recorded: bool  #: False for a gap
    layers: int
    num_reqs: str
    num_tokens: str
    query_lens: str
    seq_lens: str
    verdict: Verdict
    href: str  #: step page, "" when none was written
    label: str  #: the step number, or a range of consecutive gap steps with one reason (``1–12``)
    count: int = 1  #: steps the row stands for (more than 1 for a run of gaps)
    graph: str = ""  #: how the step ran (format 3): ``full graph (padded to 4)``, ``piecewise``, ``eager``


@dataclass(frozen=True)
class GapGroup:
    """Steps the tracer knows about but could not record, for one (kind, reason)."""

    kind: str
    reason: str
    steps: str  #: e.g. ``1–12`` or ``14, 16, 18``
    count: int
    tokens: str  #: tokens per step: ``4 each`` or a list
    explanation: str  #: why such steps are not recorded, and what would record them ("" if unknown)


#: Why gaps happen, by the part of the tracer's reason before the first colon.
GAP_EXPLANATIONS = {
    "profile run": "vLLM's memory-profiling and warm-up forward passes run without attention metadata "
    "(attn_metadata is None): attention is skipped, so there is nothing to record.",
    "cuda-graph-capture": "vLLM was capturing CUDA graphs for these batch sizes, and the hook copies nothing "
    "while a graph is being captured. These are warm-up batches, not requests.",
    "empty-step": "The engine called the model runner with no tokens scheduled: vLLM's scheduler hands the "
    "worker the ids of finished requests in the step after they finish (EngineCore keeps stepping while "
    "finished requests remain to be reported: vllm serve shows one after each request), and the V2 runner's "
    "warm-up ends with such a step to free its fake requests. execute_model updates its request states and "
    "returns before the model runs: no attention ran, nothing to record.",
    "step-raised": "vLLM itself raised an error in this step (the reason quotes it), and the error went on to "
    "its caller: the step did not finish, so what the tracer had captured of it was dropped. The engine "
    "usually stops here; had it gone on, each layer's write log would start again with whole blocks.",
    "cuda-graph-replay": "These steps replayed a captured CUDA graph (cudagraph_mode {mode}): attention ran "
    "inside the graph on the device and the Python forward() that the hook wraps was never called. {advice}",
}
#: How to record replayed steps: with FULL graphs, PIECEWISE keeps attention outside the graphs.
_REPLAY_ADVICE = {
    True: "Trace with enforce_eager, or cudagraph_mode PIECEWISE (attention stays outside the graphs), to record them.",
    False: "Trace with enforce_eager to record them.",
}


def steps_text(steps: list[int]) -> str:
    """Sorted step numbers as ranges: ``[1, 2, 3, 5]`` -> ``1–3, 5``."""
    runs: list[list[int]] = []
    for s in steps:
        if runs and s == runs[-1][-1] + 1:
            runs[-1].append(s)
        else:
            runs.append([s])
    return ", ".join(range_text(run[0], run[-1]) for run in runs)


def _tokens_text(tokens: list[int]) -> str:
    if not any(tokens):
        return "–"
    if len(set(tokens)) == 1:
        return f"{tokens[0]}" if len(tokens) == 1 else f"{tokens[0]} each"
    return fmt_list(tokens, 16)


def gap_groups(gaps: list[GapRecord], cudagraph_mode: str) -> tuple[GapGroup, ...]:
    """Group ``GapRecord``s by (kind, reason), in order of their first step."""
    groups: dict[tuple[str, str], list[GapRecord]] = {}
    for g in sorted(gaps, key=lambda g: g.step):
        groups.setdefault((g.kind, g.reason), []).append(g)
    out = []
    for (kind, reason), members in groups.items():
        explanation = GAP_EXPLANATIONS.get(reason.split(":", 1)[0].strip(), "")
        out.append(
            GapGroup(
                kind,
                reason,
                steps_text([g.step for g in members]),
                len(members),
                _tokens_text([g.num_tokens for g in members]),
                explanation.format(mode=cudagraph_mode, advice=_REPLAY_ADVICE["FULL" in cudagraph_mode]),
            )
        )
    return tuple(out)


def _gap_rows(gaps: list[GapRecord]) -> list[StepRow]:
    """Step-list rows for gaps: consecutive steps with the same kind and reason share one row."""
    runs: list[list[GapRecord]] = []
    for g in sorted(gaps, key=lambda g: g.step):
        last = runs[-1][-1] if runs else None
        if last is not None and g.step == last.step + 1 and (g.kind, g.reason) == (last.kind, last.reason):
            runs[-1].append(g)
        else:
            runs.append([g])
    rows = []
    for run in runs:
        tokens = [g.num_tokens for g in run]
        text = "" if not any(tokens) else _tokens_text(tokens)
        label = range_text(run[0].step, run[-1].step)
        rows.append(
            StepRow(
                run[0].step,
                run[0].kind,
                False,
                0,
                "",
                text,
                "",
                "",
                Verdict("none", run[0].reason),
                "",
                label,
                len(run),
            )
        )
    return rows


#: Steps numbered but neither recorded nor a gap (traces from before the ``empty-step`` gap).
UNRECORDED_WHY = (
    "The tracer counted a model-runner call here (each execute_model at the top level is a step), but "
    "attention never ran on the traced layers and this trace has no gap for it. In vLLM 0.26 that is an "
    "execute_model with no tokens scheduled, which returns before the model runs; tracers from this version "
    "on record it as an empty-step gap."
)


@dataclass(frozen=True)
class UnrecordedStep:
    """A step number with neither a record nor a gap, and why."""

    step: int
    why: str


def unrecorded_steps(trace: Trace) -> tuple[UnrecordedStep, ...]:
    """Steps between the first and last known ones with no record and no gap, each with its likely cause.

    The cause comes from the neighbours: after the V2 runner's warm-up batches, the warm-up's cleanup
    step; after a step whose requests do not all continue, the step that frees the finished requests.
    Steps outside the trace's ``--steps`` range are not listed (they were not traced on purpose).
    """
    by_step: dict[int, list[str]] = {}
    kinds: dict[int, str] = {}
    for r in trace.records:
        by_step.setdefault(r.step, list(r.request_ids))
        kinds.setdefault(r.step, r.kind)
    known = set(by_step) | {g.step for g in trace.gaps}
    if not known:
        return ()
    lo, hi = min(known), max(known)
    window = trace.run.options.get("steps") if isinstance(trace.run.options, dict) else None
    if isinstance(window, (list, tuple)) and len(window) == 2:
        start, stop = window
        lo = max(lo, start) if isinstance(start, int) else lo
        hi = min(hi, stop - 1) if isinstance(stop, int) else hi
    recorded = sorted(by_step)
    out = []
    for step in range(lo, hi + 1):
        if step in known:
            continue
        before = max((s for s in recorded if s < step), default=None)
        after = min((s for s in recorded if s > step), default=None)
        if before is not None and kinds[before] == "warmup" and (after is None or kinds[after] == "request"):
            why = (
                f"after the warm-up batch of step {before}: the V2 runner ends its warm-up with an execute_model "
                "that schedules nothing and frees the fake warm-up requests (finished_req_ids), so no attention ran."
            )
        else:
            continuing = set(by_step[after]) if after is not None else set()
            gone = [] if before is None else [r for r in by_step[before] if r and r not in continuing]
            if gone:
                shown = ", ".join(gone[:4]) + (f" and {len(gone) - 4} more" if len(gone) > 4 else "")
                why = (
                    f"request{'s' if len(gone) > 1 else ''} {shown} finished in step {before}: the scheduler's "
                    "next step carried only the finished ids to the worker (no tokens scheduled), so no attention ran."
                )
            else:
                why = "an execute_model with no tokens scheduled (no attention ran), as far as the trace shows."
        out.append(UnrecordedStep(step, why))
    return tuple(out)


@dataclass(frozen=True)
class FileRow:
    """One annotated source file on the index."""

    name: str
    vllm_path: str
    href: str  #: "" when the trace has no copy of the file
    role: str
    anchors: str  #: ``12 of 12 anchors found``
    on_path: bool  #: the traced run executed this file's code


@dataclass(frozen=True)
class IndexPage:
    """``index.html``."""

    title: str
    summary: tuple[Row, ...]
    kv_rows: tuple[Row, ...]
    layout: LayoutView | None
    steps: tuple[StepRow, ...]
    gaps: tuple[GapGroup, ...]
    files: tuple[FileRow, ...]
    replay: Verdict
    replay_checks: tuple[Row, ...]
    problems: tuple[str, ...]
    pages_note: str  #: how many steps got a page, when not all did
    replay_origin: str = ""  #: where the verdicts come from ("" when there are none)
    unrecorded: tuple[UnrecordedStep, ...] = ()  #: step numbers with no record and no gap
    unrecorded_why: str = UNRECORDED_WHY
    show_graph: bool = False  #: the trace records how each step ran (format 3): a CUDA-graph column


def graph_text(record: StepRecord) -> str:
    """``StepRecord.cudagraph`` for the step list; "" when the trace does not record it."""
    if record.cudagraph is None:
        return ""
    padded = record.padded_tokens
    pad = f" (padded to {padded})" if padded is not None and padded != record.num_actual_tokens else ""
    return {"full": "full graph", "piecewise": "piecewise", "none": "eager"}.get(
        record.cudagraph, record.cudagraph
    ) + pad


def _short(values: tuple[int, ...], limit: int = 6) -> str:
    return fmt_list(values, limit)


def _summary_rows(trace: Trace) -> tuple[Row, ...]:
    run = trace.run
    rows = []
    if run.model is not None:
        m = run.model
        rows += [
            Row("model", m.name),
            Row("architecture", ", ".join(m.architectures)),
            Row(
                "shape",
                f"{m.num_layers} layers, {m.num_attention_heads} query heads, {m.num_kv_heads} KV heads, "
                f"head size {m.head_size}, hidden {m.hidden_size}",
            ),
            Row("dtype / weights", f"{m.dtype} / {m.weights}"),
        ]
    rows += [
        Row("device", f"{run.device} ({run.device_name}), {run.platform}"),
        Row("attention backend", run.attention_backend),
        Row("FlashAttention version", f"FA{run.flash_attn_version}" if run.flash_attn_version else "none"),
        Row("CUDA graphs", f"{run.cudagraph_mode}{' (enforce_eager)' if run.enforce_eager else ''}"),
        Row("versions", f"vLLM {run.vllm_version}, torch {run.torch_version}, pagedtrace {run.pagedtrace_version}"),
        Row(
            "layers traced",
            f"{len(trace.layers)}: {', '.join(trace.layers[:4])}{' …' if len(trace.layers) > 4 else ''}",
        ),
        Row(
            "recorded",
            f"{len({r.step for r in trace.records})} steps ({len(trace.records)} layer records), "
            f"{len(trace.gaps)} gap{'' if len(trace.gaps) == 1 else 's'}",
        ),
        Row("created", run.created_at),
        Row("trace", str(trace.path)),
    ]
    return tuple(rows) + _rank_rows(trace)


def _span(heads: range) -> str:
    return str(heads.start) if len(heads) == 1 else f"{heads.start}-{heads.stop - 1}"


def _rank_rows(trace: Trace) -> tuple[Row, ...]:
    """A tensor-parallel trace's ranks and their global heads, and where their parts disagree."""
    rows = []
    for part in trace.ranks:
        tp = part.run.tensor_parallel
        if tp is None:
            continue
        where = "the trace directory" if part is trace.ranks[0] else f"{part.path.name}/"
        rows.append(
            Row(
                f"rank {tp.rank} of {tp.world_size}",
                f"query heads {_span(tp.heads)}, KV heads {_span(tp.kv_heads)}; {len(part.records)} records in {where}",
            )
        )
    if trace.disagreements:
        shown = "; ".join(str(d) for d in trace.disagreements[:4])
        more = f" (+{len(trace.disagreements) - 4} more)" if len(trace.disagreements) > 4 else ""
        rows.append(Row("ranks disagree", f"{len(trace.disagreements)}: {shown}{more}"))
    return tuple(rows)


def _kv_rows(spec: KVCacheSpec | None) -> tuple[Row, ...]:
    if spec is None:
        return (Row("KV cache", "not in this trace"),)
    order = tuple(spec.backend_stride_order) if spec.backend_stride_order else "none"
    return (
        Row("blocks x block size", f"{spec.num_blocks} x {spec.block_size} tokens"),
        Row("KV heads x head size", f"{spec.num_kv_heads} x {spec.head_size}"),
        Row(
            "dtype",
            f"{spec.dtype} ({spec.element_size} B), kv_cache_dtype={spec.cache_dtype}, "
            f"k_scale={spec.k_scale:g}, v_scale={spec.v_scale:g}",
        ),
        Row("logical shape", str(tuple(spec.shape))),
        Row("strides", str(tuple(spec.stride))),
        Row("backend shape / stride order", f"{tuple(spec.backend_kv_cache_shape)} / {order}"),
        Row("layout", f"{spec.layout}: {spec.physical_order}"),
        Row("layers sharing it", str(len(spec.layer_names))),
    )


def index_page(trace: Trace, replay: ReplayData, located: dict[str, LocatedSource], paged: set[int]) -> IndexPage:
    """The index: run summary, KV layout, steps and gaps, files."""
    run = trace.run
    layers_per_step: dict[int, int] = {}
    for r in trace.records:
        layers_per_step[r.step] = layers_per_step.get(r.step, 0) + 1
    rows: list[StepRow] = []
    for r in first_records(trace):
        rows.append(
            StepRow(
                r.step,
                r.kind,
                True,
                layers_per_step[r.step],
                str(r.num_reqs),
                str(r.num_actual_tokens),
                _short(r.query_lens),
                _short(r.seq_lens),
                step_verdict(replay.by_step.get(r.step, [])),
                step_page(r.step) if r.step in paged else "",
                str(r.step),
                graph=graph_text(r),
            )
        )
    rows += _gap_rows(list(trace.gaps))
    unrecorded = unrecorded_steps(trace)
    for u in unrecorded:
        rows.append(StepRow(u.step, "", False, 0, "", "", "", "", Verdict("none", u.why), "", str(u.step)))
    rows.sort(key=lambda row: (row.step, not row.recorded))
    files = []
    for path in ANNOTATED_FILES:
        loc = located.get(path)
        name = path.rsplit("/", 1)[-1]
        if loc is None:
            files.append(
                FileRow(name, path, "", file_role(path, run), "source not stored in this trace", on_path(path, run))
            )
            continue
        found = sum(1 for x in loc.locations.values() if x.found)
        files.append(
            FileRow(
                name,
                path,
                source_file_page(path),
                file_role(path, run),
                f"{found} of {len(loc.locations)} anchors found",
                on_path(path, run),
            )
        )
    model = run.model.name if run.model else "unknown model"
    overall = replay.overall
    if not replay.present and not any(r.tensors for r in trace.records):
        overall = Verdict("none", f"not replayable: tensors not captured ({tensors_absent(run)})")
    problems = tuple(trace.problems) + ((replay.problem,) if replay.problem else ())
    recorded = [row for row in rows if row.recorded]
    without = sum(1 for row in recorded if not row.href)
    pages_note = (
        f"{len(recorded) - without} of {len(recorded)} recorded steps have a page (the first request steps, "
        "and the first few others); `pagedtrace report --max-step-pages N` writes more."
        if without
        else ""
    )
    return IndexPage(
        title=f"pagedtrace: {model}",
        summary=_summary_rows(trace),
        kv_rows=_kv_rows(run.kv_cache),
        layout=layout_view(run.kv_cache),
        steps=tuple(rows),
        gaps=gap_groups(list(trace.gaps), run.cudagraph_mode),
        files=tuple(files),
        replay=overall,
        replay_checks=replay.checks,
        problems=problems,
        pages_note=pages_note,
        replay_origin=replay.origin if replay.present else "",
        unrecorded=unrecorded,
        show_graph=any(r.cudagraph is not None for r in trace.records),
    )
