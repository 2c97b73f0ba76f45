"""One copy per KV-cache group (``tracer.host_copies.pack_host_copies``), checked on CPU tensors.

``queue_host_copies`` packs the step's metadata on its device and copies it once (into pinned
memory on CUDA); the writer makes the host views (``Slot.make_views``) or sends the buffer
to the record process as it is. Here they run on CPU tensors, without pinning.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from tracer.handover import Slot, SlotPool, WriterThread
from tracer.host_buffers import host_message
from tracer.host_buffers import message_lists as _lists
from tracer.host_copies import PackedViews, metadata_parts, pack_host_copies, queue_host_copies
from tracer.layer_capture import host_lists
from tracer.messages import PackedCopy


def _parts(md, num_reqs: int, num_tokens: int, cols: int) -> dict:
    """The step's rows of ``md``'s tensors (``metadata_parts`` by default: nothing to trim)."""
    parts, trim = metadata_parts(md, num_reqs, num_tokens, cols)
    assert trim is None
    return parts


def _metadata(max_reqs: int = 8, max_blocks: int = 6, max_tokens: int = 40):
    """Persistent runner-like buffers: int32 query_start_loc / seq_lens / block table, int64 slot_mapping."""
    g = torch.Generator().manual_seed(0)
    return types.SimpleNamespace(
        query_start_loc=torch.arange(0, 3 * (max_reqs + 1), 3, dtype=torch.int32),
        seq_lens=torch.randint(1, 2**31 - 1, (max_reqs,), generator=g, dtype=torch.int32),
        block_table=torch.randint(-(2**31), 2**31 - 1, (max_reqs, max_blocks), generator=g, dtype=torch.int32),
        # values past int32 and the padding slot -1: each must come back whole
        slot_mapping=torch.tensor([2**40 + i if i % 3 else -1 for i in range(max_tokens)], dtype=torch.int64),
    )


def _pack(slot: Slot, name: str, parts: dict) -> dict:
    """``pack_host_copies``, then what the writer thread does before it reads the views."""
    views = pack_host_copies(slot, name, parts, pin=False)
    assert views == {}  # filled by the writer thread, not on the step
    slot.make_views()
    assert not slot.view_makers
    return views


def _assert_same(views: dict, parts: dict) -> None:
    assert list(views) == list(parts)
    for name, src in parts.items():
        view = views[name]
        assert view.dtype == src.dtype and view.shape == src.shape, name
        assert view.is_contiguous(), name
        assert torch.equal(view, src), name
        assert view.tolist() == src.tolist(), name
        assert np.array_equal(view.numpy(), src.numpy()), name


@pytest.mark.parametrize(("num_reqs", "num_tokens", "cols"), [(3, 7, 4), (5, 5, 6), (1, 1, 1), (8, 39, 2), (0, 0, 0)])
def test_the_packed_views_equal_their_sources(num_reqs, num_tokens, cols):
    md = _metadata()
    parts = _parts(md, num_reqs, num_tokens, cols)
    if num_reqs > 1 and cols < md.block_table.shape[1]:
        assert not parts["block_table"].is_contiguous()  # the slice the step reads: flattened by a kernel of its own
    views = _pack(Slot(0), "0", parts)
    _assert_same(views, parts)
    # downstream readers see what they saw with one buffer per tensor
    separate = {name: src.clone() for name, src in parts.items()}
    assert host_lists(dict(views)) == host_lists(separate)
    assert _lists(host_message(views)) == host_lists(separate)


def test_int64_parts_given_after_odd_int32_parts_come_back_whole_and_aligned():
    # given in this order, an int64 part would start at an odd int32 offset: the int64 parts go first
    parts = {
        "a": torch.arange(3, dtype=torch.int32),
        "b": torch.arange(2**33, 2**33 + 12, dtype=torch.int64).view(3, 4)[:, :3],
        "c": torch.tensor([-(2**62), 5, 2**62], dtype=torch.int64),
        "d": torch.arange(10, dtype=torch.int32).view(2, 5)[:, 1:],
        "e": torch.arange(2**35, 2**35 + 9, dtype=torch.int64)[::2],  # strided, 1-D
        "f": torch.arange(9, dtype=torch.int32)[1::3],
    }
    views = _pack(Slot(0), "x", parts)
    _assert_same(views, parts)
    for name in "bcdef":
        assert views[name].untyped_storage().data_ptr() == views["a"].untyped_storage().data_ptr()  # one buffer
    assert all(views[name].data_ptr() % 8 == 0 for name in "bce")


def test_the_host_buffer_is_reused_then_grown():
    md = _metadata(max_reqs=4, max_blocks=4, max_tokens=8)
    slot = Slot(0)
    _pack(slot, "0", _parts(md, 2, 3, 2))
    buffer = slot.buffers["0"]
    assert buffer.dtype == torch.int32 and list(slot.buffers) == ["0"]
    # sized once for the runner buffers it is filled from: 5 + 4 + 16 + 2 * 8 int32 values, at least 64
    assert buffer.numel() == 64
    big = _metadata(max_reqs=4, max_blocks=40, max_tokens=8)
    views = _pack(slot, "0", _parts(big, 4, 8, 4))
    assert slot.buffers["0"] is buffer  # a larger step that still fits: no new allocation
    _assert_same(views, _parts(big, 4, 8, 4))
    views = _pack(slot, "0", _parts(big, 4, 8, 40))
    assert slot.buffers["0"] is not buffer and slot.buffers["0"].numel() >= 4 * 40 + 5 + 4 + 16
    _assert_same(views, _parts(big, 4, 8, 40))


def test_a_part_of_another_dtype_is_not_packed():
    parts = _parts(_metadata(), 2, 3, 2)
    for dtype in (torch.int16, torch.uint8, torch.float32):
        assert pack_host_copies(Slot(0), "0", {**parts, "seq_lens": parts["seq_lens"].to(dtype)}, pin=False) is None
    slot = Slot(0)
    pack_host_copies(slot, "0", {**parts, "seq_lens": parts["seq_lens"].to(torch.int16)}, pin=False)
    assert slot.buffers == {} and not slot.view_makers  # nothing queued: the caller copies them one by one


def test_queue_host_copies_packs_on_cpu_too():
    md = _metadata()
    slot = Slot(0)
    slot.payload = {"hosts": {}}
    views = queue_host_copies(slot, md, 3, 7, 4)
    assert isinstance(views, PackedViews) and list(slot.buffers) == ["0"]  # one copy, as on CUDA
    slot.make_views()
    _assert_same(views, _parts(md, 3, 7, 4))


def _table_metadata(max_reqs: int = 8, width: int = 6, block_size: int = 4):
    """Runner-like buffers whose seq_lens use at most 4 of the table's columns: ceil(seq_len / block_size) each."""
    md = _metadata(max_reqs=max_reqs, max_blocks=width)
    md.seq_lens = torch.tensor([1 + (5 * r) % (4 * block_size) for r in range(max_reqs)], dtype=torch.int32)
    return md


def test_tensors_copied_as_given_give_the_records_the_sliced_rows_give(monkeypatch):
    from tracer import host_copies
    from tracer.layer_capture import make_record, trimmed_table

    md = _table_metadata()
    block_size, num_reqs, num_tokens = 4, 5, 7
    cols = host_copies.columns_read(md.block_table, int(md.seq_lens[:num_reqs].max()), block_size)
    assert cols < md.block_table.shape[1]  # the slice is narrower than the rows
    lists = {}
    for as_given in (False, True):
        slot = Slot(0)
        slot.payload = {"hosts": {}}
        views = queue_host_copies(slot, md, num_reqs, num_tokens, cols, as_given=as_given)
        if as_given:  # every row and column of the runner's tensors went, the views keep the step's
            assert views.packed.like["block_table"][1] == tuple(md.block_table.shape)
            assert views.packed.trim == {"query_start_loc": 6, "seq_lens": 5, "block_table": 5, "slot_mapping": 7}
        message = host_message(views)
        assert isinstance(message, PackedCopy)  # no shared memory here: the bytes go in the message
        sent = _lists(message)  # what the record process makes of it, before any view
        if as_given:  # it is sent the step's rows of the columns read, not the padded rows of every column
            table = next(part for part in message.parts if part.name == "block_table")
            assert (table.shape, table.width, table.rows) == ((num_reqs, cols), num_reqs * cols, -1)
            assert sent["block_table"] == md.block_table[:num_reqs, :cols].tolist()
            assert len(message.data) == 4 * sum(part.width for part in message.parts)
        slot.make_views()
        assert views["block_table"].shape == (num_reqs, md.block_table.shape[1] if as_given else cols)
        assert torch.equal(views["block_table"], md.block_table[:num_reqs, : views["block_table"].shape[1]])
        assert [views[k].shape[0] for k in ("query_start_loc", "seq_lens", "slot_mapping")] == [6, 5, 7]
        lists[as_given] = host_lists(dict(views))
        assert trimmed_table(sent, block_size) == trimmed_table(lists[as_given], block_size)
        assert {k: sent[k] for k in ("query_start_loc", "seq_lens", "slot_mapping")} == {
            k: lists[as_given][k] for k in ("query_start_loc", "seq_lens", "slot_mapping")
        }
    fields = {"step": 0, "layer": "l", "kind": "request", "request_ids": ("",) * num_reqs, "num_actual_tokens": 7}
    fields.update(max_query_len=3, max_seq_len=16, scale=1.0, num_heads=1, num_kv_heads=1, head_size=8)
    fields.update(causal=True, sliding_window=None, logits_soft_cap=0.0, use_cascade=False, num_splits=0)
    assert make_record(fields, lists[True], block_size) == make_record(fields, lists[False], block_size)
    # a tensor past AS_GIVEN_MAX elements: the step's rows and columns, cut on the device as by default
    monkeypatch.setattr(host_copies, "AS_GIVEN_MAX", md.block_table.numel() - 1)
    slot = Slot(0)
    slot.payload = {"hosts": {}}
    views = queue_host_copies(slot, md, num_reqs, num_tokens, cols, as_given=True)
    slot.make_views()
    assert views["block_table"].shape == (num_reqs, cols) and not views.packed.trim


def test_a_packed_copy_goes_to_the_record_process_as_its_buffer_without_a_view():
    md = _metadata()
    slot = Slot(0)
    parts = _parts(md, 3, 7, 4)
    views = pack_host_copies(slot, "0", parts, pin=False)
    message = host_message(views)
    assert views == {} and slot.view_makers  # no view was made for it
    assert isinstance(message, PackedCopy)
    layout = message.parts
    assert [part.name for part in layout] == ["slot_mapping", "query_start_loc", "seq_lens", "block_table"]
    assert [part.width for part in layout] == [14, 4, 3, 12] and len(message.data) == 4 * (14 + 4 + 3 + 12)
    assert [part.rows for part in layout] == [-1] * 4  # the step's rows only: nothing to trim
    assert _lists(message) == host_lists({k: v.clone() for k, v in parts.items()})


def test_the_writer_thread_leaves_the_views_to_its_handler():
    pool = SlotPool(2)
    parts = _parts(_metadata(), 3, 7, 4)
    seen: list = []

    def handle(slot):
        seen.append(dict(slot.payload))
        slot.make_views()
        seen.append({k: v.tolist() for k, v in slot.payload.items()})

    thread = WriterThread(pool, handle, lambda exc: seen.append(exc))
    slot = pool.acquire()
    slot.payload = pack_host_copies(slot, "0", parts, pin=False)
    thread.submit(slot)
    thread.close()
    assert seen == [{}, {k: v.tolist() for k, v in parts.items()}]
    assert not slot.view_makers  # released: nothing left for the slot's next step


@pytest.mark.parametrize("writer", ["inline", "here"])
def test_packed_steps_write_what_separate_copies_write(tmp_path, monkeypatch, writer):
    """Through the real writer (the record writer process, or this process when that cannot start): the
    packed path, as on CUDA. The separate copies reach the record process as views (``Views``)."""
    import tracer.capture
    from tests.test_record_process import _engine, _steps
    from tracer import host_copies

    calls = []

    def separate(slot, md, num_reqs, num_tokens, cols, as_given=False, shared=None, block_size=0, defer=False):
        calls.append(num_tokens)  # one copy per tensor (a dtype the packed copy does not take)
        cols = cols if cols is not None else host_copies.read_columns(md, block_size)
        key = str(len(slot.payload["hosts"]))
        return {n: slot.host(key + n, src) for n, src in _parts(md, num_reqs, num_tokens, cols).items()}

    lines = {}
    for packed in (True, False):
        if not packed:
            monkeypatch.setattr(tracer.capture, "queue_host_copies", separate)
        t = _engine(tmp_path / str(packed), monkeypatch, writer)
        _steps(t, 3, gap_at=1)
        t._handover.close()
        t._record_writer.finish()
        assert t.error is None
        lines[packed] = (tmp_path / str(packed) / "trace" / "steps.jsonl").read_text().splitlines()
    assert calls == [3, 3, 3]  # the separate copies were made
    assert len(lines[True]) == 4 and lines[True] == lines[False]


def test_a_step_over_the_same_memory_reuses_the_flat_views_and_reads_its_own_values():
    """The runner's metadata is a new set of views of its persistent buffers every step: a plan
    made for the same memory is reused, and the copy holds what the memory holds at this step."""
    from tracer import host_copies

    host_copies.forget_plans()
    md = _metadata()
    views = []
    for step in range(3):
        md.seq_lens.fill_(100 + step)  # the runner writes its buffers in place
        md.slot_mapping[:7] = torch.arange(7) + 2**33 * (step + 1)
        parts = {k: getattr(md, k)[:n] for k, n in (("query_start_loc", 4), ("seq_lens", 3), ("slot_mapping", 7))}
        parts["block_table"] = md.block_table[:3]  # whole rows: a view of the buffer
        views.append(_pack(Slot(step), "0", parts))
        _assert_same(views[-1], {k: v.clone() for k, v in parts.items()})
    assert len(host_copies._PLANS) == 1  # one plan, made at the first step
    assert [v["seq_lens"].tolist() for v in views] == [[100] * 3, [101] * 3, [102] * 3]
    # other memory (a buffer the runner made anew): a plan of its own
    _pack(Slot(9), "0", {**parts, "seq_lens": md.seq_lens.clone()[:3]})
    assert len(host_copies._PLANS) == 2
    host_copies.forget_plans()
    assert not host_copies._PLANS


def test_a_part_flattened_by_a_copy_is_not_kept():
    """A block-table column slice is flattened by a kernel: its flat copy holds one step's values."""
    from tracer import host_copies

    host_copies.forget_plans()
    md = _metadata()
    parts = _parts(md, 3, 7, 4)  # block_table[:3, :4]: not contiguous
    first = _pack(Slot(0), "0", parts)
    assert not host_copies._PLANS
    md.block_table[:3, :4] += 1
    second = _pack(Slot(1), "0", _parts(md, 3, 7, 4))
    assert torch.equal(second["block_table"], first["block_table"] + 1)
    for _ in range(host_copies._PLANS_MAX + 3):  # bounded: the oldest plan goes first
        host_copies._plan_of({"seq_lens": md.seq_lens.clone()})
    assert len(host_copies._PLANS) == host_copies._PLANS_MAX
    host_copies.forget_plans()
