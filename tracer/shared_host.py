"""Host memory the engine's process and the record writer process share: copies land where the child reads.

A metadata step's copy goes into a pinned host buffer; before this module the engine's
thread then turned that buffer into bytes (the step's rows, the block-table columns it
reads) and wrote them down the pipe to the record writer process (``tracer.writer_process``):
tens of µs a step, on the thread a PIECEWISE engine is bound by. Here the host buffer is
itself memory the child maps (a ``memfd``, handed to it when it starts), page-locked for the
device when the engine runs on CUDA (``cudaHostRegister``), so the step's one device-to-host
copy puts the values where the child reads them, and the message names a place instead of
carrying the bytes.

The memory is :data:`REGIONS` regions of :data:`REGION_BYTES`, one per packed copy
(:meth:`SharedHost.take`). A region is free again once the child says it has read the message
that named it: the child counts the messages it has finished in the first 8 bytes
(:func:`finished_counter`, a ``uint64``). Nothing ever waits for a region: when none is free (the
child is behind, a slow disk) or the copy does not fit one (a large prefill), :meth:`take` says
None and that step's copy goes into the slot's own buffer and its bytes down the pipe, as before.
So a region is reused only after the child has read it, and no step is lost.

Imports the standard library only; torch (for the tensor over the memory) when a step asks.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from collections import deque
from typing import Any

__all__ = ["HEADER_BYTES", "REGIONS", "REGION_BYTES", "SharedHost", "finished_counter"]

#: Bytes before the first region: the child's count of finished messages (``uint64``), padded.
HEADER_BYTES = 64
#: Regions: more than the ring's 64 slots (``tracer.hooks.RING_SLOTS``), so that the steps in
#: flight, queued for a message (``tracer.ring.HAND_OVER_EVERY``) and those the child is on, do not
#: leave the next step without one (~20 are in use in the steady state).
REGIONS = 128
#: One region: a decode step of 32 requests with a 256-column block table is ~33 KiB packed; a
#: prefill of 10k tokens ~120 KiB. Larger steps take the slot's own buffer (:meth:`SharedHost.take`).
REGION_BYTES = 256 * 1024


class SharedHost:
    """:data:`REGIONS` regions of shared, page-locked host memory, and whether the child has read each.

    Made by the engine's process (``tracer.writer_process.RecordProcess.start``) before the
    child starts; ``fd`` goes to the child, which maps the same memory and counts the messages it
    has finished in it (:func:`finished_counter`). Raises ``OSError`` where the memory cannot be made (no ``memfd``).
    """

    def __init__(self, regions: int | None = None, region_bytes: int | None = None):
        regions = REGIONS if regions is None else regions  # read now: tests make fewer
        region_bytes = REGION_BYTES if region_bytes is None else region_bytes
        if region_bytes % 8:
            raise ValueError("region_bytes must be a multiple of 8")
        self.regions = regions
        self.region_bytes = region_bytes
        self.size = HEADER_BYTES + regions * region_bytes
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
        #: per region: the message that named it (0: none yet), or -1 while it is not yet sent
        self._sent_in = [0] * regions
        #: free regions, a stack: the one freed last is taken first, so that in the steady state a
        #: few regions serve (their views made, their pages warm), not all of them in turn
        self._free = list(range(regions - 1, -1, -1))
        #: taken regions, oldest first: the order they are sent in, so the child finishes them in it
        self._in_flight: deque[int] = deque()
        self._tensor: Any = None  #: int32 view of the whole memory (made on the first ``take``)
        self._pinned = False  #: registered with CUDA (``cudaHostRegister``)
        self._views: dict[tuple[int, int], Any] = {}  #: (region, ints) -> the region's first ints
        self.disabled = False  #: pinning failed: every ``take`` says None
        self.taken = self.declined = 0  #: copies that went into a region / that found none free

    @property
    def address(self) -> int:
        """The memory's address in this process (its int32 tensor's ``data_ptr``), once made."""
        return 0 if self._tensor is None else int(self._tensor.data_ptr())

    def finished(self) -> int:
        """How many messages the child has finished (every region they named is read)."""
        return int(self._finished.value)

    def take(self, ints: int, *, pin: bool) -> tuple[int, Any] | None:
        """The next region as an int32 host tensor of ``ints`` elements, with its byte offset; None if unfit.

        None when every region is in flight (taken, and its message not yet finished by the
        child), when ``ints`` does not fit a region, or when the memory cannot be page-locked
        (``pin``: the copy comes from a CUDA device). The region is in flight until the child
        has finished the message :meth:`sent` says names it.
        """
        if self.disabled or 4 * ints > self.region_bytes:
            self.declined += 1
            return None
        in_flight, sent_in, free = self._in_flight, self._sent_in, self._free
        finished = self._finished.value
        while in_flight and 0 < sent_in[in_flight[0]] <= finished:  # read by the child: free again
            free.append(in_flight.popleft())
        if not free or ((self._tensor is None or (pin and not self._pinned)) and not self._make_tensor(pin)):
            self.declined += 1
            return None
        r = free.pop()
        in_flight.append(r)
        sent_in[r] = -1
        view = self._views.get((r, ints))
        if view is None:
            if len(self._views) > 4 * self.regions:
                self._views.clear()
            start = (HEADER_BYTES + r * self.region_bytes) // 4
            view = self._views[(r, ints)] = self._tensor[start : start + ints]
        self.taken += 1
        return HEADER_BYTES + r * self.region_bytes, view

    def sent(self, offset: int, message: int) -> None:
        """The region at byte ``offset`` is named by message number ``message`` (1-based) to the child."""
        self._sent_in[(offset - HEADER_BYTES) // self.region_bytes] = message

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
        self._tensor = None
        del self._finished
        self._finished = ctypes.c_uint64(2**63)  # every region reads as free: nothing takes one now
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
