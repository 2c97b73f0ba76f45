"""Replay's records spread over worker processes, one share of consecutive records each.

A replayed record costs milliseconds of small torch calls: one torch thread runs them best
(``reference_impl.replay.REPLAY_THREADS``), so a CPU with several cores is used by replaying
several records at once in forked processes. Each worker takes a contiguous share of the
records (about equal work, :func:`shares`), so a KV write log is rebuilt once per share; it
sends each record's outcome back as it finishes, and the parent puts them in record order:
the report is the one a single process gives, to the bit (each record is replayed by the same
code on one thread either way).

Workers are forked (Linux only: elsewhere replay stays in one process). On a GPU each worker
opens its own CUDA context, which CUDA allows only where this process has not initialised CUDA
before the fork (:func:`cuda_fork_safe`; :func:`reference_impl.step_pass.select_device` asks NVML,
which does not); a worker that cannot is a failed worker (below). Their
messages (:class:`Replayed`, :class:`Failed`, :class:`Finished`) are msgpack through ``msgspec``,
an outcome decoded as the caller's type, to the bit. A worker that fails sends only where: the
caller replays the rest of that share itself, so the error it raises is the one a single process
raises, of the same type.

On a GPU a record is mostly the host's small calls: each replaying process then reads its next
records on a thread of its own (:func:`prepared`) while the current one's pass runs.

Imports torch and ``msgspec`` only.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import multiprocessing
import os
import platform
import queue
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

import msgspec
import torch

__all__ = [
    "MAX_GPU_WORKERS",
    "MIN_RECORDS_PER_GPU_WORKER",
    "MIN_RECORDS_PER_WORKER",
    "PREPARE_AHEAD",
    "Failed",
    "Finished",
    "Replayed",
    "cuda_fork_safe",
    "is_gpu",
    "keep_freed_memory",
    "prepared",
    "run_records",
    "shares",
    "worker_count",
]

#: A worker is started for at least this many records (fewer share a process: a fork and a
#: write log rebuilt from its run's start cost more than they save).
MIN_RECORDS_PER_WORKER = 32

#: On a GPU a record costs about 11 ms of one host thread (the 7B-shaped default-mode workload of
#: ``benchmarks/gpu_overhead.py`` on an H100), while starting GPU workers costs seconds: each
#: opens its own CUDA context and loads cuBLAS, and the driver serves them one after another.
#: Measured on that workload's 196 records (docs/performance.md): one process 2.49 s, 4 workers
#: 2.74 s, 8 workers 3.24 s, i.e. workers cost about 1.4 s + 0.2 s each against 0.4 s alone.
#: At 128 records a worker, the first split (2 workers, 256 records) about breaks even and every
#: later one saves time.
MIN_RECORDS_PER_GPU_WORKER = 128

#: At most this many GPU workers: more contexts wait longer for the driver than they save.
MAX_GPU_WORKERS = 8


class Replayed(msgspec.Struct, tag=True, array_like=True):
    """A worker's message: record ``index`` (in the caller's order) replayed, its outcome as msgpack."""

    index: int
    outcome: msgspec.Raw


class Failed(msgspec.Struct, tag=True, array_like=True):
    """A worker's message: replaying record ``index`` raised; the caller replays from there itself."""

    index: int


class Finished(msgspec.Struct, tag=True, array_like=True):
    """A worker's last message: its whole share is replayed."""


Message = Replayed | Failed | Finished
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Message)


def can_fork() -> bool:
    """Worker processes are available: Linux's ``fork`` (a forked child shares the opened trace)."""
    return sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()


def keep_freed_memory() -> bool:
    """Let this process (and the workers it forks) reuse the memory replay frees, instead of faulting it in again.

    glibc serves a block over its mmap threshold (128 KB, rising to at most 32 MB) from fresh pages
    and unmaps it on free, and trims the heap's free top: a replayed step's tensors (tens of MB,
    the same sizes step after step) would then fault in every page again, which costs more than
    copying into them. Raising both thresholds to 1 GB keeps the freed memory for the next step;
    the process keeps its peak size until it ends. Returns False where the C library is not glibc.
    """
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30) and libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30))
    except (OSError, AttributeError):
        return False


#: glibc's ``mallopt`` parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def is_gpu(device: torch.device | str | None) -> bool:
    """``device`` names a GPU (None: the CPU)."""
    return device is not None and torch.device(device).type != "cpu"


def cuda_fork_safe() -> bool:
    """A forked child of this process can open its own CUDA context: this process has not
    initialised CUDA (``torch.cuda.device_count`` through NVML does not)."""
    return not torch.cuda.is_initialized()


def worker_count(requested: int | None, records: int, device: torch.device | str | None) -> int:
    """How many processes replay ``records`` records.

    Args:
        requested: the caller's count; None: one per CPU this process may run on, as long as
            each gets :data:`MIN_RECORDS_PER_WORKER` records (on a GPU
            :data:`MIN_RECORDS_PER_GPU_WORKER`, and at most :data:`MAX_GPU_WORKERS`). Never more
            than the records.
        device: where the records replay; a GPU in a process that has initialised CUDA: one process.
    """
    if requested is not None and requested < 1:
        raise ValueError(f"workers {requested}: expected a positive number of processes")
    gpu = is_gpu(device)
    if not can_fork() or (gpu and not cuda_fork_safe()):
        return 1
    if requested is not None:
        return max(1, min(requested, records))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if gpu:
        return max(1, min(cpus, MAX_GPU_WORKERS, records // MIN_RECORDS_PER_GPU_WORKER))
    return max(1, min(cpus, records // MIN_RECORDS_PER_WORKER))


def shares(costs: Sequence[float], workers: int) -> list[range]:
    """At most ``workers`` consecutive, non-empty index ranges of ``costs``, of about equal total cost."""
    total = sum(costs)
    cuts: list[int] = []
    running = 0.0
    for i, cost in enumerate(costs[:-1]):  # a cut after record i
        running += cost
        if len(cuts) < workers - 1 and running >= total * (len(cuts) + 1) / workers:
            cuts.append(i + 1)
    edges = [0, *cuts, len(costs)]
    return [range(a, b) for a, b in itertools.pairwise(edges) if b > a]


def run_records(
    replay_one: Callable[..., Any],
    count: int,
    costs: Sequence[float],
    workers: int,
    on_outcome: Callable[[int, Any], None],
    *,
    outcome_type: Any = Any,
    meanwhile: Callable[[], None] | None = None,
    warm_up: Callable[[], None] | None = None,
    prepare: Callable[[int], Any] | None = None,
) -> None:
    """``on_outcome(i, replay_one(i))`` for every ``i < count``, in this process or over ``workers``.

    With ``prepare``, a record is replayed as ``replay_one(i, prepare(i))``, each process
    preparing its records in order on a thread of its own, up to :data:`PREPARE_AHEAD` ahead
    of the one it replays (:func:`prepared`): on a GPU, where a record is the host's small
    calls, one record's reading overlaps the last one's pass. ``prepare`` must keep whatever
    state it has to itself: only its records' order is the one a single thread gives.

    With several workers ``on_outcome`` runs in this process as outcomes arrive (any order
    across shares; in order within one), each decoded as ``outcome_type`` (msgspec's types:
    dataclasses, named tuples, plain values). An error in a worker is raised here by replaying
    the rest of its share in this process; it stops the other workers.
    ``meanwhile`` runs here once, while the workers replay (first, in one process).
    ``warm_up`` runs in each process that replays (each worker, or this one alone) beside its
    first records (and ``meanwhile``), on a thread of its own: a GPU process opens its CUDA
    context there. Whatever it raises, the records raise again.
    """

    if workers <= 1 or count <= 1:
        if warm_up is not None:
            threading.Thread(target=_quietly, args=(warm_up,), daemon=True).start()
        if meanwhile is not None:
            meanwhile()
        for i, outcome in _replayed(replay_one, range(count), prepare):
            on_outcome(i, outcome)
        return
    outcome_decoder = msgspec.msgpack.Decoder(outcome_type)
    context = multiprocessing.get_context("fork")
    processes, pending = [], {}
    try:
        for share in shares(costs, workers):
            receive, send = context.Pipe(duplex=False)
            process = context.Process(target=_work, args=(replay_one, share, send, warm_up, prepare), daemon=True)
            process.start()
            send.close()
            processes.append(process)
            pending[receive] = (process, share)
        if meanwhile is not None:
            meanwhile()
        while pending:
            for conn in wait(list(pending)):
                assert isinstance(conn, Connection)
                try:
                    message = _DECODER.decode(conn.recv_bytes())
                except EOFError:
                    process, _ = pending.pop(conn)
                    process.join()
                    raise RuntimeError(
                        f"a replay worker ended without finishing (exit code {process.exitcode})"
                    ) from None
                if isinstance(message, Replayed):
                    on_outcome(message.index, outcome_decoder.decode(message.outcome))
                    continue
                _, share = pending.pop(conn)
                if isinstance(message, Failed):  # the error again, here, as one process raises it
                    for i, outcome in _replayed(replay_one, range(message.index, share.stop), prepare):
                        on_outcome(i, outcome)
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
            process.join()


def _work(
    replay_one: Callable[..., Any],
    share: range,
    send: Connection,
    warm_up: Callable[[], None] | None = None,
    prepare: Callable[[int], Any] | None = None,
) -> None:
    """A worker: replay its share, one message per record, then :class:`Finished` (or :class:`Failed`)."""
    if warm_up is not None:
        threading.Thread(target=_quietly, args=(warm_up,), daemon=True).start()
    pending = share.start  # the record a failure is at
    try:
        for i, outcome in _replayed(replay_one, share, prepare):
            send.send_bytes(_ENCODER.encode(Replayed(i, msgspec.Raw(_ENCODER.encode(outcome)))))
            pending = i + 1
    except BaseException:  # noqa: BLE001 - the caller replays from that record and raises the error itself
        send.send_bytes(_ENCODER.encode(Failed(pending)))
    else:
        send.send_bytes(_ENCODER.encode(Finished()))
    finally:
        send.close()


#: How many records :func:`prepared` gets ready ahead of the one being replayed (each holds its
#: tensors: a 7B-shaped default-mode step's are about 2.4 MiB).
PREPARE_AHEAD = 4


def _replayed(
    replay_one: Callable[..., Any], indices: range, prepare: Callable[[int], Any] | None
) -> Iterator[tuple[int, Any]]:
    """``(i, replay_one(i))``, or with ``prepare`` ``(i, replay_one(i, prepare(i)))``, for each ``i`` in order."""
    if prepare is None:
        for i in indices:
            yield i, replay_one(i)
        return
    for i, ready in prepared(prepare, indices):
        yield i, replay_one(i, ready)


def prepared(prepare: Callable[[int], Any], indices: range, ahead: int = PREPARE_AHEAD) -> Iterator[tuple[int, Any]]:
    """``(i, prepare(i))`` for each ``i`` in order, ``prepare`` running on a thread up to ``ahead`` records early.

    What ``prepare(i)`` raises is raised here, at ``i``; the thread stops when the caller does.
    """
    ready: queue.Queue[tuple[int, Any, BaseException | None]] = queue.Queue(maxsize=max(1, ahead))
    stop = threading.Event()

    def run() -> None:
        for i in indices:
            if stop.is_set():
                return
            try:
                item: tuple[int, Any, BaseException | None] = (i, prepare(i), None)
            except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
                item = (i, None, exc)
            while not stop.is_set():
                try:
                    ready.put(item, timeout=0.05)
                    break
                except queue.Full:
                    continue
            if item[2] is not None:
                return

    thread = threading.Thread(target=run, daemon=True, name="pagedtrace-prepare")
    thread.start()
    try:
        for _ in indices:
            i, value, error = ready.get()
            if error is not None:
                raise error
            yield i, value
    finally:
        stop.set()
        thread.join()


def _quietly(call: Callable[[], None]) -> None:
    """``call()``, its error dropped: the work it prepares raises it again where it is handled."""
    with contextlib.suppress(Exception):
        call()
