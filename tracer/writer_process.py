"""A metadata trace's records, written by a process of their own so the engine keeps the GIL.

The writer thread (``tracer.ring.WriterThread``) shares the engine's GIL. Turning a step into
a ``StepRecord`` and a JSON line is pure Python (a few hundred µs a step on the H200 host),
and in a launch-bound graph mode (PIECEWISE) the engine's thread waits for every µs of it.
So for a trace without tensors the thread only waits for each slot's CUDA event (without
the GIL), puts the slot's host buffers as bytes into a message with the records' other fields,
and writes it to this module's process (:class:`RecordProcess`, started by the model runner's
first call, so only a process that runs the model has one), which builds the records
and appends them to ``steps.jsonl``, one flushed line each, exactly as the thread would. One
message carries the slots of one hand-over (``tracer.sink.TraceSink.send_records``, after them).

Messages on the child's stdin: a 4-byte little-endian length, then a msgpack list
``[hosts, items]``. ``hosts``: one map per KV-cache group and slot (:func:`host_message`):
``{"shared": [byte offset, parts]}`` for a packed copy that landed in the host memory the child
maps (``tracer.shared_host``; given to it as ``--shared FD SIZE``), ``{"packed": [bytes, parts]}``
for one that landed in the slot's own buffer, parts ``[[name, dtype, shape, int32 width, rows],
...]``, else name -> ``[dtype, shape, bytes]``, of ``query_start_loc``, ``seq_lens``,
``block_table``, ``slot_mapping``. ``items``: ``["directory", path]`` (first, once: a
tensor-parallel rank other than 0 writes to ``rank<N>/``, known only once vLLM is up),
``["gap", GapRecord JSON]``, ``["layer", name, fields]`` (``tracer.pending.LayerCapture.layer_fields``:
sent before the layer's first record, and again whenever they change), ``["ids", request ids]``
(the records' from here on: sent when the batch changes), ``["step", host index, block size,
layer, fields]`` (``LayerCapture.step_fields`` without the ids: a record is the layer's fields
updated with these) or ``["sync"]``, which the child answers with :data:`SYNCED` on stdout once
everything before it is written. After each message the child counts it finished in the shared
memory: the stretches it named may be reused. End of input (the tracer stopped, or its process
died) ends the child once everything it got is on disk. A write error ends it early: its one
line goes to stdout, and the tracer reports it (``RecordProcess.close``).

By default (``PAGEDTRACE_WRITER=inline``) the engine's own thread hands each slot to the child,
with no writer thread (``tracer.ring.InlineWriter``); ``process`` hands them over from a writer
thread; ``thread`` keeps the records on the writer thread. The child is only used for traces
without tensors: tensor steps copy from the device on the writer thread.

    python -m tracer.writer_process --detach [--poll] [--shared FD SIZE]   (RecordProcess starts it)

``--poll`` (``PAGEDTRACE_CHILD_READ=poll``, the default): the child reads its pipe by looking
between short sleeps, never by waiting in ``read``, so the engine's writes wake nobody
(:class:`PolledInput`).

It detaches at once (a fork; the first process ends), so that it is nobody's child: vLLM's
shutdown SIGKILLs the worker's descendants, and a record still in the pipe would be lost with
it. Its first line on stdout is :data:`STARTED` with its pid, its last :data:`DONE` when it
ended well; a child that ended without it was killed.

Imports the standard library, ``msgspec`` (a dependency of vLLM), the bottom layer and
``tracer.shared_host`` (standard library only) at module level.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import functools
import os
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tracer.format import TraceError
from tracer.options import env_choice
from tracer.shared_host import SharedHost, finished_counter

__all__ = [
    "ENV_CHILD_READ",
    "ENV_HOST",
    "ENV_WRITER",
    "PolledInput",
    "RecordProcess",
    "child_polls",
    "host_message",
    "main",
    "shared_memory",
    "writer_mode",
]

#: ``inline`` (the default), ``process`` or ``thread``: how a trace without tensors reaches its records.
ENV_WRITER = "PAGEDTRACE_WRITER"
#: ``shared`` (the default) or ``pipe``: where a metadata step's copy lands for the record process.
ENV_HOST = "PAGEDTRACE_HOST"
#: ``poll`` (the default) or ``wait``: how the record process reads its pipe (:class:`PolledInput`).
ENV_CHILD_READ = "PAGEDTRACE_CHILD_READ"

_LENGTH = struct.Struct("<I")
#: The child's answer to ``["sync"]``: every record sent before it is written.
SYNCED = b"synced\n"
#: The child's first line, once detached: ``pagedtrace-writer pid N``.
STARTED = b"pagedtrace-writer pid "
#: The child's last line when it ended well (end of input, everything written).
DONE = b"pagedtrace-writer done\n"


def writer_mode() -> str:
    """``PAGEDTRACE_WRITER``: ``inline`` (default), ``process`` or ``thread``; anything else is a one-line ValueError.

    ``inline``: the records are built by the record process, and each slot is handed to it on the
    engine's own thread (``tracer.ring.InlineWriter``). ``process``: the same process, the slots
    handed to it by a writer thread. ``thread``: the writer thread builds and writes the records.
    Inline is the default since the H200 measured it (session 10, PIECEWISE, 131 paired rounds):
    0.980x the time of ``process`` [0.960, 1.000], its engine thread blocked ~28 times a pass
    against ~500.
    """
    return env_choice(ENV_WRITER, ("inline", "process", "thread"))


def child_polls() -> bool:
    """``PAGEDTRACE_CHILD_READ``: ``poll`` (default) or ``wait``; anything else is a one-line ValueError.

    ``poll``: the record process looks at its pipe between short sleeps (:class:`PolledInput`), so
    the engine's writes wake nobody; ``wait``: it sleeps in ``read`` and each write wakes it.
    """
    return env_choice(ENV_CHILD_READ, ("poll", "wait")) == "poll"


def shared_memory() -> bool:
    """``PAGEDTRACE_HOST``: ``shared`` (default) or ``pipe``; anything else is a one-line ValueError.

    ``shared``: the steps' copies land in host memory the record process maps
    (``tracer.shared_host``), and each message names where; ``pipe``: every message carries the
    bytes, as before session 11.
    """
    return env_choice(ENV_HOST, ("shared", "pipe")) == "shared"


#: Host dtypes as ``numpy`` dtype strings, without asking numpy (``tracer.capture.Packed.like``).
_DTYPE_STR = {"torch.int32": "<i4", "torch.int64": "<i8"} if sys.byteorder == "little" else {}
#: The same by dtype object (``str`` of a torch dtype is a call a part, a step); None: not sendable.
_DTYPE_OF: dict[Any, str | None] = {}


def _dtype_str(dtype: Any) -> str | None:
    """``dtype`` (a torch dtype) as a ``numpy`` dtype string, or None when no message can carry it."""
    try:
        return _DTYPE_OF[dtype]
    except KeyError:
        out = _DTYPE_OF[dtype] = _DTYPE_STR.get(str(dtype))
        return out


def _packed_message(packed: Any) -> list[Any]:
    """``[bytes, parts]`` of a packed copy (``tracer.capture.Packed``), read at its address.

    No tensor method runs (``numpy()`` would be one more on the engine's thread, which hands the
    slots over by default). A block table copied with every column (``packed.cols`` set) goes
    as the step's rows of the columns it reads: with ``max_model_len`` 4096 and 16-token blocks a
    row has 256 columns, a step of 360-token requests reads 23, and the bytes the engine's thread
    copies, encodes and writes shrink about tenfold (the records cut each row to its own blocks
    anyway).
    """
    total = sum(packed.widths)
    address = packed.host.data_ptr()
    shape = packed.like.get("block_table", (None, ()))[1]
    cols = packed.cols
    cut = cols is not None and len(shape) == 2 and cols < shape[1]  # send the columns read only
    parts = _parts(packed, cut=cut)
    if not cut:
        return [ctypes.string_at(address, 4 * total), parts]
    start = 0  # int32 elements before the block table
    for k, w in zip(packed.order, packed.widths, strict=True):
        if k == "block_table":
            break
        start += w
    rows = parts[packed.order.index("block_table")][2][0]
    values = _int32_at(address, total)
    end = start + shape[0] * shape[1]
    table = values[start:end].reshape(shape)[:rows, :cols].tobytes()
    return [values[:start].tobytes() + table + values[end:].tobytes(), parts]


def _parts(packed: Any, *, cut: bool) -> list[list[Any]]:
    """``[[name, dtype, shape, int32 width, rows], ...]`` of a packed copy, in buffer order.

    ``cut``: the block table goes as the step's rows of its first ``packed.cols`` columns (rows -1).
    """
    shape = packed.like.get("block_table", (None, ()))[1]
    parts = []
    for k, w in zip(packed.order, packed.widths, strict=True):
        dtype = _dtype_str(packed.like[k][0])
        if cut and k == "block_table":
            rows = packed.trim.get("block_table", shape[0])  # the step's (leading) rows
            parts.append([k, dtype, [rows, packed.cols], rows * packed.cols, -1])
        else:
            parts.append([k, dtype, list(packed.like[k][1]), w, packed.trim.get(k, -1)])
    return parts


#: (address, int32 count) -> a numpy array over that memory (:func:`_int32_at`)
_ARRAYS: dict[tuple[int, int], Any] = {}


def _int32_at(address: int, count: int) -> Any:
    """A numpy int32 array over ``count`` ints at ``address`` (no copy), kept for the next call.

    A slot's host buffer is reused step after step, so the same few arrays come back; making
    one costs a ctypes type and an array. Read only while a live buffer of that size is there.
    """
    values = _ARRAYS.get((address, count))
    if values is None:
        import numpy  # the engine's process only (the child never builds a message)

        if len(_ARRAYS) >= 256:
            _ARRAYS.clear()
        memory = memoryview((ctypes.c_char * (4 * count)).from_address(address)).cast("B")
        values = _ARRAYS[(address, count)] = numpy.frombuffer(memory, dtype=numpy.int32)
    return values


def host_message(host: dict[str, Any]) -> dict[str, list[Any]]:
    """One KV-cache group's host buffers (filled: the slot's event fired) as message fields.

    A packed copy (``tracer.capture.PackedViews``) goes as its one buffer, ``{"packed": [bytes,
    [[name, dtype, shape, width, rows], ...]]}`` in buffer order, widths in int32 elements,
    ``rows`` the leading rows that are the step's (-1: all): no view is made and no tensor
    operation runs (:func:`_packed_message`). Otherwise each view goes as ``[dtype, shape, bytes]``.
    """
    packed = getattr(host, "packed", None)
    if packed is not None and packed.shared is not None:  # the copy landed in memory the child maps: name it
        memo = packed.memo if packed.memo is not None else {}
        key = tuple(packed.trim.values())  # the plan fixes the rest of how the copy is cut
        parts = memo.get(key)
        if parts is None:
            if not all(_dtype_str(d) is not None for d, _ in packed.like.values()):
                raise TraceError(f"the record writer process cannot read a host buffer of {packed.like}")
            if len(memo) >= 64:
                memo.clear()
            parts = memo[key] = _parts(packed, cut=False)
        return {"shared": [packed.shared, parts]}
    if packed is not None and all(_dtype_str(d) is not None for d, _ in packed.like.values()):
        return {"packed": _packed_message(packed)}
    out = {}
    for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
        values = host[name].numpy()
        out[name] = [values.dtype.str, list(values.shape), values.tobytes()]
    return out


class RecordProcess:
    """The child process that writes a trace's records (:meth:`start`, or the first :meth:`send`)."""

    def __init__(self, directory: Callable[[], Path], *, batch: int = 1, shared: bool = False, poll: bool = False):
        #: the trace directory, asked at the first send: a tensor-parallel rank is known only by then
        self.directory = directory
        #: make host memory the child maps (``tracer.shared_host``) when it starts
        self.shared = shared
        #: the child reads its pipe by looking, not by waiting (:class:`PolledInput`)
        self.poll = poll
        #: that memory, once the child has it (None: every copy's bytes go down the pipe)
        self.shared_host: SharedHost | None = None
        #: messages queued so far (the child counts those it has finished in ``shared_host``)
        self.messages = 0
        #: messages kept before one write sends them together (:meth:`flush` sends them sooner): each
        #: write wakes the child, and a pipe's wake-up may run it on the sender's CPU
        self.batch = batch
        self._held: list[bytes] = []
        self._told = False  # the child was sent the directory
        self._proc: subprocess.Popen[bytes] | None = None  #: its pipes (the process itself is detached)
        self.pid: int | None = None  #: the detached child's pid, once started
        self._encode: Any = None
        self._lock = threading.Lock()  # the writer thread sends, the engine's thread may sync (drain)
        self.error: str | None = None  #: the child's one-line error, once it ended early

    def send(self, hosts: list[dict[str, list[Any]]], items: list[list[Any]], regions: Sequence[int] = ()) -> bool:
        """Queue one slot's records; False once the child has ended (``error`` then says why).

        ``regions``: byte offsets of the ``shared_host`` stretches ``hosts`` name; each is free again
        once the child has finished this message (its number is taken here, under the lock).
        """
        with self._lock:
            if self.error is not None:
                return False
            if self._proc is None:
                self.start()
            proc = self._proc
            assert proc is not None and proc.stdin is not None
            if not self._told:
                items = [["directory", str(self.directory())], *items]
                self._told = True
            payload = self._encode([hosts, items])
            self.messages += 1
            if regions and self.shared_host is not None:
                for offset in regions:
                    self.shared_host.sent(offset, self.messages)
            self._held.append(_LENGTH.pack(len(payload)))
            self._held.append(payload)
            if len(self._held) < 2 * self.batch:
                return True
            return self._write()

    def flush(self) -> bool:
        """Send the messages :meth:`send` holds (``batch`` > 1); False once the child has ended."""
        with self._lock:
            return self._write() if self._held and self.error is None else self.error is None

    def _write(self) -> bool:
        """Write what is held, under the lock; on a broken pipe, close and say why (``error``)."""
        proc = self._proc
        assert proc is not None and proc.stdin is not None
        data, self._held = b"".join(self._held), []
        try:
            proc.stdin.write(data)
            proc.stdin.flush()
        except OSError:  # the child ended early (BrokenPipeError): close() reads why
            self._close(failed=True)
            return False
        return True

    def sync(self) -> bool:
        """Wait until the child has written everything sent so far; False once it has ended (see ``error``)."""
        if self._proc is None:
            return self.error is None
        if not self.send([], [["sync"]]) or not self.flush():
            return False
        with self._lock:
            proc = self._proc
            assert proc is not None and proc.stdout is not None
            line = proc.stdout.readline()
            if line == SYNCED:
                return True
            self._close(line.decode("utf-8", "replace").strip(), failed=True)
            return False

    def close(self) -> str | None:
        """End of input, after what :meth:`send` holds; wait for the child to write what it has.

        Returns its error, if any.
        """
        with self._lock:
            if self._held and self._proc is not None and self.error is None:
                self._write()
            error = self._close()
            if self.shared_host is not None:  # the child has ended: nobody reads the memory now
                self.shared_host.close()
                self.shared_host = None
            return error

    def _close(self, said: str = "", *, failed: bool = False) -> str | None:
        """Close the pipe and wait for the child. ``failed``: it ended early, whatever its exit code
        (``error`` is set then, so a failed :meth:`send` or :meth:`sync` always says why)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return self.error
        assert proc.stdin is not None and proc.stdout is not None
        with contextlib.suppress(OSError):  # the child ended early: its error is on stdout
            proc.stdin.close()
        rest = proc.stdout.read()  # to its end: the child has ended (or closed its stdout, to end)
        done = rest.endswith(DONE)
        said = (said + "\n" + rest.decode("utf-8", "replace")).strip()
        lines = [line for line in said.splitlines() if line.encode() + b"\n" not in (DONE, SYNCED)]
        if (failed or not done) and self.error is None:
            self.error = (
                lines[-1]
                if lines
                else f"pagedtrace: the record writer process (pid {self.pid}) ended before its end of input "
                "(killed?); tracing stops, the engine runs on"
            )
        return self.error

    def start(self) -> None:
        """Start the child (the runner's first call does, at the profile run; else the first send).

        Raises ``OSError`` when it cannot be started.
        """
        if self._proc is not None:
            return
        import msgspec

        self._encode = msgspec.msgpack.Encoder().encode
        root = str(Path(__file__).resolve().parent.parent)  # the directory holding the tracer package
        env = dict(os.environ)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self._told = False
        self.messages = 0  # a new child counts from 0
        shared = None
        if self.shared and self.shared_host is None:
            try:
                shared = SharedHost()
            except OSError:  # no memfd: every copy's bytes go down the pipe
                shared = None
        argv = [sys.executable, "-m", "tracer.writer_process", "--detach", *(["--poll"] if self.poll else [])]
        fds: tuple[int, ...] = ()
        if shared is not None and shared.fd is not None:
            argv += ["--shared", str(shared.fd), str(shared.size)]
            fds = (shared.fd,)
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
                close_fds=True,
                pass_fds=fds,
                # Its own session: a Ctrl-C at the terminal interrupts the engine, whose stop() then
                # closes the pipe, and the child writes what it has before it ends (end of input).
                start_new_session=True,
            )
        finally:
            if shared is not None:
                shared.close_fd()  # the child has its own descriptor; the mapping stays
        self._start(proc, shared)

    def _start(self, proc: subprocess.Popen[bytes], shared: SharedHost | None) -> None:
        # It forks at once and the first process ends: the one left is nobody's child (init adopts
        # it), so that vLLM's shutdown, which SIGKILLs the worker's descendants (psutil's
        # children(recursive=True), vllm.utils.system_utils.kill_process_tree), does not kill it
        # with records still in the pipe. It reports its pid, and ends with DONE.
        proc.wait()
        assert proc.stdout is not None
        first = proc.stdout.readline()
        if not first.startswith(STARTED):
            with contextlib.suppress(OSError):
                proc.stdin.close()  # type: ignore[union-attr]
            if shared is not None:
                shared.close()
            raise OSError(f"the record writer process did not start (it said {first[:200]!r})")
        self.pid = int(first[len(STARTED) :])
        _grow_pipe(proc.stdin)
        self._proc = proc
        self.shared_host = shared


#: The pipe to the child holds this many bytes (Linux ``F_SETPIPE_SZ``; its default is 64 KiB, and
#: 1 MiB is what an unprivileged process may ask for, ``/proc/sys/fs/pipe-max-size``).
PIPE_BYTES = 1 << 20


def _grow_pipe(stream: Any) -> None:
    """Let the pipe hold :data:`PIPE_BYTES`, so that a send does not wait for the child to read the last.

    A metadata step's message is tens of KiB (the runner's block table as it gave it, every
    column); with 64 KiB a send waited whenever the child was still on the previous message,
    ~0.2 ms on the CPU stand-in (``benchmarks/hot_path.py``), on the sender's thread. Where the
    kernel says no (not Linux, or a lower limit), the pipe stays as it is.
    """
    import fcntl

    with contextlib.suppress(OSError, AttributeError, ValueError):
        fcntl.fcntl(stream.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)


def _read_exact(stream: Any, n: int) -> bytes | None:
    data = stream.read(n)
    return data if data is not None and len(data) == n else None


#: The child's pauses between looks at an empty pipe (:class:`PolledInput`): from the first to the
#: last, doubling while nothing comes, back to the first once something does.
POLL_S = (0.0005, 0.02)


class PolledInput:
    """The child's stdin read by looking, never by waiting on it: a write to the pipe wakes nobody.

    A reader asleep in ``read`` is woken by every write, and Linux may run it at once on the
    writer's CPU, the engine's (a "sync" pipe wake-up): on the 2-core CPU stand-in a write took the
    engine's thread ~0.7 ms of wall time for ~0.07 ms of CPU. Here the pipe is non-blocking and the
    child sleeps :data:`POLL_S` between looks, so its wake-ups are its own timer's, wherever it
    last ran. ``read_exact(n)``: ``n`` bytes, or None at end of input (or a message cut short by it).
    """

    def __init__(self, fd: int, poll_s: tuple[float, float] = POLL_S):
        import fcntl

        self._fd = fd
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
        self._buffer = bytearray()
        self._first, self._last = poll_s
        self._ended = False

    def read_exact(self, n: int) -> bytes | None:
        import time

        pause = self._first
        while len(self._buffer) < n and not self._ended:
            try:
                chunk = os.read(self._fd, max(n - len(self._buffer), 1 << 16))
            except BlockingIOError:
                time.sleep(pause)
                pause = min(2 * pause, self._last)
                continue
            if not chunk:
                self._ended = True
                break
            self._buffer += chunk
            pause = self._first
        if len(self._buffer) < n:
            return None
        out = bytes(self._buffer[:n])
        del self._buffer[:n]
        return out


#: ``numpy`` dtype strings of the host buffers -> ``array`` type codes of that size (checked below).
_TYPECODES = {"i4": "i", "i8": "q", "u4": "I", "u8": "Q"}


def _ints(dtype: str, data: bytes) -> list[int]:
    """One buffer's integers, with the standard library only.

    The child imports no numpy: in vLLM's CPU worker (threads bound to cores, OpenMP settings in
    the environment it inherits) importing numpy hung.
    """
    code = _TYPECODES.get(dtype[1:])
    if code is None or array.array(code).itemsize != int(dtype[2:]):
        raise TraceError(f"the record writer process cannot read a host buffer of dtype {dtype!r}")
    values = array.array(code, data)
    if (dtype[0] == "<") != (sys.byteorder == "little") and dtype[0] in "<>":
        values.byteswap()
    return values.tolist()


def _lists(host: dict[str, list[Any]], shared: Any = None) -> dict[str, Any]:
    """``tracer.pending.host_lists`` of the buffers one message carries (``host_message``).

    ``shared``: the child's mapping of the memory a ``"shared"`` buffer is in (``tracer.shared_host``).
    """
    if "shared" in host or "packed" in host:
        if "shared" in host:
            if shared is None:
                raise TraceError("a message names shared host memory the record writer process was not given")
            offset, parts = host["shared"]
            data = shared[offset : offset + 4 * sum(part[3] for part in parts)]
        else:
            data, parts = host["packed"]
        flat, shapes, offset = {}, {}, 0
        for name, dtype, shape, width, rows in parts:
            values = _ints(dtype, data[4 * offset : 4 * (offset + width)])
            offset += width
            if rows >= 0:  # the step's leading rows of a tensor copied as the runner gave it
                values = values[: rows * (shape[1] if len(shape) == 2 else 1)]
                shape = [rows, *shape[1:]]
            flat[name] = values
            shapes[name] = shape
    else:
        flat = {name: _ints(dtype, data) for name, (dtype, _shape, data) in host.items()}
        shapes = {name: shape for name, (_dtype, shape, _data) in host.items()}
    rows, cols = shapes["block_table"]
    table = flat["block_table"]
    return {
        "query_start_loc": tuple(flat["query_start_loc"]),
        "seq_lens": tuple(flat["seq_lens"]),
        "block_table": [table[r * cols : (r + 1) * cols] for r in range(rows)],
        "slot_mapping": tuple(flat["slot_mapping"]),
    }


def main(argv: list[str] | None = None) -> int:
    """The child: records from stdin into the ``steps.jsonl`` the first message names; 0 at end of input.

    ``--detach`` (how :class:`RecordProcess` starts it): fork, and let the first process end, so
    that the one left, which does the work, has no parent to be killed with; its first line
    on stdout is :data:`STARTED` and its pid. It ends with :data:`DONE` when it ended well.
    """
    args = sys.argv[1:] if argv is None else argv
    shared = None
    if "--shared" in args:  # FD SIZE: the host memory the engine's copies land in (tracer.shared_host)
        at = args.index("--shared")
        import mmap

        shared = mmap.mmap(int(args[at + 1]), int(args[at + 2]))
        os.close(int(args[at + 1]))
    if "--detach" in args:
        if os.fork():
            os._exit(0)
        _say(STARTED + str(os.getpid()).encode() + b"\n")
    code = _records(shared, poll="--poll" in args)
    if code == 0:
        _say(DONE)
    return code


def _say(line: bytes) -> None:
    with contextlib.suppress(OSError):  # the tracer's process has gone: nobody to tell
        sys.stdout.buffer.write(line)
        sys.stdout.flush()


def _records(shared: Any = None, *, poll: bool = False) -> int:
    """Records from stdin (:func:`main`): 0 at end of input, 3 after a one-line error on stdout.

    ``shared``: the mapping of the engine's shared host memory; after each message, the count of
    messages finished goes into it, so that the engine may reuse the stretches they named.
    ``poll``: stdin is read by looking (:class:`PolledInput`), not by waiting on it.
    """
    import msgspec

    from tracer.format import TraceWriter, record_from_json
    from tracer.jsonline import encode_line
    from tracer.pending import make_record

    decode = msgspec.msgpack.Decoder().decode
    if poll:
        read_exact = PolledInput(sys.stdin.fileno()).read_exact
    else:
        read_exact = functools.partial(_read_exact, sys.stdin.buffer)
    writer = None
    directory = ""
    layers: dict[str, dict[str, Any]] = {}  # layer -> its fields that no step changes
    finished = 0  # messages read to their end
    ids: tuple[str, ...] = ()
    counter = finished_counter(shared) if shared is not None else None
    try:
        while True:
            head = read_exact(_LENGTH.size)
            if head is None:
                return 0
            body = read_exact(_LENGTH.unpack(head)[0])
            if body is None:
                return 0  # the tracer's process died mid-message: what came whole is written
            hosts, items = decode(body)
            lists: dict[int, dict[str, Any]] = {}
            for item in items:
                if item[0] == "sync":  # everything before it is on disk
                    _say(SYNCED)
                    continue
                if item[0] == "directory":
                    directory = item[1]
                    continue
                if writer is None:  # opened with the first record: the manifest is on disk by then
                    writer = TraceWriter(directory, encode_line=encode_line)
                if item[0] == "gap":
                    writer.append(record_from_json({"type": "gap", **item[1]}))
                    continue
                if item[0] == "layer":  # a layer's unchanging fields, sent before its first record
                    layers[item[1]] = _tuples(item[2])
                    continue
                if item[0] == "ids":  # the request ids of the records from here on
                    ids = tuple(item[1])
                    continue
                _, index, block_size, layer, fields = item
                if index not in lists:
                    lists[index] = _lists(hosts[index], shared)
                record = {**layers[layer], "request_ids": ids, **_tuples(fields)}
                writer.append(make_record(record, lists[index], block_size))
            finished += 1
            if counter is not None:  # every host buffer of the message is read (``_lists`` copies)
                counter.value = finished
    except OSError as exc:
        return _failed(f"pagedtrace: cannot write trace to {directory}: {exc}; tracing stops, the engine runs on")
    except Exception as exc:  # noqa: BLE001 - one line for the tracer to report, not a traceback
        return _failed(f"pagedtrace: the record writer process failed ({exc!r}); tracing stops, the engine runs on")
    finally:
        if writer is not None:
            with contextlib.suppress(OSError):
                writer.close()


def _failed(message: str) -> int:
    _say(message.replace("\n", " ").encode("utf-8", "replace") + b"\n")
    return 3


def _tuples(fields: dict[str, Any]) -> dict[str, Any]:
    """msgpack gives lists back: ``StepRecord`` holds tuples."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}


if __name__ == "__main__":
    sys.exit(main())
