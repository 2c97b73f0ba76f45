"""Replay's verdicts on every committed fixture, held to the last bit.

``tests/gold/replay-verdicts.json`` holds, per fixture with tensors, every replayed (step,
layer)'s max error, bar and verdict, and each head's, as the ``fast`` reference gives them
on the CPU with one torch thread (the decode chunking, hence the last bits of the fp64 sums,
depends on the thread count: ``reference_impl.fast``). A change to how replay works (one
pass per step, batched rows, the emulation shared) must leave every one of them unchanged.

Regenerate only for a change that means to move verdicts::

    python tests/test_replay_verdicts.py   # rewrites tests/gold/replay-verdicts.json
"""

from __future__ import annotations

import json
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
def test_verdicts_are_unchanged_to_the_last_bit(gold, name):
    got = verdicts(name)
    assert [(r["step"], r["layer"]) for r in got] == [(r["step"], r["layer"]) for r in gold[name]]
    for new, old in zip(got, gold[name], strict=True):
        assert new == old, f"{name} step {old['step']} {old['layer']}"


if __name__ == "__main__":
    GOLD.write_text(json.dumps({name: verdicts(name) for name in _with_tensors()}, indent=1) + "\n")
    print(f"wrote {GOLD}")
