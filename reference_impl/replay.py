"""Replay a recorded trace: prove, step by step, that vLLM computed exactly attention.

For every recorded (step, layer) that carries tensors, three checks run on the data
vLLM's attention backend really had:

attention
    The KV blocks the step's block table references (``kv_blocks``, captured after the
    step wrote its new tokens) are read from the recorded layout into the canonical
    ``[n, block_size, H_kv, D]`` K/V caches; the block table is remapped from physical
    ids onto that compact cache; the reference kernel reruns attention from the
    recorded ``query``, ``seq_lens`` and ``query_start_loc`` in fp64 and is compared
    with vLLM's ``output``. Each head's bar is ``k * err(FlashAttention's rounding,
    emulated) + a floor of eps(activation dtype) * max|reference|`` of that head
    (:mod:`reference_impl.tolerances`; flash-attn ``hopper/test_flash_attn.py``), the same
    whichever reference form ran; absolute and relative errors are reported, per step
    and per head.
write path, legacy
    The recorded ``key``/``value`` scattered through ``slot_mapping`` must be exactly
    the captured blocks' bits; the same cache rewritten in the legacy x-split layout
    must give bitwise the same output (:mod:`reference_impl.checks`).

The legacy round trip runs on a sample of the replayed steps (the first, the last and every
:data:`LEGACY_EVERY`-th): it is a storage-order identity, the same on every step. On a GPU
(``device="cuda"``) the reference and the bar's baseline come from one batched pass there
(:mod:`reference_impl.step_pass`); on the CPU from the ``kernel`` form and the emulation.

The pieces live in their own modules and are re-exported here: reading the blocks and
choosing the layout (:mod:`reference_impl.resolve`: format 2 names the CPU backend's
AMX packing ``cpu_amx``; early format-1 traces may name it ``cpu``, and
:func:`resolve_layout` still finds it behind that name), a step's kernel inputs
(:mod:`reference_impl.inputs`), the bar (:mod:`reference_impl.tolerances`).

On the CPU every record runs on one torch thread (:data:`REPLAY_THREADS`), and the records are
shared out over one worker process per core (:mod:`reference_impl.workers`): the report is
the same, to the bit, whatever the count.

Imports torch, :mod:`reference_impl` and ``tracer.format`` (the bottom layer) only.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import NamedTuple

import torch

from reference_impl.checks import check_legacy_path, check_write_path
from reference_impl.emulation import FLASH, Emulation, emulation_of
from reference_impl.inputs import (
    KERNELS,
    StepInputs,
    compact_block_table,
    judge_output,
    reference_outputs,
    step_inputs,
)
from reference_impl.resolve import kv_spec, read_cache, resolve_layout
from reference_impl.step_pass import step_kwargs, step_outputs, warm_up
from reference_impl.tolerances import REFERENCE_DTYPE, TOL_EPS, TOL_K, TOLERANCE, bar_note, tolerance_for
from reference_impl.workers import is_gpu, keep_freed_memory, run_records, worker_count
from tracer.format import (
    REPLAY,
    HeadResult,
    KVCacheSpec,
    LegacyCheck,
    MetadataCheck,
    ReplayReport,
    StepRecord,
    StepResult,
    Trace,
    TraceError,
    WriteCheck,
    write_side_file,
)
from tracer.format.layouts import LAYOUT_CPU_AMX
from tracer.format.metadata import check_records
from tracer.format.selection import format_steps, sample_records, select_records
from tracer.format.summary import tensors_absent
from tracer.format.writelog import NotInWriteLog

__all__ = [
    "KERNELS",
    "LAYOUT_CPU_AMX",
    "LEGACY_EVERY",
    "REFERENCE_DTYPE",
    "REPLAY_THREADS",
    "TOLERANCE",
    "TOL_EPS",
    "TOL_K",
    "HeadResult",
    "LegacyCheck",
    "ReplayReport",
    "StepInputs",
    "StepResult",
    "WriteCheck",
    "check_legacy_path",
    "check_write_path",
    "compact_block_table",
    "judge_output",
    "kv_spec",
    "legacy_sample",
    "read_cache",
    "reference_outputs",
    "replay_record",
    "replay_trace",
    "resolve_layout",
    "sample_records",
    "save_report",
    "select_records",
    "step_inputs",
]


#: :func:`replay_trace` runs the legacy round trip on every this-many-th record (and the first and last).
LEGACY_EVERY = 16

#: A request row's own small operations, in a step's work units (one key times one head dimension):
#: fitted on the 301 steps of ``pagedtrace run --prompts 128 --max-tokens 300`` (one CPU process).
ROW_COST = 100_000

#: torch's intra-op threads while :func:`replay_trace` runs (the caller's count is restored after).
#: A step's tensors are small: on a 2-core machine a second thread costs more in hand-offs than
#: it saves, and far more when another process holds a core. The fast reference's decode chunks,
#: hence the last bits of its sums, follow the thread count (:mod:`reference_impl.fast`): one
#: thread gives the verdicts of ``tests/gold/replay-verdicts.json`` whatever the caller set.
REPLAY_THREADS = 1


@contextmanager
def _torch_threads(threads: int) -> Iterator[None]:
    """Run the body with ``threads`` torch intra-op threads, then restore the caller's count."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def replay_record(
    record: StepRecord,
    tensors: Mapping[str, torch.Tensor],
    spec: KVCacheSpec,
    layout: str,
    *,
    kernel: str = "fast",
    check_legacy: bool = True,
    flash_attn_version: int | None = None,
    emulation: Emulation = FLASH,
    device: torch.device | str | None = None,
    inputs: StepInputs | None = None,
) -> tuple[StepResult, LegacyCheck | None]:
    """Rerun one (step, layer)'s attention and judge vLLM's ``output``.

    Args:
        record: the step's metadata.
        tensors: ``Trace.tensors(record)``: ``query`` / ``output`` ``[T, H, D]``,
            ``kv_blocks`` ``[n, H_kv, bs, 2*D]``, ``kv_block_ids`` ``[n]``.
        spec: the trace's KV-cache spec (block size, scales).
        layout: how ``kv_blocks`` is packed (see :func:`read_cache`).
        kernel: a key of :data:`KERNELS`.
        check_legacy: also run the legacy-layout round trip.
        flash_attn_version: the trace's ``RunInfo.flash_attn_version`` (3: a bf16 query of
            an fp8 step is quantised as vLLM does for FA3, see :mod:`reference_impl.inputs`).
        emulation: how the trace's kernel rounds (``emulation_of(trace.run)``): the bar's baseline.
        device: a GPU (``cuda``) computes the reference and the baseline there in one batched
            pass (:mod:`reference_impl.step_pass`: fp64 reference, fp32 emulation); None or the
            CPU: the ``kernel`` form and the emulation on the CPU.
        inputs: the step's kernel inputs when the caller has read them already (:func:`step_inputs`
            of these arguments, on ``device``); None: read here.

    Returns:
        The step's result and, with ``check_legacy``, the legacy check (None when the
        head size is not a multiple of ``x``).
    """
    on_gpu = is_gpu(device)
    if inputs is None:
        read_to = device if on_gpu else None
        inputs = step_inputs(
            record, tensors, spec, layout, flash_attn_version=flash_attn_version, emulation=emulation, device=read_to
        )
    output, num = tensors["output"], inputs.num_tokens
    if on_gpu:
        # The verdict is computed where the pass ran: only the per-head numbers come back.
        expected, baseline = step_outputs(*inputs.args, **step_kwargs(inputs), device=device, to_cpu=False)
        assert expected is not None
        output = output.to(expected.device)
    else:
        expected, baseline = reference_outputs(inputs, kernel)
    # The bar is per head and never depends on `kernel` (reference_impl.tolerances).
    verdict = judge_output(inputs, output, expected, baseline)
    heads = tuple(
        HeadResult(
            head=h,
            ok=ok,
            max_abs=err,
            max_rel=err / float(s) if float(s) > 0 else (0.0 if err == 0 else math.inf),
            tol=tol,
        )
        for h, (err, tol, ok, s) in enumerate(
            zip(
                verdict["per_head_max_abs"],
                verdict["per_head_tol"],
                verdict["per_head_ok"],
                verdict["per_head_scale"],  # the relative error's: the head's largest |reference|
                strict=False,
            )
        )
    )
    notes = [inputs.note] if inputs.note else []
    if bar_note(verdict):
        notes.append(bar_note(verdict))
    result = StepResult(
        step=record.step,
        layer=record.layer,
        kind=record.kind,
        num_tokens=num,
        num_reqs=record.num_reqs,
        ok=bool(verdict["ok"]) and not inputs.missing,
        max_abs=verdict["max_abs"],
        max_rel=verdict["max_rel"],
        tol=verdict["tol"],
        baseline_max_abs=verdict["baseline_max_abs"],
        heads=heads,
        note="; ".join(notes),
    )
    legacy = None
    if check_legacy:
        # On a GPU the pass that gave `expected` reruns over the round-tripped caches there.
        rerun = functools.partial(_rerun_on_gpu, inputs, device) if on_gpu else None
        legacy = check_legacy_path(
            record,
            inputs.key_cache,
            inputs.value_cache,
            inputs.block_table,
            expected,
            inputs.query,
            spec,
            kernel,
            seq_lens=inputs.seq_lens,
            query_start_loc=inputs.query_start_loc,
            rerun=rerun,
        )
    return result, legacy


def _rerun_on_gpu(
    inputs: StepInputs, device: torch.device | str | None, key_cache: torch.Tensor, value_cache: torch.Tensor
) -> torch.Tensor:
    """The GPU pass's fp64 reference of ``inputs`` over other (round-tripped) caches."""
    args = (inputs.query, key_cache, value_cache, *inputs.args[3:])
    out, _ = step_outputs(*args, **step_kwargs(inputs), device=device, to_cpu=False)
    assert out is not None
    return out


class _Read(NamedTuple):
    """One record read for replay: its tensors, its kernel inputs and its write-path check (None: not run)."""

    tensors: Mapping[str, torch.Tensor]
    inputs: StepInputs
    write: WriteCheck | None


# --------------------------------------------------------------------------- driver


def replay_trace(
    trace: Trace,
    *,
    steps: tuple[int | None, int | None] | None = None,
    layers: Iterable[str | int] | None = None,
    kernel: str = "fast",
    check_write: bool = True,
    check_legacy: bool = True,
    layout: str | None = None,
    progress: Callable[[int, int, StepResult], None] | None = None,
    sample: int | None = None,
    legacy_every: int = LEGACY_EVERY,
    device: torch.device | str | None = None,
    workers: int | None = None,
) -> ReplayReport:
    """Replay every selected (step, layer) of ``trace`` that has tensors.

    Args:
        trace: an opened trace directory.
        steps: half-open ``(start, stop)`` range of step indices; None = all.
        layers: layer names and/or indices (``model.layers.<i>...``); None = all.
        kernel: ``fast`` (batched gather), ``loop`` (the block loop) or ``partitioned``.
        check_write: also check the write path (needs ``key``/``value``).
        check_legacy: also run the legacy-layout round trip.
        layout: read the blocks in this layout instead of the recorded one (for
            experiments; :func:`resolve_layout` picks the right one by default).
        progress: called as ``progress(done, total, result)`` after each step.
        sample: replay only this many of the selected records with tensors, spread evenly
            over them (:func:`sample_records`: the first and the last included, the same
            ones every time); None: all.
        legacy_every: run the legacy round trip on the first, the last and every
            ``legacy_every``-th replayed record (:func:`legacy_sample`; 1: every record).
            It is a storage-order identity: the sample proves it at a fraction of a rerun
            per step.
        device: where the reference runs (see :func:`replay_record`; None: the CPU).
        workers: processes replaying, each a share of consecutive records with
            :data:`REPLAY_THREADS` torch threads (:mod:`reference_impl.workers`; the report is
            the same whatever the count); None: one per CPU core, for at least
            :data:`reference_impl.workers.MIN_RECORDS_PER_WORKER` records each (on a GPU, each
            with its own CUDA context: :func:`reference_impl.workers.worker_count`). A process
            that has initialised CUDA replays on the GPU alone.

    Returns:
        The report; ``report.ok`` is the verdict.

    Raises:
        TraceError: nothing is selected, a tensor file is missing or unreadable, the
            manifest has no KV-cache spec. (Records without tensors get metadata
            verdicts only, :mod:`tracer.format.metadata`.)
    """
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; use one of {sorted(KERNELS)}")
    started = time.perf_counter()
    keep_freed_memory()  # a step's tensors are the same sizes step after step: reuse their pages
    spec = kv_spec(trace)
    emulation = emulation_of(trace.run)  # the bar's baseline rounds as the trace's kernel did
    layers = None if layers is None else tuple(layers)
    selected = select_records(trace, steps=steps, layers=layers)
    if not selected:
        raise TraceError(
            f"{trace.path}: no recorded step matches the selection "
            f"(steps {'all' if steps is None else format_steps(steps)}, "
            f"layers {','.join(map(str, layers or ())) or 'all'})"
        )
    with_tensors = [r for r in selected if r.tensors is not None]
    if sample is not None:
        with_tensors = sample_records(with_tensors, sample)
    legacy_at = legacy_sample(len(with_tensors), legacy_every) if check_legacy else frozenset()
    skipped = tuple(
        f"step {r.step} {r.layer}: no tensors ({tensors_absent(trace.run, r.kind)})"
        for r in selected
        if r.tensors is None
    )
    # ---- metadata verdicts (tracer.format.metadata): every selected record, tensors or not.
    # A metadata-only trace is judged on them alone: no attention, write or legacy checks.
    if not with_tensors:
        return ReplayReport(
            kernel=kernel,
            layout=spec.layout,
            recorded_layout=spec.layout,
            tolerance=tolerance_for(emulation),
            steps=(),
            write_path=(),
            legacy=(),
            metadata=check_records(trace, selected),
            skipped=skipped,
            seconds=time.perf_counter() - started,
        )
    # ---- end of metadata verdicts
    read_layout = layout if layout is not None else resolve_layout(trace, with_tensors)
    on_gpu = is_gpu(device)
    read_to, fa_version = (device if on_gpu else None), trace.run.flash_attn_version

    def read(i: int) -> _Read | NotInWriteLog:
        """Record ``i`` read (on a GPU: there) and its write path checked, or why the write log cannot give it."""
        record = with_tensors[i]
        try:
            tensors = trace.tensors(record, device=read_to)
        except NotInWriteLog as exc:
            return exc
        inputs = step_inputs(
            record, tensors, spec, read_layout, flash_attn_version=fa_version, emulation=emulation, device=read_to
        )
        write = check_write_path(record, tensors, spec, read_layout) if check_write else None
        return _Read(tensors, inputs, write)

    def replay_one(i: int, ready: _Read | NotInWriteLog | None = None) -> _Outcome:
        record = with_tensors[i]
        if ready is None:
            ready = read(i)
        if isinstance(ready, NotInWriteLog):
            # The write log cannot give this step's blocks (a record or file changed, a block never
            # logged): the step cannot be shown to match, so it fails, saying why.
            return _Outcome(unreplayable(record, str(ready)), None, None)
        result, legacy = replay_record(
            record,
            ready.tensors,
            spec,
            read_layout,
            kernel=kernel,
            check_legacy=i in legacy_at,
            flash_attn_version=fa_version,
            emulation=emulation,
            device=device,
            inputs=ready.inputs,
        )
        return _Outcome(result, ready.write, legacy)

    outcomes: list[_Outcome | None] = [None] * len(with_tensors)
    collected = 0

    def collect(i: int, outcome: _Outcome) -> None:
        nonlocal collected
        outcomes[i] = outcome
        collected += 1
        if progress is not None:
            progress(collected, len(with_tensors), outcome.result)

    # A step's work: the products over the keys its rows read, and each row's own small operations.
    costs = [sum(r.seq_lens) * r.num_heads * r.head_size + ROW_COST * r.num_reqs for r in with_tensors]
    processes = worker_count(workers, len(with_tensors), device)
    metadata: tuple[MetadataCheck, ...] = ()

    def check_metadata() -> None:  # in this process, while the workers replay
        nonlocal metadata
        metadata = check_records(trace, selected)

    with _torch_threads(REPLAY_THREADS):
        run_records(
            replay_one,
            len(with_tensors),
            costs,
            processes,
            collect,
            outcome_type=_Outcome,
            meanwhile=check_metadata,
            warm_up=functools.partial(warm_up, device) if on_gpu and device is not None else None,
            # On a GPU a record is the host's small calls: the next records are read (the file, the
            # write log, the inputs, the write path) on a thread while this one's pass runs there.
            # On a CPU every core replays records already.
            prepare=read if on_gpu else None,
        )
    done = [o for o in outcomes if o is not None]
    results = [o.result for o in done]
    writes = [o.write for o in done if o.write is not None]
    legacies = [o.legacy for o in done if o.legacy is not None]
    return ReplayReport(
        kernel=kernel,
        layout=read_layout,
        recorded_layout=spec.layout,
        steps=tuple(results),
        tolerance=tolerance_for(emulation),
        write_path=tuple(writes),
        legacy=tuple(legacies),
        metadata=metadata,
        skipped=skipped,
        seconds=time.perf_counter() - started,
    )


class _Outcome(NamedTuple):
    """One replayed record: its verdict, its write-path check and its legacy check (None: not run)."""

    result: StepResult
    write: WriteCheck | None
    legacy: LegacyCheck | None


def legacy_sample(count: int, every: int) -> frozenset[int]:
    """Indices of the records (of ``count``) whose legacy round trip runs: the first, the last, every ``every``-th."""
    if count <= 0:
        return frozenset()
    return frozenset(range(0, count, max(1, every))) | {count - 1}


def unreplayable(record: StepRecord, why: str) -> StepResult:
    """A failing result for a step whose inputs cannot be rebuilt."""
    return StepResult(
        step=record.step,
        layer=record.layer,
        kind=record.kind,
        num_tokens=record.num_actual_tokens,
        num_reqs=record.num_reqs,
        ok=False,
        max_abs=math.inf,
        max_rel=math.inf,
        tol=0.0,
        baseline_max_abs=0.0,
        heads=(),
        note=why,
    )


def save_report(trace: Trace, report: ReplayReport) -> None:
    """Write ``replay.json`` into the trace directory (the HTML report reads it)."""
    write_side_file(trace.path, REPLAY, report.to_json())
