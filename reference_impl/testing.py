"""Check your own paged-attention kernel against real vLLM steps.

A trace holds, for every captured (step, layer), exactly what vLLM's attention backend
had: the query, the KV blocks the block table references, the block table, ``seq_lens``,
``query_start_loc`` and vLLM's output. :func:`load_cases` turns each into a
:class:`KernelCase` (the compact cache and remapped table that ``pagedtrace replay``
builds), and :func:`check_kernel` runs a kernel on it::

    from reference_impl.testing import assert_kernel_matches, load_cases

    for case in load_cases("tests/fixtures/h200-qwen2.5-7b-eager"):
        assert_kernel_matches(my_paged_attention, case)

or, without writing a test, from pytest (``reference_impl.pytest_plugin``)::

    pytest -p reference_impl.pytest_plugin --pyargs reference_impl.kernel_check \\
        --pagedtrace-trace TRACE --pagedtrace-kernel mypkg.attn:paged_attention

and from the command line: ``pagedtrace replay TRACE --kernel mypkg.attn:paged_attention``.

The kernel signature
--------------------
The one :mod:`reference_impl.kernel` uses (FlashAttention's varlen batch with a block
table), with the canonical "NHD" cache::

    fn(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, **kwargs) -> out

    query            [T, H, D]            activation dtype (bf16 for bf16 models)
    key_cache        [nb, bs, H_kv, D]    the step's captured blocks, compacted
    value_cache      [nb, bs, H_kv, D]
    block_table      [B, max_blocks]      int32; row b: logical block j -> row of the caches
    seq_lens         [B]                  int32; keys of sequence b, the new ones included
    query_start_loc  [B + 1]              int32; queries of sequence b: rows qsl[b]:qsl[b+1]
    kwargs           scale, causal, window=(left, right) (-1 = unlimited), softcap (0 = off),
                     k_scale, v_scale (fp8 caches: uint8 e4m3 bytes times the scale), and
                     alibi_slopes / sinks [H] fp32 for models that have them
                     (reference_impl.options.KernelOptions)
    -> out           [T, H, D]            any float dtype, any device (moved to the CPU)

Semantics are those of vLLM / FlashAttention (GQA ``h // (H / H_kv)``, causal mask
aligned bottom-right, see :mod:`reference_impl.kernel`). A keyword the kernel does not
declare is left out when its value changes nothing (``causal=True``, ``window=(-1, -1)``,
``softcap=0``, the scales of a non-fp8 cache); when it matters, the case fails with
a ``TypeError`` naming it. A kernel may also return ``(out, lse)``; the first element
is judged. Rows of ``out`` past ``num_tokens`` are ignored.

A kernel written for vLLM's own cache tensor adapts in a few lines, e.g. one taking
FlashAttention's packed ``[nb, H_kv, bs, 2*D]`` cache with vLLM's strides::

    from reference_impl.layouts import kv_to_flash

    def adapted(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, **kw):
        kv_cache = kv_to_flash(key_cache, value_cache, "flash_nhd")
        return my_flash_kernel(query, kv_cache, block_table, seq_lens, query_start_loc, **kw)

(``kv_to_cpu`` / ``kv_to_cpu_amx`` / ``kv_to_legacy`` give the other layouts.)

The verdict
-----------
The same bar vLLM's own output meets in ``pagedtrace replay`` (flash-attn's
``hopper/test_flash_attn.py``), head by head: the kernel's output is compared with the fp64
reference, and may be at most ``TOL_K`` times as far from it as FlashAttention's rounding
(emulated, :mod:`reference_impl.emulation`), plus a floor of one ``eps`` of the activation
dtype at the head's largest value (:mod:`reference_impl.tolerances`). The tolerance never
depends on vLLM's output, so a wrong vLLM step cannot widen it; the distance from vLLM's
captured output is reported alongside. On an fp8 step (FA3's path) ``query`` is the
quantised query dequantised to fp64 (``e4m3 * q_scale``).

Imports torch, :mod:`reference_impl` and ``tracer.format`` (the bottom layer) only.
"""

from __future__ import annotations

import inspect
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from reference_impl import replay as _replay
from reference_impl.cases import (
    KernelCase,
    case_id,
    case_records,
    iter_cases,
    load_case,
    load_cases,
    open_trace,
    rounding_as,
)
from reference_impl.common import FP8_STORAGE
from reference_impl.emulation import Emulation, interval_midpoints
from reference_impl.loader import FILE_MODULE_PREFIX, load_kernel
from reference_impl.options import changes_nothing
from reference_impl.tolerances import TOLERANCE, bar_note, compare
from tracer.format import FORMAT_VERSION, CaseResult, HeadResult, Trace, WorstValue

__all__ = [
    "CaseResult",
    "KernelCase",
    "KernelReport",
    "assert_kernel_matches",
    "case_id",
    "case_records",
    "check_kernel",
    "check_trace",
    "iter_cases",
    "kernel_kwargs",
    "kernel_name",
    "load_case",
    "load_cases",
    "load_kernel",
    "rounding_as",
]


# --------------------------------------------------------------------------- checking


def kernel_name(fn: Callable[..., Any]) -> str:
    """``module:qualname`` of a kernel (its ``repr`` when it has neither).

    A kernel loaded from a file (``./attn.py:fn``) is named by its file, ``attn.py:fn``, not by
    the private module name :func:`load_kernel` imported it under.
    """
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not (module and qualname):
        return repr(fn)
    if module.startswith(FILE_MODULE_PREFIX):
        path = getattr(sys.modules.get(module), "__file__", None)
        if path:
            return f"{os.path.basename(path)}:{qualname}"
    return f"{module}:{qualname}"


def kernel_kwargs(fn: Callable[..., Any], case: KernelCase) -> dict[str, Any]:
    """The case's keywords that ``fn`` is called with.

    All of them when ``fn`` takes ``**kwargs`` or has no inspectable signature;
    otherwise those it declares, dropping undeclared ones whose value changes nothing.

    Raises:
        TypeError: ``fn`` does not declare a keyword whose value matters for this case.
    """
    kwargs = dict(case.kwargs)
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return kwargs
    declared = {
        p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    out = {}
    for name, value in kwargs.items():
        if name in declared:
            out[name] = value
        elif not changes_nothing(name, value, fp8_cache=case.key_cache.dtype in FP8_STORAGE):
            raise TypeError(f"{kernel_name(fn)} takes no {name!r} argument, but {case.id} needs {name}={value!r}")
    return out


def _failed(case: KernelCase, name: str, note: str) -> CaseResult:
    """A result for a kernel that returned nothing comparable."""
    return CaseResult(
        id=case.id,
        kernel=name,
        step=case.step,
        layer=case.layer,
        kind=case.kind,
        num_reqs=case.num_reqs,
        num_tokens=case.num_tokens,
        ok=False,
        max_abs=math.inf,
        max_rel=math.inf,
        tol=case.tol,
        baseline_max_abs=case.baseline_max_abs,
        vllm_max_abs=math.inf,
        vllm_ref_max_abs=case.vllm_max_abs,
        tol_k=case.tol_k,
        tol_eps=case.tol_eps,
        note=note,
    )


def _worst(err: torch.Tensor, case: KernelCase) -> WorstValue | None:
    """Where ``err`` ``[T, H, D]`` is largest, as request id, position and physical block."""
    if not err.numel():
        return None
    # NaN ranks above every finite error, so the first NaN is where the report points.
    flat = int(torch.nan_to_num(err, nan=math.inf).flatten().argmax())
    token, head, dim = (int(i) for i in torch.unravel_index(torch.tensor(flat), err.shape))
    qsl = case.query_start_loc.tolist()
    row = int(torch.searchsorted(case.query_start_loc, torch.tensor(token, dtype=torch.int32), right=True)) - 1
    row = min(max(row, 0), case.num_reqs - 1)
    # The row's queries are its last q_len keys: position = seq_len - q_len + offset.
    position = int(case.seq_lens[row]) - (qsl[row + 1] - qsl[row]) + (token - qsl[row])
    block = None
    logical = position // case.block_size
    if 0 <= logical < case.block_table.shape[1]:
        compact = int(case.block_table[row, logical])
        if 0 <= compact < len(case.physical_block_ids):
            block = case.physical_block_ids[compact]
    request_id = case.request_ids[row] if row < len(case.request_ids) else None
    return WorstValue(token, head, dim, row, request_id=request_id, position=position, block=block)


def _head_results(err: torch.Tensor, reference: torch.Tensor, verdict: Mapping[str, Any]) -> tuple[HeadResult, ...]:
    """Per query head, as replay writes them: max abs (NaN-propagating), max rel, its bar, ok."""
    if not err.numel():
        return ()
    errs = err.amax(dim=(0, 2)).tolist()
    scales = reference.abs().amax(dim=(0, 2)).tolist()
    out = []
    for h, (e, s, tol, ok) in enumerate(
        zip(errs, scales, verdict["per_head_tol"], verdict["per_head_ok"], strict=True)
    ):
        rel = e / s if s > 0 else (0.0 if e == 0 else math.inf)
        out.append(HeadResult(head=h, ok=bool(ok) and e <= tol, max_abs=e, max_rel=rel, tol=tol))
    return tuple(out)


def _judge(out: torch.Tensor, case: KernelCase, name: str) -> CaseResult:
    """Compare ``out`` (already on the CPU) with the case's reference.

    A kernel that truncates to bf16 (``case.emulation``) is read, with its baseline, at the middle
    of each value's interval, as ``replay`` reads the engine's output (``interval_midpoints``).
    """
    num = case.num_tokens
    out = interval_midpoints(out[:num], case.emulation)
    reference = case.reference[:num]
    baseline = interval_midpoints(case.baseline[:num], case.emulation)
    verdict = compare(out, reference, baseline, k=case.tol_k, dtype=case.out_dtype)
    err = (out.double() - reference).abs()
    nonfinite = int((~torch.isfinite(out)).sum())
    max_abs = float(err.max()) if err.numel() else 0.0  # NaN-propagating, unlike compare's
    vllm = float((out.double() - case.expected[:num].double()).abs().max()) if err.numel() else 0.0
    ok = bool(verdict["ok"]) and nonfinite == 0 and not math.isnan(max_abs)
    notes = [case.note] if case.note else []
    if bar_note(verdict):
        notes.append(bar_note(verdict))
    return CaseResult(
        id=case.id,
        kernel=name,
        step=case.step,
        layer=case.layer,
        kind=case.kind,
        num_reqs=case.num_reqs,
        num_tokens=num,
        ok=ok,
        max_abs=max_abs,
        max_rel=verdict["max_rel"],
        tol=verdict["tol"],
        baseline_max_abs=verdict["baseline_max_abs"],
        vllm_max_abs=vllm,
        vllm_ref_max_abs=case.vllm_max_abs,
        heads=_head_results(err, reference, verdict),
        worst=_worst(err, case),
        nonfinite=nonfinite,
        tol_k=case.tol_k,
        tol_eps=verdict["floor"],
        note="; ".join(notes),
    )


def check_kernel(
    fn: Callable[..., Any], case: KernelCase, *, device: str | torch.device | None = None, name: str | None = None
) -> CaseResult:
    """Run ``fn`` on ``case`` and judge its output (see the module docstring).

    Args:
        fn: a kernel with the reference signature.
        case: from :func:`load_cases`.
        device: move the inputs there first (e.g. ``"cuda"``); the output is brought
            back to the CPU.
        name: what the result calls the kernel (default :func:`kernel_name`).

    Returns:
        The result; ``result.ok`` is the verdict, ``str(result)`` explains it. A
        wrong shape or a non-tensor return is a failed result, not an exception.

    Raises:
        Whatever ``fn`` raises; ``TypeError`` when ``fn`` lacks a keyword the case needs.
    """
    name = name or kernel_name(fn)
    out = fn(*case.inputs(device), **kernel_kwargs(fn, case))
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        out = out[0]  # (out, lse)
    if not isinstance(out, torch.Tensor):
        return _failed(case, name, f"the kernel returned {type(out).__name__}, not a tensor")
    num_tokens, num_heads, head_size = case.query.shape
    if out.dim() != 3 or out.shape[0] < case.num_tokens or tuple(out.shape[1:]) != (num_heads, head_size):
        return _failed(
            case,
            name,
            f"the kernel returned shape {list(out.shape)}; expected "
            f"[{num_tokens}, {num_heads}, {head_size}] (query's shape)",
        )
    if out.is_complex() or not out.is_floating_point():
        return _failed(case, name, f"the kernel returned dtype {out.dtype}; expected a float tensor")
    return _judge(out.detach().cpu(), case, name)


def assert_kernel_matches(
    fn: Callable[..., Any],
    case: KernelCase,
    *,
    device: str | torch.device | None = None,
    name: str | None = None,
    on_result: Callable[[CaseResult], None] | None = None,
) -> CaseResult:
    """:func:`check_kernel`, raising ``AssertionError`` with the readable verdict on a mismatch.

    The message's first line is the verdict (pytest's short summary shows it): ``kernel K
    does NOT match vLLM on step 4 layer 0: max abs A > tol B``. A kernel that raises fails
    the same way, chained to its exception (``raise ... from``), so pytest shows the
    kernel's own traceback above the verdict.

    Args:
        fn, case, device, name: as :func:`check_kernel`.
        on_result: called with the result before anything is raised (the pytest plugin
            collects them for ``--pagedtrace-json``).

    Returns:
        The (passing) result.

    Raises:
        AssertionError: the output is outside tolerance, or the kernel raised.
        TypeError: ``fn`` lacks a keyword the case needs (before ``fn`` is called).
    """
    __tracebackhide__ = True  # pytest: show the message, not this frame
    name = name or kernel_name(fn)
    kernel_kwargs(fn, case)  # a missing keyword is the caller's TypeError, not the kernel's failure
    try:
        result = check_kernel(fn, case, device=device, name=name)
    except Exception as exc:
        failed = _failed(case, name, raised_note(exc))
        if on_result is not None:
            on_result(failed)
        raise AssertionError(failed.message()) from exc
    if on_result is not None:
        on_result(result)
    if not result.ok:
        raise AssertionError(result.message())
    return result


# --------------------------------------------------------------------------- whole traces


@dataclass(frozen=True)
class KernelReport:
    """A kernel's results over a trace, as ``pagedtrace replay --kernel MODULE:FUNCTION`` prints them."""

    kernel: str  #: ``module:qualname``
    trace: str  #: the trace directory
    layout: str  #: the layout the blocks were read from
    results: tuple[CaseResult, ...]
    seconds: float = 0.0
    recorded_layout: str = ""  #: ``KVCacheSpec.layout`` as the manifest has it ("" = ``layout``)

    @property
    def ok(self) -> bool:
        """True when at least one case ran and every case passed."""
        return bool(self.results) and all(r.ok for r in self.results)

    def to_json(self) -> dict[str, Any]:
        """``replay --json``'s schema (``tracer.format.ReplayReport`` reads it), plus ``trace``.

        ``steps`` holds the cases (:meth:`CaseResult.to_json`: a ``StepResult`` entry with
        the kernel's extras); a kernel check makes no write-path, legacy or metadata checks,
        so those sections are empty.
        """
        return {
            "format_version": FORMAT_VERSION,
            "ok": self.ok,
            "kernel": self.kernel,
            "trace": self.trace,
            "layout": self.layout,
            "recorded_layout": self.recorded_layout or self.layout,
            "tolerance": TOLERANCE.to_json(),
            "seconds": round(self.seconds, 3),
            "steps": [r.to_json() for r in self.results],
            "write_path": [],
            "legacy": [],
            "metadata": [],
            "skipped": [],
        }


def check_trace(
    fn: Callable[..., Any],
    trace: Trace | str | os.PathLike[str],
    *,
    kind: str | None = "request",
    layers: Iterable[str | int] | None = None,
    steps: tuple[int | None, int | None] | None = None,
    device: str | torch.device | None = None,
    name: str | None = None,
    progress: Callable[[int, int, CaseResult], None] | None = None,
    emulation: Emulation | None = None,
) -> KernelReport:
    """Check ``fn`` on every case of a trace; an exception from ``fn`` fails that case.

    Args:
        fn: a kernel with the reference signature.
        trace, kind, layers, steps: as :func:`load_cases`.
        device, name: as :func:`check_kernel`.
        progress: called as ``progress(done, total, result)`` after each case.
        emulation: how ``fn`` rounds, when it is known (vLLM's kernels: ``pagedtrace replay --kernel
            vllm:NAME``), for its bar's baseline (:func:`rounding_as`); None: as the trace's kernel.

    Raises:
        TraceError: as :func:`load_cases`.
    """
    started = time.perf_counter()
    trace = open_trace(trace)
    records = case_records(trace, kind=kind, layers=layers, steps=steps)
    layout = _replay.resolve_layout(trace, records)
    name = name or kernel_name(fn)
    results = []
    for done, record in enumerate(records, 1):
        case = load_case(trace, record, layout=layout)
        if emulation is not None:
            case = rounding_as(case, emulation)
        try:
            result = check_kernel(fn, case, device=device, name=name)
        except Exception as exc:  # noqa: BLE001 - the user's kernel: any failure is that case's verdict
            result = _failed(case, name, raised_note(exc))
        results.append(result)
        if progress is not None:
            progress(done, len(records), result)
    return KernelReport(
        kernel=name,
        trace=str(trace.path),
        layout=layout,
        results=tuple(results),
        seconds=time.perf_counter() - started,
        recorded_layout=_replay.kv_spec(trace).layout,
    )


def raised_note(exc: BaseException) -> str:
    """``the kernel raised RuntimeError: msg (at attn.py:12 in fn)``: the innermost frame of ``exc``."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    return f"the kernel raised {type(exc).__name__}: {exc}{where}"
