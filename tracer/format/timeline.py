"""A trace as a timeline: Chrome trace-event JSON for Perfetto (``pagedtrace export --perfetto``).

The trace records no clock, so time here is the step index: step ``n`` spans
``[n, n + 1)`` milliseconds. Process 1, "engine steps", holds one slice per step (its kind),
each layer's record nested inside it with the record's metadata as ``args``, and the gaps
(steps the tracer saw but could not record) as slices named by their reason. Process 2,
"requests", has one track per request: a ``prefill`` or ``decode`` slice for each step it
ran in, and instant events where blocks were allocated, found shared with other requests,
and released after its last recorded step.

Format: the "JSON Object Format" of Google's Trace Event Format (``traceEvents``, phases
``X`` complete, ``i`` instant, ``M`` metadata; ``ts`` and ``dur`` in microseconds), which
Perfetto's UI and ``chrome://tracing`` open. Standard library only.
"""

from __future__ import annotations

from typing import Any

from tracer.format.records import StepRecord
from tracer.format.requests import request_views
from tracer.format.store import Trace

__all__ = ["STEP_US", "timeline"]

#: Microseconds per step on the timeline (1 ms).
STEP_US = 1000
_STEPS_PID, _REQUESTS_PID = 1, 2


def _meta(pid: int, tid: int | None, what: str, name: str) -> dict[str, Any]:
    event: dict[str, Any] = {"name": what, "ph": "M", "pid": pid, "tid": tid or 0, "args": {"name": name}}
    return event


def _layer_args(record: StepRecord) -> dict[str, Any]:
    return {
        "kind": record.kind,
        "num_reqs": record.num_reqs,
        "num_actual_tokens": record.num_actual_tokens,
        "query_start_loc": list(record.query_start_loc),
        "seq_lens": list(record.seq_lens),
        "request_ids": list(record.request_ids),
        "blocks_in_use": len({b for row in record.block_table for b in row}),
        "shared_blocks": sorted(record.shared_blocks),
        "max_query_len": record.max_query_len,
        "max_seq_len": record.max_seq_len,
        "tensors": record.tensors,
    }


def timeline(trace: Trace) -> dict[str, Any]:
    """The trace as a Chrome trace-event JSON object (``{"traceEvents": [...], ...}``)."""
    events: list[dict[str, Any]] = [
        _meta(_STEPS_PID, None, "process_name", "engine steps"),
        _meta(_STEPS_PID, 0, "thread_name", "steps and layers"),
        _meta(_STEPS_PID, 1, "thread_name", "gaps (not recorded)"),
        _meta(_REQUESTS_PID, None, "process_name", "requests"),
    ]
    by_step: dict[int, list[StepRecord]] = {}
    for record in trace.records:
        by_step.setdefault(record.step, []).append(record)
    for step, records in sorted(by_step.items()):
        start = step * STEP_US
        events.append(
            {
                "name": f"step {step} ({records[0].kind})",
                "cat": "step",
                "ph": "X",
                "ts": start,
                "dur": STEP_US,
                "pid": _STEPS_PID,
                "tid": 0,
                "args": {"kind": records[0].kind, "layers": len(records)},
            }
        )
        width = STEP_US // max(len(records), 1)
        for i, record in enumerate(records):
            events.append(
                {
                    "name": record.layer,
                    "cat": "layer",
                    "ph": "X",
                    "ts": start + i * width,
                    "dur": width,
                    "pid": _STEPS_PID,
                    "tid": 0,
                    "args": _layer_args(record),
                }
            )
    for gap in trace.gaps:
        events.append(
            {
                "name": gap.reason.split(":")[0],
                "cat": "gap",
                "ph": "X",
                "ts": gap.step * STEP_US,
                "dur": STEP_US,
                "pid": _STEPS_PID,
                "tid": 1,
                "args": {"kind": gap.kind, "num_tokens": gap.num_tokens, "step": gap.step, "reason": gap.reason},
            }
        )
    if any(r.kind == "request" for r in trace.records):
        events.extend(_request_events(trace))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "pagedtrace_trace": str(trace.path),
            "time": f"not measured: step n spans [n, n+1) ms ({STEP_US} us per step)",
            "vllm_version": trace.run.vllm_version,
        },
    }


def _request_events(trace: Trace) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    records = {(r.step, r.layer): r for r in trace.records}
    for tid, view in enumerate(request_views(trace).values(), 1):
        events.append(_meta(_REQUESTS_PID, tid, "thread_name", f"{view.label} {view.request_id}"))
        held: set[int] = set()
        for i, app in enumerate(view.appearances):
            start = app.step * STEP_US
            phase = "prefill" if i == 0 or app.query_len > 1 else "decode"
            events.append(
                {
                    "name": phase,
                    "cat": "request",
                    "ph": "X",
                    "ts": start,
                    "dur": STEP_US,
                    "pid": _REQUESTS_PID,
                    "tid": tid,
                    "args": {
                        "step": app.step,
                        "query_len": app.query_len,
                        "seq_len": app.seq_len,
                        "blocks": list(app.blocks),
                    },
                }
            )
            new = [b for b in app.blocks if b not in held]
            record = next(r for (s, _), r in records.items() if s == app.step)
            shared = sorted(set(app.blocks) & record.shared_blocks)
            if new:
                events.append(_instant(f"allocated {len(new)} block(s)", start, tid, {"blocks": new}))
            if shared:
                events.append(_instant(f"shares {len(shared)} block(s)", start + 1, tid, {"blocks": shared}))
            held |= set(app.blocks)
        last = view.last
        events.append(
            _instant(
                f"released {len(held)} block(s)",
                (last.step + 1) * STEP_US - 1,
                tid,
                {"blocks": sorted(held), "note": "after its last recorded step; vLLM frees at finish"},
            )
        )
    return events


def _instant(name: str, ts: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": name,
        "cat": "blocks",
        "ph": "i",
        "s": "t",
        "ts": ts,
        "pid": _REQUESTS_PID,
        "tid": tid,
        "args": args,
    }
