"""The KV write log, tracer side: what each tensor step stores so that KV is stored once.

On the hot path (``forward``, right after ``do_kv_cache_update`` wrote the cache) two
device-side copies are queued, neither of which needs the host: :func:`gather_written`,
the cache entries at this step's slots (``kv_written``), and :func:`clone_read_blocks`,
every block the step's block table names (a device-to-device copy; H200 bandwidth makes
it microseconds). The writer thread, once the step's event has fired, asks a
:class:`WriteLog` which of those blocks the trace has not seen whole yet, and copies only
those to the host (``kv_new_blocks``). Trace bytes then grow with new tokens, not with
context x steps. ``tracer.format.writelog`` rebuilds each step's blocks from the log.

A layer's log is valid only while every write to its cache is in it: a step that ran the
model without logging that layer (a step outside ``--steps``, a warm-up pass, a full CUDA
graph replay, a spent budget) ends the *epoch*; the next logged step starts a new one and
stores every block it reads again.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tracer.format.layouts import token_elements

__all__ = [
    "INT_OF_SIZE",
    "LayerGeometry",
    "WriteLog",
    "clone_read_blocks",
    "columns_read",
    "gather_written",
    "geometry_of",
]


@dataclass
class LayerGeometry:
    """One layer's cache as the gathers index it: computed once per layer on the device."""

    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    #: ``[block_size, 2*H_kv*D]`` storage offsets (elements, relative to block 0's start) of
    #: each token's K|V entries, in ``token_elements`` order, for the live cache's strides.
    token_offsets: Any
    block_stride: int
    flat: Any  #: the cache's storage as one flat integer tensor (bit-exact gathers for any dtype)


#: The integer dtype (by name) of each element size: a cache's bits gathered or compared as integers.
INT_OF_SIZE = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def geometry_of(kv_cache: Any, layout: str) -> LayerGeometry:
    """The index tensors for ``kv_cache`` (logical ``(nb, H_kv, bs, 2*D)``) in ``layout``."""
    import torch

    nb, h, bs, two_d = (int(n) for n in kv_cache.shape)
    d = two_d // 2
    positions = torch.tensor(token_elements(layout, h, bs, d), dtype=torch.long)  # logical, contiguous block
    # logical (head, token, col) of each position -> storage offset through the live strides
    s0, s1, s2, s3 = (int(s) for s in kv_cache.stride())
    head, rest = positions // (bs * two_d), positions % (bs * two_d)
    token, col = rest // two_d, rest % two_d
    offsets = (head * s1 + token * s2 + col * s3).to(kv_cache.device)
    int_dtype = getattr(torch, INT_OF_SIZE[kv_cache.element_size()])
    storage = kv_cache.untyped_storage()
    numel = storage.nbytes() // kv_cache.element_size()
    flat = torch.empty(0, dtype=int_dtype, device=kv_cache.device).set_(storage, 0, (numel,), (1,))
    flat = flat[kv_cache.storage_offset() :]
    return LayerGeometry(nb, bs, h, d, offsets, s0, flat)


def gather_written(geom: LayerGeometry, slot_mapping: Any, dtype: Any) -> Any:
    """``[n, 2, H_kv, D]``: the cache's entries at ``slot_mapping`` (device; -1 rows read block 0).

    No host sync: padding slots (-1) are read as slot 0 and dropped by the writer thread,
    which has the slot values by then.
    """
    slots = slot_mapping.long().clamp(min=0)
    blocks = (slots // geom.block_size).clamp(max=geom.num_blocks - 1)
    index = blocks.unsqueeze(1) * geom.block_stride + geom.token_offsets[slots % geom.block_size]
    values = geom.flat[index]  # [n, 2*H*D] in the cache's bits
    return values.view(dtype).reshape(-1, 2, geom.num_kv_heads, geom.head_size)


def columns_read(block_table: Any, max_seq_len: int, block_size: int) -> int:
    """Block-table columns a step reads: ``ceil(max_seq_len / block_size)``, at most the table's width."""
    return min(int(block_table.shape[1]), max(1, math.ceil(max_seq_len / block_size)))


def clone_read_blocks(kv_cache: Any, block_table: Any, num_reqs: int, max_seq_len: int) -> Any:
    """``[num_reqs * cols, H_kv, bs, 2*D]``: every block the step's table rows name, copied on the device.

    ``cols = ceil(max_seq_len / block_size)``: the widest row the step reads. Ids are clamped
    into the pool (a row's unused tail may hold anything); the writer thread reads the real
    ids from the host copy of the table and picks the rows it needs.
    """
    cols = columns_read(block_table, max_seq_len, int(kv_cache.shape[2]))
    ids = block_table[:num_reqs, :cols].reshape(-1).long().clamp(0, int(kv_cache.shape[0]) - 1)
    return kv_cache.index_select(0, ids), cols


@dataclass
class _LayerLog:
    epoch: int = -1
    #: per block id, the bitmask of token offsets known (``uint64``; grown to the largest id seen)
    known: Any = None
    tensor_steps: int = 0  #: tensor records so far (for check sampling)


#: Block sizes whose masks fit a ``uint64`` (larger ones keep Python ints in an object array).
WORD_BLOCK_SIZE = 64


class WriteLog:
    """Writer-thread bookkeeping: per layer, which blocks (and token offsets) the trace holds.

    ``check_every``: every N-th tensor step of a layer also stores its blocks whole (0: never).
    The plan is vectorised (numpy): a decode step of 32 requests names ~1,000 blocks, and the
    writer thread holds the GIL the engine's thread needs while it runs.
    """

    def __init__(self, check_every: int = 0):
        self.check_every = check_every
        self._layers: dict[str, _LayerLog] = {}
        self._next_epoch: dict[str, int] = {}

    def invalidate(self, layer: str) -> None:
        """Some write to ``layer``'s cache was not logged: its next logged step starts a new epoch."""
        self._layers.pop(layer, None)

    def plan(
        self,
        layer: str,
        block_table: Sequence[Sequence[int]],
        seq_lens: Sequence[int],
        written_slots: Any,
        block_size: int,
        *,
        reset: bool,
    ) -> tuple[int, list[int], bool]:
        """Return (epoch, the blocks to store whole, whether this is a check step); update the state.

        ``block_table``: each request's row, trimmed to the blocks it uses (as records hold them).
        """
        import numpy as np

        rows = list(block_table)[: len(seq_lens)]
        width = max((len(row) for row in rows), default=0)
        table = np.zeros((len(rows), width), dtype=np.int64)
        for r, row in enumerate(rows):
            table[r, : len(row)] = row
        # a row reads no further than its own blocks: the padding columns then read nothing
        seq = [min(int(s), len(row) * block_size) for row, s in zip(rows, seq_lens, strict=False)]
        return self.plan_table(layer, table, seq, written_slots, block_size, reset=reset)[:3]

    def plan_table(
        self,
        layer: str,
        table: Any,
        seq_lens: Sequence[int],
        written_slots: Any,
        block_size: int,
        *,
        reset: bool,
    ) -> tuple[int, list[int], bool, Any, Any]:
        """:meth:`plan` for the step's host block table ``[num_reqs, cols]`` (a numpy array).

        Also returns every block the step reads (sorted ids) and its first row in the
        table flattened, which is its row in ``clone_read_blocks``'s output.
        """
        import numpy as np

        if reset:
            self.invalidate(layer)
        log = self._layers.get(layer)
        if log is None:
            epoch = self._next_epoch.get(layer, 0)
            self._next_epoch[layer] = epoch + 1
            log = self._layers[layer] = _LayerLog(epoch=epoch, known=_zeros(0, block_size))
        table = np.asarray(table, dtype=np.int64)
        if table.ndim != 2:  # no requests: the host copy may have lost its column count
            table = table.reshape(len(seq_lens), -1) if table.size else np.zeros((len(seq_lens), 0), dtype=np.int64)
        seq = np.asarray(seq_lens, dtype=np.int64)
        used = np.clip(seq[:, None] - np.arange(table.shape[1], dtype=np.int64)[None, :] * block_size, 0, block_size)
        take = used > 0
        blocks, need = table[take], _mask(used[take], block_size)
        slots = np.asarray(written_slots, dtype=np.int64)
        top = max(int(blocks.max(initial=-1)), int(slots.max(initial=-1)) // block_size) + 1
        if top > log.known.shape[0]:
            log.known = np.concatenate([log.known, _zeros(top - log.known.shape[0], block_size)])
        known = log.known
        if slots.size:
            bits = _mask(slots % block_size + 1, block_size) ^ _mask(slots % block_size, block_size)  # 1 << offset
            np.bitwise_or.at(known, slots // block_size, bits)
        new = np.unique(blocks[(known[blocks] & need) != need])
        known[new] = _mask(np.array([block_size]), block_size)[0]
        log.tensor_steps += 1
        check = self.check_every > 0 and (log.tensor_steps - 1) % self.check_every == 0
        ids, first = np.unique(blocks, return_index=True)
        return log.epoch, new.tolist(), check, ids, np.flatnonzero(take)[first]


def _zeros(n: int, block_size: int) -> Any:
    import numpy as np

    if block_size <= WORD_BLOCK_SIZE:
        return np.zeros(n, dtype=np.uint64)
    out = np.empty(n, dtype=object)
    out[:] = 0
    return out


def _mask(used: Any, block_size: int) -> Any:
    """``(1 << used) - 1`` per element of the int array ``used`` (each in 0..block_size)."""
    import numpy as np

    if block_size > WORD_BLOCK_SIZE:
        out = np.empty(len(used), dtype=object)
        out[:] = [(1 << int(u)) - 1 for u in used]
        return out
    used = np.asarray(used, dtype=np.uint64)
    shifted = np.left_shift(np.uint64(1), np.minimum(used, np.uint64(63))) - np.uint64(1)
    return np.where(used >= 64, np.uint64(0xFFFFFFFFFFFFFFFF), shifted)
