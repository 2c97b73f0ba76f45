"""``benchmarks/sensitivity.py`` on one fixture: planted bugs are caught (guards the benchmark)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.conftest import fixture_path

ROOT = Path(__file__).resolve().parents[1]
EAGER = fixture_path("h200-qwen2.5-7b-eager")


def _sensitivity():
    spec = importlib.util.spec_from_file_location("sensitivity", ROOT / "benchmarks" / "sensitivity.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["sensitivity"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_planted_bugs_are_caught_by_the_check_that_should_see_them():
    s = _sensitivity()
    fx = s._Fixture(EAGER)
    targets = fx.targets(2)
    assert [(r.step, r.num_actual_tokens) for r in targets] == [(4, 111), (9, 4)]  # a prefill and a decode
    kv = s.run_mutation(fx, "kv_swap", targets)
    assert (kv.status, kv.caught, kv.by) == ("caught", 2, ("attention",))
    slot = s.run_mutation(fx, "slot_off_by_one", targets)
    assert (slot.status, slot.caught, slot.by) == ("caught", 2, ("write", "metadata"))
    zero = s.run_mutation(fx, "query_zero", targets)
    assert zero.status == "caught" and zero.worst_ratio > 10
    assert s.run_mutation(fx, "softcap", targets).status == "n/a"  # Qwen2.5 has no soft-cap


def test_unmodified_fixture_has_no_false_failures():
    s = _sensitivity()
    failed, judged, what = s.false_failures(s._Fixture(EAGER))
    assert (failed, judged) == (0, 8), what


def test_a_zeroed_query_row_is_planted_among_the_kept_rows_of_a_query_rows_trace():
    # format 4 (``--query-rows 8``): the query holds the kept rows only, not the step's every token
    s = _sensitivity()
    fx = s._Fixture(fixture_path("h200-qwen2.5-7b-default-rows"))
    targets = fx.targets(2)
    assert max(r.num_actual_tokens for r in targets) > 8  # a prefill: more tokens than rows kept
    zero = s.run_mutation(fx, "query_zero", targets)
    assert zero.status == "caught" and zero.caught == len(targets) and zero.by == ("attention",)


BACKEND_TRACES = sorted(p.name for p in EAGER.parent.iterdir() if p.name.startswith("h100-qwen2.5-7b-"))


def test_every_backend_trace_is_committed():
    assert {n.removeprefix("h100-qwen2.5-7b-") for n in BACKEND_TRACES} >= {
        "triton-default",
        "triton-eager",
        "flex-eager",
        "flashinfer-eager",
        "hnd-eager",
    }


@pytest.mark.parametrize("name", BACKEND_TRACES)
def test_a_scale_of_1_02_is_caught_on_every_backend_trace(name):
    s = _sensitivity()
    fx = s._Fixture(fixture_path(name))
    targets = fx.targets(2)
    scale = s.run_mutation(fx, "scale", targets)
    assert (scale.status, scale.caught, scale.by) == ("caught", len(targets), ("attention",))
