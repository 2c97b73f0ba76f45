"""Replay on a GPU gives the CPU's verdicts, from blocks rebuilt on the GPU (skipped without one).

The device machine runs these (``scripts/device/replay-gpu.sh``); CI has no GPU.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from reference_impl.checks import check_write_path
from reference_impl.replay import replay_record, replay_trace
from tests.conftest import FIXTURES, fixture_path
from tracer.format import Trace
from tracer.format.schema import INDEX_TENSORS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() == 0, reason="needs a CUDA GPU")]

ROOT = Path(__file__).resolve().parents[1]
WITH_TENSORS = sorted(
    p.name
    for p in FIXTURES.iterdir()
    if (p / "manifest.json").is_file() and any(r.tensors for r in Trace.open(p).records)
)
WRITE_LOG = sorted(n for n in WITH_TENSORS if any(r.kv_log_epoch is not None for r in Trace.open(FIXTURES / n).records))


@pytest.mark.parametrize("name", WITH_TENSORS)
def test_the_gpu_gives_the_cpu_verdicts(name):
    cpu = replay_trace(Trace.open(fixture_path(name)), workers=1, legacy_every=1)
    gpu = replay_trace(Trace.open(fixture_path(name)), device="cuda", workers=1, legacy_every=1)
    assert len(gpu.steps) == len(cpu.steps) > 0
    for a, b in zip(gpu.steps, cpu.steps, strict=True):
        assert (a.step, a.ok, [h.ok for h in a.heads]) == (b.step, b.ok, [h.ok for h in b.heads])
        # one fp64 reference against another, one fp32 emulation against another: far inside the bar
        assert abs(a.tol - b.tol) <= 1e-3 * b.tol
        assert abs(a.max_abs - b.max_abs) <= 1e-3 * b.tol
    assert [(w.step, w.tokens, w.mismatches) for w in gpu.write_path] == [
        (w.step, w.tokens, w.mismatches) for w in cpu.write_path
    ]
    assert [(c.step, c.ok) for c in gpu.legacy] == [(c.step, c.ok) for c in cpu.legacy]


@pytest.mark.parametrize("name", WRITE_LOG)
def test_blocks_rebuilt_on_the_gpu_are_the_cpu_bits(name):
    cpu_trace, gpu_trace = Trace.open(fixture_path(name)), Trace.open(fixture_path(name))
    for record in (r for r in cpu_trace.records if r.tensors is not None):
        on_cpu, on_gpu = cpu_trace.tensors(record), gpu_trace.tensors(record, device="cuda")
        assert on_gpu.keys() == on_cpu.keys()
        for key, t in on_gpu.items():
            assert t.device.type == ("cpu" if key in INDEX_TENSORS else "cuda"), key
            assert torch.equal(t.cpu().view(torch.uint8), on_cpu[key].view(torch.uint8)), (record.step, key)


def _sensitivity():
    spec = importlib.util.spec_from_file_location("sensitivity", ROOT / "benchmarks" / "sensitivity.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["sensitivity"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["h100-qwen2.5-7b-triton-default", "h200-llama3.1-8b-fp8-writelog"])
@pytest.mark.parametrize(
    ("mutation", "check"), [("scale", "attention"), ("kv_swap", "attention"), ("slot_off_by_one", "write")]
)
def test_planted_bugs_are_caught_on_the_gpu(name, mutation, check):
    s = _sensitivity()
    fx = s._Fixture(fixture_path(name))
    caught = 0
    for record in fx.targets(2):
        planted = s.MUTATIONS[mutation](record, dict(fx.trace.tensors(record)), fx.spec, fx.layout)
        assert planted is not None
        m_record, m_tensors, m_spec = planted
        on_gpu = {k: t if k in INDEX_TENSORS else t.cuda() for k, t in m_tensors.items()}
        kwargs = {"flash_attn_version": fx.fa, "emulation": fx.emulation, "check_legacy": False, "device": "cuda"}
        result, _ = replay_record(m_record, on_gpu, m_spec, fx.layout, **kwargs)
        write = check_write_path(m_record, on_gpu, m_spec, fx.layout)
        failed = {"attention": not result.ok, "write": write is not None and not write.ok}
        caught += failed[check]
    assert caught == len(fx.targets(2))


def test_the_warm_up_runs_a_step_through_the_pass_and_leaves_tf32_alone():
    from reference_impl.step_pass import warm_up

    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        warm_up("cuda")  # replay runs it on a thread that drops its errors: here they would show
        assert torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
