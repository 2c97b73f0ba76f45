"""The engine's thread does little per metadata step: counted torch calls (``benchmarks/hot_path.py``).

Each torch call on the engine's thread is a dispatch and a release of the GIL (~15 µs apiece on
the H200 host under vLLM, where PIECEWISE steps are bound by that thread), so the count is the
machine-independent part of what a metadata trace costs a launch-bound engine.
"""

from __future__ import annotations

import argparse

import pytest

from tests.factories import load_script
from tracer.format import parse_layers


def _hot_path():
    return load_script("benchmarks/hot_path.py")


#: Calls that only read a tensor's attributes: no dispatch.
ATTRIBUTE_READS = {"__get__", "numel", "dim", "is_contiguous", "data_ptr", "stride"}


@pytest.mark.parametrize("deferred", [False, True])
def test_a_metadata_step_makes_one_tensor_operation_on_the_engines_thread(monkeypatch, deferred):
    """One ``cat`` a step: on CPU straight into the memory the record process reads; deferred (as on
    CUDA, ``host_copies.DEFER_ON_CPU``), into the device mirror, whose copy to the host and event come
    once every few steps (the median step makes neither)."""
    from tracer import host_copies

    monkeypatch.setattr(host_copies, "DEFER_ON_CPU", deferred)
    hot_path = _hot_path()
    for layers in ("first", "all"):
        args = argparse.Namespace(
            layers=28, ops=1, python_us=0.0, reqs=32, context=360, trace_layers=parse_layers(layers)
        )
        calls = hot_path.torch_calls_per_step(args, steps=30)
        dispatched = {name: n for name, n in calls.items() if name not in ATTRIBUTE_READS}
        # no slicing, and the flat views of the block table and of slot_mapping (as int32 pairs)
        # are an earlier step's, made for the same memory; whatever the number of layers recorded
        # (they share their KV-cache group's copy)
        assert dispatched == {"cat": 1}, (layers, calls)


@pytest.mark.parametrize("deferred", [False, True])
def test_a_steady_metadata_step_makes_few_python_calls_into_the_tracer(monkeypatch, deferred):
    """The tracer's Python on a steady decode step, counted (``hot_path.python_opcodes_per_step``).

    On the H200 host what a PIECEWISE metadata step costs the engine's thread is mostly this
    Python. A steady step makes 37-38 calls (the wrappers, the step's start and end, the shared
    ring's take, the hand-over's message); the bound holds them there, whatever the machine's speed.
    """
    from tracer import host_copies

    monkeypatch.setattr(host_copies, "DEFER_ON_CPU", deferred)
    hot_path = _hot_path()
    # Steps as long as the benchmark's (24 operations a layer, ~1 ms here): the record process then
    # keeps up, and every copy takes the shared ring (a declined one takes the slot's own buffer,
    # another path with other calls) however busy the machine is
    args = argparse.Namespace(layers=28, ops=24, python_us=0.0, reqs=32, context=360, trace_layers="first")
    counts = hot_path.python_opcodes_per_step(args, steps=200)
    calls = counts.pop(hot_path.CALLS)
    assert 20 <= calls <= 40, counts
    # every step reaches the step's end, its one capture and the hand-over's message
    for name in ("capture:_end_request_step", "capture:_capture", "record_writer:send_slot"):
        assert counts.get(name, 0) > 0, (name, counts)
