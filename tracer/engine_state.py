"""What the hooks ask of the running engine, cheaply: graph capture, CUDA, warm-up batches.

Kept apart from :mod:`tracer.install` so that the wrappers read as what they record; torch is
imported lazily (the tracer package imports neither torch nor vLLM at import time).
"""

from __future__ import annotations

import functools

__all__ = ["WARMUP_REQ_PREFIX", "capturing", "cuda_available", "is_warmup_batch"]

#: Request ids the V2 model runner gives its fake warm-up requests: ``_warmup_<i>_``.
WARMUP_REQ_PREFIX = "_warmup_"


def is_warmup_batch(req_ids: tuple[str, ...] | None) -> bool:
    """True for the V2 runner's fake warm-up requests (``_warmup_<i>_``)."""
    if not req_ids or not req_ids[0].startswith(WARMUP_REQ_PREFIX):
        return False
    return all(r.startswith(WARMUP_REQ_PREFIX) for r in req_ids)


@functools.lru_cache(maxsize=1)
def cuda_available() -> bool:
    """``torch.cuda.is_available()``, asked once: it costs ~0.3 ms a call, too much for every forward."""
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - no torch or a broken CUDA: not capturing
        return False


def capturing() -> bool:
    """True while a CUDA graph is being captured: a GPU->CPU copy then would crash the engine."""
    if not cuda_available():
        return False
    import torch

    return bool(torch.cuda.is_current_stream_capturing())
