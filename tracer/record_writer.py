"""The writer's half of the tracer: records, the KV write log's tensors, the trace on disk.

:class:`RecordWriter` is handed the slots one at a time, in step order. A trace without tensors
has no writer thread: the engine's own thread hands each slot over
(``tracer.handover.InlineWriter``), :meth:`RecordWriter.send_slot` turns it into hosts and items
of a ``tracer.messages.Message``, and :meth:`RecordWriter.send_records` sends that message, one a
hand-over, to the record writer process (``tracer.record_process``), which builds and writes
the records. A trace with tensors has a writer thread (``tracer.handover.WriterThread``): each
slot's captures (``tracer.layer_capture.LayerCapture``) become records here, and tensor steps become
write-log tensors (copied to the host on a CUDA stream of the writer's own, so the engine's
stream never waits). A trace without tensors whose record process cannot start
(:meth:`RecordWriter.start`) has its records built here too, on the engine's thread. Either way
the manifest goes to disk before the first line of ``steps.jsonl``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from tracer.engine_state import cuda_available
from tracer.format import GapRecord, RunInfo, StepRecord, TraceWriter
from tracer.format.rows import QUERY_ROWS, sample_rows
from tracer.format.schema import KV_INPUTS_WRITTEN
from tracer.host_buffers import host_message
from tracer.jsonline import encode_line
from tracer.layer_capture import LayerCapture, host_lists, make_record, read_static_floats
from tracer.manifest import tp_rank, write_manifest
from tracer.messages import Gap, Host, Item, Layer, RequestIds, SharedCopy, Step
from tracer.options import TracerOptions
from tracer.record_process import RecordProcess
from tracer.shared_host import SharedHost
from tracer.slots import Slot
from tracer.writelog import INT_OF_SIZE, WriteLog

__all__ = ["RecordWriter"]

logger = logging.getLogger("pagedtrace")


class RecordWriter:
    """Writes one trace directory from the slots its writer (the engine's thread or a writer thread) hands it.

    ``on_fail(message)``: called on a write error (the tracer stops recording, the engine
    runs on). ``vllm_config`` is set by the hooks once a runner is seen (for the manifest).
    """

    def __init__(self, options: TracerOptions, on_fail: Callable[[str], None]):
        self.options = options
        self.on_fail = on_fail
        self.failed = False
        self.vllm_config: Any = None
        self.runner: Any = None  #: the model runner (its ``kv_cache_config`` gives the manifest's groups)
        self.log = WriteLog(options.kv_check_every)
        self.stats = {"records": 0, "gaps": 0, "tensor_files": 0}
        self._writer: TraceWriter | None = None
        self._manifest_written = False  # with the first record's backend and KV cache
        self._run_info: RunInfo | None = None  # the manifest on disk, once written
        self._side_stream: Any = None
        #: Without tensors the engine's thread hands the slots over, several steps a message
        #: (``tracer.handover.InlineWriter``); a tensor trace has a writer thread
        self.inline = not options.tensors
        #: Without tensors the records are built and written by a process of their own, off the
        #: engine's GIL (``tracer.record_process``); None: this process writes them
        self.records_out: RecordProcess | None = None if options.tensors else RecordProcess(self.directory)
        #: the next message: (hosts, items, the byte offsets of the shared stretches its hosts name)
        self._outgoing: tuple[list[Host], list[Item], list[int]] = ([], [], [])
        self._layers_sent: dict[str, tuple[Any, ...]] = {}  # layer -> LayerCapture.layer_key() last sent
        self._ids_sent: tuple[str, ...] | None = None  # the request ids last sent (the records after carry them)

    def shared_host(self) -> SharedHost | None:
        """The memory the record writer process maps, once it runs (``tracer.shared_host``); else None."""
        out = self.records_out
        return out.shared_host if out is not None and not self.failed else None

    @property
    def budget_exhausted(self) -> bool:
        return self._writer is not None and self._writer.budget_exhausted

    def side_stream(self) -> Any:
        """A CUDA stream of the writer's own for its device-to-host copies (made on first use)."""
        if self._side_stream is None:
            import torch

            self._side_stream = torch.cuda.Stream()
        return self._side_stream

    def handle_slot(self, slot: Slot) -> None:
        """The slot's copies have landed: write its records in order (or queue them for the record process)."""
        if self.records_out is not None:
            self.send_slot(slot)
            return
        slot.make_views()
        for item in slot.payload["captures"]:
            if self.failed:
                return
            if isinstance(item, GapRecord):
                self.write(item, None)
                self.stats["gaps"] += 1
                continue
            record = make_record(self.record_fields(item), host_lists(item.host), item.static.block_size)
            tensors = None
            if item.tensors is not None:  # an unlogged write before it came with item.reset (hooks._end_pass)
                pages = item.tensors.get("paged_kv_indices")
                if pages is not None:  # FlashInfer's page indices: a record field, read on the writer's thread
                    record = replace(record, paged_kv_indices=self._ints(pages))
                record, tensors = self.log_tensors(item, record)
            self.write(record, tensors, item)
            self.stats["records"] += 1

    def _ints(self, tensor: Any) -> tuple[int, ...]:
        """A small device tensor's values, read through the writer's own stream (never the engine's)."""
        stream = self.side_stream() if cuda_available() and tensor.is_cuda else None
        if stream is None:
            return tuple(tensor.tolist())
        import torch

        with torch.cuda.stream(stream):
            return tuple(tensor.cpu().tolist())

    def send_records(self) -> None:
        """Send what :meth:`send_slot` queued to the record writer process, in one message (after each hand-over)."""
        if self.records_out is None or not self._outgoing[1]:
            return
        hosts, items, regions = self._outgoing
        self._outgoing = ([], [], [])
        if not self.failed and not self.records_out.send(hosts, items, regions):
            self._process_failed()

    def flush_records(self) -> None:
        """Write the messages the record process's pipe holds back (``RecordProcess.batch``) now."""
        if self.records_out is not None and not self.failed and not self.records_out.flush():
            self._process_failed()

    def record_fields(self, item: LayerCapture) -> dict[str, Any]:
        """``item``'s record fields (``LayerCapture.record_fields``), the layer's floats read once.

        The layer's scales are kept from its first record on when vLLM does not recompute them
        (``calculate_kv_scales`` off): later captures carry none (``tracer.layer_capture.capture_scales``).
        """
        read_static_floats(item.static)
        fields = item.record_fields()
        self._keep_scales(item, fields)
        return fields

    @staticmethod
    def _keep_scales(item: LayerCapture, fields: dict[str, Any]) -> None:
        if item.scales is not None and not getattr(item.static.module, "calculate_kv_scales", False):
            item.static.scales = {k: fields[k] for k in ("q_scale", "k_scale", "v_scale")}

    def start(self) -> None:
        """Start the record writer process now, before the engine's steps; if it cannot, this process writes."""
        if self.records_out is None:
            return
        try:
            self.records_out.start()
        except OSError as exc:
            logger.warning(
                "pagedtrace: cannot start the record writer process (%s); this process writes the records", exc
            )
            self.records_out = None

    def sync(self) -> None:
        """Every record handed over so far is on disk (the record writer process has written it)."""
        if self.records_out is not None and not self.records_out.sync() and not self.failed:
            self._process_failed()

    def send_slot(self, slot: Slot) -> None:
        """A slot without tensors, for the record writer process: its host buffers and record fields.

        Queued into the next message (:meth:`send_records` sends it): each KV-cache group's host
        buffers once (``host_message``: where they are in the memory the process maps, or their
        bytes, no view made), a ``Layer`` item with the layer's unchanging fields and a
        ``RequestIds`` item when they are new or changed, then a ``Step`` item a record (and a
        ``Gap`` item a gap). What stays here is what needs the engine's objects: the layer's
        ALiBi slopes and sinks (read once), its scales, and the manifest (written before the
        first record is sent).
        """
        assert self.records_out is not None
        hosts, items, regions = self._outgoing
        host_index: dict[int, int] = {}
        try:
            for item in slot.payload["captures"]:
                if self.failed:
                    return
                if isinstance(item, GapRecord):
                    self._ensure_manifest(None)
                    items.append(Gap(item.to_json()))
                    self.stats["gaps"] += 1
                    continue
                static = item.static
                if not static.floats_read:
                    read_static_floats(static)
                step = item.step_fields(with_ids=False)
                if item.scales is not None:
                    self._keep_scales(item, step)
                if item.req_ids is not self._ids_sent:  # a decode step's batch is the last step's (the same tuple)
                    self._ids_sent = item.req_ids
                    items.append(RequestIds(item.req_ids))
                if not self._manifest_written:
                    self._ensure_manifest(item)
                layer = static.name
                key = item.layer_key()
                if self._layers_sent.get(layer) != key:
                    self._layers_sent[layer] = key
                    items.append(Layer(layer, item.layer_fields()))
                host = item.host
                index = host_index.get(id(host))
                if index is None:
                    index = host_index[id(host)] = len(hosts)
                    message = host_message(host)
                    hosts.append(message)
                    if isinstance(message, SharedCopy):  # its stretch is free again once the child has read the message
                        regions.append(message.offset)
                items.append(Step(index, static.block_size, layer, step))
                self.stats["records"] += 1
        except OSError as exc:
            self._write_failed(exc)

    def _process_failed(self) -> None:
        """The record writer process ended early: its one line (``RecordProcess.error``) stops the trace."""
        assert self.records_out is not None and self.records_out.error is not None
        self.on_fail(self.records_out.error)

    def _write_failed(self, exc: OSError) -> None:
        self.on_fail(
            f"pagedtrace: cannot write trace to {self.options.directory}: {exc}; tracing stops, the engine runs on"
        )

    def log_tensors(self, item: LayerCapture, record: StepRecord) -> tuple[StepRecord, dict[str, Any] | None]:
        """The write-log tensors of one record.

        Every device-to-host copy is queued at once on the writer's own stream into pinned
        memory, then one event is waited for (blocking: the thread sleeps in the driver),
        rather than a synchronous copy per tensor.
        """
        import numpy as np
        import torch

        dev = item.tensors
        assert dev is not None
        on_cuda = cuda_available()
        n = record.num_actual_tokens
        slots = np.asarray(record.slot_mapping[:n], dtype=np.int64)
        rows = np.flatnonzero(slots >= 0)  # padding rows (slot -1) wrote nothing
        # The host block table the record was made from ([num_reqs, cols], cols as the clone's):
        # the plan, and each block's row in read_blocks, come from it without a Python loop.
        epoch, new_blocks, check, ids, rows_of = self.log.plan_table(
            item.layer,
            item.host["block_table"].numpy(),
            record.seq_lens,
            slots[rows],
            item.static.block_size,
            reset=item.reset,
        )
        read_blocks = dev["read_blocks"]

        def blocks_of(wanted: Any) -> Any:
            index = torch.from_numpy(rows_of[np.searchsorted(ids, wanted)]).to(read_blocks.device)
            return read_blocks.index_select(0, index)

        kept = None
        if self.options.query_rows and n > self.options.query_rows:
            kept = sample_rows(record.query_start_loc, self.options.query_rows, record.step)
        stream = self.side_stream() if on_cuda else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            picked = {k: dev[k] for k in ("query", "output") if k in dev}
            if kept is not None:
                index = torch.tensor(kept, dtype=torch.long, device=dev["query"].device)
                picked = {k: t.index_select(0, index) for k, t in picked.items()}
            out: dict[str, Any] = {k: _to_host(t, on_cuda) for k, t in picked.items()}
            same = inputs_are_written(dev, rows, n)
            for k in ("key", "value"):
                if k in dev and not same:
                    out[k] = _to_host(dev[k], on_cuda)
            written = _to_host(dev["written"], on_cuda)
            out["kv_new_blocks"] = _to_host(blocks_of(np.asarray(new_blocks, dtype=np.int64)), on_cuda)
            if check:
                out["kv_blocks"] = _to_host(blocks_of(ids), on_cuda)
                out["kv_block_ids"] = torch.from_numpy(ids.astype(np.int32))
            if stream is not None:
                done = torch.cuda.Event(blocking=True)
                done.record(stream)
                done.synchronize()
        spec_heads = (record.num_heads, record.head_size)
        out["query"] = out["query"].reshape(-1, *spec_heads)
        out["output"] = out["output"].reshape(-1, *spec_heads)
        if kept is not None:
            out[QUERY_ROWS] = torch.tensor(kept, dtype=torch.int64)
        if same:
            out[KV_INPUTS_WRITTEN] = torch.ones(1, dtype=torch.uint8)
        out["kv_slots"] = torch.from_numpy(slots[rows])
        out["kv_written"] = written[torch.from_numpy(rows)] if len(rows) != written.shape[0] else written
        out["kv_new_block_ids"] = torch.tensor(new_blocks, dtype=torch.int32)
        size = sum(t.numel() * t.element_size() for t in out.values())
        writer = self.writer()
        budget = writer.tensor_budget_bytes
        if budget is not None and writer.tensor_bytes + size > budget:
            writer.budget_exhausted = True
            self.log.invalidate(item.layer)
            return record, None
        return replace(record, kv_log_epoch=epoch), out

    def write(
        self, record: StepRecord | GapRecord, tensors: dict[str, Any] | None, first: LayerCapture | None = None
    ) -> None:
        """Append one record; the manifest goes to disk before the first line of ``steps.jsonl``.

        ``first``: the record's capture, whose backend and cache complete the manifest.
        """
        if self.failed:
            return
        try:
            writer = self.writer()
            self._ensure_manifest(first)
            stored = writer.append(record, tensors)
            if getattr(stored, "tensors", None):
                self.stats["tensor_files"] += 1
        except OSError as exc:
            self._write_failed(exc)

    def _ensure_manifest(self, first: LayerCapture | None) -> None:
        """The manifest on disk before the first line of ``steps.jsonl``; raises ``OSError``.

        A gap (the profile run) can come first: what is known then is written, so a trace killed
        from there on opens; the first record's backend and cache (``first``) complete it.
        """
        if not self._manifest_written and (first is not None or self._run_info is None):
            self._run_info = write_manifest(
                self.writer(),
                self.options,
                self.vllm_config,
                impl=first.static.impl if first else None,
                kv_cache=first.static.kv_cache if first else None,
                layer=first.layer if first else "",
                runner=self.runner,
            )
            self._manifest_written = first is not None

    def directory(self) -> Path:
        """The trace directory of this process: tensor-parallel ranks other than 0 write their own."""
        directory = Path(self.options.directory)
        rank = tp_rank()
        return directory / f"rank{rank}" if rank else directory

    def writer(self) -> TraceWriter:
        if self._writer is None:
            self._writer = TraceWriter(
                self.directory(), tensor_budget_bytes=self.options.budget_bytes, encode_line=encode_line
            )
        return self._writer

    def finish(self, tracer_stats: dict[str, Any] | None = None) -> None:
        """Close the trace (the record writer process first); mark the manifest finished unless recording failed.

        The finished manifest keeps how the trace was recorded in ``extra["tracer"]``: this writer's
        ``stats`` and the tracer's ``tracer_stats`` (ring waits, the inline writer's idle mode).
        """
        if self.records_out is not None:
            host = self.records_out.shared_host
            if host is not None:  # how the steps' copies went: into shared memory, or down the pipe
                self.stats["shared_copies"], self.stats["pipe_copies"] = host.taken, host.declined
            error = self.records_out.close()
            if error is not None and not self.failed:
                self.on_fail(error)
        if self._writer is None:
            return
        if self._manifest_written and self._writer.budget_exhausted:
            logger.warning(
                "pagedtrace: tensor budget of %d bytes used up; later steps have no tensors",
                self.options.budget_bytes,
            )
        self._writer.close()
        if self._run_info is not None and not self.failed:
            stats = {**self.stats, **(tracer_stats or {})}
            if self._writer.budget_exhausted:
                stats["budget_exhausted"] = True
            finished = replace(self._run_info, extra={**self._run_info.extra, "finished": True, "tracer": stats})
            try:
                self._writer.write_manifest(finished)
            except OSError as exc:
                self.on_fail(f"pagedtrace: cannot finish the trace's manifest in {self.options.directory}: {exc}")
        self._writer = None


def inputs_are_written(dev: dict[str, Any], rows: Any, n: int) -> bool:
    """Whether the step's ``key``/``value`` equal ``written`` (the cache at their slots) bit for bit.

    ``rows``: the tokens that wrote (slot not -1), a numpy array. True only for a cache that keeps
    its inputs as they are (bf16/fp16, not fp8): then storing them again would add nothing. The
    comparison runs on the device (the writer's stream, which then waits for it).
    """
    import torch

    key, value, written = dev.get("key"), dev.get("value"), dev["written"]
    if key is None or value is None or key.dtype != written.dtype or value.dtype != written.dtype:
        return False
    if key.shape[0] < n or value.shape[0] < n or tuple(key.shape[1:]) != tuple(written.shape[2:]):
        return False
    index = torch.from_numpy(rows).to(written.device)
    got = written.index_select(0, index)
    sent = torch.stack([key[:n].index_select(0, index), value[:n].index_select(0, index)], dim=1)
    ints = getattr(torch, INT_OF_SIZE[written.element_size()])
    return bool(torch.equal(got.contiguous().view(ints), sent.contiguous().view(ints)))


def _to_host(tensor: Any, on_cuda: bool) -> Any:
    """Queue a copy of ``tensor`` into pinned host memory (non-blocking on CUDA; a plain copy on CPU)."""
    if not on_cuda or not tensor.is_cuda:
        return tensor.to("cpu")
    import torch

    host = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host
