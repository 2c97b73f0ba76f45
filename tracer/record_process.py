"""A metadata trace's records, written by a process of their own so the engine keeps the GIL.

Turning a step into a ``StepRecord`` and a JSON line is pure Python (a few hundred µs a step on
the H200 host), and in a launch-bound graph mode (PIECEWISE) the engine's thread waits for every
µs it spends on it. So a trace without tensors has no writer thread: at each hand-over the
engine's own thread (``tracer.handover.InlineWriter``) puts the slots' host buffers and the
records' other fields into one message (``tracer.record_writer.RecordWriter.send_slot``, then
``send_records``) and writes it to this module's process (:class:`RecordProcess`, started by the
model runner's first call, so only a process that runs the model has one), which builds the
records and appends them to ``steps.jsonl``, one flushed line each. Where that process cannot
start, the engine's process builds and writes the records itself (``RecordWriter.start``). A trace
with tensors has a writer thread instead, which copies the tensors from the device and writes
the records (``tracer.record_writer``).

The messages are defined once, in ``tracer.messages``: a :class:`tracer.messages.Message` holds
the host buffers of the hand-over's slots and its items, encoded and decoded by that module's
one encoder and typed decoder. A step's packed copy normally lands in host memory the child maps
(``tracer.shared_host``; given to it as ``--shared FD SIZE``), and the message names where
(``SharedCopy``); a copy that found no room there (the ring full, the copy too large, or no
shared memory at all) goes as its bytes (``PackedCopy``), a tensor of another dtype as its own
view's (``Views``). After each message the child counts it finished in the shared memory: the
stretches it named may be reused. The child answers a ``Sync`` item with :data:`SYNCED` on
stdout once everything before it is written. End of input (the tracer stopped, or its process
died) ends the child once everything it got is on disk. A write error ends it early: its one
line goes to stdout, and the tracer reports it (``RecordProcess.close``).

    python -m tracer.record_process --detach [--shared FD SIZE]   (RecordProcess starts it)

The child reads its pipe by looking between short sleeps, never by waiting in ``read``, so the
engine's writes wake nobody (:class:`PolledInput`).

It detaches at once (a fork; the first process ends), so that it is nobody's child: vLLM's
shutdown SIGKILLs the worker's descendants, and a record still in the pipe would be lost with
it. Its first line on stdout is :data:`STARTED` with its pid, its last :data:`DONE` when it
ended well; a child that ended without it was killed.

Imports the standard library, ``msgspec`` (a dependency of vLLM), the bottom layer,
``tracer.messages`` and ``tracer.shared_host`` (standard library only) at module level.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tracer.host_buffers import message_lists
from tracer.messages import (
    DECODER,
    ENCODER,
    LENGTH,
    Directory,
    Gap,
    Host,
    Item,
    Layer,
    Message,
    RequestIds,
    Step,
    Sync,
)
from tracer.shared_host import SharedHost, finished_counter

__all__ = ["PolledInput", "RecordProcess", "main"]

#: The child's answer to a ``Sync`` item: every record sent before it is written.
SYNCED = b"synced\n"
#: The child's first line, once detached: ``pagedtrace-writer pid N``.
STARTED = b"pagedtrace-writer pid "
#: The child's last line when it ended well (end of input, everything written).
DONE = b"pagedtrace-writer done\n"


class RecordProcess:
    """The child process that writes a trace's records (:meth:`start`, or the first :meth:`send`)."""

    def __init__(self, directory: Callable[[], Path], *, batch: int = 1):
        #: the trace directory, asked at the first send: a tensor-parallel rank is known only by then
        self.directory = directory
        #: the host memory the child maps (``tracer.shared_host``), made when it starts; None where
        #: it cannot be made (no ``memfd``): then every copy's bytes go down the pipe
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
        self._lock = threading.Lock()  # the engine's thread and the inline writer's idle thread both send
        self.error: str | None = None  #: the child's one-line error, once it ended early

    def send(self, hosts: list[Host], items: list[Item], regions: Sequence[int] = ()) -> bool:
        """Queue one message (a hand-over's slots); False once the child has ended (``error`` then says why).

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
                items = [Directory(str(self.directory())), *items]
                self._told = True
            payload = ENCODER.encode(Message(hosts, items))
            self.messages += 1
            if regions and self.shared_host is not None:
                for offset in regions:
                    self.shared_host.sent(offset, self.messages)
            self._held.append(LENGTH.pack(len(payload)))
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
        if not self.send([], [Sync()]) or not self.flush():
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
        root = str(Path(__file__).resolve().parent.parent)  # the directory holding the tracer package
        env = dict(os.environ)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self._told = False
        self.messages = 0  # a new child counts from 0
        shared: SharedHost | None
        try:
            shared = SharedHost()
        except OSError:  # no memfd: every copy's bytes go down the pipe
            shared = None
        argv = [sys.executable, "-m", "tracer.record_process", "--detach"]
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
    code = _records(shared)
    if code == 0:
        _say(DONE)
    return code


def _say(line: bytes) -> None:
    with contextlib.suppress(OSError):  # the tracer's process has gone: nobody to tell
        sys.stdout.buffer.write(line)
        sys.stdout.flush()


def _records(shared: Any = None) -> int:
    """Records from stdin (:func:`main`): 0 at end of input, 3 after a one-line error on stdout.

    Stdin is read by looking (:class:`PolledInput`), each message decoded as a
    ``tracer.messages.Message``. ``shared``: the mapping of the engine's shared host memory; after
    each message, the count of messages finished goes into it, so that the engine may reuse the
    stretches they named.
    """
    from tracer.format import TraceWriter, record_from_json
    from tracer.jsonline import encode_line
    from tracer.layer_capture import make_record

    read_exact = PolledInput(sys.stdin.fileno()).read_exact
    writer = None
    directory = ""
    layers: dict[str, dict[str, Any]] = {}  # layer -> its fields that no step changes
    finished = 0  # messages read to their end
    ids: tuple[str, ...] = ()
    counter = finished_counter(shared) if shared is not None else None
    try:
        while True:
            head = read_exact(LENGTH.size)
            if head is None:
                return 0
            body = read_exact(LENGTH.unpack(head)[0])
            if body is None:
                return 0  # the tracer's process died mid-message: what came whole is written
            message = DECODER.decode(body)
            lists: dict[int, dict[str, Any]] = {}
            for item in message.items:
                if isinstance(item, Step):
                    if writer is None:  # opened with the first record: the manifest is on disk by then
                        writer = TraceWriter(directory, encode_line=encode_line)
                    if item.host not in lists:
                        lists[item.host] = message_lists(message.hosts[item.host], shared)
                    record = {**layers[item.layer], "request_ids": ids, **_tuples(item.fields)}
                    writer.append(make_record(record, lists[item.host], item.block_size))
                elif isinstance(item, Layer):  # a layer's unchanging fields, sent before its first record
                    layers[item.name] = _tuples(item.fields)
                elif isinstance(item, RequestIds):  # the request ids of the records from here on
                    ids = item.ids
                elif isinstance(item, Gap):
                    if writer is None:
                        writer = TraceWriter(directory, encode_line=encode_line)
                    writer.append(record_from_json({"type": "gap", **item.record}))
                elif isinstance(item, Sync):  # everything before it is on disk
                    _say(SYNCED)
                elif isinstance(item, Directory):
                    directory = item.path
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
