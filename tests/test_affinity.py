"""``tracer.affinity``: the writer thread and record process kept off the engine thread's core."""

from __future__ import annotations

import os
import threading

import pytest

from tracer.affinity import _cpu_list, affinity_apart, core_of, cpus_apart, current_cpu, move_to

linux_only = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux CPU affinity")


def test_cpu_lists_as_linux_writes_them():
    assert _cpu_list("0-3,8,10-11") == {0, 1, 2, 3, 8, 10, 11}
    assert _cpu_list("5") == {5}
    assert _cpu_list("") == set()


def test_core_of_reads_the_siblings_and_falls_back_to_the_cpu(tmp_path):
    topo = tmp_path / "cpu3" / "topology"
    topo.mkdir(parents=True)
    (topo / "thread_siblings_list").write_text("3,11\n")
    assert core_of(3, tmp_path) == {3, 11}
    assert core_of(4, tmp_path) == {4}  # no topology: the CPU alone


def test_cpus_apart_leaves_out_the_whole_core():
    assert cpus_apart({0, 1, 2, 3}, 1, {1, 3}) == {0, 2}
    assert cpus_apart({0, 1}, 0, {0, 1}) is None  # nothing would be left
    assert cpus_apart({0, 1}, None) is None  # the engine's CPU unknown


def test_the_setting_takes_two_words_and_says_what_else_is_wrong(monkeypatch):
    monkeypatch.delenv("PAGEDTRACE_AFFINITY", raising=False)
    assert affinity_apart() is False
    monkeypatch.setenv("PAGEDTRACE_AFFINITY", " Apart ")
    assert affinity_apart() is True
    monkeypatch.setenv("PAGEDTRACE_AFFINITY", "pinned")
    with pytest.raises(ValueError, match="PAGEDTRACE_AFFINITY='pinned': expected 'any' or 'apart'"):
        affinity_apart()


@linux_only
def test_move_to_sets_a_threads_cpus_and_skips_a_gone_id():
    cpu = current_cpu()
    assert cpu is not None and cpu in os.sched_getaffinity(0)
    seen: list[set[int]] = []
    ready, done = threading.Event(), threading.Event()

    def body():
        ready.set()
        done.wait(5)
        seen.append(os.sched_getaffinity(0))

    thread = threading.Thread(target=body)
    thread.start()
    ready.wait(5)
    assert thread.native_id is not None
    gone = 2**22 + 12345  # above Linux's pid_max default: no such task
    assert move_to([thread.native_id, gone], {cpu}) == [thread.native_id]
    done.set()
    thread.join(5)
    assert seen == [{cpu}]


@linux_only
def test_apart_moves_the_writer_thread_and_the_record_process_off_the_engines_core(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDTRACE_AFFINITY", "apart")
    monkeypatch.setenv("PAGEDTRACE_WRITER", "process")
    from tracer.hooks import Tracer, TracerOptions

    t = Tracer(TracerOptions(str(tmp_path / "t"))).start()
    try:
        t._sink.start()  # as the model runner's first call does, then _place_apart
        allowed = os.sched_getaffinity(0)
        cpu = current_cpu()
        t._place_apart()
        want = cpus_apart(allowed, cpu)
        if want is None:  # one CPU, or one core: nothing to move to
            assert "cpus_apart" not in t.stats
            return
        assert t.stats["cpus_apart"] == len(want)
        assert t._thread is not None and t._thread.native_id is not None
        assert os.sched_getaffinity(t._thread.native_id) == want
        pid = t._sink.records_out.pid
        assert pid is not None and os.sched_getaffinity(pid) == want
        assert os.sched_getaffinity(0) == allowed  # the engine's own thread is left alone
    finally:
        t.stop()


def test_any_moves_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("PAGEDTRACE_AFFINITY", raising=False)
    from tracer.hooks import Tracer, TracerOptions

    t = Tracer(TracerOptions(str(tmp_path / "t"))).start()
    try:
        t._place_apart()
        assert "cpus_apart" not in t.stats
    finally:
        t.stop()
