"""The messages the tracer sends its record writer process: one protocol, defined once, used by both ends.

``tracer.record_writer.RecordWriter`` builds them (``send_slot``; each KV-cache group's host buffers with
``tracer.host_buffers.host_message``), ``tracer.record_process.RecordProcess`` encodes them
with :data:`ENCODER`, and the record process decodes them with :data:`DECODER`, typed: a
message of another shape is a one-line error there, never a misread record.

On the child's stdin each :class:`Message` is :data:`LENGTH` (its byte count, 4 bytes
little-endian), then its msgpack. A message is the host buffers of one hand-over's slots
(:data:`Host`, one per KV-cache group and slot) and its items (:data:`Item`), in order:

* :class:`Directory`: first, once (a tensor-parallel rank other than 0 writes to ``rank<N>/``,
  known only once vLLM is up);
* :class:`Gap`: a gap record;
* :class:`Layer`: a layer's unchanging fields, before its first record and whenever they change;
* :class:`RequestIds`: the request ids of the records from here on, when the batch changes;
* :class:`Step`: one record, the layer's fields updated with its own, its lists read from a host;
* :class:`Sync`: the child answers ``tracer.record_process.SYNCED`` once everything before it
  is written.

Every struct is encoded as an array (no field names on the wire), each union's member led by
its class name (``tag=True``). They hold plain values only and are never part of a reference
cycle, so the garbage collector does not track them (``gc=False``): a step's structs are made on
the engine's thread. Imports the standard library and ``msgspec`` only: the record process
imports this module, and never numpy or torch.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec

__all__ = [
    "DECODER",
    "ENCODER",
    "LENGTH",
    "Directory",
    "Gap",
    "Host",
    "Item",
    "Layer",
    "Message",
    "PackedCopy",
    "Part",
    "RequestIds",
    "SharedCopy",
    "Step",
    "Sync",
    "View",
    "Views",
]

#: Each message's byte count, before it on the pipe.
LENGTH = struct.Struct("<I")


class _Item(msgspec.Struct, tag=True, array_like=True, frozen=True, gc=False):
    """What one message asks of the record process (its subclasses, each ``frozen`` too: type checkers
    do not carry that option over)."""


class Directory(_Item, frozen=True):
    """The trace directory: the child opens ``steps.jsonl`` there with the first record."""

    path: str


class Gap(_Item, frozen=True):
    """A gap record: ``tracer.format.GapRecord.to_json``."""

    record: dict[str, Any]


class Layer(_Item, frozen=True):
    """A layer's fields that no step changes (``tracer.layer_capture.LayerCapture.layer_fields``)."""

    name: str  #: the layer's name, as each :class:`Step` names it
    fields: dict[str, Any]


class RequestIds(_Item, frozen=True):
    """The request ids of the records from here on, one per request row."""

    ids: tuple[str, ...]


class Step(_Item, frozen=True):
    """One record: the layer's fields updated with ``fields``, its lists read from ``hosts[host]``."""

    host: int  #: 0-based index into the message's hosts
    block_size: int  #: tokens per KV-cache block (each block-table row is cut to the blocks it uses)
    layer: str  #: a name a :class:`Layer` item gave earlier
    #: ``tracer.layer_capture.LayerCapture.step_fields`` without the request ids
    fields: dict[str, Any]


class Sync(_Item, frozen=True):
    """Answer ``tracer.record_process.SYNCED`` on stdout once everything before this is written."""


class Part(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One metadata tensor in a packed host buffer, in buffer order."""

    name: str  #: ``query_start_loc``, ``seq_lens``, ``block_table`` or ``slot_mapping``
    dtype: str  #: a numpy dtype string (``<i4``, ``<i8``)
    shape: tuple[int, ...]
    width: int  #: its int32 elements in the buffer
    rows: int  #: its leading rows that are the step's (-1: all)


class _Host(msgspec.Struct, tag=True, array_like=True, frozen=True, gc=False):
    """One KV-cache group's host buffers for one slot (its subclasses, ``frozen`` as :class:`_Item`'s)."""


class SharedCopy(_Host, frozen=True):
    """A packed copy that landed in the host memory the child maps (``tracer.shared_host``)."""

    offset: int  #: byte offset in that memory; the stretch is free again once the child has read the message
    parts: tuple[Part, ...]


class PackedCopy(_Host, frozen=True):
    """A packed copy's bytes, carried in the message (the copy went into the slot's own buffer)."""

    data: bytes
    parts: tuple[Part, ...]


class View(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One host view's values."""

    dtype: str  #: a numpy dtype string
    shape: tuple[int, ...]
    data: bytes


class Views(_Host, frozen=True):
    """Host views copied one by one (a tensor of a dtype the packed copy does not take)."""

    query_start_loc: View
    seq_lens: View
    block_table: View
    slot_mapping: View


#: What a message asks, item by item.
Item = Directory | Gap | Layer | RequestIds | Step | Sync
#: Where one KV-cache group's host buffers are.
Host = SharedCopy | PackedCopy | Views


class Message(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One hand-over: its host buffers, and its items, in order."""

    hosts: list[Host]
    items: list[Item]


#: Both ends' one encoder and decoder (the decoder gives back the structs above, checked).
ENCODER = msgspec.msgpack.Encoder()
DECODER = msgspec.msgpack.Decoder(Message)
