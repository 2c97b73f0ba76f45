"""A tensor-parallel trace: every rank's part, read as one trace with the global heads.

Under tensor parallelism each vLLM worker runs ``1 / world_size`` of every attention layer's
heads on the same block tables (one scheduler), with its own KV cache. Each worker's tracer
writes its part: rank 0 the trace directory itself, rank ``N > 0`` the directory
``rank<N>/`` inside it (:func:`rank_dir`), each a whole trace whose manifest's
``tensor_parallel`` (:class:`~tracer.format.records.TensorParallel`) names the rank, the world
size and the rank's global head ranges. Every rank writes the metadata (block tables, slot
mapping, lengths): nothing decides on one rank's behalf that the others agree, so the reader
checks it.

``Trace.open`` on a multi-rank trace (rank 0's manifest says ``world_size > 1``) opens every
rank and joins them (:func:`join`):

* one record per (step, layer): rank 0's metadata, with the global ``num_heads`` and
  ``num_kv_heads`` (per-head ``alibi_slopes`` / ``sinks`` joined in head order);
* ``Trace.tensors`` joins the ranks' tensors along their head dimension (:func:`join_tensors`):
  ``query``/``output`` over query heads, ``key``/``value``/``kv_written``/``kv_blocks`` over KV
  heads (a KV head replicated on several ranks is taken once, from the first); the rest
  (``kv_slots``, ``kv_block_ids``, ``query_rows``) must be equal on every rank;
* ``Trace.run`` is rank 0's manifest with the KV-cache spec widened to every KV head and no
  ``tensor_parallel``; ``Trace.ranks`` holds each rank's own ``Trace``, whose heads are its local ones;
* every disagreement between ranks (a field of a record, a record or gap one rank lacks) is a
  :class:`RankDisagreement` in ``Trace.disagreements``: replay's ``ranks`` metadata check fails
  on it, and the step's tensors are not joined (:class:`RanksDisagree`, a failing step in replay).

Standard library only; torch is imported when tensors are joined.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from tracer.format.errors import TraceError
from tracer.format.findings import Findings
from tracer.format.records import GapRecord, KVCacheSpec, RunInfo, StepRecord, TensorParallel
from tracer.format.verdicts import MAX_PROBLEMS, MetadataCheck, MetadataProblem
from tracer.format.writelog import NotInWriteLog

if TYPE_CHECKING:
    import torch

__all__ = [
    "HEAD_TENSORS",
    "KV_HEAD_TENSORS",
    "RANKS_CHECK",
    "Joined",
    "RankDisagreement",
    "RanksDisagree",
    "join",
    "join_tensors",
    "kv_ranks",
    "rank_checks",
    "rank_dir",
    "rank_of_head",
]

#: Tensors with a query-head dimension: name -> that dimension.
HEAD_TENSORS = {"query": 1, "output": 1}
#: Tensors with a KV-head dimension: name -> that dimension.
KV_HEAD_TENSORS = {"key": 1, "value": 1, "kv_written": 2, "kv_blocks": 1, "kv_new_blocks": 1}
#: The metadata check a tensor-parallel trace adds (:func:`rank_checks`): the ranks' parts agree.
RANKS_CHECK = "ranks"
#: Record fields that differ between ranks by design (each holds its own heads and tensor file).
PER_RANK_FIELDS = frozenset({"num_heads", "num_kv_heads", "alibi_slopes", "sinks", "tensors", "tensor_names"})


def rank_dir(rank: int) -> str:
    """The directory, inside the trace directory, where tensor-parallel rank ``rank > 0`` writes."""
    return f"rank{rank}"


class RanksDisagree(NotInWriteLog):
    """The ranks' records of a (step, layer) disagree: its tensors cannot be joined.

    As a block the write log does not hold, a verdict on the step: replay fails it, saying why.
    """


@dataclass(frozen=True)
class RankDisagreement:
    """One way a rank's part differs from rank 0's."""

    step: int
    layer: str  #: "" for a gap
    kind: str  #: the record's ``kind`` (``StepRecord.kind``), or ``gap``
    rank: int  #: the rank that differs from rank 0
    field: str  #: the record field, ``record`` (one has it, the other not) or ``gap``
    message: str  #: one line, naming both values

    def __str__(self) -> str:
        return f"step {self.step}{f' {self.layer}' if self.layer else ''}: {self.message}"


@dataclass(frozen=True)
class Joined:
    """What :func:`join` makes of the ranks' parts."""

    run: RunInfo
    records: list[StepRecord]
    disagreements: tuple[RankDisagreement, ...]
    #: per rank, (step, layer) -> that rank's own record
    by_key: tuple[dict[tuple[int, str], StepRecord], ...]


def kv_ranks(parts: Sequence[Any]) -> list[int]:
    """The ranks whose KV heads a joined tensor takes: a KV head replicated on several ranks
    (more ranks than KV heads) is taken once, from the first rank that holds it."""
    starts = [part.run.tensor_parallel.kv_head_start for part in parts]
    return [r for r, start in enumerate(starts) if r == 0 or start != starts[r - 1]]


def rank_of_head(ranks: Sequence[TensorParallel], head: int) -> int | None:
    """The rank that holds global query head ``head``; None when no rank does."""
    return next((tp.rank for tp in ranks if head in tp.heads), None)


def _first_difference(a: Any, b: Any) -> str:
    """Where two field values first differ, briefly: ``row 2 [1, 2, 3] vs [1, 2, 4]``."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        if len(a) != len(b):
            return f"{len(a)} entries vs {len(b)}"
        i = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
        return f"[{i}] {_short(a[i])} vs {_short(b[i])}"
    return f"{_short(a)} vs {_short(b)}"


def _short(value: Any) -> str:
    text = str(list(value) if isinstance(value, tuple) else value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_ranks(parts: Sequence[Any]) -> list[TensorParallel]:
    """Each part's ``tensor_parallel``, checked to tile the heads rank by rank; ``TraceError`` if not."""
    infos: list[TensorParallel] = []
    world = parts[0].run.tensor_parallel.world_size
    next_head = next_kv = 0
    for rank, part in enumerate(parts):
        tp = part.run.tensor_parallel
        where = f"{part.path}"
        if tp is None or tp.rank != rank or tp.world_size != world:
            said = "no tensor_parallel" if tp is None else f"rank {tp.rank} of {tp.world_size}"
            raise TraceError(f"{where}: the manifest says {said}; expected rank {rank} of {world}")
        if tp.head_start != next_head:
            raise TraceError(f"{where}: rank {rank}'s query heads start at {tp.head_start}, expected {next_head}")
        if tp.kv_head_start not in (next_kv, infos[-1].kv_head_start if infos else 0):
            raise TraceError(f"{where}: rank {rank}'s KV heads start at {tp.kv_head_start}, expected {next_kv}")
        next_head = tp.head_start + tp.num_heads
        next_kv = max(next_kv, tp.kv_head_start + tp.num_kv_heads)
        infos.append(tp)
    return infos


def _widened(spec: KVCacheSpec | None, num_kv_heads: int) -> KVCacheSpec | None:
    """``spec`` over ``num_kv_heads`` KV heads: the shape's head dimension, and the strides of a
    dense tensor of that shape laid out in the same memory order."""
    if spec is None:
        return None
    shape = (spec.shape[0], num_kv_heads, *spec.shape[2:])
    order = sorted(range(len(shape)), key=lambda d: -spec.stride[d])  # outermost first
    stride = [0] * len(shape)
    step = 1
    for d in reversed(order):
        stride[d] = step
        step *= shape[d]
    return replace(spec, num_kv_heads=num_kv_heads, shape=shape, stride=tuple(stride))


def _per_head(records: Sequence[StepRecord], name: str) -> tuple[float, ...] | None:
    values = [getattr(r, name) for r in records]
    if any(v is None for v in values):
        return None
    return tuple(x for v in values for x in v)


def _compare(rank: int, mine: StepRecord, first: StepRecord) -> list[RankDisagreement]:
    step, layer, kind = first.step, first.layer, first.kind
    out = []
    for f in dataclasses.fields(StepRecord):
        if f.name in PER_RANK_FIELDS:
            continue
        a, b = getattr(first, f.name), getattr(mine, f.name)
        if a != b:
            detail = _first_difference(a, b)
            out.append(
                RankDisagreement(
                    step, layer, kind, rank, f.name, f"rank {rank}'s {f.name} differs from rank 0's: {detail}"
                )
            )
    if (mine.tensors is None) != (first.tensors is None):
        has = "has" if mine.tensors is not None else "lacks"
        out.append(RankDisagreement(step, layer, kind, rank, "tensors", f"rank {rank} {has} tensors, rank 0 not"))
    return out


def _gap_key(g: GapRecord) -> tuple[int, str, str]:
    return (g.step, g.kind, g.reason)


def join(parts: Sequence[Any]) -> Joined:
    """Join the ranks' traces (``parts[r]`` is rank ``r``'s ``Trace``) into one.

    Raises:
        TraceError: a part's manifest does not say its rank, or the ranks' heads do not follow
            each other (rank ``r`` must start where rank ``r - 1`` ends).
    """
    infos = _check_ranks(parts)
    num_heads = sum(tp.num_heads for tp in infos)
    num_kv_heads = max(tp.kv_head_start + tp.num_kv_heads for tp in infos)
    by_key = tuple({(r.step, r.layer): r for r in part.records} for part in parts)
    disagreements: list[RankDisagreement] = []
    first = by_key[0]
    for rank, mine in enumerate(by_key[1:], 1):
        for key in sorted(first.keys() - mine.keys()):
            message = f"rank {rank} has no record; rank 0 has"
            disagreements.append(RankDisagreement(*key, first[key].kind, rank, "record", message))
        for key in sorted(mine.keys() - first.keys()):
            message = f"rank {rank} has a record; rank 0 has none"
            disagreements.append(RankDisagreement(*key, mine[key].kind, rank, "record", message))
        for key in sorted(mine.keys() & first.keys()):
            disagreements.extend(_compare(rank, mine[key], first[key]))
        gaps0, gaps = {_gap_key(g) for g in parts[0].gaps}, {_gap_key(g) for g in parts[rank].gaps}
        for step, kind, reason in sorted(gaps0 ^ gaps):
            who = f"rank {rank}" if (step, kind, reason) in gaps else "rank 0"
            message = f"only {who} has the {kind} gap {reason!r}"
            disagreements.append(RankDisagreement(step, "", "gap", rank, "gap", message))
    records = []
    for record in parts[0].records:
        key = (record.step, record.layer)
        own = [k[key] for k in by_key if key in k]
        whole = len(own) == len(by_key) and all(r.tensors is not None for r in own)
        names = [n for n in record.tensor_names if all(n in r.tensor_names for r in own)] if whole else []
        records.append(
            replace(
                record,
                num_heads=num_heads if len(own) == len(by_key) else record.num_heads,
                num_kv_heads=num_kv_heads if len(own) == len(by_key) else record.num_kv_heads,
                alibi_slopes=_per_head(own, "alibi_slopes") if len(own) == len(by_key) else record.alibi_slopes,
                sinks=_per_head(own, "sinks") if len(own) == len(by_key) else record.sinks,
                tensors=record.tensors if whole else None,
                tensor_names=tuple(names),
            )
        )
    run = parts[0].run
    run = replace(run, kv_cache=_widened(run.kv_cache, num_kv_heads), tensor_parallel=None)
    return Joined(run=run, records=records, disagreements=tuple(disagreements), by_key=by_key)


def join_tensors(
    parts: Sequence[Any],
    by_key: Sequence[Mapping[tuple[int, str], StepRecord]],
    record: StepRecord,
    disagree: bool,
    device: Any = None,
) -> dict[str, torch.Tensor]:
    """The tensors of joined ``record``: each rank's ``Trace.tensors`` of its own record (on ``device``),
    joined over heads.

    Raises:
        RanksDisagree: the ranks' records of this (step, layer) disagree (``disagree``), or
            their tensors that must be equal (``kv_slots``, ``kv_block_ids``, ...) are not.
    """
    import torch

    key = (record.step, record.layer)
    where = f"step {record.step} layer {record.layer}"
    if disagree:
        raise RanksDisagree(f"{where}: the ranks' records disagree (replay's ranks check says how)")
    loaded = [part.tensors(k[key], device=device) for part, k in zip(parts, by_key, strict=True)]
    kv = kv_ranks(parts)
    out: dict[str, torch.Tensor] = {}
    for name in loaded[0]:
        if not all(name in t for t in loaded):
            continue
        if name in HEAD_TENSORS:
            out[name] = torch.cat([t[name] for t in loaded], dim=HEAD_TENSORS[name])
        elif name in KV_HEAD_TENSORS:
            out[name] = torch.cat([loaded[r][name] for r in kv], dim=KV_HEAD_TENSORS[name])
        else:
            first = loaded[0][name]
            for rank, t in enumerate(loaded[1:], 1):
                if t[name].shape != first.shape or not torch.equal(t[name], first):
                    raise RanksDisagree(f"{where}: tensor {name} of rank {rank} differs from rank 0's")
            out[name] = first
    return out


def rank_checks(trace: Any, records: Sequence[StepRecord]) -> list[MetadataCheck]:
    """Replay's :data:`RANKS_CHECK` of a tensor-parallel ``trace`` (a joined ``Trace``), over ``records``.

    One check per record, failing with each of its :class:`RankDisagreement`; and one failing
    check per (step, layer) of a step of ``records`` that disagrees but has no joined record (a
    gap, a record rank 0 lacks).
    """
    by_key: dict[tuple[int, str], list[Any]] = {}
    for d in trace.disagreements:
        by_key.setdefault((d.step, d.layer), []).append(d)
    out = []
    for r in records:
        f = Findings(r, RANKS_CHECK)
        f.checked = len(trace.ranks) - 1
        for d in by_key.pop((r.step, r.layer), ()):
            f.add(d.message)
        out.append(f.done())
    steps = {r.step for r in records}
    joined = {(r.step, r.layer) for r in trace.records}
    for (step, layer), found in sorted(by_key.items()):
        if step in steps and (step, layer) not in joined:
            problems = tuple(MetadataProblem(d.message) for d in found[:MAX_PROBLEMS])
            out.append(MetadataCheck(step, layer, found[0].kind, RANKS_CHECK, False, len(found), len(found), problems))
    return out
