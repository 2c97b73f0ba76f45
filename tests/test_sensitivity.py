"""``benchmarks/sensitivity.py`` on one fixture: planted bugs are caught (guards the benchmark)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EAGER = ROOT / "tests" / "fixtures" / "h200-qwen2.5-7b-eager"


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
