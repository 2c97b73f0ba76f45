"""Keep the tracer's writer thread and record writer process off the engine thread's CPU core.

The engine's thread is what a launch-bound graph mode (PIECEWISE) waits for. The tracer's own
work, the writer thread and the record writer process (``tracer.ring``, ``tracer.writer_process``),
wakes once a step; Linux's wake-up placement tends to run a woken task near the task that
woke it, which can be the engine thread's CPU or the other hardware thread of its core. With
``PAGEDTRACE_AFFINITY=apart`` the tracer moves both, once, to the CPUs the engine's thread may
use minus that thread's core (every hardware thread of it), read when the model runner first
runs (:func:`cpus_apart`). ``any`` (the default) leaves placement to Linux.

Linux only (``os.sched_setaffinity``, ``/proc``, ``/sys``); elsewhere, or when no CPU would be
left, nothing is moved. Standard library only.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from tracer.options import env_choice

__all__ = ["ENV_AFFINITY", "affinity_apart", "core_of", "cpus_apart", "current_cpu", "move_to"]

#: ``any`` (default): Linux places the tracer's thread and process; ``apart``: off the engine thread's core.
ENV_AFFINITY = "PAGEDTRACE_AFFINITY"


def affinity_apart() -> bool:
    """Whether ``PAGEDTRACE_AFFINITY`` asks for ``apart`` (anything but ``any`` / ``apart``: a one-line error)."""
    return env_choice(ENV_AFFINITY, ("any", "apart")) == "apart"


def current_cpu() -> int | None:
    """The CPU the calling thread runs on (``/proc/thread-self/stat``, field 39), or None."""
    try:
        stat = Path("/proc/thread-self/stat").read_text()
        return int(stat[stat.rindex(")") + 2 :].split()[36])
    except (OSError, ValueError, IndexError):
        return None


def core_of(cpu: int, sys_root: Path = Path("/sys/devices/system/cpu")) -> set[int]:
    """Every hardware thread of ``cpu``'s core (``thread_siblings_list``, e.g. ``"3,11"`` or ``"2-3"``).

    ``{cpu}`` alone when the file is missing or unreadable (a VM may not say).
    """
    try:
        text = (sys_root / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text().strip()
        return _cpu_list(text) | {cpu}
    except (OSError, ValueError):
        return {cpu}


def _cpu_list(text: str) -> set[int]:
    """A Linux CPU list (``"0-3,8,10-11"``) as a set."""
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def cpus_apart(allowed: set[int], engine_cpu: int | None, core: set[int] | None = None) -> set[int] | None:
    """``allowed`` minus the engine thread's core; None when that CPU is unknown or nothing would be left."""
    if engine_cpu is None:
        return None
    rest = allowed - (core if core is not None else core_of(engine_cpu))
    return rest or None


def move_to(task_ids: list[int], cpus: set[int]) -> list[int]:
    """Set the CPU affinity of each thread or process id in ``task_ids``; the ids that were moved."""
    moved = []
    for tid in task_ids:
        with contextlib.suppress(OSError, AttributeError):  # gone already, or not Linux
            os.sched_setaffinity(tid, cpus)
            moved.append(tid)
    return moved
