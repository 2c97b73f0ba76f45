"""The batched step pass (the GPU path of replay) against the CPU forms, run here on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from reference_impl.emulation import emulation_of
from reference_impl.inputs import judge_output, reference_outputs, step_inputs
from reference_impl.replay import legacy_sample
from reference_impl.resolve import kv_spec, resolve_layout
from reference_impl.step_pass import select_device, step_kwargs, step_outputs
from tracer.format import Trace
from tracer.format.selection import sample_records

FIXTURES = Path(__file__).resolve().parent / "fixtures"
WITH_TENSORS = sorted(p.name for p in FIXTURES.iterdir() if (p / "tensors").is_dir())


@pytest.mark.parametrize("name", WITH_TENSORS)
def test_step_pass_gives_the_cpu_forms_verdicts(name):
    trace = Trace.open(FIXTURES / name)
    spec, records = kv_spec(trace), [r for r in trace.records if r.tensors]
    layout = resolve_layout(trace, records)
    for record in records:
        tensors = trace.tensors(record)
        inputs = step_inputs(
            record,
            tensors,
            spec,
            layout,
            flash_attn_version=trace.run.flash_attn_version,
            emulation=emulation_of(trace.run),
        )
        expected, baseline = reference_outputs(inputs)
        batched, batched_base = step_outputs(*inputs.args, **step_kwargs(inputs), device="cpu")
        assert batched is not None
        num = inputs.num_tokens
        scale = float(expected[:num].abs().max())
        # fp64 sums in another order: the answers agree to a few fp64 ulps of the output's scale.
        assert float((batched[:num] - expected[:num]).abs().max()) <= 1e-13 * max(scale, 1.0)
        # fp32 sums in another order flip a rare bf16 rounding, nothing more.
        assert int((batched_base[:num] != baseline[:num]).sum()) <= max(2, baseline[:num].numel() // 10_000)
        old = judge_output(inputs, tensors["output"], expected, baseline)
        new = judge_output(inputs, tensors["output"], batched, batched_base)
        assert new["per_head_ok"] == old["per_head_ok"], f"{name} step {record.step}"


def test_device_selection():
    assert select_device("cpu") == torch.device("cpu")
    chosen = select_device(None)
    assert not torch.cuda.is_initialized()  # forked replay workers can still open CUDA contexts of their own
    assert chosen.type == ("cuda" if torch.cuda.device_count() > 0 else "cpu")
    with pytest.raises(ValueError, match="use one of"):
        select_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no GPU"):
            select_device("cuda")


def test_sample_is_spread_evenly_and_reproducible():
    records = list(range(100))
    picked = sample_records(records, 5)  # type: ignore[arg-type]
    assert picked == [0, 25, 50, 74, 99]  # round(i * 99 / 4)
    assert sample_records(records, 5) == picked  # type: ignore[arg-type]
    assert sample_records(records, 500) == records  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        sample_records(records, 0)  # type: ignore[arg-type]


def test_legacy_sample_takes_first_last_and_every_nth():
    assert legacy_sample(40, 16) == {0, 16, 32, 39}
    assert legacy_sample(1, 16) == {0}
    assert legacy_sample(0, 16) == frozenset()
    assert legacy_sample(3, 1) == {0, 1, 2}
