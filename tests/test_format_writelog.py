"""The KV write log (format 3): blocks rebuilt from the writes, bit for bit, in every stored layout.

A small paged cache is simulated in torch for two layers: canonical K/V of random bits (NaN
payloads included, so only a bit-level comparison passes), packed by the reference writers
(independent of ``token_elements``, which the reader uses). A schedule shares a prefix block,
frees a block and reuses it, skips a step and starts a second epoch. The records are written
as the tracer writes them: the slots each step wrote, the blocks the run had not seen, and on
check steps every block read.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from reference_impl.layouts import WRITERS
from tests.factories import LAYER, kv_spec, run_info, scheduled_step
from tracer.format import TENSORS_DIR, StepRecord, Trace, TraceError, TraceWriter
from tracer.format.writelog import WriteLogReader, verify_write_log

LAYERS = (LAYER, "model.layers.1.self_attn.attn")
NB, BS, HKV, D, H = 12, 16, 2, 16, 4  # cpu_amx tiles by 16: block_size and head_size multiples of 16
LAYOUTS = ("flash_nhd", "cpu", "cpu_amx")
DTYPES = {"bfloat16": torch.bfloat16, "uint8": torch.uint8}  # uint8: fp8 as vLLM stores it
INTS = {1: torch.uint8, 2: torch.int16}


@dataclasses.dataclass(frozen=True)
class Step:
    """One engine step: per request (block-table row, seq_len, query_len)."""

    step: int
    epoch: int | None  #: None: the tracer did not log this step (the cache is still written)
    rows: tuple[tuple[tuple[int, ...], int, int], ...]
    check: bool = False  #: a check step: kv_blocks stored too


SCHEDULE = (
    Step(0, 0, (((3, 5), 20, 20),)),  # A: prefill
    Step(1, 0, (((3, 5), 21, 1), ((3, 7), 18, 2))),  # A decodes; B hits A's prefix block 3
    Step(2, 0, (((3, 5), 22, 1), ((3, 7), 19, 1)), check=True),
    Step(3, 0, (((3, 7), 20, 1), ((5,), 4, 4))),  # A done: block 5 freed, reused by C (no snapshot)
    Step(4, 0, (((3, 7), 21, 1), ((5,), 5, 1)), check=True),
    Step(5, None, (((3, 7), 22, 1), ((5,), 6, 1))),  # not logged: the log breaks, a new epoch follows
    Step(6, 1, (((3, 7), 23, 1), ((5, 9), 20, 14)), check=True),  # C's chunk grows into block 9
    Step(7, 1, (((3, 7), 24, 1), ((5, 9), 21, 1)), check=True),
)
CHECKS = [(s.step, layer) for s in SCHEDULE if s.check for layer in LAYERS]


def _random_bits(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    size = torch.empty(0, dtype=dtype).element_size()
    ints = INTS[size]
    info = torch.iinfo(ints)
    return torch.randint(info.min, info.max + 1, shape, generator=gen, dtype=ints).view(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` as integers of its element size: equal means equal bit for bit."""
    return t.contiguous().view(INTS[t.element_size()])


class SimCache:
    """One layer's paged cache: canonical K/V ``[NB, BS, HKV, D]``, packed into ``layout`` on demand."""

    def __init__(self, layout: str, dtype: torch.dtype, seed: int) -> None:
        self.layout, self.dtype = layout, dtype
        self.gen = torch.Generator().manual_seed(seed)
        self.key = _random_bits(self.gen, (NB, BS, HKV, D), dtype)  # stale garbage everywhere to start
        self.value = _random_bits(self.gen, (NB, BS, HKV, D), dtype)

    def write(self, slots: list[int]) -> torch.Tensor:
        """New random K/V at ``slots``; return them as ``kv_written`` ``[t, 2, HKV, D]``."""
        rows = []
        for slot in slots:
            b, t = divmod(slot, BS)
            self.key[b, t] = _random_bits(self.gen, (HKV, D), self.dtype)
            self.value[b, t] = _random_bits(self.gen, (HKV, D), self.dtype)
            rows.append(torch.stack([self.key[b, t], self.value[b, t]]))
        return torch.stack(rows) if rows else torch.empty(0, 2, HKV, D, dtype=self.dtype)

    def packed(self) -> torch.Tensor:
        """The layer's ``kv_cache`` ``[NB, HKV, BS, 2*D]`` with the backend's strides."""
        kv_cache = WRITERS[self.layout](self.key, self.value)
        assert isinstance(kv_cache, torch.Tensor)  # stored layouts: one tensor
        return kv_cache


def build(
    path: Path, layout: str, dtype_name: str, *, drop: tuple[int, int] | None = None
) -> dict[tuple[int, str], tuple[list[int], torch.Tensor]]:
    """Write the schedule as the tracer would; return the true ``(ids, blocks)`` per (step, layer).

    ``drop=(step, block)``: the tracer forgets that block's snapshot at that step (a bug).
    """
    dtype = DTYPES[dtype_name]
    caches = {layer: SimCache(layout, dtype, seed=i) for i, layer in enumerate(LAYERS)}
    packed = caches[LAYER].packed()
    spec = kv_spec(
        layer_names=LAYERS, num_blocks=NB, block_size=BS, num_kv_heads=HKV, head_size=D, dtype=dtype_name,
        cache_dtype="auto" if dtype_name == "bfloat16" else "fp8_e4m3", element_size=packed.element_size(),
        shape=tuple(packed.shape), stride=tuple(packed.stride()), layout=layout,
        backend_kv_cache_shape=tuple(packed.shape),
    )  # fmt: skip
    gen = torch.Generator().manual_seed(99)
    seen: dict[str, set[int]] = {layer: set() for layer in LAYERS}
    epochs: dict[str, int | None] = dict.fromkeys(LAYERS)
    truth = {}
    with TraceWriter(path) as w:
        w.write_manifest(run_info(kv_cache=spec))
        for s in SCHEDULE:
            table, seq_lens, query_lens = zip(*s.rows, strict=True)
            for layer in LAYERS:
                rec = scheduled_step(
                    s.step, query_lens, seq_lens, table, block_size=BS, layer=layer, num_heads=H,
                    num_kv_heads=HKV, head_size=D, kv_log_epoch=s.epoch, cudagraph="piecewise",
                )  # fmt: skip
                # Padded to a captured graph size: the padding's slots are -1, never written.
                t = rec.num_actual_tokens
                rec = dataclasses.replace(rec, slot_mapping=(*rec.slot_mapping, -1, -1), padded_tokens=t + 2)
                slots = [slot for slot in rec.slot_mapping if slot >= 0]
                cache = caches[layer]
                written = cache.write(slots)
                if s.epoch is None:
                    w.append(rec)  # a record without tensors: the tracer's log breaks here
                    continue
                if epochs[layer] != s.epoch:
                    epochs[layer], seen[layer] = s.epoch, set()
                ids = sorted({b for row in table for b in row})
                new = [b for b in ids if b not in seen[layer] and (s.step, b) != drop]
                seen[layer].update(new)
                kv_cache = cache.packed()
                truth[(s.step, layer)] = (ids, kv_cache[ids].contiguous())
                tensors = {
                    "query": torch.randn(t, H, D, generator=gen).to(torch.bfloat16),
                    "output": torch.randn(t, H, D, generator=gen).to(torch.bfloat16),
                    "key": torch.randn(t, HKV, D, generator=gen).to(torch.bfloat16),
                    "value": torch.randn(t, HKV, D, generator=gen).to(torch.bfloat16),
                    "kv_slots": torch.tensor(slots, dtype=torch.int64),
                    "kv_written": written,
                    "kv_new_block_ids": torch.tensor(new, dtype=torch.int32),
                    "kv_new_blocks": kv_cache[new].contiguous(),
                }
                if s.check:
                    tensors["kv_blocks"] = kv_cache[ids].contiguous()
                    tensors["kv_block_ids"] = torch.tensor(ids, dtype=torch.int32)
                w.append(rec, tensors)
    return truth


CASES = [pytest.param((layout, dtype), id=f"{layout}-{dtype}") for layout in LAYOUTS for dtype in DTYPES]


@pytest.fixture(params=CASES)
def logged(request, tmp_path):
    """``(trace path, truth)`` for one layout and dtype."""
    layout, dtype = request.param
    path = tmp_path / "t"
    return path, build(path, layout, dtype)


def _logged_records(trace: Trace) -> list[StepRecord]:
    return [r for r in trace.records if r.kv_log_epoch is not None]


def _assert_true_blocks(ids: torch.Tensor, blocks: torch.Tensor, truth: tuple[list[int], torch.Tensor]) -> None:
    want_ids, want_blocks = truth
    assert ids.dtype == torch.int32 and ids.tolist() == want_ids
    assert blocks.dtype == want_blocks.dtype and blocks.shape == want_blocks.shape
    assert torch.equal(bits(blocks), bits(want_blocks))


def test_tensors_rebuild_every_step_bit_for_bit(logged):
    path, truth = logged
    trace = Trace.open(path)
    assert len(trace.records) == 16 and len(_logged_records(trace)) == len(truth) == 14
    rebuilt_only = 0
    for rec in _logged_records(trace):
        tensors = trace.tensors(rec)
        _assert_true_blocks(tensors["kv_block_ids"], tensors["kv_blocks"], truth[(rec.step, rec.layer)])
        _assert_true_blocks(*trace.rebuilt_kv(rec), truth[(rec.step, rec.layer)])
        rebuilt_only += "kv_blocks" not in rec.tensor_names
    assert rebuilt_only == 6  # steps 0, 1, 3 of both layers have no stored blocks: only the log serves them


def test_reading_in_order_continues_the_run(logged, monkeypatch):
    """In order, a record's own tensors suffice; only a check step (served from its stored blocks) is read later."""
    path, _ = logged
    trace = Trace.open(path)
    loads = []
    real_load = WriteLogReader.load

    def load(self, rec, names):
        loads.append((rec.step, rec.layer))
        return real_load(self, rec, names)

    monkeypatch.setattr(WriteLogReader, "load", load)
    for rec in _logged_records(trace):
        trace.tensors(rec)
    assert loads == [(2, LAYER), (2, LAYERS[1])]  # step 3 continues past check step 2, once per layer
    loads.clear()
    trace.tensors(trace.records[0])  # back to the start of layer 0's run: replayed from there
    trace.rebuilt_kv(trace.records[4])  # step 2 of layer 0: continues, reading steps 1 and 2
    assert loads == [(1, LAYER), (2, LAYER)]


def test_check_steps_verify(logged):
    path, _ = logged
    results = verify_write_log(Trace.open(path))
    assert [(r.step, r.layer) for r in results] == CHECKS
    assert all(r.ok and r.block is None and r.detail == "" for r in results), [r.detail for r in results]
    # Epoch 0 snapshots blocks 3 and 5 at step 0 and 7 at step 1: every token is known.
    assert [(r.blocks, r.tokens) for r in results[:2]] == [(3, 3 * BS), (3, 3 * BS)]


def test_a_flipped_byte_in_an_earlier_write_is_named(logged):
    path, _ = logged
    trace = Trace.open(path)
    step1 = next(r for r in trace.records if r.step == 1 and r.layer == LAYER)
    file = path / TENSORS_DIR / step1.tensors
    tensors = load_file(str(file))
    slot = 7 * BS + 0  # B's first token: block 7, token 0
    j = tensors["kv_slots"].tolist().index(slot)
    element = 1 * HKV * D + 1 * D + 3  # V, head 1, dim 3
    raw = tensors["kv_written"][j].contiguous().view(torch.uint8).reshape(-1).clone()
    raw[element * tensors["kv_written"].element_size()] ^= 0x10
    tensors["kv_written"][j] = raw.view(tensors["kv_written"].dtype).reshape(2, HKV, D)
    save_file(tensors, str(file))

    results = {(r.step, r.layer): r for r in verify_write_log(Trace.open(path))}
    for step in (2, 4):  # every check of layer 0's epoch 0 reads block 7
        bad = results[(step, LAYER)]
        assert not bad.ok and (bad.block, bad.token) == (7, 0)
        assert bad.detail.startswith("block 7 token 0: V head 1 dim 3 is 0x") and "\n" not in bad.detail
    assert [key for key, r in results.items() if not r.ok] == [(2, LAYER), (4, LAYER)]  # epoch 1 snapshots again


@pytest.mark.parametrize(
    "drop, message",
    [
        ((6, 3), r"step 6 layer '.*layers\.0.*': block 3 \(request row 0\) is not in the write log: no snapshot"),
        ((6, 7), r"step 6 layer '.*layers\.0.*': block 7 token 0 \(request row 0\) is not in the write log"),
    ],
    ids=["block-never-seen", "block-partly-written"],
)
def test_a_missing_snapshot_is_a_one_line_error(tmp_path, drop, message):
    # Block 3 is only read in epoch 1; block 7 gets one write at token 6, tokens 0..5 are unknown.
    build(tmp_path / "t", "flash_nhd", "bfloat16", drop=drop)
    trace = Trace.open(tmp_path / "t")
    rec = next(r for r in trace.records if r.step == 6 and r.layer == LAYER)
    with pytest.raises(TraceError, match=message) as info:
        trace.rebuilt_kv(rec)  # a check step: trace.tensors would serve its stored blocks
    assert "\n" not in str(info.value) and "kv_log_epoch 1, which starts at step 6" in str(info.value)
    # The tracer snapshots the block at step 7 (it had not seen it): from there the run is whole again.
    results = verify_write_log(trace)
    assert [(r.step, r.layer) for r in results if not r.ok] == [(6, LAYER), (6, LAYERS[1])]  # both forgot it
    assert results[4].detail == str(info.value) and results[4].tokens == 0


def test_a_block_outside_the_pool_is_not_in_the_log(logged):
    """A record changed in memory (a planted bug) may name a block the cache cannot hold."""
    path, _ = logged
    trace = Trace.open(path)
    rec = next(r for r in trace.records if r.step == 3 and r.layer == LAYER)
    bad = dataclasses.replace(rec, block_table=(rec.block_table[0], (10**6,)))
    with pytest.raises(TraceError, match=r"step 3 .*: block 1000000 \(request row 1\) is not in the write log"):
        trace.tensors(bad)


@pytest.mark.parametrize("order", ["reversed", "shuffled"])
def test_reading_out_of_order_gives_the_same_blocks(logged, order):
    path, truth = logged
    trace = Trace.open(path)
    records = _logged_records(trace)
    records = records[::-1] if order == "reversed" else random.Random(0).sample(records, len(records))
    for rec in records:
        _assert_true_blocks(*trace.rebuilt_kv(rec), truth[(rec.step, rec.layer)])
        tensors = trace.tensors(rec)
        _assert_true_blocks(tensors["kv_block_ids"], tensors["kv_blocks"], truth[(rec.step, rec.layer)])


def test_v2_records_read_unchanged(tmp_path):
    spec = kv_spec(num_blocks=NB, block_size=BS, num_kv_heads=HKV, head_size=D, shape=(NB, HKV, BS, 2 * D))
    blocks = torch.randn(2, HKV, BS, 2 * D).to(torch.bfloat16)
    rec = scheduled_step(1, [1], [17], [[3, 5]], block_size=BS, num_heads=H, num_kv_heads=HKV, head_size=D)
    with TraceWriter(tmp_path / "t") as w:
        w.write_manifest(run_info(format_version=2, kv_cache=spec))
        w.append(rec, {
            "query": torch.zeros(1, H, D), "output": torch.zeros(1, H, D),
            "kv_blocks": blocks, "kv_block_ids": torch.tensor([3, 5], dtype=torch.int32),
        })  # fmt: skip
    trace = Trace.open(tmp_path / "t")
    (stored,) = trace.records
    assert stored.kv_log_epoch is None
    tensors = trace.tensors(stored)
    assert sorted(tensors) == ["kv_block_ids", "kv_blocks", "output", "query"]
    assert torch.equal(bits(tensors["kv_blocks"]), bits(blocks)) and tensors["kv_block_ids"].tolist() == [3, 5]
    with pytest.raises(TraceError, match=r"step 1 layer .*: not a write-log record \(kv_log_epoch is null\)"):
        trace.rebuilt_kv(stored)
    assert verify_write_log(trace) == []


def _one_record(path: Path, **changes: torch.Tensor | None) -> Trace:
    """A one-record write-log trace (decode of token 16 into block 5), its tensors changed (None: left out)."""
    spec = kv_spec(num_blocks=NB, block_size=BS, num_kv_heads=HKV, head_size=D, shape=(NB, HKV, BS, 2 * D))
    rec = scheduled_step(
        1, [1], [17], [[3, 5]], block_size=BS, num_heads=H, num_kv_heads=HKV, head_size=D, kv_log_epoch=0
    )
    tensors: dict[str, torch.Tensor | None] = {
        "query": torch.zeros(1, H, D),
        "output": torch.zeros(1, H, D),
        "kv_slots": torch.tensor([5 * BS], dtype=torch.int64),
        "kv_written": torch.zeros(1, 2, HKV, D, dtype=torch.bfloat16),
        "kv_new_block_ids": torch.tensor([3, 5], dtype=torch.int32),
        "kv_new_blocks": torch.zeros(2, HKV, BS, 2 * D, dtype=torch.bfloat16),
    }
    tensors.update(changes)
    with TraceWriter(path) as w:
        w.write_manifest(run_info(kv_cache=spec))
        w.append(rec, {k: v for k, v in tensors.items() if v is not None})
    return Trace.open(path)


def test_a_well_formed_record_reads(tmp_path):
    trace = _one_record(tmp_path / "t")
    ids, blocks = trace.rebuilt_kv(trace.records[0])
    assert ids.tolist() == [3, 5] and blocks.shape == (2, HKV, BS, 2 * D) and not blocks.any()


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"kv_slots": None}, r"a write-log record \(kv_log_epoch 0\) without tensors kv_slots$"),
        ({"kv_new_blocks": None, "kv_new_block_ids": None}, "without tensors kv_new_block_ids, kv_new_blocks$"),
        ({"kv_slots": torch.tensor([80.0])}, r"tensor kv_slots has shape \[1\] torch.float32, expected 1-D integers"),
        ({"kv_slots": torch.tensor([NB * BS])}, rf"tensor kv_slots names slots outside 0\.\.{NB * BS - 1}"),
        ({"kv_slots": torch.tensor([NB * BS], dtype=torch.uint64)}, r"tensor kv_slots names slots outside"),
        ({"kv_slots": torch.tensor([80, 81]), "kv_written": torch.zeros(2, 2, HKV, D).bfloat16()},
         r"tensor kv_slots has 2 slots, more than slot_mapping's 1"),
        ({"kv_written": torch.zeros(1, HKV, 2 * D).bfloat16()},
         r"tensor kv_written has shape \[1, 2, 32\], expected \[1, 2, 2, 16\] \(len\(kv_slots\), K\|V"),
        ({"kv_written": torch.zeros(1, 2, HKV, D)}, "tensor kv_written is float32, the KV cache is bfloat16"),
        ({"kv_new_block_ids": torch.tensor([5, 3], dtype=torch.int32)},
         "tensor kv_new_block_ids is not strictly increasing"),
        ({"kv_new_block_ids": torch.tensor([3, NB], dtype=torch.int32)},
         rf"tensor kv_new_block_ids names blocks outside 0\.\.{NB - 1}"),
        ({"kv_new_blocks": torch.zeros(1, HKV, BS, 2 * D).bfloat16()}, "kv_new_blocks has 1 blocks for 2 ids"),
        ({"kv_new_blocks": torch.zeros(2, HKV, BS, D).bfloat16()},
         r"tensor kv_new_blocks has shape \[2, 2, 16, 16\], expected \[n, 2, 16, 32\]"),
        ({"kv_new_blocks": torch.zeros(2, HKV, BS, 2 * D, dtype=torch.uint8)},
         "tensor kv_new_blocks is uint8, the KV cache is bfloat16"),
    ],
    ids=["no-slots", "no-new-blocks", "float-slots", "slot-outside", "uint64-slots", "too-many-slots", "written-shape",
         "written-dtype", "ids-order", "ids-outside", "blocks-count", "blocks-shape", "blocks-dtype"],
)  # fmt: skip
def test_bad_write_log_tensors_are_one_line_errors(tmp_path, changes, message):
    trace = _one_record(tmp_path / "t", **changes)
    for read in (trace.tensors, trace.rebuilt_kv):
        with pytest.raises(TraceError, match=message) as info:
            read(trace.records[0])
        assert str(info.value).startswith("step 1 layer ") and "\n" not in str(info.value)
