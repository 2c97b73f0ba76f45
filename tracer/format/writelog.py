"""The KV write log (format 3): rebuild the blocks a step reads from the writes before it.

A write-log record (``StepRecord.kv_log_epoch`` not None) stores what its step *wrote* to
the layer's cache, not every block it read:

- ``kv_slots`` int64 ``[t]``: the slots written (``slot_mapping`` entries >= 0, in order);
- ``kv_written`` ``[t, 2, H_kv, D]``: the cache entries at those slots after the write, K then V,
  in the cache's dtype;
- ``kv_new_block_ids`` int32 ``[m]`` and ``kv_new_blocks`` ``[m, *cache.shape[1:]]``: whole
  blocks (after the write) the trace had not seen yet in this run;
- on a *check step*, also ``kv_blocks`` / ``kv_block_ids`` as in format 2 (every block read).

Records of one layer with the same ``kv_log_epoch``, in step order, form a *run*. The reader
replays a run from an empty state: each record's snapshots go in whole, then each written
slot ``s`` puts its row at token ``s % block_size`` of block ``s // block_size``, at the
positions :func:`tracer.format.layouts.token_elements` gives for the layout. Check-step
``kv_blocks`` never enter the state: they are what :func:`verify_write_log` compares it with.
A block is only as known as the log makes it (a snapshot: every token; a write: its token);
a step reading a token the log does not know is a ``TraceError`` naming step, layer and block.

The state is kept per layer and continues from the last record rebuilt when a later record
of the same run is asked for; anything else replays the run from its start. Only the
``kv_*`` tensors of earlier records are read (``safetensors.safe_open``), and only the
blocks the run has touched are kept, in the cache's dtype viewed as integers so every bit
(NaN payloads included) comes back as stored. The blocks' bits may live on a GPU
(``device``): each step then sends only what it wrote there, and its blocks come back
there, instead of every block it reads crossing the bus; which blocks and tokens the log
knows stays on the CPU, where the block table is.

The reader asks of a trace only what :class:`LoggedTrace` names (its records, its manifest,
its tensor files), so this module does not import the store that owns a reader.

Standard library at module level; torch and safetensors are imported inside functions.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from tracer.format.errors import TraceError
from tracer.format.layouts import token_elements
from tracer.format.records import KVCacheSpec, RunInfo, StepRecord
from tracer.format.schema import WRITE_LOG_TENSORS, check_tensors

if TYPE_CHECKING:
    import torch

__all__ = ["WRITE_LOG_TENSORS", "KVCheck", "LoggedTrace", "NotInWriteLog", "WriteLogReader", "verify_write_log"]


class LoggedTrace(Protocol):
    """What the write-log reader reads of a trace: :class:`tracer.format.store.Trace` is one."""

    @property
    def run(self) -> RunInfo:
        """The manifest: its ``kv_cache`` gives the geometry the log addresses."""
        ...

    @property
    def records(self) -> Sequence[StepRecord]:
        """Every step record, in any order (the reader groups them into runs)."""
        ...

    def tensor_path(self, record: StepRecord) -> Path:
        """The tensor file of ``record``; ``TraceError`` when it has none."""
        ...


class NotInWriteLog(TraceError):
    """A block (or token) a step reads that its write log does not hold: the step cannot be rebuilt.

    Unlike a missing or unreadable file (bad input), this is a verdict on the step: replay
    fails it, naming the block, as it fails a format-2 step whose block was not captured.
    """


def _where(record: StepRecord) -> str:
    return f"step {record.step} layer {record.layer[:80]!r}"


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` reinterpreted as integers of its element size (contiguous): compared and copied bit for bit."""
    import torch

    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    t = t.contiguous()
    size = t.element_size()
    if size not in ints:
        raise TraceError(f"a KV cache of {size}-byte elements ({t.dtype}) cannot be rebuilt")
    return t if t.dtype == ints[size] else t.view(ints[size])


@dataclass(frozen=True, eq=False)
class _Geometry:
    """One layer's cache as the write log addresses it (from the manifest's ``KVCacheSpec``)."""

    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    block_shape: tuple[int, ...]  #: ``cache.shape[1:]``, logical ``(H_kv, block_size, 2*D)``
    index: torch.Tensor  #: long ``[block_size, 2*H_kv*D]``: ``token_elements`` of the layout

    @property
    def elements(self) -> int:
        """Elements of one block."""
        return math.prod(self.block_shape)

    @classmethod
    def of(cls, spec: KVCacheSpec | None) -> _Geometry:
        import torch

        if spec is None:
            raise TraceError("the manifest has no kv_cache: a KV write log cannot be rebuilt without its geometry")
        h, bs, d = spec.num_kv_heads, spec.block_size, spec.head_size
        block_shape = tuple(spec.shape[1:])
        if math.prod(block_shape) != 2 * h * bs * d:
            raise TraceError(
                f"the manifest's kv_cache shape {list(spec.shape)} does not hold {h} kv heads x {bs} tokens x 2*{d}"
            )
        try:
            rows = token_elements(spec.layout, h, bs, d)
        except ValueError as exc:
            raise TraceError(f"the manifest's kv_cache: {exc}") from None
        index = torch.tensor(rows, dtype=torch.long)
        return cls(spec.num_blocks, bs, h, d, block_shape, index)


class _LayerState:
    """The blocks one run of one layer has rebuilt so far, up to record ``done`` of the run.

    ``data`` lives on ``device``; the bookkeeping (``row_of``, ``known``) on the CPU.
    """

    def __init__(self, epoch: int, geometry: _Geometry, device: torch.device) -> None:
        import torch

        self.epoch = epoch
        self.geometry = geometry
        self.device = device
        self.index = geometry.index.to(device)  #: ``geometry.index`` where ``data`` is
        self.done = -1  #: index in the run of the last record applied
        self.dtype: torch.dtype | None = None  #: the cache's dtype, from the first record's tensors
        self.row_of = torch.full((geometry.num_blocks,), -1, dtype=torch.long)  #: block id -> row of data
        self.count = 0  #: rows in use
        self.data = torch.empty(0, device=device)  #: [capacity, elements], the cache's bits (integers)
        self.known = torch.zeros(0, geometry.block_size, dtype=torch.bool)  #: [capacity, block_size]

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``ids`` (unique block ids), allocating (zeros, unknown) those not seen yet."""
        import torch

        rows = self.row_of[ids]
        new = ids[rows < 0]
        if new.numel():
            need = self.count + new.numel()
            capacity = self.data.shape[0]
            if need > capacity:
                grown = min(max(need, 2 * capacity, 8), self.geometry.num_blocks)
                data = torch.zeros(grown, self.geometry.elements, dtype=self.data.dtype, device=self.device)
                data[:capacity] = self.data
                known = torch.zeros(grown, self.geometry.block_size, dtype=torch.bool)
                known[:capacity] = self.known
                self.data, self.known = data, known
            self.row_of[new] = torch.arange(self.count, need, dtype=torch.long)
            self.count = need
            rows = self.row_of[ids]
        return rows

    def apply(self, record: StepRecord, tensors: Mapping[str, torch.Tensor]) -> None:
        """Put one record's snapshots, then its writes, into the state."""
        import torch

        geo = self.geometry
        written = tensors["kv_written"]
        new_blocks = tensors["kv_new_blocks"]
        if self.dtype is None:
            self.dtype = written.dtype
            self.data = torch.zeros(0, geo.elements, dtype=_bits(written).dtype, device=self.device)
        for name, t in (("kv_written", written), ("kv_new_blocks", new_blocks)):
            if t.dtype != self.dtype:
                raise TraceError(
                    f"{_where(record)}: tensor {name} is {t.dtype}, earlier records of its run {self.dtype}"
                )
        new_ids = tensors["kv_new_block_ids"].long()
        if new_ids.numel():
            rows = self._rows(new_ids)
            self.data[rows.to(self.device)] = _bits(new_blocks).reshape(new_ids.numel(), geo.elements).to(self.device)
            self.known[rows] = True
        slots = tensors["kv_slots"].long()
        if slots.numel():
            values = _bits(written).reshape(slots.numel(), -1).to(self.device)
            if torch.unique(slots).numel() < slots.numel():
                # A slot written twice in one step holds its last write, as the cache would.
                last = {s: j for j, s in enumerate(slots.tolist())}
                keep = torch.tensor(sorted(last.values()), dtype=torch.long)
                slots, values = slots[keep], values[keep.to(self.device)]
            blocks, tokens = slots // geo.block_size, slots % geo.block_size
            unique, inverse = torch.unique(blocks, return_inverse=True)
            rows = self._rows(unique)[inverse]
            rows_at, tokens_at = torch.stack([rows, tokens]).to(self.device)  # one copy
            self.data[rows_at[:, None], self.index[tokens_at]] = values
            self.known[rows, tokens] = True

    def read(self, record: StepRecord, first_step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(ids int32 [n], blocks [n, *block_shape], known bool [n, block_size])`` for ``record``'s block table.

        ``blocks`` is on the state's device; ``ids`` and ``known`` on the CPU.

        Raises:
            TraceError: a block, or a token the step reads, is not in the write log.
        """
        import torch

        geo = self.geometry
        bs = geo.block_size
        # Each block the table names, and the tokens from its start that some row reads.
        table = record.block_table
        if len(table) != len(record.seq_lens):
            raise TraceError(f"{_where(record)}: {len(table)} block-table rows for {len(record.seq_lens)} seq_lens")
        entries = torch.tensor(list(itertools.chain.from_iterable(table)), dtype=torch.long)
        widths = torch.tensor([len(row) for row in table], dtype=torch.long)
        starts = torch.repeat_interleave(torch.cumsum(widths, 0) - widths, widths)
        position = torch.arange(len(entries)) - starts  # j: the entry's place in its row
        seq_lens = torch.repeat_interleave(torch.tensor(record.seq_lens, dtype=torch.long), widths)
        reads = (seq_lens - position * bs).clamp(max=bs)
        id_tensor, inverse = torch.unique(entries, return_inverse=True)  # sorted
        most = torch.full((len(id_tensor),), -(1 << 62), dtype=torch.long)
        most = most.scatter_reduce(0, inverse, reads, reduce="amax")
        ids = id_tensor.tolist()
        rows = torch.full((len(ids),), -1, dtype=torch.long)
        inside = (id_tensor >= 0) & (id_tensor < geo.num_blocks)  # a record changed in memory may name others
        rows[inside] = self.row_of[id_tensor[inside]]
        present = rows >= 0
        known = torch.zeros(len(ids), bs, dtype=torch.bool)
        known[present] = self.known[rows[present]]
        leading = known.to(torch.int32).cumprod(dim=1).sum(dim=1)  # known tokens from offset 0
        short = ~present | (leading < most)
        if bool(short.any()):
            self._missing(
                record, first_step, set(id_tensor[short].tolist()), dict(zip(ids, leading.tolist(), strict=True))
            )
        # Rows of bytes: torch's CPU index_select copies a byte row with one memcpy, wider elements one by one.
        taken = self.data.view(torch.uint8).index_select(0, rows.to(self.device))
        blocks = taken.view(self.dtype).reshape(len(ids), *geo.block_shape)  # type: ignore[arg-type]
        return id_tensor.to(torch.int32), blocks, known

    def _missing(self, record: StepRecord, first_step: int, short: set[int], leading: dict[int, int]) -> None:
        """Raise the one-line error for the first block-table entry the log cannot serve."""
        for i, row in enumerate(record.block_table):
            for block in row:
                if block not in short:
                    continue
                since = f"kv_log_epoch {self.epoch}, which starts at step {first_step}"
                if not 0 <= block < self.geometry.num_blocks or int(self.row_of[block]) < 0:
                    raise NotInWriteLog(
                        f"{_where(record)}: block {block} (request row {i}) is not in the write log: "
                        f"no snapshot of it and no write to it in {since}"
                    )
                raise NotInWriteLog(
                    f"{_where(record)}: block {block} token {leading[block]} (request row {i}) is not in the write "
                    f"log: the block has no snapshot and that token no write in {since}"
                )


class WriteLogReader:
    """Rebuilds write-log records' ``kv_blocks`` for one trace (a :class:`LoggedTrace`).

    ``Trace.tensors`` and ``Trace.rebuilt_kv`` use the one the trace owns (``trace.write_log``).
    State is kept per layer, one run at a time: asking for a later record of the run
    continues from the last one rebuilt; any other record replays its run from the start.
    """

    def __init__(self, trace: LoggedTrace) -> None:
        self.trace = trace
        self._indexed = -1  # len(trace.records) when the runs were indexed
        self._runs: dict[tuple[str, int], list[StepRecord]] = {}
        self._position: dict[tuple[str, int, int], int] = {}  # (layer, epoch, step) -> index in its run
        self._states: dict[str, _LayerState] = {}
        self._geometry: _Geometry | None = None

    def rebuild(
        self,
        record: StepRecord,
        tensors: Mapping[str, torch.Tensor] | None = None,
        *,
        device: torch.device | str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(kv_block_ids int32 [n], kv_blocks [n, *cache.shape[1:]])`` of ``record``, from the log.

        ``tensors``: ``record``'s own tensors when the caller has them loaded already (ids on the CPU,
        the written values on the CPU or on ``device``).
        ``device``: where the run's blocks are kept and ``kv_blocks`` comes back (None: the CPU);
        ``kv_block_ids`` is on the CPU. Asking for another device than the last rebuild of this
        layer's run replays the run there from its start.

        Raises:
            TraceError: ``record`` is not a write-log record, its run cannot be read, or a
                block it reads is not in the log.
        """
        ids, blocks, _ = self.rebuild_known(record, tensors, device=device)
        return ids, blocks

    def rebuild_known(
        self,
        record: StepRecord,
        tensors: Mapping[str, torch.Tensor] | None = None,
        *,
        device: torch.device | str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`rebuild`, and which tokens of each block the log knows (bool ``[n, block_size]``, CPU)."""
        import torch

        at = torch.device("cpu" if device is None else device)
        epoch = record.kv_log_epoch
        if epoch is None:
            raise TraceError(f"{_where(record)}: not a write-log record (kv_log_epoch is null)")
        if self._geometry is None:
            self._geometry = _Geometry.of(self.trace.run.kv_cache)
        self._index()
        position = self._position.get((record.layer, epoch, record.step))
        if position is None:
            raise TraceError(f"{_where(record)}: not a record of this trace (kv_log_epoch {epoch})")
        run = self._runs[(record.layer, epoch)]
        state = self._states.get(record.layer)
        if state is None or state.epoch != epoch or state.done > position or state.device != at:
            state = self._states[record.layer] = _LayerState(epoch, self._geometry, at)
        try:
            for i in range(state.done + 1, position + 1):
                own = tensors if i == position and tensors is not None else None
                state.apply(run[i], own if own is not None else self.load(run[i], WRITE_LOG_TENSORS))
                state.done = i
        except BaseException:
            del self._states[record.layer]  # half applied: never continue from it
            raise
        return state.read(record, run[0].step)

    def reset(self, layer: str | None = None) -> None:
        """Drop the state of ``layer`` (every layer when None); the next rebuild replays its run."""
        if layer is None:
            self._states.clear()
        else:
            self._states.pop(layer, None)

    def load(self, record: StepRecord, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """Only ``names`` of ``record``'s tensor file (and, for a write-log record, the log's
        tensors with them), checked against the record and the manifest."""
        if record.kv_log_epoch is not None:
            names = (*WRITE_LOG_TENSORS, *(n for n in names if n not in WRITE_LOG_TENSORS))
        names = tuple(names)
        if record.tensors is None:
            raise TraceError(
                f"{_where(record)}: no tensors captured, so the KV write log of kv_log_epoch "
                f"{record.kv_log_epoch} cannot be read past it"
            )
        file = self.trace.tensor_path(record)
        try:
            from safetensors import safe_open

            with safe_open(str(file), framework="pt") as f:
                stored = set(f.keys())
                loaded = {name: f.get_tensor(name) for name in names if name in stored}
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise TraceError(f"{file}: cannot read tensors: {str(exc)[:200]}") from None
        check_tensors(record, loaded, self.trace.run.kv_cache)  # first: it names a write-log tensor missing
        missing = [name for name in names if name not in loaded]
        if missing:
            raise TraceError(f"{file}: tensors {missing} missing")
        return loaded

    def _index(self) -> None:
        """Group the trace's write-log records into runs (again if records were added)."""
        records = self.trace.records
        if self._indexed == len(records):
            return
        runs: dict[tuple[str, int], list[StepRecord]] = {}
        for rec in records:
            if rec.kv_log_epoch is not None:
                runs.setdefault((rec.layer, rec.kv_log_epoch), []).append(rec)
        position: dict[tuple[str, int, int], int] = {}
        for (layer, epoch), run in runs.items():
            run.sort(key=lambda r: r.step)
            for i, rec in enumerate(run):
                if (layer, epoch, rec.step) in position:
                    raise TraceError(f"{_where(rec)}: two records of kv_log_epoch {epoch} for one step")
                position[(layer, epoch, rec.step)] = i
        self._runs, self._position, self._indexed = runs, position, len(records)
        self._states.clear()


@dataclass(frozen=True)
class KVCheck:
    """One check step: the rebuilt blocks against the whole blocks the step stored."""

    step: int
    layer: str
    kv_log_epoch: int
    blocks: int  #: blocks compared
    tokens: int  #: block tokens compared: those the log knows (a snapshot, or a write)
    block: int | None = None  #: first differing block (physical id); None when equal
    token: int | None = None  #: its first differing token offset (0-based)
    detail: str = ""  #: what differs, one line; empty when the rebuild is exact

    @property
    def ok(self) -> bool:
        """The rebuild equals the stored blocks bit for bit (every token the log knows)."""
        return not self.detail


def verify_write_log(trace: LoggedTrace) -> list[KVCheck]:
    """Check every check step of ``trace`` (a write-log record that also stores ``kv_blocks``).

    The rebuilt blocks are compared with the stored ones as raw bits, token by token, over
    the tokens the log knows; the first difference (in block-id order, then token order) is
    named with its K/V, head and dim. A record the log cannot rebuild is a failed check
    whose ``detail`` says why. A reader of its own walks the records in the trace's order,
    so each layer's state advances once through each run, and the trace's own reader
    (``Trace.write_log``) keeps its state.
    """
    reader = WriteLogReader(trace)
    results = []
    for record in trace.records:
        if record.kv_log_epoch is None or "kv_blocks" not in record.tensor_names:
            continue
        results.append(_check(reader, record))
    return results


def _check(reader: WriteLogReader, record: StepRecord) -> KVCheck:
    import torch

    epoch = record.kv_log_epoch
    assert epoch is not None
    head = (record.step, record.layer, epoch)
    try:
        ids, rebuilt, known = reader.rebuild_known(record)
        stored = reader.load(record, ("kv_blocks", "kv_block_ids"))
    except TraceError as exc:
        return KVCheck(*head, blocks=0, tokens=0, detail=str(exc))
    stored_ids = [int(b) for b in stored["kv_block_ids"].tolist()]
    rebuilt_ids = [int(b) for b in ids.tolist()]
    if stored_ids != rebuilt_ids:
        first = min(set(stored_ids) ^ set(rebuilt_ids))
        return KVCheck(
            *head, blocks=0, tokens=0, block=first,
            detail=f"stored kv_block_ids {stored_ids[:8]} are not the block table's blocks {rebuilt_ids[:8]}",
        )  # fmt: skip
    blocks = stored["kv_blocks"]
    tokens = int(known.sum())
    if blocks.dtype != rebuilt.dtype:
        detail = f"stored kv_blocks are {blocks.dtype}, the write log {rebuilt.dtype}"
        return KVCheck(*head, blocks=len(ids), tokens=tokens, detail=detail)
    geo = reader._geometry
    assert geo is not None
    n = len(rebuilt_ids)
    got = _bits(rebuilt).reshape(n, -1)[:, geo.index]  # [n, bs, 2*H*D]
    want = _bits(blocks).reshape(n, -1)[:, geo.index]
    differs = (got != want) & known[:, :, None]
    if not bool(differs.any()):
        return KVCheck(*head, blocks=n, tokens=tokens)
    row, token, element = (int(i) for i in torch.nonzero(differs)[0])
    hd = geo.num_kv_heads * geo.head_size
    part, kv_head, dim = "KV"[element // hd], (element % hd) // geo.head_size, element % geo.head_size
    width = 2 * rebuilt.element_size()
    mask = (1 << (8 * rebuilt.element_size())) - 1
    was, now = int(got[row, token, element]) & mask, int(want[row, token, element]) & mask
    block = rebuilt_ids[row]
    detail = (
        f"block {block} token {token}: {part} head {kv_head} dim {dim} is 0x{was:0{width}x} in the rebuild, "
        f"0x{now:0{width}x} in the check step"
    )
    return KVCheck(*head, blocks=n, tokens=tokens, block=block, token=token, detail=detail)
