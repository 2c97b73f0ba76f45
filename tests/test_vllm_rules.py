"""``tracer.vllm_rules`` against the installed vLLM: the rules ``run`` checks are vLLM's own.

The checks run before vLLM is imported; these tests import it and compare, so a vLLM that
changes a rule fails here rather than in a user's run. Also: which graph mode ``run`` asks for,
and what a run that stops before its first request step leaves behind.
"""

from __future__ import annotations

import typing
from pathlib import Path

import pytest

from tests.factories import kv_spec, model_summary, run_info, scheduled_step
from tracer import vllm_rules
from tracer.format import TraceWriter
from tracer.session import discard_unrecorded
from tracer.session_config import SessionConfig, is_eager, validate_config

vllm = pytest.importorskip("vllm")


def test_kv_cache_dtypes_are_vllms():
    from vllm.config.cache import CacheDType

    assert typing.get_args(CacheDType) == vllm_rules.KV_CACHE_DTYPES


def test_graph_modes_are_vllms_and_the_default_is_its_default():
    from vllm.config.compilation import CUDAGraphMode

    assert tuple(CUDAGraphMode.__members__) == vllm_rules.CUDAGRAPH_MODES
    # The defaults of vLLM's optimization levels (vllm/config/vllm.py) name the mode.
    text = (Path(vllm.__file__).parent / "config" / "vllm.py").read_text()
    assert f'"cudagraph_mode": CUDAGraphMode.{vllm_rules.DEFAULT_CUDAGRAPH_MODE},' in text
    assert vllm_rules.cudagraph_mode("piecewise") == "PIECEWISE"  # vLLM upper-cases a string too


def test_flash_attn_versions_are_vllms():
    from vllm.config.attention import AttentionConfig

    hint = typing.get_type_hints(AttentionConfig)["flash_attn_version"]
    literal = next(a for a in typing.get_args(hint) if typing.get_origin(a) is typing.Literal)
    assert typing.get_args(literal) == vllm_rules.FLASH_ATTN_VERSIONS


def test_block_sizes_are_what_the_backends_take():
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    (rule,) = CPUAttentionBackend.get_supported_kernel_block_sizes()
    assert isinstance(rule, MultipleOf) and rule.base == vllm_rules.BLOCK_SIZE_MULTIPLE
    # FlashAttention's module needs CUDA kernels to import: read its rule from the source.
    text = (Path(vllm.__file__).parent / "v1" / "attention" / "backends" / "flash_attn.py").read_text()
    assert f"return [MultipleOf({vllm_rules.BLOCK_SIZE_MULTIPLE})]" in text
    for good in (16, 32, 48, 128):
        vllm_rules.check_block_size(good)
    for bad in (7, 8, 24, 0):
        with pytest.raises(ValueError, match="multiple of 16"):
            vllm_rules.check_block_size(bad)


def test_a_gpu_runs_vllms_default_graph_mode_and_the_cpu_runs_eager():
    cfg = SessionConfig(trace_dir="")
    assert is_eager(cfg, cuda=True) is False and is_eager(cfg, cuda=False) is True
    assert is_eager(SessionConfig(trace_dir="", enforce_eager=True), cuda=True) is True
    assert is_eager(SessionConfig(trace_dir="", cudagraph_mode="PIECEWISE"), cuda=False) is False


def test_max_model_len_must_hold_the_longest_prompt_and_its_tokens(tmp_path):
    cfg = SessionConfig(trace_dir=str(tmp_path / "t"), max_model_len=166)  # longest prompt 154 + 12
    validate_config(cfg)
    with pytest.raises(ValueError, match="need at least 166"):
        validate_config(SessionConfig(trace_dir=str(tmp_path / "t"), max_model_len=165))


def _trace(path: Path, kinds: tuple[str, ...]) -> None:
    with TraceWriter(path) as writer:
        writer.write_manifest(run_info(kv_cache=kv_spec(), model=model_summary()))
        for i, kind in enumerate(kinds):
            writer.append(scheduled_step(i + 1, [1], [17], [[3, 5]], kind=kind))


def test_a_run_stopped_before_its_first_request_step_leaves_nothing(tmp_path):
    made = tmp_path / "made"
    _trace(made, ("profile",))  # the engine's memory profile ran, then the start failed
    assert discard_unrecorded(made, created=True) and not made.exists()
    given = tmp_path / "given"  # an empty -o the user made: emptied again, not removed
    given.mkdir()
    _trace(given, ())
    assert discard_unrecorded(given, created=False) and given.is_dir() and not any(given.iterdir())
    kept = tmp_path / "kept"
    _trace(kept, ("profile", "request"))
    assert not discard_unrecorded(kept, created=True) and (kept / "steps.jsonl").is_file()
