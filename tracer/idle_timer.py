"""A one-shot timer an idle thread sleeps on without the GIL: Linux's ``timerfd``, through ctypes.

The inline writer's idle thread (``tracer.handover.InlineWriter``, ``idle="timer"``) sleeps
on it; each step pushes it ahead (one system call, no wake-up), so the thread wakes only once
steps stop. Standard library only.
"""

from __future__ import annotations

import os

__all__ = ["IdleTimer"]


class IdleTimer:
    """A one-shot Linux ``timerfd`` (``CLOCK_MONOTONIC``), made and set through libc with ctypes.

    :meth:`arm` sets it to fire ``seconds`` from now (arming again moves it: no wake-up, one
    system call); :meth:`wait` sleeps in ``select`` without the GIL until it fires (True) or
    ``timeout`` passes (False). Raises ``OSError`` where there is no ``timerfd`` (not Linux).
    """

    def __init__(self) -> None:
        import ctypes
        import ctypes.util

        class _Timespec(ctypes.Structure):
            _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

        class _Itimerspec(ctypes.Structure):
            _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]

        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
            create, settime = libc.timerfd_create, libc.timerfd_settime
        except (OSError, AttributeError) as exc:
            raise OSError(f"no timerfd here: {exc}") from None
        create.argtypes, create.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        settime.restype = ctypes.c_int
        fd = create(1, os.O_CLOEXEC | os.O_NONBLOCK)  # CLOCK_MONOTONIC; TFD_CLOEXEC / TFD_NONBLOCK are these
        if fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create failed")
        self.fd = fd
        self._settime = settime
        self._spec = _Itimerspec()  # it_interval 0: one-shot
        self._address = ctypes.addressof(self._spec)

    def arm(self, seconds: float) -> None:
        value = self._spec.it_value
        value.tv_sec, value.tv_nsec = divmod(max(1, int(seconds * 1e9)), 1_000_000_000)
        self._settime(self.fd, 0, self._address, None)

    def wait(self, timeout: float | None = None) -> bool:
        import select

        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return False
        try:
            os.read(self.fd, 8)  # the expirations count: reading it disarms the readiness
        except BlockingIOError:
            return False
        return True

    def close(self) -> None:
        os.close(self.fd)
