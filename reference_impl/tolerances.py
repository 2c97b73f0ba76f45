"""How close is close enough: error relative to the same math in low precision.

A kernel may be at most ``k`` times as wrong as naive low-precision math, plus ``eps``
(flash-attn ``hopper/test_flash_attn.py``): :func:`tolerance` is that bar, :func:`compare`
judges an output by it and reports absolute and relative errors. ``pagedtrace replay``
and :mod:`reference_impl.testing` hold vLLM and users' kernels to :data:`TOLERANCE`.

Imports torch and ``tracer.format`` (the bottom layer) only.
"""

from __future__ import annotations

import math

import torch

from tracer.format import Tolerance

__all__ = ["REFERENCE_DTYPE", "TOLERANCE", "TOL_EPS", "TOL_K", "compare", "tolerance"]

#: Tolerance: ``TOL_K * err(baseline) + TOL_EPS``; the baseline is the reference's own
#: math run in the activation dtype (bf16 for the tiny preset).
TOL_K = 2.0
TOL_EPS = 1e-5

#: Precision of the reference the output is judged against.
REFERENCE_DTYPE = torch.float64

#: The bar, as ``replay.json`` records it.
TOLERANCE = Tolerance(k=TOL_K, eps=TOL_EPS, reference_dtype=str(REFERENCE_DTYPE).removeprefix("torch."))


def tolerance(expected: torch.Tensor, baseline: torch.Tensor, k: float = 2.0, eps: float = 1e-5) -> float:
    """Allowed max-abs error: ``k * max|baseline - expected| + eps``.

    ``baseline`` is the same math run in low precision (bf16/fp16), ``expected`` the
    fp32/fp64 reference: a kernel may be at most ``k`` times as wrong as naive
    low-precision math (flash-attn ``hopper/test_flash_attn.py``).
    """
    return k * float((baseline.double() - expected.double()).abs().max()) + eps


def compare(
    actual: torch.Tensor,
    expected: torch.Tensor,
    baseline: torch.Tensor | None = None,
    *,
    k: float = 2.0,
    eps: float = 1e-5,
) -> dict:
    """Judge ``actual`` against ``expected``, relative to a low-precision ``baseline``.

    Args:
        actual: ``[T, H, D]``, e.g. the output vLLM recorded.
        expected: ``[T, H, D]``, the fp32/fp64 reference.
        baseline: ``[T, H, D]``, the reference's math in bf16/fp16; without it the
            tolerance is ``eps`` alone.
        k, eps: see :func:`tolerance`.

    Returns:
        A JSON-ready dict: ``max_abs``; ``max_rel`` (``max_abs`` over ``max|expected|``);
        ``per_head_max_abs`` (list of ``H`` floats); ``baseline_max_abs``; ``tol``; ``ok``.
    """
    if actual.shape != expected.shape:
        raise ValueError(f"shapes differ: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    err = (actual.double() - expected.double()).abs()
    max_abs = float(err.max()) if err.numel() else 0.0
    scale = float(expected.double().abs().max()) if expected.numel() else 0.0
    per_head = err.amax(dim=tuple(i for i in range(err.dim()) if i != err.dim() - 2))
    if baseline is None:
        baseline_err = 0.0
        tol = eps
    else:
        baseline_err = float((baseline.double() - expected.double()).abs().max())
        tol = tolerance(expected, baseline, k=k, eps=eps)
    return {
        "max_abs": max_abs,
        "max_rel": max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf),
        "per_head_max_abs": [float(x) for x in per_head],
        "baseline_max_abs": baseline_err,
        "tol": tol,
        "ok": bool(max_abs <= tol),
    }
