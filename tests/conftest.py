"""Shared fixtures: one real vLLM 0.26 engine session per test run, shared by all tests.

The engine runs in a subprocess (``python -m pagedtrace run``), which exercises the
CLI end to end and keeps vLLM's global state out of the test process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

def _site_packages() -> Path | None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).parent


#: site-packages holding the installed vLLM 0.26 (its sources are read, never imported).
SITE = _site_packages()
needs_vllm_sources = pytest.mark.skipif(SITE is None, reason="vLLM 0.26 sources not installed")

#: The session every engine test reads: tiny preset, tensors on, block size 32 on CPU.
RUN_ARGS = ["--model", "tiny", "--prompts", "4", "--prompt-len", "20:90", "--shared-prefix", "64",
            "--max-tokens", "12", "--seed", "0"]

ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "TORCH_COMPILE_DISABLE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}


def engine_env(**extra: str) -> dict[str, str]:
    """Environment for an engine subprocess (no PAGEDTRACE_* leaking in from the parent)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDTRACE_")}
    env.update(ENGINE_ENV)
    env.update(extra)
    return env


def run_engine(args: list[str], env: dict[str, str] | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    """Run ``args`` with this Python; fail the test with the output if it fails."""
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env or engine_env(),
                          timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"{args} exited {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-6000:]}")
    return proc


#: Prints the generated tokens of the same session, optionally with the tracer pointed elsewhere.
UNTRACED_SNIPPET = """
import json, sys
from tracer.session import SessionConfig, run_session
r = run_session(SessionConfig(trace_dir="unused", trace=False, num_prompts=4, prompt_len=(20, 90),
                              shared_prefix=64, max_tokens=12, seed=0))
print("TOKENS=" + json.dumps(r.outputs))
"""


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
