"""Session 10's CPU A/B of the inline hand-over's message (run from the repository root):

    PAGEDTRACE_WRITER=inline python benchmarks/results/cpu-session10-message-ab.py [ROUNDS]

In one process, rounds alternate two forms of the tracer on ``benchmarks/hot_path.py``'s stand-in
engine (28 layers, 32 requests of 360 tokens, ``max_model_len`` 4096: 256 block-table columns,
23 read): ``before``, the message carrying every block-table column and the request ids made
anew each step (as before session 10), and ``now``. Each round times the tracer's calls on the
engine's thread over 1,000 steps (``time.thread_time``, ``hot_path.tracer_cpu_per_step``).
Prints each round's µs a step and the paired median ratio. The machine's noise is large (the
same form varies by ±25 % between rounds on a shared 2-core VM): read the paired ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path[:0] = ["benchmarks", "."]
os.environ.setdefault("PAGEDTRACE_WRITER", "inline")

import hot_path  # noqa: E402

import tracer.hooks as hooks  # noqa: E402

NOW_QUEUE, NOW_IDS = hooks.queue_host_copies, hooks.Tracer._req_ids


def queue_every_column(*args, **kwargs):
    host = NOW_QUEUE(*args, **kwargs)
    packed = getattr(host, "packed", None)
    if packed is not None:
        packed.cols = None  # the message carries the buffer whole, every column
    return host


def ids_each_step(self, num_reqs):
    self._ids_made = None  # made anew
    return NOW_IDS(self, num_reqs)


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    args = argparse.Namespace(layers=28, ops=24, reqs=32, context=360, trace_layers="first")
    seen: dict[str, list[float]] = {"before": [], "now": []}
    for r in range(rounds):
        for form in ("before", "now") if r % 2 else ("now", "before"):
            old = form == "before"
            hooks.queue_host_copies = queue_every_column if old else NOW_QUEUE
            hooks.Tracer._req_ids = ids_each_step if old else NOW_IDS
            seen[form].append(hot_path.tracer_cpu_per_step(args, 1000) * 1e6)
    for form, values in seen.items():
        print(f"{form:7s} µs a step: {[round(v) for v in values]}, median {statistics.median(values):.1f}")
    ratio = statistics.median(n / b for n, b in zip(seen["now"], seen["before"], strict=True))
    print(f"now / before, paired median over {rounds} rounds: {ratio:.3f}")


if __name__ == "__main__":
    main()
