"""What every form of the reference kernel shares: the batch check, fp8 reads, sinks.

The forms live in :mod:`reference_impl.kernel` (the block loop, the partitioned v2 form),
:mod:`reference_impl.fast` (the vectorised gather) and :mod:`reference_impl.compiled`;
they all take the varlen batch described in :mod:`reference_impl.kernel`.

Imports torch only.
"""

from __future__ import annotations

import torch

__all__ = [
    "FP8_STORAGE",
    "add_sinks",
    "cdiv",
    "cdiv_tensor",
    "check_args",
    "check_used_blocks",
    "read_cache_as",
    "take_blocks",
]

#: Cache dtypes holding fp8 e4m3 values (vLLM stores ``kv_cache_dtype="fp8"`` as uint8).
FP8_STORAGE = (torch.uint8, torch.float8_e4m3fn)


def take_blocks(cache: torch.Tensor, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``cache.index_select(0, ids)`` (into ``out``, contiguous, when given), the same bits.

    A contiguous cache is gathered as rows of bytes: torch's CPU ``index_select`` copies a byte
    row with one ``memcpy``, and a row of 2- or 4-byte elements element by element, 4-5x slower.
    """
    if not cache.is_contiguous() or cache.dim() < 2 or cache.device.type != "cpu":
        return torch.index_select(cache, 0, ids, out=out) if out is not None else cache.index_select(0, ids)
    rows = cache.reshape(cache.shape[0], -1).view(torch.uint8)
    if out is None:
        return rows.index_select(0, ids).view(cache.dtype).view(-1, *cache.shape[1:])
    torch.index_select(rows, 0, ids, out=out.view(out.shape[0], -1).view(torch.uint8))
    return out


def read_cache_as(cache: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``cache`` as ``dtype``; fp8 bytes are decoded as e4m3 and multiplied by ``scale``."""
    if cache.dtype in FP8_STORAGE:
        if cache.dtype == torch.uint8:
            cache = cache.view(torch.float8_e4m3fn)
        return cache.to(dtype) * scale
    return cache.to(dtype)


def check_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    """Raise ``ValueError`` unless the six tensors form one varlen batch.

    Shapes: ``query [T, H, D]``, caches ``[nb, bs, H_kv, D]`` with ``H % H_kv == 0``,
    ``seq_lens [B]``, ``query_start_loc [B + 1]``, ``block_table [>= B, max_blocks]`` wide
    enough for the longest sequence, and every block a sequence with queries reads inside
    the cache (:func:`check_used_blocks`).
    """
    if query.dim() != 3 or key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            "expected query [T, H, D] and caches [nb, bs, H_kv, D]; got "
            f"{tuple(query.shape)}, {tuple(key_cache.shape)}, {tuple(value_cache.shape)}"
        )
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_size or num_heads % num_kv_heads:
        raise ValueError(
            f"query heads {num_heads} x {head_size} do not fit kv heads {num_kv_heads} x {key_cache.shape[3]}"
        )
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1 or block_table.shape[0] < num_seqs:
        raise ValueError(
            f"seq_lens [{num_seqs}] needs query_start_loc [{num_seqs + 1}] and "
            f"block_table [>= {num_seqs}, ...]; got {tuple(query_start_loc.shape)}, "
            f"{tuple(block_table.shape)}"
        )
    if num_seqs and block_table.shape[1] * key_cache.shape[1] < int(seq_lens.max()):
        longest = int(seq_lens.argmax())
        raise ValueError(
            f"block_table has {block_table.shape[1]} columns of {key_cache.shape[1]} slots; "
            f"sequence {longest} has {int(seq_lens[longest])} keys"
        )
    check_used_blocks(block_table, seq_lens, query_start_loc, key_cache.shape[0], key_cache.shape[1])


def check_used_blocks(
    block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, num_blocks: int, block_size: int
) -> None:
    """Raise ``ValueError`` naming the first block a sequence reads that is not in the cache.

    Row ``b`` reads entries ``0 .. ceil(seq_lens[b] / block_size) - 1`` when it has queries;
    each must be a block of the cache (``0 <= id < num_blocks``). Past them the table may
    hold anything (vLLM leaves them stale). Without this a ``-1`` would index the last block
    (a silent wrong answer) in one form and raise a bare ``IndexError`` in another.
    """
    num_seqs = seq_lens.shape[0]
    if not num_seqs or block_table.numel() == 0:
        return
    used = cdiv_tensor(seq_lens.long(), block_size)  # [B]
    has_queries = (query_start_loc[1:] - query_start_loc[:-1]) > 0
    columns = torch.arange(block_table.shape[1])[None, :] < (used * has_queries)[:, None]
    rows = block_table[:num_seqs].long()
    bad = columns & ((rows < 0) | (rows >= num_blocks))
    if bool(bad.any()):
        b, j = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"block_table[{b}][{j}] is {int(rows[b, j])}: sequence {b} ({int(seq_lens[b])} keys) reads "
            f"logical block {j}, but the cache has blocks 0..{num_blocks - 1}"
        )


def cdiv_tensor(a: torch.Tensor, b: int) -> torch.Tensor:
    """``ceil(a / b)`` elementwise for a non-negative integer tensor."""
    return -(-a // b)


def add_sinks(
    out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, num_queries: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add the sink logits ``[H]`` to the softmax of rows ``< num_queries``.

    The sink joins every query's denominator once: ``out [T, H, D]`` is scaled by the share
    the keys keep, ``lse [T, H]`` becomes the log of the whole denominator.
    """
    is_query = (torch.arange(out.shape[0]) < num_queries)[:, None]
    with_sink = torch.where(is_query, torch.logaddexp(lse, sinks.to(lse.dtype)[None, :]), lse)
    return out * torch.exp(lse - with_sink).nan_to_num(0.0)[..., None], with_sink


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative ints."""
    return -(-a // b)
