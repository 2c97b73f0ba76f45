"""One pass over a captured step: the fp64 reference and the bar's baseline from one gather.

Replay needs two answers per (step, layer): the fp64 reference (what attention is) and the
same attention rounded as the trace's kernel rounds it (the bar's baseline,
:mod:`reference_impl.emulation`). :func:`step_outputs` gives both from one read of each
row's K/V, batched over rows of similar shape instead of looping over requests:

* the step's rows are cut into work items, (sequence, query chunk, key range): a decode
  row is one query over its keys, a prefill chunk ``t`` queries over the keys any of them
  sees (window and causal edge cut the range);
* items are sorted by (queries, keys) and padded into groups whose padding costs at most
  the device's :data:`PAD_SLACK` of the group's real work and whose logits stay under the
  memory caps;
* per group, K/V blocks are gathered once through the block table in the cache dtype, then
  read as fp64 for the reference (a masked softmax: :mod:`reference_impl.kernel`'s
  semantics) and as the emulation's inputs (bf16/fp16 values, or fp8 e4m3 with descales,
  as :func:`reference_impl.emulation.emulate_flash_attention` takes them) for the baseline.

The reference is fp64 on every device: the bar is ``TOL_K`` times the emulation's error
against it, and an fp32 reference (error ~1e-7 relative) would be a visible share of a bf16
emulation's error (~4e-3) only at ``TOL_K`` scale, but the floor (one bf16 ulp at the
head's max) and the mean bar (``MEAN_FLOOR_ULPS = 1/16`` ulp) leave less room: fp64 keeps
the reference's own error out of the verdict everywhere. The emulation is fp32, as the
kernels it models (``torch.backends.cuda.matmul.allow_tf32`` is turned off during the pass on a GPU).

Einsum letters as in :mod:`reference_impl.kernel`, with ``r`` the item within a group.

Imports torch and :mod:`reference_impl` only.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from reference_impl.common import FP8_STORAGE, add_sinks, cdiv
from reference_impl.emulation import FLASH, FP8_MAX_OFFSET, Emulation, round_output
from reference_impl.emulation_rows import softmax_first
from reference_impl.gathered import visibility

__all__ = ["DEVICES", "PAD_SLACK", "select_device", "step_kwargs", "step_outputs", "warm_up"]

#: Padding a group may add, as a share of its items' own logits, per device kind. On a CPU padded
#: logits cost what real ones do: sorted items pad little. On a GPU the pass is bound by the host,
#: which launches some fifty kernels a group (about 0.4 ms on an H100), while the padded arithmetic
#: runs on a device that is otherwise idle: a step's rows share one group unless it would pad more
#: than three times their work (a decode step's 32 rows of 260 to 430 keys pad about a quarter).
PAD_SLACK = {"cpu": 0.25, "cuda": 3.0}

#: Caps per group, in elements: gathered K (one of K/V, ``r * n * H_kv * D``) and logits
#: (``r * t * n * H``), per device kind (a CPU group should stay near its caches).
_CAPS = {"cpu": (1 << 21, 1 << 21), "cuda": (1 << 26, 1 << 26)}

#: The dtype the soft-cap's tanh is rounded to (``tanh.approx.f32``: ~11 significant bits).
_TANH_DTYPE = torch.float16


@dataclass(frozen=True)
class _Item:
    """Query rows ``row0 .. row0 + num_q`` of sequence ``seq`` (positions from ``pos0``),
    against keys ``[first, end)`` read from logical blocks ``first // bs ..``."""

    seq: int
    row0: int
    num_q: int
    pos0: int
    first: int
    end: int
    seq_len: int

    @property
    def num_keys(self) -> int:
        return self.end - self.first


def _items(
    seq_lens: Sequence[int], starts: Sequence[int], causal: bool, window: tuple[int, int], num_heads: int, cap: int
) -> list[_Item]:
    """The step's work items: each sequence's queries, chunked so one item's logits stay under ``cap``."""
    left, right = window
    items = []
    for b, seq_len in enumerate(seq_lens):
        q_len = starts[b + 1] - starts[b]
        if q_len <= 0 or seq_len <= 0:
            continue
        chunk = max(1, min(q_len, cap // max(1, num_heads * seq_len)))
        for i0 in range(0, q_len, chunk):
            num_q = min(chunk, q_len - i0)
            pos0 = seq_len - q_len + i0
            last = pos0 + num_q - 1
            end = seq_len
            if causal:
                end = min(end, last + 1)
            if right >= 0:
                end = min(end, last + right + 1)
            first = max(0, pos0 - left) if left >= 0 else 0
            items.append(_Item(b, starts[b] + i0, num_q, pos0, min(first, end), end, seq_len))
    return items


def _groups(
    items: list[_Item], block_size: int, kv_row: int, num_heads: int, caps: tuple[int, int], slack: float
) -> list[list[_Item]]:
    """Items sorted by (queries, keys), padded into groups within ``slack`` (:data:`PAD_SLACK`) and ``caps``."""
    kv_cap, score_cap = caps
    groups: list[list[_Item]] = []
    current: list[_Item] = []
    real = current_width = 0  # the group's work and _width(current)
    for item in sorted(items, key=lambda it: (it.num_q, it.num_keys)):
        own = cdiv(item.end, block_size) - item.first // block_size
        width = own + 1  # blocks, one of slack for alignment
        work = item.num_q * max(item.num_keys, 1)
        if current:
            n = len(current) + 1
            max_q = max(item.num_q, current[-1].num_q)
            max_w = max(width, current_width)
            padded = n * max_q * max_w * block_size
            fits = n * max_w * block_size * kv_row <= kv_cap and padded * num_heads <= score_cap
            if fits and padded <= (1 + slack) * (real + work) + n * max_q * block_size:
                current.append(item)
                real += work
                current_width = max(current_width, own)
                continue
            groups.append(current)
        current, real, current_width = [item], work, own
    if current:
        groups.append(current)
    return groups


def _width(items: list[_Item], block_size: int) -> int:
    return max(cdiv(it.end, block_size) - it.first // block_size for it in items)


def step_outputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
    causal: bool = True,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    fp8_query: torch.Tensor | None = None,
    q_scale: float = 1.0,
    out_dtype: torch.dtype = torch.bfloat16,
    emulation: Emulation = FLASH,
    reference: bool = True,
    device: torch.device | str | None = None,
    to_cpu: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The step's fp64 reference and its emulated baseline, ``[T, H, D]`` each, on the CPU.

    Args:
        query: ``[T, H, D]``: the activation dtype, or (fp8 path) the dequantised fp64 query.
        key_cache, value_cache, block_table, seq_lens, query_start_loc, scale, causal, window,
        softcap, alibi_slopes, sinks, k_scale, v_scale: as :mod:`reference_impl.kernel`.
        fp8_query: ``[T, H, D]`` e4m3: the query FA3's fp8 path got (the emulation's input), else None.
        q_scale: that query's descale.
        out_dtype: the activation dtype the baseline is rounded to.
        emulation: how the trace's kernel rounds (:mod:`reference_impl.emulation`).
        reference: also compute the fp64 reference (False: ``(None, baseline)``).
        device: where to compute (default: the CPU); results come back to the CPU.
        to_cpu: False leaves the results on ``device`` (a step with sinks: on the CPU), for a
            verdict computed there.

    Returns:
        ``(expected fp64 or None, baseline in out_dtype)``; rows of sequences without queries are 0.
    """
    # TF32 would round the emulation's fp32 products to 10 bits: off for the pass, whatever the caller set.
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return _step_outputs(
            query,
            key_cache,
            value_cache,
            block_table,
            seq_lens,
            query_start_loc,
            scale=scale,
            causal=causal,
            window=window,
            softcap=softcap,
            alibi_slopes=alibi_slopes,
            sinks=sinks,
            k_scale=k_scale,
            v_scale=v_scale,
            fp8_query=fp8_query,
            q_scale=q_scale,
            out_dtype=out_dtype,
            emulation=emulation,
            reference=reference,
            dev=torch.device(device) if device is not None else torch.device("cpu"),
            to_cpu=to_cpu,
        )
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def _step_outputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    window: tuple[int, int],
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    k_scale: float,
    v_scale: float,
    fp8_query: torch.Tensor | None,
    q_scale: float,
    out_dtype: torch.dtype,
    emulation: Emulation,
    reference: bool,
    dev: torch.device,
    to_cpu: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """:func:`step_outputs` on ``dev``."""
    num_tokens, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    caps = _CAPS.get(dev.type, _CAPS["cpu"])
    slack = PAD_SLACK.get(dev.type, PAD_SLACK["cpu"])
    lens, starts = seq_lens.tolist(), query_start_loc.tolist()
    items = _items(lens, starts, causal, window, num_heads, caps[1])
    table = block_table.tolist()

    fp8_path = fp8_query is not None
    fp8_cache = key_cache.dtype in FP8_STORAGE
    emu_query = (query if fp8_query is None else fp8_query).to(dev)
    element = emu_query.dtype if emu_query.dtype in (torch.bfloat16, torch.float16) else torch.float32
    ref_query = query.to(dev)
    k_cache, v_cache = key_cache.to(dev), value_cache.to(dev)
    if fp8_cache and k_cache.dtype == torch.uint8:
        k_cache, v_cache = k_cache.view(torch.float8_e4m3fn), v_cache.view(torch.float8_e4m3fn)
    slopes = None if alibi_slopes is None else alibi_slopes.to(dev, torch.float32).view(num_kv_heads, group)
    sink = None if sinks is None else sinks.to(dev, torch.float32).view(num_kv_heads, group)

    expected = torch.zeros(num_tokens, num_heads, head_size, dtype=torch.float64, device=dev) if reference else None
    lse = torch.full((num_tokens, num_heads), -math.inf, dtype=torch.float64, device=dev) if reference else None
    emulated = torch.zeros(num_tokens, num_heads, head_size, dtype=torch.float32, device=dev)
    score_scale = scale * (q_scale * k_scale if fp8_path else 1.0)
    p_offset = float(2**FP8_MAX_OFFSET) if fp8_path else 1.0

    for members in _groups(items, block_size, num_kv_heads * head_size, num_heads, caps, slack):
        r, max_q, width = len(members), max(it.num_q for it in members), _width(members, block_size)
        # The group's indices cross to the device in one transfer, cut into views there.
        lo = [it.first // block_size for it in members]
        ids = [(table[it.seq][b0 : b0 + width] + [0] * width)[:width] for it, b0 in zip(members, lo, strict=True)]
        q_at = [[it.pos0 + min(i, it.num_q - 1) for i in range(max_q)] for it in members]
        row_at = [[it.row0 + min(i, it.num_q - 1) for i in range(max_q)] for it in members]
        keep = [(i * max_q + j) for i, it in enumerate(members) for j in range(it.num_q)]
        kept = [it.row0 + j for it in members for j in range(it.num_q)]
        flat = list(itertools.chain(*ids, lo, [it.first for it in members], [it.end for it in members]))
        flat += itertools.chain(*q_at, *row_at, keep, kept)
        sizes = (r * width, r, r, r, r * max_q, r * max_q, len(keep), len(kept))
        uploaded = torch.tensor(flat, dtype=torch.long, device=dev)
        ids_t, lo_t, first_t, end_t, q_pos, row_ids, keep_t, rows = uploaded.split(sizes)
        k_raw = k_cache.index_select(0, ids_t).view(r, width * block_size, num_kv_heads, head_size)
        v_raw = v_cache.index_select(0, ids_t).view(r, width * block_size, num_kv_heads, head_size)
        k_pos = (lo_t * block_size)[:, None] + torch.arange(width * block_size, device=dev)
        k_valid = (k_pos >= first_t[:, None]) & (k_pos < end_t[:, None])
        q_pos = q_pos.view(r, max_q)
        visible = visibility(q_pos, k_pos, k_valid, causal, window)  # [r, t, n]
        stale = ~k_valid[:, :, None, None]
        distance = (q_pos[:, :, None] - k_pos[:, None, :]).abs() if slopes is not None else None

        if reference:
            assert expected is not None and lse is not None
            k64 = _dequantize(k_raw, k_scale, torch.float64)
            v64 = _dequantize(v_raw, v_scale, torch.float64).masked_fill_(stale, 0.0)
            q64 = ref_query[row_ids].to(torch.float64).view(r, max_q, num_kv_heads, group, head_size)
            s = torch.einsum("rthgd,rnhd->rhgtn", q64, k64).mul_(scale)
            if softcap > 0:
                s.div_(softcap).tanh_().mul_(softcap)
            if slopes is not None and distance is not None:
                s.sub_(slopes.to(torch.float64)[None, :, :, None, None] * distance[:, None, None])
            s.masked_fill_(~visible[:, None, None], -math.inf)
            m = s.amax(dim=-1)
            m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
            p = s.sub_(m[..., None]).exp_()
            l = p.sum(dim=-1)
            o = torch.einsum("rhgtn,rnhd->rthgd", p, v64)
            l_t = l.permute(0, 3, 1, 2)[..., None]  # [r, t, h, g, 1]
            o = torch.where(l_t > 0, o / l_t.clamp_min(1e-300), 0.0)
            part_lse = (m + torch.log(l)).permute(0, 3, 1, 2).reshape(r * max_q, num_heads)
            expected[rows] = o.reshape(r * max_q, num_heads, head_size)[keep_t]
            lse[rows] = part_lse[keep_t]

        # ---- the emulation (emulate_flash_attention's rounding, batched)
        if fp8_path:
            k32, v32 = k_raw.to(torch.float32), v_raw.to(torch.float32)
        elif fp8_cache and emulation.fp32_probabilities:
            k32, v32 = k_raw.to(torch.float32) * k_scale, v_raw.to(torch.float32) * v_scale
        elif fp8_cache:
            k32 = _round_to(k_raw.to(torch.float32) * k_scale, element)
            v32 = _round_to(v_raw.to(torch.float32) * v_scale, element)
        elif k_raw.dtype == element:  # already the operand dtype: exact in fp32
            k32, v32 = k_raw.to(torch.float32), v_raw.to(torch.float32)
        else:
            k32, v32 = _round_to(k_raw.to(torch.float32), element), _round_to(v_raw.to(torch.float32), element)
        v32 = v32.masked_fill_(stale, 0.0)
        q32 = emu_query[row_ids].to(torch.float32).view(r, max_q, num_kv_heads, group, head_size)
        s32 = torch.einsum("rthgd,rnhd->rhgtn", q32, k32)
        if softcap > 0:
            t = torch.tanh(s32 * (score_scale / softcap))
            s32 = softcap * (_round_to(t, _TANH_DTYPE) if emulation.fast_tanh else t)
        else:
            s32 = s32 * score_scale
        if slopes is not None and distance is not None:
            s32 = s32 - slopes[None, :, :, None, None] * distance[:, None, None].to(torch.float32)
        s32 = s32.masked_fill(~visible[:, None, None], -math.inf)
        m32 = s32.amax(dim=-1)  # [r, h, g, t]
        if sink is not None:
            m32 = torch.maximum(m32, sink[None, :, :, None])
        m32 = torch.where(torch.isinf(m32), torch.zeros_like(m32), m32)
        p32 = torch.exp(s32 - m32[..., None]) * p_offset
        row_sum = p32.sum(dim=-1)
        if sink is not None:
            row_sum = row_sum + torch.exp(sink[None, :, :, None] - m32) * p_offset
        if emulation.normalized_probabilities and not fp8_path:
            p32, row_sum = softmax_first(p32, row_sum)
        if fp8_path:
            p_op = p32.to(torch.float8_e4m3fn).to(torch.float32)
        else:
            p_op = p32 if emulation.fp32_probabilities else _round_to(p32, element)
        acc = torch.einsum("rhgtn,rnhd->rhgtd", p_op, v32)
        o32 = torch.where(row_sum[..., None] > 0, acc / row_sum.clamp_min(1e-38)[..., None], 0.0)
        if fp8_path:
            o32 = o32 * v_scale
        emulated[rows] = o32.permute(0, 3, 1, 2, 4).reshape(r * max_q, num_heads, head_size)[keep_t]

    baseline = round_output(emulated, out_dtype, emulation)
    if to_cpu:
        baseline = baseline.cpu()
    if not reference:
        return None, baseline
    assert expected is not None and lse is not None
    if sinks is not None:
        expected, _ = add_sinks(expected.cpu(), lse.cpu(), sinks.cpu().to(torch.float64), int(query_start_loc[-1]))
        return expected, baseline.cpu()
    return (expected.cpu() if to_cpu else expected), baseline


#: The devices replay runs on (``--device``).
DEVICES = ("cpu", "cuda")


def select_device(name: str | None = None) -> torch.device:
    """The device replay runs on: ``name`` (``cpu`` or ``cuda``), or by default a GPU when one is present.

    Raises:
        ValueError: ``name`` is not one of :data:`DEVICES`, or is ``cuda`` without a GPU.
    """
    if name is None:
        return torch.device("cuda" if gpu_present() else "cpu")
    if name not in DEVICES:
        raise ValueError(f"device {name!r}: use one of {', '.join(DEVICES)}")
    if name == "cuda" and not gpu_present():
        raise ValueError("device 'cuda': no GPU is present here (torch.cuda.device_count() is 0); use --device cpu")
    return torch.device(name)


def warm_up(device: torch.device | str) -> None:
    """Open ``device``'s CUDA context and run a tiny step through the pass there.

    Replay runs it on a thread beside its first records (:func:`reference_impl.workers.run_records`):
    the driver's and cuBLAS's start-up and the pass's kernels (CUDA loads each one's module on its
    first use) then load while the trace is read, not in its first records. The pass runs without
    :func:`step_outputs`' TF32 switch, which is process-wide and belongs to the records' thread.
    """
    torch.cuda.init()
    query = torch.ones(3, 2, 8, dtype=torch.bfloat16)
    cache = torch.ones(2, 16, 1, 8, dtype=torch.bfloat16)
    table, lens, starts = torch.tensor([[0, 1]]), torch.tensor([20]), torch.tensor([0, 3])
    _step_outputs(
        query,
        cache,
        cache,
        table,
        lens,
        starts,
        scale=0.5,
        causal=True,
        window=(-1, -1),
        softcap=0.0,
        alibi_slopes=None,
        sinks=None,
        k_scale=1.0,
        v_scale=1.0,
        fp8_query=None,
        q_scale=1.0,
        out_dtype=torch.bfloat16,
        emulation=FLASH,
        reference=True,
        dev=torch.device(device),
        to_cpu=False,
    )
    torch.cuda.synchronize(device)


def gpu_present() -> bool:
    """A CUDA GPU is present, asked through NVML where it can be: unlike ``torch.cuda.is_available()``,
    that leaves CUDA uninitialised, so forked replay workers can each open their own context."""
    return torch.cuda.device_count() > 0


def _dequantize(raw: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """K/V as values: fp8 e4m3 times its scale, other dtypes converted (exact)."""
    if raw.dtype == torch.float8_e4m3fn:
        return raw.to(dtype) * scale
    return raw.to(dtype)


def _round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded to ``dtype`` (to nearest even) and brought back to fp32."""
    return x if dtype == torch.float32 else x.to(dtype).to(torch.float32)


def step_kwargs(inputs: Any) -> dict[str, Any]:
    """:func:`step_outputs`'s keywords for a ``reference_impl.inputs.StepInputs``."""
    return {
        **inputs.kwargs,
        "fp8_query": inputs.fp8_query,
        "q_scale": inputs.q_scale,
        "out_dtype": inputs.out_dtype,
        "emulation": inputs.emulation,
    }
