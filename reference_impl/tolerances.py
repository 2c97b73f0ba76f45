"""How close is close enough: a small multiple of FlashAttention's own rounding, per head.

The bar for one head of one (step, layer) (and, for bf16/fp16, a bar on the mean error, ``MEAN_K``)::

    tol[h] = TOL_K * max|emulated[h] - reference[h]| + FLOOR_ULPS * eps(dtype) * max|reference[h]|

``reference`` is the fp64 answer (any form: loop, fast, partitioned, compiled agree to
~1e-14, so the bar does not depend on which one ran); ``emulated`` is the same attention
rounded as FlashAttention rounds it (:func:`reference_impl.emulation.emulate_flash_attention`);
``eps(dtype)`` is the activation dtype's machine epsilon (bf16: 2^-7). The output is judged
head by head; a step passes when every head does. The step's own ``tol`` (the largest head
bar: ``TOL_K`` times the step's emulation error plus the floor at the step's max|reference|)
is what the CLI prints; every head bar is at most that, so a passing step has
``max_abs <= tol``.

Why these numbers:

``TOL_K = 2``
    flash-attn's own tests hold the kernel to ``2 x`` the error of a low-precision
    reference (``hopper/test_flash_attn.py``: ``rtol = 2``, 3 with a soft-cap). Here the
    baseline makes the kernel's own roundings (P to bf16/e4m3 before P·V, the output, the
    soft-cap's approximate tanh), so the kernel's error and the emulation's are two draws of
    the same rounding process that differ only in where each element's rounding lands
    (FA's key blocks, split-KV merges and accumulation order are not the emulation's):
    the max of one is within 2x the max of the other. flash-attn's 3 for a soft-cap pays for
    a baseline that computes the soft-cap in bf16 and an unmodelled ``tanh.approx``; this one
    models both, so 2 holds there too.
``MEAN_K = 1.5`` (bf16 / fp16 activations)
    A second bar per head, on the *mean* error: ``mean|out - ref| <= MEAN_K *
    mean|emulated - ref| + MEAN_FLOOR_ULPS * eps * mean|ref|``. The max alone cannot see a
    systematic shift of one bf16 ulp (a scale 2 % off moves outputs of ~13 by about one
    ulp, where a correct kernel's rounding also lands), but the mean can: on the committed
    H200 trace vLLM's mean error is 1.000 +- 0.004 times the emulation's per head (they
    round the same values: 99.9 % of outputs are bitwise equal), a 2 % scale or a 10 %
    soft-cap gives 2-7x. The mean of two realisations of one rounding process over a head's
    >= 64 values differs by a few percent; 1.5 is many of those. With fp32 activations the
    error is the kernel's fp32 summation order, which the emulation does not mirror, so
    only the max bar applies there.
``FLOOR_ULPS = 1``
    The output is rounded to the activation dtype: the kernel and the reference can differ
    by one rounding step at the head's largest value even where the emulation happens to
    round the same way (flash-attn's ``fwd_atol`` is the same idea: twice the rounding
    error of ``out_ref + 0.3``). ``eps * max|ref|`` is one to two ulps there. It scales with
    the output, so a step whose outputs are all 1e-6 gets a 1e-8 floor, not 1e-5.

:func:`compare` judges an output and reports absolute and relative errors per head;
``pagedtrace replay`` and :mod:`reference_impl.testing` hold vLLM and users' kernels to
:data:`TOLERANCE`.

Imports torch and ``tracer.format`` (the bottom layer) only.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from reference_impl.emulation import EMULATION_DESCRIPTION, EMULATION_NAME, Emulation
from tracer.format import Tolerance

__all__ = [
    "FLOOR_RULE",
    "FLOOR_ULPS",
    "MEAN_FLOOR_ULPS",
    "MEAN_K",
    "REFERENCE_DTYPE",
    "TOLERANCE",
    "TOL_EPS",
    "TOL_K",
    "bar_note",
    "compare",
    "head_bars",
    "tolerance",
    "tolerance_for",
]

#: Multiple of the emulation's error a kernel may have (see the module docstring).
TOL_K = 2.0

#: Absolute term of the bar: zero (the floor is relative, :data:`FLOOR_ULPS`); a caller
#: may pass its own to :func:`tolerance`.
TOL_EPS = 0.0

#: Floor: this many ``eps(activation dtype)`` times the head's max |reference|.
FLOOR_ULPS = 1.0

#: The mean bar (bf16/fp16 activations): ``MEAN_K`` times the emulation's mean error ...
MEAN_K = 1.5
#: ... plus this many ``eps`` at the head's mean |reference| (one flipped rounding in 16 values).
MEAN_FLOOR_ULPS = 1 / 16

#: Activation dtypes whose rounding the emulation reproduces, so the mean bar applies.
MEAN_DTYPES = (torch.bfloat16, torch.float16)

#: The floor rule, in words, as ``replay.json`` records it.
FLOOR_RULE = (
    f"per head: max error <= k x emulation's max error + {FLOOR_ULPS:g} x eps(activation dtype) x max|reference|; "
    f"bf16/fp16 also mean error <= {MEAN_K:g} x emulation's mean error + {MEAN_FLOOR_ULPS:g} x eps x mean|reference|"
)

#: Precision of the reference the output is judged against.
REFERENCE_DTYPE = torch.float64

#: The bar, as ``replay.json`` records it (``eps`` 0: there is no absolute floor).
TOLERANCE = Tolerance(
    k=TOL_K,
    eps=0.0,
    reference_dtype=str(REFERENCE_DTYPE).removeprefix("torch."),
    emulation=EMULATION_NAME,
    emulation_description=EMULATION_DESCRIPTION,
    floor=FLOOR_RULE,
)


def tolerance_for(emulation: Emulation) -> Tolerance:
    """:data:`TOLERANCE` with ``emulation`` as its baseline (``replay.json`` says which kernel's rounding)."""
    if emulation.name == TOLERANCE.emulation:
        return TOLERANCE
    return dataclasses.replace(TOLERANCE, emulation=emulation.name, emulation_description=emulation.description)


def _eps(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps) if dtype.is_floating_point else 0.0


def _per_head_max(x: torch.Tensor) -> torch.Tensor:
    """``[H]``: max over every dim but the head dim (``[..., H, D]``); NaN propagates."""
    if x.numel() == 0:
        return torch.zeros(x.shape[-2] if x.dim() >= 2 else 0, dtype=x.dtype)
    dims = tuple(i for i in range(x.dim()) if i != x.dim() - 2)
    return x.amax(dim=dims)


def _per_head_mean(x: torch.Tensor) -> torch.Tensor:
    """``[H]``: mean over every dim but the head dim (``[..., H, D]``)."""
    if x.numel() == 0:
        return torch.zeros(x.shape[-2] if x.dim() >= 2 else 0, dtype=torch.float64)
    dims = tuple(i for i in range(x.dim()) if i != x.dim() - 2)
    return x.double().mean(dim=dims)


def head_bars(
    expected: torch.Tensor,
    baseline: torch.Tensor | None,
    *,
    dtype: torch.dtype,
    k: float = TOL_K,
    floor_ulps: float = FLOOR_ULPS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each head's bar: ``(tol [H], baseline_err [H], floor [H])``, fp64.

    Args:
        expected: ``[T, H, D]``, the fp64 reference.
        baseline: ``[T, H, D]``, the emulation (None: the floor alone).
        dtype: the activation dtype whose epsilon sets the floor.
    """
    tol, base, floor, _ = _bars(expected, baseline, dtype, k, floor_ulps)
    return tol, base, floor


def _bars(
    expected: torch.Tensor, baseline: torch.Tensor | None, dtype: torch.dtype, k: float, floor_ulps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`head_bars` and each head's largest ``|expected|``, the floor's scale."""
    scale = _per_head_max(expected.double().abs())
    floor = floor_ulps * _eps(dtype) * scale
    if baseline is None:
        base = torch.zeros_like(floor)
    else:
        base = _per_head_max((baseline.double() - expected.double()).abs())
    return k * base + floor, base, floor, scale


def tolerance(
    expected: torch.Tensor,
    baseline: torch.Tensor,
    k: float = TOL_K,
    eps: float = TOL_EPS,
    *,
    dtype: torch.dtype | None = None,
    floor_ulps: float = FLOOR_ULPS,
) -> float:
    """The step's bar: ``k * max|baseline - expected| + floor_ulps * eps(dtype) * max|expected| + eps``.

    ``dtype`` defaults to ``baseline``'s (the emulation returns the activation dtype);
    ``eps`` is an extra absolute term (0 in replay's bar).
    """
    dtype = baseline.dtype if dtype is None else dtype
    err = float((baseline.double() - expected.double()).abs().max()) if expected.numel() else 0.0
    scale = float(expected.double().abs().max()) if expected.numel() else 0.0
    return k * err + floor_ulps * _eps(dtype) * scale + eps


def compare(
    actual: torch.Tensor,
    expected: torch.Tensor,
    baseline: torch.Tensor | None = None,
    *,
    k: float = TOL_K,
    dtype: torch.dtype | None = None,
    floor_ulps: float = FLOOR_ULPS,
) -> dict:
    """Judge ``actual`` against ``expected`` head by head, relative to the emulated ``baseline``.

    Args:
        actual: ``[T, H, D]``, e.g. the output vLLM recorded.
        expected: ``[T, H, D]``, the fp64 reference.
        baseline: ``[T, H, D]``, :func:`reference_impl.emulation.emulate_flash_attention`'s
            output; without it the bar is the floor alone.
        k, floor_ulps: see the module docstring.
        dtype: the activation dtype of the floor; default ``baseline``'s dtype, else
            ``actual``'s.

    Returns:
        A JSON-ready dict: ``max_abs`` (NaN if any error is NaN); ``max_rel`` (``max_abs``
        over ``max|expected|``); ``per_head_max_abs``, ``per_head_tol``,
        ``per_head_ok``, ``per_head_baseline_max_abs``, ``per_head_mean_abs``,
        ``per_head_mean_tol`` (None where the mean bar does not apply), ``per_head_scale``
        (the largest ``|expected|``) (lists of ``H``);
        ``baseline_max_abs``; ``floor`` and ``tol`` (the step's: at its largest values);
        ``ok`` (every head within its bars).
    """
    if actual.shape != expected.shape:
        raise ValueError(f"shapes differ: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    if dtype is None:
        dtype = baseline.dtype if baseline is not None else actual.dtype
    err = (actual.double() - expected.double()).abs()
    per_head = _per_head_max(err)
    tol_h, base_h, floor_h, scale_h = _bars(expected, baseline, dtype, k, floor_ulps)
    ok_h = per_head <= tol_h  # NaN compares False
    mean_h = _per_head_mean(err)
    columns = [per_head, tol_h, ok_h, base_h, mean_h, scale_h]
    mean_bar = baseline is not None and dtype in MEAN_DTYPES and err.numel() > 0
    if mean_bar:
        assert baseline is not None
        base_mean = _per_head_mean((baseline.double() - expected.double()).abs())
        bar = MEAN_K * base_mean + MEAN_FLOOR_ULPS * _eps(dtype) * _per_head_mean(expected.double().abs())
        columns[2] = ok_h & (mean_h <= bar)
        columns.append(bar)
    # Every number crosses from the device once (the tensors may be on a GPU): the same floats as float(x) each.
    at = err.device
    tops = [_top(x, at) for x in (per_head, scale_h, base_h, floor_h)]  # the step's: the largest head's
    numbers = torch.cat([*tops, *(c.to(at, torch.float64) for c in columns)]).tolist()
    (max_abs, scale, base, floor), heads = numbers[:4], len(per_head)
    per_head_l, tol_l, ok_l, base_l, mean_l, scale_l, *bar_l = (
        numbers[4 + i * heads : 4 + (i + 1) * heads] for i in range(len(columns))
    )
    ok_l = [x == 1.0 for x in ok_l]
    return {
        "max_abs": max_abs,
        "max_rel": max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf),
        "per_head_max_abs": per_head_l,
        "per_head_tol": tol_l,
        "per_head_ok": ok_l,
        "per_head_baseline_max_abs": base_l,
        "per_head_mean_abs": mean_l,
        "per_head_mean_tol": bar_l[0] if mean_bar else [None] * heads,
        "per_head_scale": scale_l,
        "baseline_max_abs": base,
        "floor": floor,
        "tol": k * base + floor,
        "ok": all(ok_l) and not math.isnan(max_abs),
    }


def _top(x: torch.Tensor, at: torch.device) -> torch.Tensor:
    """``[1]`` fp64 on ``at``: the largest value of ``x`` (NaN propagates), 0 when ``x`` is empty."""
    if x.numel() == 0:
        return torch.zeros(1, dtype=torch.float64, device=at)
    return x.amax().reshape(1).to(at, torch.float64)


def bar_note(verdict: dict) -> str:
    """Why heads failed when the step's max error is within the step's ``tol`` ("" otherwise).

    A head fails below the step's ``tol`` when its own (smaller) scale sets its bar, or when
    its mean error is a systematic shift the max does not show.
    """
    if verdict["ok"] or not verdict["max_abs"] <= verdict["tol"]:
        return ""
    heads = [h for h, ok in enumerate(verdict["per_head_ok"]) if not ok]
    shifted = [
        h
        for h in heads
        if verdict["per_head_mean_tol"][h] is not None
        and not verdict["per_head_mean_abs"][h] <= verdict["per_head_mean_tol"][h]
    ]
    parts = [f"head(s) {heads} outside their own bar"]
    if shifted:
        worst = max(shifted, key=lambda h: verdict["per_head_mean_abs"][h] / verdict["per_head_mean_tol"][h])
        parts.append(
            f"mean error of head {worst} {verdict['per_head_mean_abs'][worst]:.3g} > "
            f"{verdict['per_head_mean_tol'][worst]:.3g} (a systematic shift the max error does not show)"
        )
    return ": ".join(parts)
