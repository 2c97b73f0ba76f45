"""A KV-cache group's host buffers in a message, and back: the engine's side and the record process's.

:func:`host_message` (on the engine's thread, at a hand-over) names where a packed copy landed in
the memory the record process maps (:class:`tracer.messages.SharedCopy`), or carries its bytes
(:class:`tracer.messages.PackedCopy`, and :class:`tracer.messages.Views` for a copy made tensor by
tensor). :func:`message_lists` (in the record process) reads them back as the record's lists, with
the standard library only: the record process imports no numpy.
"""

from __future__ import annotations

import array
import ctypes
import sys
from typing import Any

from tracer.format import TraceError
from tracer.messages import Host, PackedCopy, Part, SharedCopy, View, Views

__all__ = ["host_message", "message_lists"]


#: Host dtypes as ``numpy`` dtype strings, without asking numpy (``tracer.host_copies.Packed.like``).
_DTYPE_STR = {"torch.int32": "<i4", "torch.int64": "<i8"} if sys.byteorder == "little" else {}
#: The same by dtype object (``str`` of a torch dtype is a call a part, a step); None: not sendable.
_DTYPE_OF: dict[Any, str | None] = {}


def _dtype_str(dtype: Any) -> str | None:
    """``dtype`` (a torch dtype) as a ``numpy`` dtype string, or None when no message can carry it."""
    try:
        return _DTYPE_OF[dtype]
    except KeyError:
        out = _DTYPE_OF[dtype] = _DTYPE_STR.get(str(dtype))
        return out


def _packed_message(packed: Any) -> PackedCopy:
    """A packed copy (``tracer.host_copies.Packed``) in the slot's own buffer, its bytes read at its address.

    No tensor method runs (``numpy()`` would be one more on the engine's thread, which hands the
    slots over). A block table copied with every column (``packed.cols`` set) goes as the step's
    rows of the columns it reads: with ``max_model_len`` 4096 and 16-token blocks a row has 256
    columns, a step of 360-token requests reads 23, and the bytes the engine's thread copies,
    encodes and writes shrink about tenfold (the records cut each row to its own blocks anyway).
    """
    total = sum(packed.widths)
    address = packed.host.data_ptr()
    shape = packed.like.get("block_table", (None, ()))[1]
    cols = packed.cols
    cut = cols is not None and len(shape) == 2 and cols < shape[1]  # send the columns read only
    parts = _parts(packed, cut=cut)
    if not cut:
        return PackedCopy(ctypes.string_at(address, 4 * total), parts)
    start = 0  # int32 elements before the block table
    for k, w in zip(packed.order, packed.widths, strict=True):
        if k == "block_table":
            break
        start += w
    rows = parts[packed.order.index("block_table")].shape[0]
    values = _int32_at(address, total)
    end = start + shape[0] * shape[1]
    table = values[start:end].reshape(shape)[:rows, :cols].tobytes()
    return PackedCopy(values[:start].tobytes() + table + values[end:].tobytes(), parts)


def _parts(packed: Any, *, cut: bool) -> tuple[Part, ...]:
    """The parts of a packed copy, in buffer order.

    ``cut``: the block table goes as the step's rows of its first ``packed.cols`` columns (rows -1).
    """
    shape = packed.like.get("block_table", (None, ()))[1]
    parts = []
    for k, w in zip(packed.order, packed.widths, strict=True):
        dtype = _dtype_str(packed.like[k][0])
        assert dtype is not None  # the callers checked every part's dtype
        if cut and k == "block_table":
            rows = packed.trim.get("block_table", shape[0])  # the step's (leading) rows
            parts.append(Part(k, dtype, (rows, packed.cols), rows * packed.cols, -1))
        else:
            parts.append(Part(k, dtype, tuple(packed.like[k][1]), w, packed.trim.get(k, -1)))
    return tuple(parts)


#: (address, int32 count) -> a numpy array over that memory (:func:`_int32_at`)
_ARRAYS: dict[tuple[int, int], Any] = {}


def _int32_at(address: int, count: int) -> Any:
    """A numpy int32 array over ``count`` ints at ``address`` (no copy), kept for the next call.

    A slot's host buffer is reused step after step, so the same few arrays come back; making
    one costs a ctypes type and an array. Read only while a live buffer of that size is there.
    """
    values = _ARRAYS.get((address, count))
    if values is None:
        import numpy  # the engine's process only (the child never builds a message)

        if len(_ARRAYS) >= 256:
            _ARRAYS.clear()
        memory = memoryview((ctypes.c_char * (4 * count)).from_address(address)).cast("B")
        values = _ARRAYS[(address, count)] = numpy.frombuffer(memory, dtype=numpy.int32)
    return values


def host_message(host: dict[str, Any]) -> Host:
    """One KV-cache group's host buffers (filled: the slot's event fired) as a message's host.

    A packed copy (``tracer.host_copies.PackedViews``) that landed in the memory the child maps
    goes as where it is (``SharedCopy``), one in the slot's own buffer as its bytes
    (``PackedCopy``, :func:`_packed_message`): either way no view is made and no tensor
    operation runs. Otherwise each view goes as its own bytes (``Views``).
    """
    packed = getattr(host, "packed", None)
    if packed is not None and packed.shared is not None:  # the copy landed in memory the child maps: name it
        memo = packed.memo if packed.memo is not None else {}
        key = tuple(packed.trim.values())  # the plan fixes the rest of how the copy is cut
        parts = memo.get(key)
        if parts is None:
            if not all(_dtype_str(d) is not None for d, _ in packed.like.values()):
                raise TraceError(f"the record writer process cannot read a host buffer of {packed.like}")
            if len(memo) >= 64:
                memo.clear()
            parts = memo[key] = _parts(packed, cut=False)
        return SharedCopy(packed.shared, parts)
    if packed is not None and all(_dtype_str(d) is not None for d, _ in packed.like.values()):
        return _packed_message(packed)
    views = {}
    for name in Views.__struct_fields__:
        values = host[name].numpy()
        views[name] = View(values.dtype.str, tuple(values.shape), values.tobytes())
    return Views(**views)


#: ``numpy`` dtype strings of the host buffers -> ``array`` type codes of that size (checked below).
_TYPECODES = {"i4": "i", "i8": "q", "u4": "I", "u8": "Q"}


def _ints(dtype: str, data: bytes) -> list[int]:
    """One buffer's integers, with the standard library only.

    The child imports no numpy: in vLLM's CPU worker (threads bound to cores, OpenMP settings in
    the environment it inherits) importing numpy hung.
    """
    code = _TYPECODES.get(dtype[1:])
    if code is None or array.array(code).itemsize != int(dtype[2:]):
        raise TraceError(f"the record writer process cannot read a host buffer of dtype {dtype!r}")
    values = array.array(code, data)
    if (dtype[0] == "<") != (sys.byteorder == "little") and dtype[0] in "<>":
        values.byteswap()
    return values.tolist()


def message_lists(host: Host, shared: Any = None) -> dict[str, Any]:
    """``tracer.layer_capture.host_lists`` of the buffers one message carries (``host_message``).

    ``shared``: the child's mapping of the memory a ``SharedCopy`` is in (``tracer.shared_host``).
    """
    if isinstance(host, Views):
        views = {name: getattr(host, name) for name in Views.__struct_fields__}
        flat = {name: _ints(view.dtype, view.data) for name, view in views.items()}
        shapes = {name: view.shape for name, view in views.items()}
    else:
        if isinstance(host, SharedCopy):
            if shared is None:
                raise TraceError("a message names shared host memory the record writer process was not given")
            data = shared[host.offset : host.offset + 4 * sum(part.width for part in host.parts)]
        else:
            data = host.data
        flat, shapes, offset = {}, {}, 0
        for part in host.parts:
            values = _ints(part.dtype, data[4 * offset : 4 * (offset + part.width)])
            offset += part.width
            shape = part.shape
            if part.rows >= 0:  # the step's leading rows of a tensor copied as the runner gave it
                values = values[: part.rows * (shape[1] if len(shape) == 2 else 1)]
                shape = (part.rows, *shape[1:])
            flat[part.name] = values
            shapes[part.name] = shape
    rows, cols = shapes["block_table"]
    table = flat["block_table"]
    return {
        "query_start_loc": tuple(flat["query_start_loc"]),
        "seq_lens": tuple(flat["seq_lens"]),
        "block_table": [table[r * cols : (r + 1) * cols] for r in range(rows)],
        "slot_mapping": tuple(flat["slot_mapping"]),
    }
