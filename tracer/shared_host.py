"""Host memory the engine's process and the record writer process share: copies land where the child reads.

A metadata step's copy goes into memory the record writer process (``tracer.record_process``)
maps (a ``memfd``, handed to it when it starts), page-locked for the device when the engine
runs on CUDA (``cudaHostRegister``), so the step's copy puts the values where the child reads
them, and the message names a place (``tracer.messages.SharedCopy``) instead of carrying the
bytes. Turning a host buffer into bytes (the step's rows, the block-table columns it reads)
and writing them down the pipe costs tens of µs a step, on the thread a PIECEWISE engine is
bound by.

The memory is a ring of :data:`RING_BYTES` after a header: each packed copy takes the next
stretch of it (:meth:`SharedHost.take`, 64-byte aligned), first in, first out, so that the
copies of consecutive steps lie side by side. A stretch is free again once the child says it
has read the message that named it: the child counts the messages it has finished in the first
8 bytes (:func:`finished_counter`, a ``uint64``). Nothing ever waits for room: when the ring is
full (the child is behind, a slow disk) or a copy is larger than :data:`MAX_TAKE_BYTES` (a very
large prefill), :meth:`take` says None and that step's copy goes into the slot's own buffer and
its bytes down the pipe (``tracer.messages.PackedCopy``). So a stretch is reused only after the
child has read it, and no step is lost.

**Deferred copies** (``defer``, CUDA). Each device call costs the engine's thread tens of µs
under vLLM on the H200 (a ``cat`` and a ``copy_`` ~108 µs together, an event ~50 µs, measured
there), so a step need not make three. The ring has a mirror in device memory, at the same offsets: the
step's one call packs its metadata into the mirror (``torch.cat(..., out=)``, a device-to-device
kernel, ordered on the step's stream like any other), and :meth:`SharedHost.flush` later moves
the stretches not yet moved, side by side, to the host in one ``copy_``. The writer flushes
before it hands steps over and records one event after the flush
(``tracer.handover.InlineWriter``): every ``HAND_OVER_EVERY`` steps one copy and one event, not
one of each a step.

Imports the standard library only; torch (for the tensors over the memory) when a step asks.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from collections import deque
from typing import Any

__all__ = ["ALIGN", "HEADER_BYTES", "MAX_TAKE_BYTES", "RING_BYTES", "SharedHost", "finished_counter"]

#: Bytes before the ring: the child's count of finished messages (``uint64``), padded.
HEADER_BYTES = 64
#: The ring's bytes. A decode step of 32 requests with a 256-column block table packs ~33 KiB,
#: a prefill of 10k tokens ~120 KiB; ~20 steps are in flight in the steady state (those queued for
#: a message, ``tracer.handover.HAND_OVER_EVERY``, and those the child is on), and the 64 ring slots
#: (``tracer.install.RING_SLOTS``) at most. Its device mirror (deferred copies) is as large.
RING_BYTES = 16 * 2**20
#: The largest copy one step puts in the ring; a larger one takes the slot's own buffer.
MAX_TAKE_BYTES = 2 * 2**20
#: Every stretch starts on a multiple of this many bytes (an int64 part stays 8-byte aligned).
ALIGN = 64

#: An entry's message before it is sent (``SharedHost.sent``); 0: given up (``SharedHost.forget``)
_UNSENT = -1


class SharedHost:
    """A ring of shared, page-locked host memory (and its device mirror), and what the child has read.

    Made by the engine's process (``tracer.record_process.RecordProcess.start``) before the
    child starts; ``fd`` goes to the child, which maps the same memory and counts the messages it
    has finished in it (:func:`finished_counter`). ``ring_bytes`` / ``max_take``: the ring's size
    and the largest stretch one copy takes (tests make them small). Raises ``OSError`` where the
    memory cannot be made (no ``memfd``).
    """

    def __init__(self, ring_bytes: int | None = None, max_take: int | None = None):
        ring_bytes = RING_BYTES if ring_bytes is None else ring_bytes  # read now: tests make it small
        max_take = MAX_TAKE_BYTES if max_take is None else max_take
        if ring_bytes % ALIGN:
            raise ValueError(f"ring_bytes must be a multiple of {ALIGN}")
        self.ring_bytes = ring_bytes
        self.max_take = min(max_take, ring_bytes - ALIGN)
        self.size = HEADER_BYTES + ring_bytes
        memfd_create = getattr(os, "memfd_create", None)
        if memfd_create is None:
            raise OSError("no memfd_create on this platform")
        self.fd: int | None = memfd_create("pagedtrace-host", 0)  # no CLOEXEC: the child inherits it
        try:
            os.ftruncate(self.fd, self.size)
            self._map: mmap.mmap | None = mmap.mmap(self.fd, self.size)
        except OSError:
            os.close(self.fd)
            raise
        #: the child's count of finished messages, read without a copy
        self._finished = finished_counter(self._map)
        #: stretches taken, oldest first: ``[start, end, message]`` (ring offsets; ``_UNSENT`` until sent)
        self._in_flight: deque[list[int]] = deque()
        self._by_start: dict[int, list[int]] = {}  #: ring offset -> its entry of ``_in_flight``
        self._head = 0  #: where the next stretch starts (ring offset)
        self._tensor: Any = None  #: int32 view of the whole memory (made on the first ``take``)
        self._pinned = False  #: registered with CUDA (``cudaHostRegister``)
        self._mirror: Any = None  #: the ring's device mirror, int32 (made on the first deferred ``take``)
        self._stream: Any = None  #: the stream the deferred copies are queued on (the steps' own)
        self._raw_stream: Any = None  #: ``torch._C._cuda_getCurrentRawStream`` (CUDA mirrors)
        self._device_index = 0
        self._stream_id = 0  #: ``_stream``'s raw handle
        #: (which, ring offset, ints) -> a view: ``h`` of the host memory, ``d`` of the device mirror
        self._views: dict[tuple[str, int, int], Any] = {}
        #: ring offsets ``[start, end)`` packed in the mirror and not yet moved to the host
        self._dirty: list[int] | None = None
        self.disabled = False  #: pinning failed: every ``take`` says None
        self.taken = self.declined = 0  #: copies that went into the ring / that found no room
        self.flushes = 0  #: deferred copies made (:meth:`flush`), each moving one or more steps

    @property
    def address(self) -> int:
        """The memory's address in this process (its int32 tensor's ``data_ptr``), once made."""
        return 0 if self._tensor is None else int(self._tensor.data_ptr())

    @property
    def unflushed(self) -> bool:
        """Some step's copy is in the device mirror only (:meth:`flush` moves it)."""
        return self._dirty is not None

    def finished(self) -> int:
        """How many messages the child has finished (every stretch they named is read)."""
        return int(self._finished.value)

    def take(self, ints: int, *, pin: bool, device: Any = None) -> tuple[int, Any, Any] | None:
        """The next stretch for ``ints`` int32: its byte offset, a host tensor over it, and a device one or None.

        ``device`` (a CUDA ``torch.device``, with ``pin``): the copy is deferred. The third item
        is then the stretch's view of the device mirror: the caller packs into it, and the host
        holds the values once :meth:`flush` has run and an event recorded after it has fired.
        Otherwise the third is None and the caller copies into the host tensor itself.

        None when the ring has no room (stretches in flight: taken, and their message not yet
        finished by the child), when ``ints`` is more than :data:`MAX_TAKE_BYTES`, or when the
        memory cannot be page-locked (``pin``: the copy comes from a CUDA device). A stretch is in
        flight until the child has finished the message :meth:`sent` says names it.
        """
        nbytes = 4 * ints
        if self.disabled or nbytes > self.max_take:
            self.declined += 1
            return None
        if (self._tensor is None or (pin and not self._pinned)) and not self._make_tensor(pin):
            self.declined += 1
            return None
        stretch = -(-nbytes // ALIGN) * ALIGN
        start = self._room(stretch)
        if start is None:
            self.declined += 1
            return None
        mirror = None
        if device is not None:
            if self._mirror is None:
                self._make_mirror(device)
            elif self._raw_stream is not None and self._raw_stream(self._device_index) != self._stream_id:
                self._follow_stream(device)
            dirty = self._dirty
            if dirty is not None and dirty[1] != start:  # the ring wrapped: move what lies at its end first
                self.flush()
                dirty = None
            if dirty is None:
                self._dirty = [start, start + stretch]
            else:
                dirty[1] = start + stretch
            mirror = self._views.get(("d", start, ints))
            if mirror is None:
                mirror = self._view("d", start, ints)
        self.taken += 1
        host = self._views.get(("h", start, ints))
        if host is None:
            host = self._view("h", start, ints)
        return HEADER_BYTES + start, host, mirror

    def _room(self, nbytes: int) -> int | None:
        """Take ``nbytes`` at the ring's head (or at its start, wrapping); None: no room."""
        in_flight, by_start = self._in_flight, self._by_start
        if in_flight and in_flight[0][2] >= 0:  # sent (or given up): the child may have read it
            finished = self._finished.value
            while in_flight and 0 <= in_flight[0][2] <= finished:  # read by the child (or given up): free again
                del by_start[in_flight.popleft()[0]]
        head, size = self._head, self.ring_bytes
        if not in_flight:
            start = 0 if self._dirty is None else head  # nothing in flight: start over, unless the mirror waits
            if start + nbytes > size:
                start = 0
        else:
            tail = in_flight[0][0]
            if head > tail:  # free: [head, size) and [0, tail)
                if head + nbytes <= size:
                    start = head
                elif nbytes < tail:
                    start = 0
                else:
                    return None
            elif head + nbytes < tail:  # wrapped: free is [head, tail)
                start = head
            else:
                return None
        entry = [start, start + nbytes, _UNSENT]
        in_flight.append(entry)
        by_start[start] = entry
        self._head = start + nbytes
        return start

    def _view(self, which: str, start: int, ints: int) -> Any:
        key = (which, start, ints)
        view = self._views.get(key)
        if view is None:
            if len(self._views) > 4096:
                self._views.clear()
            if which == "h":
                first = (HEADER_BYTES + start) // 4
                view = self._tensor[first : first + ints]
            else:
                view = self._mirror[start // 4 : start // 4 + ints]
            self._views[key] = view
        return view

    def flush(self) -> bool:
        """Queue one copy of the stretches packed in the mirror since the last flush to the host.

        On the stream the deferred packs were queued on (non-blocking: the host holds the values
        once an event recorded after this, on that stream, has fired). False: nothing to move.
        """
        dirty, self._dirty = self._dirty, None
        if dirty is None:
            return False
        import torch

        start, end = dirty
        ints = (end - start) // 4
        host, mirror = self._view("h", start, ints), self._view("d", start, ints)
        # The steps run in inference mode (vLLM's worker), so the memory's tensors are inference
        # tensors; the engine's idle call and ``stop`` move what is left from outside it. The copy
        # goes on the steps' stream: a hand-over at a step's end is on it already (both contexts
        # are a dozen Python calls each, skipped then).
        raw = self._raw_stream
        other_stream = raw is not None and raw(self._device_index) != self._stream_id
        if other_stream or not torch.is_inference_mode_enabled():
            with torch.inference_mode(), torch.cuda.stream(self._stream if other_stream else None):
                host.copy_(mirror, non_blocking=True)
        else:
            host.copy_(mirror, non_blocking=True)
        self.flushes += 1
        return True

    @property
    def stream(self) -> Any:
        """The stream the deferred copies are queued on (an event after :meth:`flush` goes there), or None."""
        return self._stream

    def sent(self, offset: int, message: int) -> None:
        """The stretch at byte ``offset`` is named by message number ``message`` (1-based) to the child."""
        entry = self._by_start.get(offset - HEADER_BYTES)
        if entry is not None:
            entry[2] = message

    def forget(self, offset: int) -> None:
        """The stretch at byte ``offset`` will never be sent (its step was dropped): free it in its turn."""
        self.sent(offset, 0)

    def _make_tensor(self, pin: bool) -> bool:
        import torch

        if self._tensor is None:
            assert self._map is not None
            self._tensor = torch.frombuffer(self._map, dtype=torch.int32)
        if pin and not self._pinned:
            code = int(torch.cuda.cudart().cudaHostRegister(self._tensor.data_ptr(), self.size, 0))
            if code != 0:  # the slots' own pinned buffers serve
                # The runtime keeps a failed call's error as this thread's last error, and torch
                # checks that after every kernel launch: left there, it would fail the engine's next one.
                _clear_last_cuda_error(torch)
                self.disabled = True
                return False
            self._pinned = True
        return True

    def _make_mirror(self, device: Any) -> None:
        import torch

        self._mirror = torch.empty(self.ring_bytes // 4, dtype=torch.int32, device=device)
        if device.type == "cuda":
            self._stream = torch.cuda.current_stream(device)
            self._device_index = self._stream.device_index
            self._raw_stream = torch._C._cuda_getCurrentRawStream  # an int: one cheap call a step
            self._stream_id = self._raw_stream(self._device_index)

    def _follow_stream(self, device: Any) -> None:
        """The steps' stream changed: what the old one packed moves on it, and the new one waits for that.

        So that the one event a seal records on the new stream covers every copy before it.
        """
        import torch

        self.flush()
        old, self._stream = self._stream, torch.cuda.current_stream(device)
        self._stream.wait_stream(old)
        self._stream_id = self._raw_stream(self._device_index)

    def close_fd(self) -> None:
        """Close this process's descriptor (the child has its own; the mapping stays)."""
        fd, self.fd = self.fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def close(self) -> None:
        """Unregister and unmap, once no copy into the memory is in flight (the tracer has drained)."""
        self.close_fd()
        self.disabled = True
        if self._pinned:
            import torch

            self._pinned = False
            torch.cuda.cudart().cudaHostUnregister(self._tensor.data_ptr())
        self._views.clear()
        self._tensor = self._mirror = None
        self._dirty = None
        del self._finished
        self._finished = ctypes.c_uint64(2**63)  # every stretch reads as free: nothing takes one now
        mapped, self._map = self._map, None
        if mapped is not None:
            with contextlib.suppress(BufferError):  # a view still held elsewhere keeps the mapping
                mapped.close()


def _clear_last_cuda_error(torch: Any) -> None:
    """Reset the CUDA runtime's last error on this thread (``cudaGetLastError``), best effort.

    torch exposes no ``cudaGetLastError``; the runtime it loaded is found by its soname.
    """
    major = str(getattr(torch.version, "cuda", "") or "").split(".")[0]
    for name in (f"libcudart.so.{major}", "libcudart.so"):
        try:
            ctypes.CDLL(name).cudaGetLastError()
            return
        except (OSError, AttributeError):
            continue


def finished_counter(mapped: Any) -> Any:
    """The count of finished messages in a mapping of the memory, as a ``ctypes.c_uint64`` over it.

    Both sides go through it, so that the count is written and read as one aligned 8-byte word
    (a byte-wise copy could be read half-written, and say more than the child has read).
    """
    return ctypes.c_uint64.from_buffer(mapped, 0)
