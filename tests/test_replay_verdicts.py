"""Replay's verdicts on every committed fixture, held to the last bits.

``tests/gold/replay-verdicts.json`` holds, per fixture with tensors, every replayed (step,
layer)'s max error, bar and verdict, and each head's, as the ``fast`` reference gives them
on the CPU with one torch thread (the decode chunking, hence the last bits of the fp64 sums,
depends on the thread count: ``reference_impl.fast``). A change to how replay works (one
pass per step, batched rows, the emulation shared) must leave every one of them unchanged:
verdicts, notes and steps exactly, and every error and bar to :data:`RTOL`. On the machine
that wrote the gold the numbers are equal to the bit; a CPU of another vector width sums
torch's fp64 reductions in another order and moves their last few bits (measured: 3.3e-13 at
most on these fixtures, between the AMX Xeon that wrote it and an AVX2 EPYC).

Regenerate only for a change that means to move verdicts::

    python tests/test_replay_verdicts.py   # rewrites tests/gold/replay-verdicts.json
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reference_impl.replay import replay_trace
from tracer.format import Trace

FIXTURES = Path(__file__).resolve().parent / "fixtures"
GOLD = Path(__file__).resolve().parent / "gold" / "replay-verdicts.json"


def _with_tensors() -> list[str]:
    return sorted(p.name for p in FIXTURES.iterdir() if p.is_dir() and (p / "tensors").is_dir())


def verdicts(name: str) -> list[dict]:
    """Every replayed (step, layer) of fixture ``name``: errors, bars and verdicts, floats as ``float.hex``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        report = replay_trace(Trace.open(FIXTURES / name), kernel="fast")
    finally:
        torch.set_num_threads(threads)
    writes = {(w.step, w.layer): w.ok for w in report.write_path}
    return [
        {
            "step": r.step,
            "layer": r.layer,
            "ok": r.ok,
            "max_abs": float.hex(r.max_abs),
            "max_rel": float.hex(r.max_rel),
            "tol": float.hex(r.tol),
            "baseline_max_abs": float.hex(r.baseline_max_abs),
            "write_ok": writes.get((r.step, r.layer)),
            "note": r.note,
            "heads": [[h.ok, float.hex(h.max_abs), float.hex(h.tol)] for h in r.heads],
        }
        for r in report.steps
    ]


@pytest.fixture(scope="module")
def gold() -> dict[str, list[dict]]:
    return json.loads(GOLD.read_text())


def test_every_fixture_with_tensors_has_gold_verdicts(gold):
    assert sorted(gold) == _with_tensors()


@pytest.mark.parametrize("name", _with_tensors())
def test_verdicts_are_unchanged_to_the_last_bits(gold, name):
    got = verdicts(name)
    assert [(r["step"], r["layer"]) for r in got] == [(r["step"], r["layer"]) for r in gold[name]]
    for new, old in zip(got, gold[name], strict=True):
        where = f"{name} step {old['step']} {old['layer']}"
        assert _exact(new) == _exact(old), where
        for key, (a, b) in _numbers(new, old):
            assert math.isclose(a, b, rel_tol=RTOL, abs_tol=0.0), f"{where} {key}: {a!r} vs gold {b!r}"


#: How far an error or a bar may move from the gold, relatively: the order of fp64 sums only.
RTOL = 1e-11


def _exact(row: dict) -> dict:
    """A gold row without its numbers: the verdicts, notes and head count, compared exactly."""
    kept = {k: v for k, v in row.items() if k not in ("max_abs", "max_rel", "tol", "baseline_max_abs", "heads")}
    return {**kept, "heads_ok": [h[0] for h in row["heads"]]}


def _numbers(new: dict, old: dict) -> list[tuple[str, tuple[float, float]]]:
    """Each error and bar of a row, new beside gold, as floats."""
    pairs = [(k, (new[k], old[k])) for k in ("max_abs", "max_rel", "tol", "baseline_max_abs")]
    for h, (a, b) in enumerate(zip(new["heads"], old["heads"], strict=True)):
        pairs += [(f"head {h} max_abs", (a[1], b[1])), (f"head {h} tol", (a[2], b[2]))]
    return [(k, (float.fromhex(a), float.fromhex(b))) for k, (a, b) in pairs]


if __name__ == "__main__":
    GOLD.write_text(json.dumps({name: verdicts(name) for name in _with_tensors()}, indent=1) + "\n")
    print(f"wrote {GOLD}")
