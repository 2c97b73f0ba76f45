"""Tensors of full CUDA-graph steps: device buffers the captured graphs copy into on every replay.

A full graph replays without calling Python ``forward``, so the tensor path of
``tracer.capture`` cannot clone a replayed step's query / output / key / value. What it can do
is add copies to the graph while vLLM captures it: a device-to-device copy is legal during
capture and becomes one more node of the graph. :meth:`GraphCopies.stage` (called from
``forward`` and ``do_kv_cache_update`` while a stream is capturing) copies each tensor into
a buffer kept here, so every replay of that graph leaves its step's tensors in the buffer.
The end of the runner's step, outside the graph and on the same stream, then clones the
real rows (``tracer.host_copies.tensor_clones``) before the next replay can overwrite them.

One buffer per layer and tensor serves every captured size: a graph of ``n`` padded tokens
writes rows ``[:n]``, and steps replay one at a time on one stream. The buffer is made for
the largest size vLLM will capture (``capacity``); a larger size than that gets a buffer of
its own (the smaller graphs keep theirs).

The graphs outlive any one tracer: they write into these buffers on every replay until the
process ends. So the buffers are never freed (a freed one would be handed to some other
tensor and overwritten by every replay), and :data:`SHARED` is the one set of graph copies of
the process: a tracer started later on the same engine reads the copies an earlier one captured.
"""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["SHARED", "GraphCopies"]


class GraphCopies:
    """Per (layer, padded tokens): the views a captured full graph writes its tensors into."""

    def __init__(self) -> None:
        self._views: dict[tuple[str, int], dict[str, Any]] = {}
        self._buffers: dict[tuple[str, str], Any] = {}
        self._held: list[Any] = []  #: every buffer a captured graph may write into

    def __len__(self) -> int:
        return len(self._views)

    def stage(self, layer: str, tensors: dict[str, Any], kv_cache: Any, capacity: int = 0) -> None:
        """Inside a capture: copy ``tensors`` (first dim: the graph's padded tokens) into the layer's buffers.

        ``kv_cache``: the layer's cache, which tells this engine's graphs from another's;
        ``capacity``: the largest padded size vLLM captures (a new buffer's rows).
        """
        for key, tensor in tensors.items():
            n = int(tensor.shape[0])
            view = self._buffer(layer, key, tensor, max(n, capacity))[:n]
            view.copy_(tensor.detach())
            views = self._views.get((layer, n))
            if views is None or views["cache"]() is not kv_cache:
                views = self._views[(layer, n)] = {"cache": weakref.ref(kv_cache)}
            views[key] = view

    def get(self, layer: str, padded: int | None, kv_cache: Any) -> dict[str, Any] | None:
        """What the graph of ``padded`` tokens of the engine owning ``kv_cache`` wrote this replay.

        None when that graph was captured without copies (before any tracer started, or
        for another engine of the process).
        """
        if padded is None:
            return None
        views = self._views.get((layer, int(padded)))
        if views is None or views["cache"]() is not kv_cache or "query" not in views or "output" not in views:
            return None
        return views

    def _buffer(self, layer: str, key: str, like: Any, rows: int) -> Any:
        import torch

        buf = self._buffers.get((layer, key))
        if (
            buf is None
            or buf.shape[0] < like.shape[0]
            or tuple(buf.shape[1:]) != tuple(like.shape[1:])
            or buf.dtype != like.dtype
        ):
            # Allocated while capturing, from the graph pool; held here for good (see the module's note).
            buf = torch.empty((rows, *like.shape[1:]), dtype=like.dtype, device=like.device)
            self._buffers[(layer, key)] = buf
            self._held.append(buf)
        return buf


#: The process's graph copies: every tracer stages into them and reads from them.
SHARED = GraphCopies()
