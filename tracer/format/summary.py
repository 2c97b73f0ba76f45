"""What a trace holds, in one object: the head of ``pagedtrace show`` (and its ``--json``).

Built from the trace directory alone (the manifest, the step and gap records, and the side
files ``session.json`` / ``replay.json`` when present), so it summarises any trace: one
``pagedtrace run`` wrote, or one a ``vllm serve`` worker wrote through the plugin (no
``session.json`` there).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Any

from tracer.format.records import TraceError
from tracer.format.selection import layer_index
from tracer.format.store import REPLAY, SESSION, Trace
from tracer.format.verdicts import ReplayReport

__all__ = ["GapGroup", "TraceSummary", "step_ranges", "summarize", "tensors_absent"]


def step_ranges(steps: list[int]) -> str:
    """``[1, 2, 3, 7, 9, 10]`` -> ``1-3, 7, 9-10`` (sorted, duplicates dropped)."""
    out: list[str] = []
    ordered = sorted(set(steps))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ", ".join(out)


def tensors_absent(run: Any, kind: str = "request") -> str:
    """Why a record of ``kind`` in the trace of manifest ``run`` has no tensors, in a few words.

    From what the manifest says: recorded without tensors; the tracer's own reason
    (``extra.tracer.tensors_absent``: a backend whose tensors it does not capture, full CUDA
    graphs captured before it started); the tensor budget spent; tensors are captured on
    request steps only. A trace that says none of these (one not finished, or older) says so.
    """
    options = getattr(run, "options", None) or {}
    if not options.get("tensors", True):
        return "recorded with --no-tensors"
    if kind != "request":
        return f"a {kind} step (tensors are captured on request steps)"
    tracer = (getattr(run, "extra", None) or {}).get("tracer")
    tracer = tracer if isinstance(tracer, dict) else {}
    if tracer.get("tensors_absent"):
        return str(tracer["tensors_absent"])
    if tracer.get("budget_exhausted"):
        return "the tensor budget (--budget-mb) was spent"
    return "the manifest does not say why (an unfinished trace, or one that reached its tensor budget)"


@dataclass(frozen=True)
class GapGroup:
    """The steps the tracer could not see for one reason (e.g. ``cuda-graph-replay``)."""

    reason: str
    kinds: tuple[str, ...]  #: the gaps' step kinds, sorted
    steps: tuple[int, ...]  #: 0-based step indices, sorted

    def to_json(self) -> dict[str, Any]:
        """As ``show --json`` prints it."""
        return {"reason": self.reason, "kinds": list(self.kinds), "steps": list(self.steps)}


@dataclass(frozen=True)
class TraceSummary:
    """A trace at a glance; every field comes from the trace directory."""

    path: str
    versions: dict[str, Any]  #: pagedtrace, format, vLLM and torch versions that wrote it
    device: str  #: ``cuda (NVIDIA H200)``
    platform: str
    backend: str  #: qualified name of vLLM's AttentionImpl
    flash_attn_version: int | None
    cudagraph_mode: str
    enforce_eager: bool
    model: dict[str, Any] | None  #: ``ModelSummary.to_json()``; None when the manifest has none
    kv_cache: dict[str, Any] | None  #: layout, blocks, block size, dtype, cache dtype, shape
    steps_by_kind: dict[str, int]  #: recorded steps (not records) per kind
    num_records: int  #: (step, layer) records
    layers: tuple[str, ...]  #: recorded layers, in the trace's order
    gaps: tuple[GapGroup, ...]  #: by reason, most steps first
    records_with_tensors: int  #: records whose tensors were saved
    tracer_options: dict[str, Any]  #: layers, steps, tensors, budget as the tracer ran
    session: dict[str, Any] | None  #: prompts and generated tokens (``pagedtrace run``); None without session.json
    replay: dict[str, Any] | None  #: verdict of ``replay.json`` when present (``ok``, counts, kernel)
    #: request steps by how they ran (``StepRecord.cudagraph``: ``full``, ``piecewise``, ``none``);
    #: empty for traces before format 3
    steps_by_graph: dict[str, int] = dataclasses.field(default_factory=dict)
    write_log_records: int = 0  #: records whose tensors are a KV write log (format 3)
    tensors_absent: str = ""  #: why request records lack tensors (:func:`tensors_absent`); "" when none does
    check_records: int = 0  #: of those, check steps that also keep their blocks whole
    #: tensor-parallel ranks (``TensorParallel.to_json()`` each, with ``directory`` and ``records``): every
    #: rank of a joined trace, or the one rank a rank's own directory holds; empty for a single rank
    ranks: tuple[dict[str, Any], ...] = ()
    disagreements: tuple[str, ...] = ()  #: where a rank's part differs from rank 0's (``Trace.disagreements``)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON types only."""
        return {
            "path": self.path,
            "versions": self.versions,
            "device": self.device,
            "platform": self.platform,
            "backend": self.backend,
            "flash_attn_version": self.flash_attn_version,
            "cudagraph_mode": self.cudagraph_mode,
            "enforce_eager": self.enforce_eager,
            "model": self.model,
            "kv_cache": self.kv_cache,
            "steps_by_kind": self.steps_by_kind,
            "num_records": self.num_records,
            "layers": list(self.layers),
            "gaps": [g.to_json() for g in self.gaps],
            "records_with_tensors": self.records_with_tensors,
            "tracer_options": self.tracer_options,
            "session": self.session,
            "replay": self.replay,
            "steps_by_graph": self.steps_by_graph,
            "write_log_records": self.write_log_records,
            "tensors_absent": self.tensors_absent,
            "check_records": self.check_records,
            "ranks": list(self.ranks),
            "disagreements": list(self.disagreements),
        }


def summarize(trace: Trace) -> TraceSummary:
    """The :class:`TraceSummary` of ``trace``; a side file that cannot be read is noted, not raised."""
    run = trace.run
    kinds: dict[str, set[int]] = {}
    graphs: dict[str, set[int]] = {}
    for r in trace.records:
        kinds.setdefault(r.kind, set()).add(r.step)
        if r.kind == "request" and r.cudagraph is not None:
            graphs.setdefault(r.cudagraph, set()).add(r.step)
    by_reason: dict[str, list] = {}
    for g in trace.gaps:
        by_reason.setdefault(g.reason, []).append(g)
    gaps = tuple(
        GapGroup(reason, tuple(sorted({g.kind for g in group})), tuple(sorted({g.step for g in group})))
        for reason, group in sorted(by_reason.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    )
    kv = run.kv_cache
    return TraceSummary(
        path=str(trace.path),
        versions={
            "pagedtrace": run.pagedtrace_version,
            "format": run.format_version,
            "vllm": run.vllm_version,
            "torch": run.torch_version,
        },
        device=f"{run.device} ({run.device_name})" if run.device_name else run.device,
        platform=run.platform,
        backend=run.attention_backend,
        flash_attn_version=run.flash_attn_version,
        cudagraph_mode=run.cudagraph_mode,
        enforce_eager=run.enforce_eager,
        model=run.model.to_json() if run.model else None,
        kv_cache=None
        if kv is None
        else {
            "layout": kv.layout,
            "physical_order": kv.physical_order,
            "num_blocks": kv.num_blocks,
            "block_size": kv.block_size,
            "dtype": kv.dtype,
            "cache_dtype": kv.cache_dtype,
            "shape": list(kv.shape),
            "num_layers": len(kv.layer_names),
        },
        steps_by_kind={kind: len(steps) for kind, steps in sorted(kinds.items())},
        num_records=len(trace.records),
        layers=tuple(sorted(trace.layers, key=lambda n: (layer_index(n) is None, layer_index(n) or 0, n))),
        gaps=gaps,
        records_with_tensors=sum(r.tensors is not None for r in trace.records),
        tracer_options=dict(run.options),
        session=_session(trace),
        replay=_replay(trace),
        steps_by_graph={mode: len(steps) for mode, steps in sorted(graphs.items(), key=lambda kv: -len(kv[1]))},
        write_log_records=sum(r.kv_log_epoch is not None for r in trace.records),
        tensors_absent=tensors_absent(run)
        if any(r.tensors is None and r.kind == "request" for r in trace.records)
        else "",
        check_records=sum(r.kv_log_epoch is not None and "kv_blocks" in r.tensor_names for r in trace.records),
        ranks=_ranks(trace),
        disagreements=tuple(str(d) for d in trace.disagreements),
    )


def _ranks(trace: Trace) -> tuple[dict[str, Any], ...]:
    parts = trace.ranks or (trace,)
    out = []
    for part in parts:
        tp = part.run.tensor_parallel
        if tp is None or tp.world_size == 1:
            return ()
        directory = part.path.relative_to(trace.path).as_posix() if trace.ranks else "."
        out.append({**tp.to_json(), "directory": directory, "records": len(part.records)})
    return tuple(out)


def _session(trace: Trace) -> dict[str, Any] | None:
    try:
        data = trace.read_json(SESSION)
    except TraceError as exc:
        return {"error": str(exc)}
    if not isinstance(data, dict):
        return None
    prompts: list[Any] = data["prompts"] if isinstance(data.get("prompts"), list) else []
    outputs: list[Any] = data["outputs"] if isinstance(data.get("outputs"), list) else []
    return {
        "prompts": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts if isinstance(p, list)),
        "generated_tokens": sum(len(o) for o in outputs if isinstance(o, list)),
        "engine_start_s": data.get("engine_start_s"),
        "generate_s": data.get("generate_s"),
    }


def _replay(trace: Trace) -> dict[str, Any] | None:
    try:
        data = trace.read_json(REPLAY)
        if data is None:
            return None
        report = ReplayReport.from_json(data)
    except TraceError as exc:
        return {"error": str(exc)}
    failed = Counter(name for name, checks in report.sections() for c in checks if not c.ok)
    return {
        "ok": report.ok,
        "kernel": report.kernel,
        "steps": len(report.steps),
        "write_path": len(report.write_path),
        "legacy": len(report.legacy),
        "metadata": len(report.metadata),
        "failed": dict(failed),
    }
