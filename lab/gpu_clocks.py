"""The GPU's SM clock while a benchmark runs, and each timed engine step's clock.

Why: on the H200 a launch-bound PIECEWISE engine leaves the GPU idle often enough that its SM
clock drops from ~1980 MHz to 345 MHz for seconds at a time (nvidia-smi shows it). A pass's
median step then jumps between ~5–6 ms and ~9–11 ms whatever the tracer does, far more than the
~3 % the issue's target is about, and pass-time ratios at 20–40 rounds cannot show a 3 % bar.
Sampling the clock lets a probe (``lab/h200_overhead_probe.py --clocks``) say, for every engine
step, the clock it ran at, and compare the steps that ran at full clock. That is where the
tracer's cost shows most: it is CPU time on the engine's thread, which a launch-bound step pays
in full, and which a slower GPU step partly hides.

Two halves:

* the sampler, a process of its own (``python3 lab/gpu_clocks.py OUT [--period-ms 20]``):
  NVML through ctypes (``libnvidia-ml.so.1``, present wherever the driver is; no pynvml), one
  line a sample, ``unix_seconds sm_mhz reasons_hex gpu_util_percent``, until it is sent SIGTERM
  or SIGINT. ``reasons`` is NVML's clock-event (throttle) bit mask: ``0x1`` the GPU idle,
  ``0x4`` the software power cap, ...;
* the reading side, pure Python (tests run it on CPU): :func:`load_samples`, :func:`step_clocks`
  (the lowest clock seen while a step ran) and :func:`full_clock_steps`.
"""

from __future__ import annotations

import argparse
import bisect
import ctypes
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["FULL_CLOCK_SHARE", "Sample", "full_clock_steps", "load_samples", "sample", "step_clocks"]

#: A step ran "at full clock" when the lowest SM clock sampled while it ran is at least this share
#: of the highest clock sampled in the whole run (H200: 1980 MHz boost; the throttled states seen
#: were 1545-1635 MHz under the power cap and 345 MHz idle).
FULL_CLOCK_SHARE = 0.9

#: NVML's constants (nvml.h): ``NVML_CLOCK_SM``.
_NVML_CLOCK_SM = 1

Sample = tuple[float, int, int, int]  #: (unix seconds, SM MHz, clock-event reasons, GPU utilisation %)


class _Utilization(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


def sample(out: Path, *, period_s: float = 0.02, device: int = 0) -> int:
    """Append one line a sample to ``out`` until SIGTERM / SIGINT; returns the number of samples."""
    nvml = ctypes.CDLL("libnvidia-ml.so.1")
    _check(nvml.nvmlInit_v2(), "nvmlInit_v2")
    handle = ctypes.c_void_p()
    _check(nvml.nvmlDeviceGetHandleByIndex_v2(device, ctypes.byref(handle)), "nvmlDeviceGetHandleByIndex_v2")
    reasons_of = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
    reasons_of = reasons_of or nvml.nvmlDeviceGetCurrentClocksThrottleReasons
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    clock, reasons, util = ctypes.c_uint(), ctypes.c_ulonglong(), _Utilization()
    n = 0
    with out.open("a", buffering=1) as f:
        while not stop:
            t = time.time()
            if nvml.nvmlDeviceGetClockInfo(handle, _NVML_CLOCK_SM, ctypes.byref(clock)) == 0:
                r = reasons.value if reasons_of(handle, ctypes.byref(reasons)) == 0 else 0
                u = util.gpu if nvml.nvmlDeviceGetUtilizationRates(handle, ctypes.byref(util)) == 0 else -1
                f.write(f"{t:.4f} {clock.value} {r:#x} {u}\n")
                n += 1
            time.sleep(max(0.0, period_s - (time.time() - t)))
    nvml.nvmlShutdown()
    return n


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed: NVML error {rc}")


def load_samples(path: Path) -> list[Sample]:
    """The sampler's lines, in time order; a line cut short by the sampler's end is skipped."""
    out: list[Sample] = []
    for line in Path(path).read_text().splitlines():
        parts = line.split()
        if len(parts) != 4:
            continue
        try:
            out.append((float(parts[0]), int(parts[1]), int(parts[2], 16), int(parts[3])))
        except ValueError:
            continue
    out.sort()
    return out


def step_clocks(steps: Sequence[tuple[float, float]], samples: Sequence[Sample]) -> list[int | None]:
    """For each step ``(start unix seconds, duration seconds)``: the lowest SM clock seen while it ran.

    The samples taken during the step, and the last one before it (the clock it started at);
    None when no sample is that close (before the first sample, or a gap of over a second).
    """
    times = [s[0] for s in samples]
    out: list[int | None] = []
    for start, duration in steps:
        lo = bisect.bisect_right(times, start) - 1
        hi = bisect.bisect_right(times, start + duration)
        if lo < 0 or start - times[lo] > 1.0:
            out.append(None)
            continue
        out.append(min(s[1] for s in samples[lo:hi]))
    return out


def full_clock_steps(
    steps: Sequence[tuple[float, float]], clocks: Sequence[int | None], top_mhz: int, *, share: float = FULL_CLOCK_SHARE
) -> list[float]:
    """The durations (seconds) of the steps that ran at full clock: ``clock >= share * top_mhz``."""
    bar = share * top_mhz
    return [d for (_, d), c in zip(steps, clocks, strict=True) if c is not None and c >= bar]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="file the samples are appended to")
    ap.add_argument("--period-ms", type=float, default=20.0)
    ap.add_argument("--device", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        n = sample(args.out, period_s=args.period_ms / 1e3, device=args.device)
    except (OSError, RuntimeError, AttributeError) as exc:
        print(f"gpu_clocks: {exc}", file=sys.stderr)
        return 1
    print(f"gpu_clocks: {n} samples in {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
