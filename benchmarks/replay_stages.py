"""Where one replay process's time goes, stage by stage, on a CPU or a GPU.

Replays ``--steps`` records of a trace in one process, the way :func:`reference_impl.replay.replay_trace`
does, timing each stage around the call replay makes for it (a GPU is synchronised at every stage
boundary, so its asynchronous work lands in the stage that queued it), and prints milliseconds per
record for each stage::

    python benchmarks/replay_stages.py TRACE [--device cuda] [--steps 200:230] [--profile 30] [--torch-profile 30]

The stages: ``tensors`` (the record's safetensors file, the KV write log applied and read),
``inputs`` (:func:`reference_impl.inputs.step_inputs`: the captured blocks in the canonical layout),
``reference`` (on a CPU the fp64 reference form; on a GPU the one pass of reference and emulation),
``emulation`` (CPU only: the bar's baseline), ``judge`` (the bar and the verdict), ``write path``.
``--profile N`` adds cProfile's N costliest Python functions; ``--torch-profile N`` torch's profiler's
N costliest operators by their own host time (on a GPU, with their device time and the CUDA calls
that wait, such as copies from pageable memory). Figures only, no asserts.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reference_impl.checks import check_write_path
from reference_impl.emulation import emulation_of
from reference_impl.inputs import emulated_output, judge_output, run_kernel, step_inputs
from reference_impl.replay import REPLAY_THREADS
from reference_impl.resolve import kv_spec, resolve_layout
from reference_impl.step_pass import step_kwargs, step_outputs
from reference_impl.tolerances import REFERENCE_DTYPE
from reference_impl.workers import keep_freed_memory
from tracer.format import Trace
from tracer.format.selection import parse_steps, select_records


class _Laps:
    """Seconds per stage: :meth:`lap` charges the time since the last lap (or :meth:`start`) to a stage."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self.spent: dict[str, float] = defaultdict(float)
        self._sync = sync
        self._clock = time.perf_counter()

    def start(self) -> None:
        self._clock = time.perf_counter()

    def lap(self, stage: str) -> None:
        self._sync()
        now = time.perf_counter()
        self.spent[stage] += now - self._clock
        self._clock = now


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--steps", default=None, help="a half-open range START:STOP of step indices (default: all)")
    parser.add_argument("--repeat", type=int, default=1, help="replay the selection this many times; the last is timed")
    parser.add_argument(
        "--profile", type=int, default=0, metavar="N", help="also print cProfile's N costliest functions"
    )
    parser.add_argument(
        "--torch-profile", type=int, default=0, metavar="N", help="also print torch's profiler's N costliest operators"
    )
    args = parser.parse_args(argv)
    profiler = cProfile.Profile() if args.profile else None
    operators = None
    if args.torch_profile:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if args.device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        operators = torch.profiler.profile(activities=activities, acc_events=True)
    torch.set_num_threads(REPLAY_THREADS)
    keep_freed_memory()  # as replay_trace does
    trace = Trace.open(args.trace)
    spec = kv_spec(trace)
    emulation = emulation_of(trace.run)
    steps = parse_steps(args.steps) if args.steps else None
    records = [r for r in select_records(trace, steps=steps) if r.tensors is not None]
    layout = resolve_layout(trace, records)
    gpu = args.device == "cuda"

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize()

    for round_ in range(args.repeat):
        if profiler is not None and round_ == args.repeat - 1:
            profiler.enable()
        if operators is not None and round_ == args.repeat - 1:
            operators.start()
        laps = _Laps(sync)
        trace = Trace.open(args.trace)  # a fresh write-log state per round
        for record in records:
            laps.start()
            tensors = trace.tensors(record, device="cuda" if gpu else None)  # as replay_trace
            laps.lap("tensors")
            inputs = step_inputs(
                record,
                tensors,
                spec,
                layout,
                flash_attn_version=trace.run.flash_attn_version,
                emulation=emulation,
                device="cuda" if gpu else None,  # as replay_record
            )
            laps.lap("inputs")
            output = tensors["output"]
            if gpu:
                expected, baseline = step_outputs(*inputs.args, **step_kwargs(inputs), device="cuda", to_cpu=False)
                assert expected is not None
                laps.lap("reference")
            else:
                block_size = inputs.key_cache.shape[1]
                expected = run_kernel(
                    "fast", *inputs.args, block_size=block_size, compute_dtype=REFERENCE_DTYPE, **inputs.kwargs
                )
                laps.lap("reference")
                baseline = emulated_output(inputs)
                laps.lap("emulation")
            judge_output(inputs, output, expected, baseline)
            laps.lap("judge")
            check_write_path(record, tensors, spec, layout)
            laps.lap("write path")
    if profiler is not None:
        profiler.disable()
    if operators is not None:
        operators.stop()
    total = sum(laps.spent.values())
    n = max(1, len(records))
    per = 1e3 * total / n
    print(f"{trace.path.name}: {len(records)} records on {args.device}, {total:.2f} s, {per:.1f} ms per record")
    for stage, seconds in sorted(laps.spent.items(), key=lambda kv: -kv[1]):
        print(f"  {stage:<11} {1e3 * seconds / n:7.2f} ms per record  ({100 * seconds / total:4.1f} %)")
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
    if operators is not None:
        print(operators.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.torch_profile))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
