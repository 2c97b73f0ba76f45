"""torch's view arithmetic on (shape, strides, offset) tuples, in plain Python.

What a line's ``transpose`` / ``split`` / ``chunk`` / ``view`` / indexing gives for the
captured cache, computed from the ``KVCacheSpec`` alone: the annotator runs on a machine
that has only the trace, without torch. ``TensorView.view`` fails where torch would,
with torch's message (ATen's ``computeStride``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tracer.format import KVCacheSpec

__all__ = ["TensorView", "ViewError", "cache_view", "fmt_tuple"]


def fmt_tuple(values: Sequence[int]) -> str:
    """``(a, b)`` as Python prints a tuple, ``(a,)`` for one element."""
    return "(" + ", ".join(str(v) for v in values) + ("," if len(values) == 1 else "") + ")"


@dataclass(frozen=True)
class TensorView:
    """A strided view: shape, strides and storage offset, all in elements."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int = 0

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    def transpose(self, a: int, b: int) -> TensorView:
        """``tensor.transpose(a, b)``."""
        shape, stride = list(self.shape), list(self.stride)
        shape[a], shape[b] = shape[b], shape[a]
        stride[a], stride[b] = stride[b], stride[a]
        return TensorView(tuple(shape), tuple(stride), self.offset)

    def split(self, size: int, dim: int = -1) -> list[TensorView]:
        """``tensor.split(size, dim)``: equal pieces along ``dim``, last may be short."""
        dim %= len(self.shape)
        out = []
        for start in range(0, self.shape[dim], size):
            shape = list(self.shape)
            shape[dim] = min(size, self.shape[dim] - start)
            out.append(TensorView(tuple(shape), self.stride, self.offset + start * self.stride[dim]))
        return out

    def chunk(self, chunks: int, dim: int) -> list[TensorView]:
        """``tensor.chunk(chunks, dim)``."""
        dim %= len(self.shape)
        return self.split(-(-self.shape[dim] // chunks), dim)

    def select(self, dim: int, index: int) -> TensorView:
        """``tensor[index]`` along ``dim`` (drops the dimension)."""
        return TensorView(
            self.shape[:dim] + self.shape[dim + 1 :],
            self.stride[:dim] + self.stride[dim + 1 :],
            self.offset + index * self.stride[dim],
        )

    def view(self, *shape: int) -> TensorView:
        """``tensor.view(*shape)``; raises ``ViewError`` with torch's message when torch would."""
        new = list(shape)
        if new.count(-1) > 1:
            raise ViewError("only one dimension can be inferred")
        if -1 in new:
            known = math.prod(s for s in new if s != -1)
            if known == 0 or self.numel % known:
                raise ViewError(f"shape '{list(shape)}' is invalid for input of size {self.numel}")
            new[new.index(-1)] = self.numel // known
        if math.prod(new) != self.numel:
            raise ViewError(f"shape '{list(shape)}' is invalid for input of size {self.numel}")
        stride = _view_strides(self.shape, self.stride, tuple(new))
        if stride is None:
            raise ViewError(
                "view size is not compatible with input tensor's size and stride "
                "(at least one dimension spans across two contiguous subspaces)"
            )
        return TensorView(tuple(new), stride, self.offset)

    def describe(self) -> str:
        """``shape (a, b) strides (c, d)``, plus the offset when it is not 0."""
        text = f"shape {fmt_tuple(self.shape)} strides {fmt_tuple(self.stride)}"
        return text + (f" offset +{self.offset}" if self.offset else "")


class ViewError(ValueError):
    """``TensorView.view`` would fail in torch; the message is torch's."""


def _view_strides(old_shape: tuple[int, ...], old_stride: tuple[int, ...], new_shape: tuple[int, ...]):
    """Strides of ``view(new_shape)`` or None if not expressible (ATen ``computeStride``)."""
    if math.prod(old_shape) == 0:
        return None
    new_stride = [0] * len(new_shape)
    view_d = len(new_shape) - 1
    chunk_base_stride = old_stride[-1] if old_stride else 1
    tensor_numel = 1
    view_numel = 1
    for tensor_d in range(len(old_shape) - 1, -1, -1):
        tensor_numel *= old_shape[tensor_d]
        if tensor_d == 0 or (
            old_shape[tensor_d - 1] != 1 and old_stride[tensor_d - 1] != tensor_numel * chunk_base_stride
        ):
            while view_d >= 0 and (view_numel < tensor_numel or new_shape[view_d] == 1):
                new_stride[view_d] = view_numel * chunk_base_stride
                view_numel *= new_shape[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return None
            if tensor_d > 0:
                chunk_base_stride = old_stride[tensor_d - 1]
                tensor_numel = 1
                view_numel = 1
    if view_d != -1:
        return None
    return tuple(new_stride)


def cache_view(spec: KVCacheSpec) -> TensorView:
    """One layer's captured ``kv_cache`` tensor as a ``TensorView``."""
    return TensorView(tuple(spec.shape), tuple(spec.stride))
