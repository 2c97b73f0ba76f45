"""reference_impl.workers: records replayed over processes give the one-process report, to the bit."""

from __future__ import annotations

import os
import platform
import shutil
import threading
import time
from pathlib import Path

import pytest

from reference_impl import workers
from reference_impl.replay import replay_trace
from reference_impl.workers import (
    MAX_GPU_WORKERS,
    MIN_RECORDS_PER_GPU_WORKER,
    MIN_RECORDS_PER_WORKER,
    can_fork,
    prepared,
    run_records,
    shares,
    worker_count,
)
from tracer.format import Trace, TraceError

FIXTURES = Path(__file__).resolve().parent / "fixtures"

needs_fork = pytest.mark.skipif(not can_fork(), reason="worker processes are forked (Linux)")


def test_shares_are_consecutive_nonempty_and_balanced():
    assert shares([1.0] * 10, 2) == [range(5), range(5, 10)]
    assert shares([1.0, 2, 3, 4, 5, 6, 7, 8], 3) == [range(5), range(5, 7), range(7, 8)]
    assert shares([5.0], 3) == [range(1)]
    assert shares([1.0, 1, 1, 10], 2) == [range(4)]  # no cut leaves each side half
    assert shares([], 2) == []


def test_worker_count():
    assert worker_count(1, 500, None) == 1
    assert worker_count(None, MIN_RECORDS_PER_WORKER - 1, None) == 1
    assert worker_count(8, 3, None) <= 3
    with pytest.raises(ValueError, match="positive"):
        worker_count(0, 10, None)


@pytest.mark.skipif(not can_fork(), reason="workers are forked (Linux)")
def test_gpu_workers_each_open_a_context_only_where_this_process_has_none(monkeypatch):
    monkeypatch.setattr(workers, "cuda_fork_safe", lambda: True)
    assert worker_count(4, 500, "cuda") == 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(64)), raising=False)
    assert worker_count(None, 10_000, "cuda") == MAX_GPU_WORKERS
    assert worker_count(None, 3 * MIN_RECORDS_PER_GPU_WORKER, "cuda") == 3
    # the H100's 196-step default-mode trace: GPU workers' contexts would cost more than they save
    assert worker_count(None, 196, "cuda") == 1
    assert (
        worker_count(None, 3 * MIN_RECORDS_PER_GPU_WORKER, None)
        == 3 * MIN_RECORDS_PER_GPU_WORKER // MIN_RECORDS_PER_WORKER
    )
    monkeypatch.setattr(workers, "cuda_fork_safe", lambda: False)  # CUDA initialised here: one process
    assert worker_count(4, 500, "cuda") == 1


def _without_time(report) -> dict:
    out = report.to_json()
    out.pop("seconds")
    return out


@needs_fork
@pytest.mark.parametrize("name", ["h200-qwen2.5-7b-default-rows", "h200-llama3.1-8b-fp8-writelog"])
def test_workers_give_the_one_process_report(name):
    alone = replay_trace(Trace.open(FIXTURES / name), workers=1, legacy_every=2)
    seen = []
    shared = replay_trace(
        Trace.open(FIXTURES / name), workers=3, legacy_every=2, progress=lambda done, total, r: seen.append(done)
    )
    assert _without_time(shared) == _without_time(alone)
    assert sorted(seen) == list(range(1, len(alone.steps) + 1))


@needs_fork
def test_an_error_in_a_worker_is_raised_in_the_caller(tmp_path):
    trace_dir = tmp_path / "trace"
    shutil.copytree(FIXTURES / "h200-qwen2.5-7b-default-rows", trace_dir)
    trace = Trace.open(trace_dir)
    last = [r for r in trace.records if r.tensors is not None][-1]
    (trace_dir / "tensors" / last.tensors).unlink()
    with pytest.raises(TraceError, match="tensor file missing"):
        replay_trace(trace, workers=2)


@needs_fork
def test_outcomes_come_back_for_every_record():
    got: dict[int, int] = {}
    run_records(lambda i: i * i, 7, [1.0] * 7, 3, got.__setitem__)
    assert got == {i: i * i for i in range(7)}


@needs_fork
def test_each_worker_warms_up_beside_its_records_and_a_failing_warm_up_changes_nothing(tmp_path):
    def warm_up() -> None:
        (tmp_path / str(os.getpid())).touch()

    def slow(i: int) -> int:
        time.sleep(0.1)  # the warm-up thread runs beside the records, and a worker ends with its last one
        return i + 1

    got: dict[int, int] = {}
    run_records(slow, 6, [1.0] * 6, 3, got.__setitem__, warm_up=warm_up)
    assert got == {i: i + 1 for i in range(6)}
    assert len(list(tmp_path.iterdir())) == 3  # one per worker, none in this process
    assert not (tmp_path / str(os.getpid())).exists()

    def broken() -> None:
        raise RuntimeError("no GPU here")

    got.clear()
    run_records(lambda i: -i, 4, [1.0] * 4, 2, got.__setitem__, warm_up=broken)
    assert got == {i: -i for i in range(4)}
    got.clear()
    run_records(lambda i: -i, 4, [1.0] * 4, 1, got.__setitem__, warm_up=broken)
    assert got == {i: -i for i in range(4)}


def test_a_process_replaying_alone_warms_up_beside_its_records():
    warmed = threading.Event()
    seen: list[bool] = []
    run_records(lambda i: seen.append(warmed.wait(5)), 2, [1.0] * 2, 1, lambda i, o: None, warm_up=warmed.set)
    assert seen == [True, True]


def test_records_are_prepared_in_order_on_a_thread_ahead_of_the_one_replayed():
    main = threading.get_ident()
    threads: set[int] = set()
    started: list[int] = []

    def prepare(i: int) -> int:
        threads.add(threading.get_ident())
        started.append(i)
        return 10 * i

    got = []
    for i, ready in prepared(prepare, range(6), ahead=2):
        time.sleep(0.02)  # the thread runs ahead, never more than `ahead` records (+ the one it holds)
        assert max(started) <= i + 3
        got.append((i, ready))
    assert got == [(i, 10 * i) for i in range(6)] and started == list(range(6))
    assert threads and main not in threads


def test_an_error_in_preparing_is_raised_at_its_record_and_the_thread_stops():
    def prepare(i: int) -> int:
        if i == 3:
            raise TraceError("record 3 is unreadable")
        return i

    got = []
    with pytest.raises(TraceError, match="record 3"):
        for _, ready in prepared(prepare, range(10)):
            got.append(ready)
    assert got == [0, 1, 2]
    before = threading.active_count()
    for _ in prepared(prepare, range(3)):  # a caller that stops early stops the thread too
        break
    assert threading.active_count() <= before


@pytest.mark.parametrize("processes", [1, pytest.param(3, marks=needs_fork)])
def test_prepared_records_are_replayed_with_what_was_prepared_for_them(processes):
    got: dict[int, list[int]] = {}
    run_records(lambda i, ready: [i, ready], 9, [1.0] * 9, processes, got.__setitem__, prepare=lambda i: -i)
    assert got == {i: [i, -i] for i in range(9)}


@needs_fork
def test_a_worker_that_fails_in_preparing_hands_the_rest_to_the_caller():
    def prepare(i: int) -> int:
        if i == 4 and os.getpid() != parent:
            raise RuntimeError("only in the worker")
        return i

    parent = os.getpid()
    got: dict[int, int] = {}
    run_records(lambda i, ready: ready + 100, 8, [1.0] * 8, 2, got.__setitem__, prepare=prepare)
    assert got == {i: i + 100 for i in range(8)}


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_replay_keeps_the_memory_it_frees_for_the_next_step():
    assert workers.keep_freed_memory()


def test_the_gpu_path_prepares_records_on_a_thread_and_gives_the_one_thread_report(monkeypatch):
    """The GPU's code path, run on the CPU (``is_gpu`` says yes, no device named): reading records ahead
    on a thread gives the report that reading each one just before its pass gives, to the bit."""
    import reference_impl.replay as replay_module

    monkeypatch.setattr(replay_module, "is_gpu", lambda device: True)
    threaded = []

    def spied(prepare, indices, ahead=workers.PREPARE_AHEAD):
        threaded.append(len(indices))
        yield from prepared(prepare, indices, ahead)

    monkeypatch.setattr(workers, "prepared", spied)
    name = "h200-llama3.1-8b-fp8-writelog"  # a write log: the thread keeps its state, in order
    ahead = replay_trace(Trace.open(FIXTURES / name), workers=1, legacy_every=2)
    assert threaded == [len(ahead.steps)]

    def inline(prepare, indices, ahead=0):
        for i in indices:
            yield i, prepare(i)

    monkeypatch.setattr(workers, "prepared", inline)
    one_thread = replay_trace(Trace.open(FIXTURES / name), workers=1, legacy_every=2)
    assert _without_time(ahead) == _without_time(one_thread)
    assert ahead.steps and all(s.ok for s in ahead.steps) and ahead.write_path
