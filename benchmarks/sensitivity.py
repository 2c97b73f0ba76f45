"""How sharp is replay's verdict? Plant bugs into real traces and count which are caught.

For every committed fixture with tensors (``tests/fixtures/*``: the H200 traces, and any
added later) each mutation below is planted, in memory, into a few of its captured
(step, layer) records, and the record is judged by the public replay API: attention
(:func:`reference_impl.replay.replay_record`), the write path
(:func:`reference_impl.replay.check_write_path`) and the metadata checks
(:func:`tracer.format.metadata.check_record`). A mutation is

caught
    when at least one check fails on it (the table says which);
undetectable
    when no check fails *and* the fp64 reference output is the same as without it (e.g. two
    full blocks of a decode row swapped: the keys are permuted, attention is unchanged), so
    no output-based check could see it: not counted as a miss;
MISSED
    otherwise: the output changed and no check noticed;
n/a
    where the mutation does not apply (no soft-cap, no window, not an fp8 cache).

The unmodified records are judged too: every failure there is a false failure. Targets per
layer: the record with the most query tokens (a prefill) and the last one (a decode)::

    python benchmarks/sensitivity.py                     # every fixture, every mutation
    python benchmarks/sensitivity.py tests/fixtures/h200-qwen2.5-7b-eager --mutations scale,kv_swap

Figures only: the exit code is 0 unless a fixture cannot be read.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reference_impl.emulation import emulation_of
from reference_impl.layouts import WRITERS
from reference_impl.replay import (
    check_write_path,
    read_cache,
    reference_outputs,
    replay_record,
    resolve_layout,
    step_inputs,
)
from tracer.format import SESSION, KVCacheSpec, StepRecord, Trace
from tracer.format.metadata import check_record
from tracer.format.requests import known_tokens
from tracer.format.rows import QUERY_ROWS

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"
#: fp64 outputs closer than this (relative to max |output|) count as unchanged: summation order only.
UNCHANGED_REL = 1e-12

Tensors = dict[str, torch.Tensor]
#: (record, tensors, spec, layout) -> the mutated triple, or None where it does not apply.
Mutation = Callable[[StepRecord, Tensors, KVCacheSpec, str], "tuple[StepRecord, Tensors, KVCacheSpec] | None"]


# --------------------------------------------------------------------------- mutations


def _longest_row(record: StepRecord) -> int:
    """The row with the most query tokens (ties: the longest sequence)."""
    return max(range(record.num_reqs), key=lambda r: (record.query_lens[r], record.seq_lens[r]))


def swap_blocks(record: StepRecord, tensors: Tensors, spec: KVCacheSpec, layout: str):
    """Two blocks of a row swapped in the block table.

    Two full blocks no other row shares when the row has them (in a decode row that only
    permutes keys: undetectable), else two full ones, else the first and the last.
    """
    bs = spec.block_size
    rows = [r for r in range(record.num_reqs) if -(-record.seq_lens[r] // bs) >= 2]
    if not rows:
        return None
    r = max(rows, key=lambda r: (record.query_lens[r], record.seq_lens[r]))
    used = -(-record.seq_lens[r] // bs)
    full = record.seq_lens[r] // bs
    private = [j for j in range(full) if record.block_table[r][j] not in record.shared_blocks]
    a, b = private[-2:] if len(private) >= 2 else ((0, 1) if full >= 2 else (0, used - 1))
    row = list(record.block_table[r])
    row[a], row[b] = row[b], row[a]
    table = tuple(tuple(row) if i == r else t for i, t in enumerate(record.block_table))
    return dataclasses.replace(record, block_table=table), tensors, spec


def kv_swap(record: StepRecord, tensors: Tensors, spec: KVCacheSpec, layout: str):
    """K and V swapped, in the cache and in the new key/value alike (the write path stays consistent)."""
    key, value = read_cache(tensors["kv_blocks"], layout, spec.head_size)
    out = dict(tensors, kv_blocks=WRITERS[layout](value, key))
    if "key" in tensors and "value" in tensors:
        out["key"], out["value"] = tensors["value"], tensors["key"]
    return record, out, spec


def seq_len_short(record: StepRecord, tensors: Tensors, spec: KVCacheSpec, layout: str):
    """One row's seq_len one short."""
    r = _longest_row(record)
    lens = tuple(s - 1 if i == r else s for i, s in enumerate(record.seq_lens))
    return dataclasses.replace(record, seq_lens=lens), tensors, spec


def slot_off_by_one(record: StepRecord, tensors: Tensors, spec: KVCacheSpec, layout: str):
    """The last new token's slot one too high."""
    t = record.num_actual_tokens - 1
    slots = tuple(s + 1 if i == t else s for i, s in enumerate(record.slot_mapping))
    return dataclasses.replace(record, slot_mapping=slots), tensors, spec


def scale(record: StepRecord, tensors: Tensors, spec: KVCacheSpec, layout: str):
    """The softmax scale x 1.02."""
    return dataclasses.replace(record, scale=record.scale * 1.02), tensors, spec


def softcap(record: StepRecord, tensors: Tensors, spec: KVCacheSpec, layout: str):
    """The logits soft-cap x 1.1, where one is used."""
    if not record.logits_soft_cap:
        return None
    return dataclasses.replace(record, logits_soft_cap=record.logits_soft_cap * 1.1), tensors, spec


def window(record: StepRecord, tensors: Tensors, spec: KVCacheSpec, layout: str):
    """The sliding window's left edge one token narrower, where a window is used."""
    if record.sliding_window is None or record.sliding_window[0] < 1:
        return None
    left, right = record.sliding_window
    return dataclasses.replace(record, sliding_window=(left - 1, right)), tensors, spec


def query_zero(record: StepRecord, tensors: Tensors, spec: KVCacheSpec, layout: str):
    """One query row (the last token of the longest row, every head) zeroed.

    With format 4's ``query_rows`` the query holds the kept rows only: the last kept row of the
    longest row that has one, else the last kept row.
    """
    r = _longest_row(record)
    t = record.query_start_loc[r + 1] - 1
    if QUERY_ROWS in tensors:  # row i of the query is token kept[i] of the step
        kept = tensors[QUERY_ROWS].tolist()
        mine = [i for i, k in enumerate(kept) if record.query_start_loc[r] <= k <= t]
        t = mine[-1] if mine else len(kept) - 1
    query = tensors["query"].clone()
    query[t] = 0
    return record, dict(tensors, query=query), spec


def fp8_scale(record: StepRecord, tensors: Tensors, spec: KVCacheSpec, layout: str):
    """The k scale x 1.1, on an fp8 cache."""
    if not spec.cache_dtype.startswith("fp8"):
        return None
    k = (spec.k_scale if record.k_scale is None else record.k_scale) * 1.1
    return dataclasses.replace(record, k_scale=k), tensors, dataclasses.replace(spec, k_scale=k)


MUTATIONS: dict[str, Mutation] = {
    "swap_blocks": swap_blocks,
    "kv_swap": kv_swap,
    "seq_len_short": seq_len_short,
    "slot_off_by_one": slot_off_by_one,
    "scale": scale,
    "softcap": softcap,
    "window": window,
    "query_zero": query_zero,
    "fp8_scale": fp8_scale,
}


# --------------------------------------------------------------------------- judging


@dataclasses.dataclass(frozen=True)
class Judged:
    """What the checks said of one record."""

    failed: tuple[str, ...]  #: checks that failed: ``attention``, ``write``, ``metadata``
    max_abs: float
    tol: float


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One mutation on one fixture, over its targets."""

    fixture: str
    mutation: str
    status: str  #: ``caught`` / ``undetectable`` / ``MISSED`` / ``n/a``
    by: tuple[str, ...]  #: checks that caught it (on any target)
    caught: int  #: targets caught
    undetectable: int  #: targets where the fp64 output did not change and nothing failed
    applicable: int  #: targets the mutation applied to
    worst_ratio: float  #: max over targets of attention's max abs / tol (how far past the bar)
    max_abs: float
    tol: float
    details: tuple[str, ...] = ()  #: per target: step, layer, what failed, error vs tolerance


class _Fixture:
    """A trace with what judging its records needs, loaded once."""

    def __init__(self, path: Path):
        self.trace = Trace.open(path)
        self.name = path.name
        spec = self.trace.run.kv_cache
        if spec is None:
            raise SystemExit(f"{path}: the manifest has no KV-cache spec")
        self.spec: KVCacheSpec = spec
        self.with_tensors = [r for r in self.trace.records if r.tensors is not None]
        self.layout = resolve_layout(self.trace, self.with_tensors) if self.with_tensors else spec.layout
        self.tokens = known_tokens(self.trace.read_json(SESSION))
        self.fa = self.trace.run.flash_attn_version
        self.emulation = emulation_of(self.trace.run)  # the bar's baseline: how the trace's kernel rounds

    def judge(self, record: StepRecord, tensors: Mapping[str, torch.Tensor], spec: KVCacheSpec) -> Judged:
        result, _ = replay_record(
            record,
            tensors,
            spec,
            self.layout,
            kernel="fast",
            check_legacy=False,
            flash_attn_version=self.fa,
            emulation=self.emulation,
        )
        write = check_write_path(record, tensors, spec, self.layout)
        meta = check_record(record, spec, self.trace.run, self.tokens)
        failed = (
            *(("attention",) if not result.ok else ()),
            *(("write",) if write is not None and not write.ok else ()),
            *(("metadata",) if not all(c.ok for c in meta) else ()),
        )
        return Judged(failed, result.max_abs, result.tol)

    def reference(self, record: StepRecord, tensors: Mapping[str, torch.Tensor], spec: KVCacheSpec) -> torch.Tensor:
        """The fp64 reference output ``[T, H, D]`` of the record as given."""
        inputs = step_inputs(record, tensors, spec, self.layout, flash_attn_version=self.fa, emulation=self.emulation)
        return reference_outputs(inputs, "fast")[0][: inputs.num_tokens]

    def targets(self, per_layer: int) -> list[StepRecord]:
        """Per layer: the request record with the most query tokens, then the last one."""
        out: list[StepRecord] = []
        for layer in dict.fromkeys(r.layer for r in self.with_tensors):
            records = [r for r in self.with_tensors if r.layer == layer and r.kind == "request"]
            if not records:
                continue
            picks = [max(records, key=lambda r: r.num_actual_tokens), records[-1]]
            out += list(dict.fromkeys(picks))[:per_layer]
        return out


def _changed(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return True
    scale = float(a.abs().max()) if a.numel() else 0.0
    return bool((a - b).abs().max() > UNCHANGED_REL * max(scale, 1e-300)) if a.numel() else False


def false_failures(fx: _Fixture) -> tuple[int, int, list[str]]:
    """``(failed, judged, what)`` over every record of the unmodified trace (metadata-only records too)."""
    bad: list[str] = []
    for r in fx.trace.records:
        if r.tensors is not None:
            judged = fx.judge(r, fx.trace.tensors(r), fx.spec)
            failed = judged.failed
        else:
            failed = ("metadata",) if not all(c.ok for c in check_record(r, fx.spec, fx.trace.run, fx.tokens)) else ()
        if failed:
            bad.append(f"step {r.step} {r.layer}: {', '.join(failed)}")
    return len(bad), len(fx.trace.records), bad


def run_mutation(fx: _Fixture, name: str, targets: Sequence[StepRecord]) -> Outcome:
    """Plant ``name`` into each target of ``fx`` and judge it."""
    mutate = MUTATIONS[name]
    by: set[str] = set()
    caught = undetectable = applicable = 0
    worst, worst_abs, worst_tol = -1.0, float("nan"), float("nan")
    details: list[str] = []
    for record in targets:
        tensors = fx.trace.tensors(record)
        planted = mutate(record, dict(tensors), fx.spec, fx.layout)
        if planted is None:
            continue
        applicable += 1
        m_record, m_tensors, m_spec = planted
        judged = fx.judge(m_record, m_tensors, m_spec)
        ratio = judged.max_abs / judged.tol if judged.tol > 0 else float("inf")
        if ratio > worst:
            worst, worst_abs, worst_tol = ratio, judged.max_abs, judged.tol
        verdict = ", ".join(judged.failed) or "nothing failed"
        if judged.failed:
            caught += 1
            by.update(judged.failed)
        elif not _changed(fx.reference(record, tensors, fx.spec), fx.reference(m_record, m_tensors, m_spec)):
            undetectable += 1
            verdict += " (fp64 output unchanged: undetectable)"
        details.append(
            f"step {record.step} {record.layer} ({record.num_actual_tokens} tokens): {verdict}; "
            f"max abs {_fmt(judged.max_abs)} vs tol {_fmt(judged.tol)}"
        )
    if not applicable:
        status = "n/a"
    elif caught + undetectable < applicable:
        status = "MISSED"
    elif caught:
        status = "caught"
    else:
        status = "undetectable"
    order = ("attention", "write", "metadata")
    return Outcome(
        fx.name,
        name,
        status,
        tuple(c for c in order if c in by),
        caught,
        undetectable,
        applicable,
        worst,
        worst_abs,
        worst_tol,
        tuple(details),
    )


def fixture_dirs(root: Path = FIXTURES) -> list[Path]:
    """Every trace directory under ``root`` (mutations go into those with tensors; all count false failures)."""
    return [p for p in sorted(root.iterdir()) if (p / "manifest.json").is_file()]


def _fmt(x: float) -> str:
    return f"{x:.3g}"


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table: per fixture and mutation, caught or not, by which check, error vs tolerance."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("fixtures", nargs="*", type=Path, help="trace directories (default: tests/fixtures/*)")
    parser.add_argument("--mutations", default=",".join(MUTATIONS), help="comma-separated, of: " + ", ".join(MUTATIONS))
    parser.add_argument("--targets", type=int, default=2, help="records per layer to plant each mutation into")
    parser.add_argument("-v", "--verbose", action="store_true", help="also print each target's result")
    args = parser.parse_args(argv)
    names = [n for n in args.mutations.split(",") if n]
    unknown = sorted(set(names) - MUTATIONS.keys())
    if unknown:
        parser.error(f"unknown mutation(s) {', '.join(unknown)}")
    torch.set_num_threads(min(2, torch.get_num_threads()))
    paths = args.fixtures or fixture_dirs()
    started = time.perf_counter()
    print(
        f"# replay sensitivity, {date.today().isoformat()}, {platform.machine()} {platform.processor() or ''}".rstrip()
    )
    print("| fixture | mutation | verdict | caught by | targets caught | max abs vs tol |")
    print("| --- | --- | --- | --- | --- | --- |")
    summary = []
    for path in paths:
        fx = _Fixture(path)
        targets = fx.targets(args.targets)
        for name in names if targets else ():
            o = run_mutation(fx, name, targets)
            counts = f"{o.caught}/{o.applicable}" + (f" ({o.undetectable} undetectable)" if o.undetectable else "")
            err = "–" if o.status == "n/a" else f"{_fmt(o.max_abs)} vs {_fmt(o.tol)}"
            by = ", ".join(o.by) or "–"
            print(f"| {o.fixture} | {o.mutation} | {o.status} | {by} | {counts if o.applicable else '–'} | {err} |")
            summary.append(o)
            for line in o.details if args.verbose else ():
                print(f"|   | | {line} | | | |")
        failed, judged, what = false_failures(fx)
        summary_line = f"| {fx.name} | (unmodified) | {failed} false failure(s) of {judged} record(s) | | | |"
        print(summary_line)
        for line in what[:5]:
            print(f"|   | | {line} | | | |")
    missed = [o for o in summary if o.status == "MISSED"]
    print(
        f"\n{len(summary)} (fixture, mutation) pairs: {sum(o.status == 'caught' for o in summary)} caught, "
        f"{sum(o.status == 'undetectable' for o in summary)} undetectable, {len(missed)} missed, "
        f"{sum(o.status == 'n/a' for o in summary)} n/a; {time.perf_counter() - started:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
