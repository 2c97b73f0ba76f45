"""The online softmax of one real query, block by block: the records of ``pagedtrace step``.

:func:`reference_impl.stepper.walk_query` fills them from a captured step by running the
reference kernel's own block loop (``paged_attention_loop``) with its ``on_block`` hook;
``reports.stepper_page`` draws them without torch. ``to_json`` / ``from_json`` carry
them between the two (``pagedtrace step --json``).

The report's tour shows one walk: the query :func:`tour_target` picks, walked by ``pagedtrace
replay`` and kept in the trace as :data:`TOUR_WALK`, so that a report builds without torch.

Standard library only.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from tracer.format.records import StepRecord, TraceError
from tracer.format.store import Trace

__all__ = ["TOUR_WALK", "BlockLine", "KernelLine", "PartitionLine", "QueryWalk", "read_tour_walk", "tour_target"]

#: The side file in a trace that holds the tour's walk (written by ``pagedtrace replay``).
TOUR_WALK = "walk.json"


def _num(x: float | None) -> float | None:
    """JSON has no inf/NaN: write them as null (a fully masked block's max is -inf)."""
    return x if x is None or math.isfinite(x) else None


@dataclass(frozen=True)
class KernelLine:
    """A line of ``paged_attention_loop`` that computes a value the walk shows."""

    value: str  #: e.g. ``m``, ``rescale``
    line: int  #: 1-based line in ``reference_impl/kernel.py``
    text: str  #: the line, stripped


@dataclass(frozen=True)
class BlockLine:
    """The running state after logical block ``logical`` is folded in, for one query and head."""

    logical: int  #: j, 0-based
    physical: int  #: the block table's entry (the engine's physical id)
    positions: tuple[int, int]  #: key positions, half-open
    n_valid: int  #: valid tokens of the block (the last block may be partial)
    n_visible: int  #: of those, keys this query sees (causal mask, window)
    block_max: float  #: max score of the block's visible keys (-inf: none visible)
    m: float  #: running max after the block
    l: float  #: running sum of exp(score - m)
    rescale: float  #: exp(m_old - m_new) applied to the old l and acc
    acc_norm: float  #: ||acc||_2, the unnormalised output
    text: str | None = None  #: the words its keys are (None: the trace records no token text)


@dataclass(frozen=True)
class PartitionLine:
    """One partition of the v2 (partitioned) form."""

    blocks: tuple[int, int]  #: logical blocks, half-open
    m: float  #: max score inside the partition
    l: float  #: sum of exp(score - m) inside it
    lse: float  #: log-sum-exp of its scores: m + log(l)
    weight: float  #: exp(lse_p - lse): its share in the merge


@dataclass(frozen=True)
class QueryWalk:
    """One query row of one head in one (step, layer), walked through the kernel."""

    trace: str
    step: int
    layer: str
    request_id: str
    row: int  #: the request's block-table row
    token: int  #: 0-based query index within the request's query rows
    position: int  #: its token position in the sequence
    head: int  #: query head
    kv_head: int  #: the KV head it reads (GQA)
    seq_len: int
    block_size: int
    scale: float
    compute_dtype: str
    blocks: tuple[BlockLine, ...]
    kernel_lines: tuple[KernelLine, ...]
    partition_size: int
    partitions: tuple[PartitionLine, ...]
    lse: float  #: merged log-sum-exp
    loop_vs_partitioned: float  #: max |loop output - partitioned output| for this head's row
    output_norm: float  #: ||acc / l|| of the reference
    vllm_norm: float  #: ||vLLM's output row||
    #: max |vLLM - reference| over the head dimension (a truncating CPU kernel's values read at the
    #: middle of their intervals, as replay reads them)
    max_abs: float
    tolerance: float  #: replay's bar for this head of the step: k * err(the kernel's rounding, emulated) + a floor
    output_head: tuple[float, ...]  #: the first values of the reference output row
    vllm_head: tuple[float, ...]  #: the same values of vLLM's output
    query_text: str | None = None  #: the word whose query this is (None: the trace records no token text)

    @property
    def ok(self) -> bool:
        """vLLM's output is within the bar."""
        return self.max_abs <= self.tolerance

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict (non-finite numbers as null)."""
        data = asdict(self)
        for line in data["blocks"]:
            line["block_max"] = _num(line["block_max"])
        data["ok"] = self.ok
        return data

    @classmethod
    def from_json(cls, data: Any) -> QueryWalk:
        """Read :meth:`to_json`'s output back; a malformed object is a ``TraceError``."""
        try:
            body = {k: v for k, v in data.items() if k != "ok"}
            body["blocks"] = tuple(
                BlockLine(
                    **{
                        **b,
                        "positions": tuple(b["positions"]),
                        "block_max": -math.inf if b["block_max"] is None else b["block_max"],
                    }
                )
                for b in body["blocks"]
            )
            body["kernel_lines"] = tuple(KernelLine(**k) for k in body["kernel_lines"])
            body["partitions"] = tuple(PartitionLine(**{**p, "blocks": tuple(p["blocks"])}) for p in body["partitions"])
            body["output_head"] = tuple(body["output_head"])
            body["vllm_head"] = tuple(body["vllm_head"])
            return cls(**body)
        except (AttributeError, KeyError, TypeError) as exc:
            raise TraceError(f"not a query walk: {exc}") from None


def tour_target(trace: Trace) -> tuple[int, str, str] | None:
    """``(step, request id, layer)`` of the query the tour walks, or None (no tensors).

    The first request step with tensors (the first traced layer), its row with the most
    blocks: the most iterations of the loop to show.
    """
    layer = trace.layers[0] if trace.layers else None
    records: list[StepRecord] = [
        r for r in trace.records if r.kind == "request" and r.tensors is not None and r.layer == layer
    ]
    if not records or not records[0].request_ids:
        return None
    record = records[0]
    row = max(range(len(record.seq_lens)), key=lambda i: (record.seq_lens[i], -i))
    return record.step, record.request_ids[row], record.layer


def read_tour_walk(trace: Trace) -> QueryWalk | None:
    """The walk ``pagedtrace replay`` kept for the tour (:data:`TOUR_WALK`); None if there is none.

    Raises ``TraceError`` when the file is unreadable or its walk is not of this trace's target.
    """
    data = trace.read_json(TOUR_WALK)
    if data is None:
        return None
    walk = QueryWalk.from_json(data)
    target = tour_target(trace)
    if target is None or (walk.step, walk.request_id, walk.layer) != target:
        raise TraceError(f"{trace.path / TOUR_WALK}: a walk of step {walk.step}, not of the query the tour shows")
    return walk
