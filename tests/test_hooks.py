"""Install / uninstall of the tracer: symmetric, refuses to nest, leaves nothing patched."""

from __future__ import annotations

import pytest

from tracer import hooks
from tracer.hooks import Tracer, TracerOptions, parse_layers, parse_steps

cpu_attn = pytest.importorskip("vllm.v1.attention.backends.cpu_attn")
runner = pytest.importorskip("vllm.v1.worker.gpu_model_runner")

TARGETS = [
    (cpu_attn.CPUAttentionBackendImpl, "forward"),
    (cpu_attn.CPUAttentionBackendImpl, "do_kv_cache_update"),
    (runner.GPUModelRunner, "execute_model"),
    (runner.GPUModelRunner, "_dummy_run"),
    (runner.GPUModelRunner, "profile_run"),
]


@pytest.fixture(autouse=True)
def nothing_left_patched():
    before = {(c, n): vars(c)[n] for c, n in TARGETS}
    yield
    assert hooks.active() is None
    assert {(c, n): vars(c)[n] for c, n in TARGETS} == before


def test_start_patches_and_stop_restores(tmp_path):
    t = Tracer(TracerOptions(str(tmp_path / "t"))).start()
    try:
        for cls, name in TARGETS:
            assert hasattr(vars(cls)[name], "__pagedtrace_original__"), name
    finally:
        t.stop()
    t.stop()  # twice is harmless


def test_second_start_refuses(tmp_path):
    with Tracer(TracerOptions(str(tmp_path / "a"))):
        with pytest.raises(RuntimeError, match="already active"):
            Tracer(TracerOptions(str(tmp_path / "b"))).start()


def test_failed_start_leaves_nothing_patched(tmp_path, monkeypatch):
    def broken(self):
        self._patch(cpu_attn.CPUAttentionBackendImpl, "forward", self._wrap_forward)
        raise OSError("boom")

    monkeypatch.setattr(Tracer, "_install", broken)
    with pytest.raises(OSError, match="boom"):
        Tracer(TracerOptions(str(tmp_path / "t"))).start()


def test_env_is_exported_for_child_processes_and_restored(tmp_path, monkeypatch):
    monkeypatch.delenv("PAGEDTRACE_DIR", raising=False)
    import os

    import tracer

    t = tracer.start(tmp_path / "t", layers="all", steps=(2, 9), tensors=True)
    try:
        opts = TracerOptions.from_env()
        assert opts == TracerOptions(str(tmp_path / "t"), layers="all", steps=(2, 9), tensors=True,
                                     budget_bytes=t.options.budget_bytes)
    finally:
        tracer.stop()
    assert "PAGEDTRACE_DIR" not in os.environ


def test_option_parsing():
    assert parse_layers("first") == "first" and parse_layers("0, 3,model.x") == (0, 3, "model.x")
    assert parse_steps("") == (None, None) and parse_steps("3:") == (3, None) and parse_steps("5") == (5, 6)
    with pytest.raises(ValueError, match="bad step range"):
        parse_steps("a:b")
    with pytest.raises(ValueError, match="bad layer selection"):
        parse_layers(",")
