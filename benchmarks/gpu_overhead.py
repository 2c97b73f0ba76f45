"""The tracer's overhead on a real vLLM engine, per CUDA-graph mode: the issue's workload.

Each (mode, case) runs in a fresh process with a fresh in-process engine
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``): one small untimed warm-up ``generate``, then
``--batches`` timed ``generate`` calls of ``--prompts`` token-id prompts (one shared prefix,
suffixes drawn with a seed per batch), greedy, ``--max-tokens`` new tokens each (``ignore_eos``).

Modes: ``default`` (vLLM's own compilation config: FULL_AND_PIECEWISE on a GPU), ``piecewise``
(``cudagraph_mode`` PIECEWISE), ``eager`` (``enforce_eager``). Cases: ``untraced``,
``metadata`` (first layer, no tensors), ``tensors-l0`` (layer 0 with tensors) and
``tensors-all`` (every layer with tensors), both with a 4096 MiB tensor budget, and the same two
keeping 8 query rows a step (``tensors-l0-rows8``, ``tensors-all-rows8``: format 4's
``query_rows``).

Per case it prints and writes (``--json``) the generate time and its ratio to the mode's and
to default's untraced run, the request steps the trace recorded against the engine steps
(records and gaps), the sampled tokens the trace accounts for against ``prompts x max_tokens``,
the trace size, tensor bytes per recorded layer-step against the ideal (query and output of the
rows kept, key and value of the step's new tokens), the steps per ``cudagraph`` value, whether the greedy tokens
equal the untraced ones, and any tracer error; then a markdown table (``--md``). Exits 1 when a
case crashed. On the H200: ``bash scripts/h200-bench.sh OUT``; on a CPU::

    python benchmarks/gpu_overhead.py --model tiny --modes eager --prompts 4 --prompt-len 20:40 \\
        --max-tokens 8 --batches 2

Imports only ``tracer`` and ``tracer.format`` (the GPU host has no libcst).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import inspect
import json
import os
import platform
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: the repository's packages first
    sys.path.insert(0, str(ROOT))

from tracer.format import TENSORS_DIR, GapRecord, StepRecord, Trace  # noqa: E402 - needs the path above
from tracer.format.requests import session_id_of  # noqa: E402

MODES = ("default", "piecewise", "eager")
#: Case -> ``tracer.start`` keywords (None: untraced).
CASES: dict[str, dict[str, Any] | None] = {
    "untraced": None,
    "metadata": {"layers": "first", "tensors": False},
    "tensors-l0": {"layers": (0,), "tensors": True, "budget_mb": 4096.0},
    "tensors-all": {"layers": "all", "tensors": True, "budget_mb": 4096.0},
    # format 4: 8 query rows a step kept (tracer.format.rows), the KV write log whole
    "tensors-l0-rows8": {"layers": (0,), "tensors": True, "budget_mb": 4096.0, "query_rows": 8},
    "tensors-all-rows8": {"layers": "all", "tensors": True, "budget_mb": 4096.0, "query_rows": 8},
}
#: Bytes per element of the activation dtypes a model may run in.
ELEMENT_SIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
#: The untimed warm-up: a couple of short prompts outside the timed prefix.
WARMUP_PROMPTS, WARMUP_LEN, WARMUP_TOKENS = 2, 16, 4
#: A gap whose reason starts with this is a step where the model did not run (nothing to miss).
EMPTY_STEP = "empty-step"


@dataclass(frozen=True)
class Workload:
    """What every case generates, and the engine settings shared by all cases."""

    model: str = "qwen2.5-7b-instruct"
    prompts: int = 32
    prompt_len: tuple[int, int] = (200, 300)  #: suffix length range after the shared prefix, inclusive
    shared_prefix: int = 64
    max_tokens: int = 64
    batches: int = 3
    seed: int = 0
    block_size: int | None = None  #: None: 32 on a CPU, vLLM's default on a GPU
    max_model_len: int | None = None  #: None: the preset's
    gpu_memory_utilization: float = 0.85
    flash_attn_version: int | None = None
    capture_sizes: tuple[int, ...] | None = None  #: None: vLLM's default capture sizes
    kv_check_every: int = 0  #: passed to ``tracer.start`` only when it takes it


# -- the child: one engine, one case ---------------------------------------------------------


def batch_prompts(w: Workload, vocab_size: int) -> list[list[list[int]]]:
    """``w.batches`` lists of prompts: the same shared prefix, suffixes seeded per batch."""
    from tracer.session_config import SessionConfig, make_prompts

    out: list[list[list[int]]] = []
    prefix: list[int] | None = None
    for b in range(w.batches):
        cfg = SessionConfig(
            trace_dir="unused",
            num_prompts=w.prompts,
            prompt_len=w.prompt_len,
            shared_prefix=w.shared_prefix,
            seed=w.seed + b,
        )
        prompts = make_prompts(cfg, vocab_size)
        if prefix is None:
            prefix = prompts[0][: w.shared_prefix]
        out.append([prefix + p[w.shared_prefix :] for p in prompts])
    return out


def warmup_prompts(w: Workload, vocab_size: int) -> list[list[int]]:
    """The untimed warm-up's prompts: short, no shared prefix (they warm the engine, not its cache)."""
    from tracer.session_config import SessionConfig, make_prompts

    cfg = SessionConfig(
        trace_dir="unused",
        num_prompts=WARMUP_PROMPTS,
        prompt_len=(WARMUP_LEN, WARMUP_LEN),
        shared_prefix=0,
        seed=w.seed + 1000,
    )
    return make_prompts(cfg, vocab_size)


def engine_kwargs(w: Workload, mode: str, model_path: str, load_format: str, preset_len: int, on_cpu: bool) -> dict:
    """``LLM(...)`` keywords for ``mode``; ``default`` leaves the compilation config to vLLM."""
    kwargs: dict[str, Any] = dict(
        model=model_path,
        load_format=load_format,
        skip_tokenizer_init=True,
        seed=w.seed,
        max_model_len=w.max_model_len or preset_len or 4096,
        dtype="bfloat16",
        enforce_eager=mode == "eager",
    )
    compilation: dict[str, Any] = {}
    if mode == "piecewise":
        compilation["cudagraph_mode"] = "PIECEWISE"
    if mode != "eager" and w.capture_sizes:
        compilation["cudagraph_capture_sizes"] = list(w.capture_sizes)
    if compilation:
        kwargs["compilation_config"] = compilation
    block_size = w.block_size or (32 if on_cpu else None)
    if block_size:
        kwargs["block_size"] = block_size
    if not on_cpu:
        kwargs["gpu_memory_utilization"] = w.gpu_memory_utilization
    if w.flash_attn_version is not None:
        kwargs["attention_config"] = {"flash_attn_version": w.flash_attn_version}
    return kwargs


def start_kwargs(case: str, kv_check_every: int) -> dict[str, Any]:
    """``tracer.start`` keywords of a traced case; ``kv_check_every`` only if this tracer takes it."""
    import tracer

    kwargs = dict(CASES[case] or {})
    if "query_rows" in kwargs and "query_rows" not in inspect.signature(tracer.start).parameters:
        raise SystemExit(f"--cases {case}: this tracer's start() takes no query_rows")
    if "kv_check_every" in inspect.signature(tracer.start).parameters:
        kwargs["kv_check_every"] = kv_check_every
    elif kv_check_every:
        raise SystemExit("--kv-check-every: this tracer's start() takes no kv_check_every")
    return kwargs


def machine_name() -> str:
    """The GPU's name, or the CPU's architecture and core count."""
    import torch

    if torch.cuda.is_available():
        return str(torch.cuda.get_device_name())
    return f"{platform.machine()} CPU, {os.cpu_count()} cores"


def child(spec: dict[str, Any]) -> None:
    """Run one case (``spec``: workload, mode, case, trace dir, result file) and write its result."""
    import tracer
    from tracer.models import resolve_model
    from tracer.random_weights import register_loader

    w = Workload(**{**spec["workload"], "prompt_len": tuple(spec["workload"]["prompt_len"])})
    mode, case, trace_dir = spec["mode"], spec["case"], spec["trace_dir"]
    workdir = Path(tempfile.mkdtemp(prefix="pagedtrace-bench-model-"))
    result: dict[str, Any] = {"mode": mode, "case": case}
    t = None
    try:
        model_path, load_format, vocab, preset_len = resolve_model(w.model, workdir)
        batches = batch_prompts(w, vocab)
        warm = warmup_prompts(w, vocab)
        register_loader()
        if CASES[case] is not None:
            t = tracer.start(trace_dir, export_env=False, **start_kwargs(case, w.kv_check_every))
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.platforms import current_platform

        on_cpu = current_platform.device_type == "cpu"
        t0 = time.perf_counter()
        llm = LLM(**engine_kwargs(w, mode, model_path, load_format, preset_len, on_cpu))
        result["engine_start_s"] = time.perf_counter() - t0
        config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
        result["cudagraph_mode"] = str(getattr(getattr(config, "compilation_config", None), "cudagraph_mode", None))
        result["machine"] = machine_name()
        result["vllm_version"] = vllm.__version__
        import torch

        result["torch_version"] = torch.__version__

        def generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> tuple[list[str], list[list[int]], float]:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
            start = time.perf_counter()
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
            seconds = time.perf_counter() - start
            return [str(o.request_id) for o in outs], [list(o.outputs[0].token_ids) for o in outs], seconds

        def step_of() -> int | None:
            return getattr(t, "step", None)

        _, _, result["warmup_s"] = generate(llm, warm, WARMUP_TOKENS)
        marks = [step_of()]
        result["batch_s"], result["request_ids"], result["outputs"] = [], [], []
        for prompts in batches:
            ids, outputs, seconds = generate(llm, prompts, w.max_tokens)
            result["batch_s"].append(seconds)
            result["request_ids"].append(ids)
            result["outputs"].append(outputs)
            marks.append(step_of())
        result["generate_s"] = sum(result["batch_s"])
        result["prompt_lens"] = [[len(p) for p in prompts] for prompts in batches]
        # Steps (the tracer's forward-pass counter) after the warm-up and after each batch:
        # batch b's steps are (marks[b], marks[b + 1]]. None when this tracer keeps no counter.
        result["step_marks"] = marks if all(isinstance(m, int) for m in marks) else None
        if t is not None:
            t0 = time.perf_counter()
            t.stop()
            result["stop_s"] = time.perf_counter() - t0
            result["tracer_error"] = t.error
            result["tracer_stats"] = dict(getattr(t, "stats", {}))
            t = None
        del llm
    finally:
        if t is not None:
            t.stop()
        shutil.rmtree(workdir, ignore_errors=True)
        Path(spec["result_file"]).write_text(json.dumps(result))


# -- the parent: run the cases, read their traces ----------------------------------------------


def dir_bytes(path: Path) -> int:
    """Bytes of every regular file under ``path`` (0 when it does not exist)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def safetensors_sizes(path: Path) -> dict[str, int]:
    """Bytes of each tensor in a safetensors file, from its JSON header alone (no torch)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > 100 * 2**20:
            raise ValueError(f"{path}: a safetensors header of {length} bytes")
        header = json.loads(f.read(length))
    return {
        name: int(v["data_offsets"][1]) - int(v["data_offsets"][0])
        for name, v in header.items()
        if name != "__metadata__"
    }


def gap_reason(gap: GapRecord) -> str:
    """A gap's reason up to its first colon (``cuda-graph-replay``, ``empty-step``, ...)."""
    return gap.reason.split(":", 1)[0].strip()


def ideal_tensor_bytes(record: StepRecord, element_size: int, kept_rows: int | None = None) -> int:
    """Query and output of the rows kept (all: ``None``), key and value of the step's new tokens.

    The least a record's tensors can be: replay needs those rows' query and output, and every
    new token's key and value to rebuild the cache.
    """
    rows = record.num_actual_tokens if kept_rows is None else kept_rows
    return (rows * 2 * record.num_heads + record.num_actual_tokens * 2 * record.num_kv_heads) * (
        record.head_size * element_size
    )


def analyze_trace(path: Path, child_result: dict[str, Any]) -> dict[str, Any]:
    """What the trace of one case says about the timed batches (see the module docstring)."""
    trace = Trace.open(path, strict=False)
    marks = child_result.get("step_marks")
    ids = child_result["request_ids"]
    prompt_len: dict[str, int] = {}
    batch_of_id: dict[str, int] = {}
    for b, (batch_ids, lens) in enumerate(zip(ids, child_result["prompt_lens"], strict=True)):
        for request_id, n in zip(batch_ids, lens, strict=True):
            prompt_len[request_id] = n
            batch_of_id[request_id] = b

    def batch_of_step(step: int) -> int | None:
        if marks is None:
            return None
        for b in range(len(marks) - 1):
            if marks[b] < step <= marks[b + 1]:
                return b
        return None

    def batch_of_record(record: StepRecord) -> int | None:
        if marks is not None:
            return batch_of_step(record.step)
        found = {batch_of_id.get(session_id_of(r, batch_of_id) or "") for r in record.request_ids}
        return found.pop() if len(found) == 1 else None

    records = [r for r in trace.records if r.kind == "request" and batch_of_record(r) is not None]
    gaps = [g for g in trace.gaps if g.kind == "request" and (marks is None or batch_of_step(g.step) is not None)]
    n_batches = len(ids)
    recorded: list[set[int]] = [set() for _ in range(n_batches)]
    engine: list[set[int]] = [set() for _ in range(n_batches)]
    for r in records:
        batch = batch_of_record(r)
        assert batch is not None
        recorded[batch].add(r.step)
        engine[batch].add(r.step)
    for g in gaps:
        batch = batch_of_step(g.step)
        if batch is not None:
            engine[batch].add(g.step)
    recorded_steps = set().union(*recorded)
    missed = {g.step for g in gaps if not gap_reason(g).startswith(EMPTY_STEP)} - recorded_steps

    layer = records[0].layer if records else None
    first_layer = [r for r in records if r.layer == layer]
    sampled = 0  # rows whose step sampled a token: the prompt complete (seq_len >= prompt length)
    for r in first_layer:
        for request_id, seq_len in zip(r.request_ids, r.seq_lens, strict=True):
            matched = session_id_of(request_id, prompt_len)
            if matched is not None and seq_len >= prompt_len[matched]:
                sampled += 1

    model = trace.run.model
    element_size = ELEMENT_SIZE.get(model.dtype if model else "bfloat16", 2)
    with_tensors = [r for r in records if r.tensors]
    by_name: Counter[str] = Counter()
    ideal = 0
    for r in with_tensors:
        sizes = safetensors_sizes(trace.member(TENSORS_DIR, r.tensors or ""))
        by_name.update(sizes)
        kept = sizes["query_rows"] // 8 if "query_rows" in sizes else None  # int64 row indices
        ideal += ideal_tensor_bytes(r, element_size, kept)
    tensor_bytes = sum(by_name.values())
    n_tensor = len(with_tensors)
    return {
        "steps": {
            "engine": sum(map(len, engine)) if marks is not None else None,
            "recorded": len(recorded_steps),
            "missed": len(missed),
            "per_batch_engine": [len(s) for s in engine] if marks is not None else None,
            "per_batch_recorded": [len(s) for s in recorded] if marks is not None else None,
        },
        "gaps": {
            "request": len(gaps),
            "by_reason": dict(Counter(gap_reason(g) for g in gaps)),
            "all_kinds": dict(Counter(f"{g.kind}: {gap_reason(g)}" for g in trace.gaps)),
        },
        "tokens_in_trace": sampled,
        "layers": len({r.layer for r in records}),
        "layer_steps": len(records),
        "cudagraph_steps": dict(Counter(r.cudagraph or "unrecorded" for r in first_layer)),
        "cudagraph_records": dict(Counter(r.cudagraph or "unrecorded" for r in records)),
        "tensors": {
            "layer_steps": n_tensor,
            "layer_steps_without": len(records) - n_tensor,  # all for metadata; else the budget ran out
            "bytes": tensor_bytes,
            "bytes_per_layer_step": tensor_bytes / n_tensor if n_tensor else None,
            "ideal_bytes_per_layer_step": ideal / n_tensor if n_tensor else None,
            "ratio_to_ideal": tensor_bytes / ideal if ideal else None,
            "bytes_per_layer_step_by_name": {k: v / n_tensor for k, v in sorted(by_name.items())},
        },
        "trace_bytes": dir_bytes(path),
        "trace_problems": trace.problems[:5],
        "format_version": trace.run.format_version,
        "trace_cudagraph_mode": trace.run.cudagraph_mode,
    }


def tokens_digest(outputs: list[list[list[int]]]) -> list[str]:
    """A short digest of each request's generated tokens, batch by batch."""
    return [hashlib.sha256(json.dumps(o).encode()).hexdigest()[:16] for batch in outputs for o in batch]


def child_env(mode: str) -> dict[str, str]:
    """The environment of a case: in-process engine, quiet, offline, no ``PAGEDTRACE_*`` from outside
    (the case's tracer is configured through ``tracer.start``'s keywords alone)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDTRACE_")}
    env.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_HOST_IP="127.0.0.1",
        HF_HUB_OFFLINE="1",
        VLLM_LOGGING_STREAM="ext://sys.stderr",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    )
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if mode == "eager":  # eager needs no torch.compile (vLLM would still compile its sampler)
        env["TORCH_COMPILE_DISABLE"] = "1"
    return env


def run_case(w: Workload, mode: str, case: str, workdir: Path, timeout: float, keep: bool) -> dict[str, Any]:
    """One case in its own process; the child's result, its trace read, and ``crash`` when it failed."""
    name = f"{mode}-{case}"
    trace_dir = workdir / name
    result_file = workdir / f"{name}.result.json"
    log = workdir / f"{name}.log"
    spec = {
        "workload": asdict(w),
        "mode": mode,
        "case": case,
        "trace_dir": str(trace_dir),
        "result_file": str(result_file),
    }
    t0 = time.perf_counter()
    crash = None
    with open(log, "w") as log_file:
        try:
            proc = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=child_env(mode),
                timeout=timeout,
            )
            if proc.returncode != 0:
                crash = f"exit {proc.returncode}"
        except subprocess.TimeoutExpired:
            crash = f"timed out after {timeout:.0f} s"
    wall = time.perf_counter() - t0
    result: dict[str, Any] = {}
    if result_file.is_file():
        result = json.loads(result_file.read_text())
    result.update(mode=mode, case=case, wall_s=wall, crash=crash)
    if crash is None and "generate_s" not in result:
        crash = result["crash"] = "no result"
    if crash is not None:
        tail = log.read_text(errors="replace").splitlines()[-40:]
        result["log_tail"] = tail
        print(f"{name}: crashed ({crash}); the end of its log:", *tail, sep="\n  ", file=sys.stderr)
    else:
        w_tokens = w.prompts * w.max_tokens * w.batches
        result["tokens"] = {
            "expected": w_tokens,
            "generated": sum(len(o) for batch in result["outputs"] for o in batch),
        }
        result["tokens_digest"] = tokens_digest(result.pop("outputs"))
        if CASES[case] is not None:
            result.update(analyze_trace(trace_dir, result))
            result["tokens"]["in_trace"] = result.pop("tokens_in_trace")
        result["steps_floor"] = w.batches * w.max_tokens  # every decode step adds one token per request
    if not keep:
        shutil.rmtree(trace_dir, ignore_errors=True)
        for f in (result_file, log):
            f.unlink(missing_ok=True)
    return result


def compare(results: list[dict[str, Any]]) -> None:
    """Fill each case's ratios and token comparisons against its mode's and default's untraced run."""
    by_key = {(r["mode"], r["case"]): r for r in results if not r.get("crash") and not r.get("skipped")}
    default = by_key.get(("default", "untraced"))
    for r in by_key.values():
        mode_base = by_key.get((r["mode"], "untraced"))
        for suffix, base in (("mode_untraced", mode_base), ("default_untraced", default)):
            if base is None:
                r[f"ratio_to_{suffix}"] = r[f"tokens_equal_{suffix}"] = None
                continue
            r[f"ratio_to_{suffix}"] = r["generate_s"] / base["generate_s"]
            ours, theirs = r["tokens_digest"], base["tokens_digest"]
            r[f"tokens_equal_{suffix}"] = ours == theirs
            r[f"requests_differing_from_{suffix}"] = sum(a != b for a, b in zip(ours, theirs, strict=False)) + abs(
                len(ours) - len(theirs)
            )


def _fmt_ratio(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}×"


def _fmt_bool(x: bool | None) -> str:
    return "–" if x is None else ("yes" if x else "**no**")


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "–"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def table_row(r: dict[str, Any]) -> list[str]:
    """One markdown row of a case's figures."""
    head = [r["mode"], r["case"]]
    if r.get("skipped"):
        return [*head, f"skipped ({r['skipped']})", *["–"] * 10]
    if r.get("crash"):
        return [*head, f"**crashed** ({r['crash']})", *["–"] * 10]
    traced = "steps" in r
    steps, tokens = r.get("steps", {}), r.get("tokens", {})
    if traced:
        engine = steps["engine"] if steps["engine"] is not None else "?"
        step_text = f"{steps['recorded']} / {engine}" + (f" ({steps['missed']} missed)" if steps["missed"] else "")
        gaps = ", ".join(f"{k} {v}" for k, v in sorted(r["gaps"]["by_reason"].items())) or "0"
        token_text = f"{tokens['in_trace']} / {tokens['expected']}"
        tens = r["tensors"]
        if tens["layer_steps"]:
            tensor_text = f"{_fmt_bytes(tens['bytes_per_layer_step'])} ({tens['ratio_to_ideal']:.1f}× ideal)"
            if tens["layer_steps_without"]:
                tensor_text += f"; {tens['layer_steps_without']} of {r['layer_steps']} layer-steps without"
        else:
            tensor_text = "–"
        graphs = r["cudagraph_steps"]
        graph_text = " / ".join(str(graphs.get(k, 0)) for k in ("full", "piecewise", "none"))
        if graphs.get("unrecorded"):
            graph_text += f" (+{graphs['unrecorded']} unrecorded)"
        size = _fmt_bytes(r["trace_bytes"])
    else:
        step_text = gaps = token_text = tensor_text = graph_text = size = "–"
    same = f"{_fmt_bool(r.get('tokens_equal_mode_untraced'))} / {_fmt_bool(r.get('tokens_equal_default_untraced'))}"
    error = r.get("tracer_error") or ("–" if traced else "")
    return [
        *head,
        f"{r['generate_s']:.2f} s",
        _fmt_ratio(r.get("ratio_to_mode_untraced")),
        _fmt_ratio(r.get("ratio_to_default_untraced")),
        step_text,
        gaps,
        token_text,
        size,
        tensor_text,
        graph_text,
        same,
        error.replace("|", "\\|"),
    ]


HEADER = [
    "mode",
    "case",
    "generate",
    "× mode untraced",
    "× default untraced",
    "request steps recorded / engine",
    "request gaps",
    "sampled tokens in trace / expected",
    "trace",
    "tensor bytes / layer-step",
    "steps full / piecewise / none",
    "same tokens (mode / default untraced)",
    "tracer error",
]


def markdown(report: dict[str, Any]) -> str:
    """The README table: a line naming the date, machine, vLLM and workload, then one row per case."""
    w = report["workload"]
    lo, hi = w["prompt_len"]
    pre = w["shared_prefix"]
    lines = [
        f"{report['date']}, {report['machine']}, vLLM {report['vllm_version']} (torch {report['torch_version']}): "
        f"`{w['model']}`, {w['batches']} batches of {w['prompts']} prompts of {lo + pre}–{hi + pre} tokens "
        f"({pre} shared), {w['max_tokens']} new tokens each, greedy; a fresh engine per case.",
        "",
        "| " + " | ".join(HEADER) + " |",
        "| " + " | ".join("---" for _ in HEADER) + " |",
    ]
    lines += ["| " + " | ".join(table_row(r)) + " |" for r in report["cases"]]
    return "\n".join(lines) + "\n"


def case_line(r: dict[str, Any]) -> str:
    """One progress line per finished case: its wall time and headline figures."""
    name = f"{r['mode']:9s} {r['case']:11s}"
    if r.get("crash"):
        return f"{name} wall {r['wall_s']:6.1f} s  CRASHED ({r['crash']})"
    text = (
        f"{name} wall {r['wall_s']:6.1f} s  engine {r.get('engine_start_s', 0):5.1f} s  "
        f"generate {r['generate_s']:7.3f} s  tokens {r['tokens']['generated']}/{r['tokens']['expected']}"
    )
    if "steps" in r:
        s = r["steps"]
        text += (
            f"  steps recorded {s['recorded']}/{s['engine']}  gaps {r['gaps']['by_reason'] or 0}  "
            f"trace {_fmt_bytes(r['trace_bytes'])}"
        )
        if r.get("tracer_error"):
            text += f"  tracer error: {r['tracer_error']}"
    return text


def parse_range(text: str) -> tuple[int, int]:
    """``LO:HI`` (inclusive) as two ints; ``argparse`` turns a ``ValueError`` into a usage error."""
    lo, sep, hi = text.partition(":")
    if not sep:
        raise ValueError(text)
    return int(lo), int(hi)


def parse_list(choices: Sequence[str]):
    """An ``argparse`` type: a comma-separated subset of ``choices``, in the order given."""

    def parse(text: str) -> list[str]:
        items = list(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
        bad = [s for s in items if s not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {','.join(choices)}")
        return items

    return parse


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's flags (defaults: the issue's workload on the qwen2.5-7b-instruct preset)."""
    d = Workload()
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", default=d.model, help="preset, model dir or HF id (default %(default)s)")
    ap.add_argument("--prompts", type=int, default=d.prompts, help="prompts per batch (default %(default)s)")
    ap.add_argument(
        "--prompt-len", type=parse_range, default=d.prompt_len, metavar="LO:HI", help="suffix tokens (default 200:300)"
    )
    ap.add_argument("--shared-prefix", type=int, default=d.shared_prefix, help="default %(default)s")
    ap.add_argument("--max-tokens", type=int, default=d.max_tokens, help="default %(default)s")
    ap.add_argument("--batches", type=int, default=d.batches, help="timed generate calls (default %(default)s)")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--modes", type=parse_list(MODES), default=list(MODES), help="comma-separated: " + ",".join(MODES))
    ap.add_argument("--cases", type=parse_list(list(CASES)), default=list(CASES), help=",".join(CASES))
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    ap.add_argument("--flash-attn-version", type=int, choices=(2, 3), default=None)
    ap.add_argument(
        "--capture-sizes", type=lambda s: tuple(int(x) for x in s.split(",")), default=None, metavar="N,N,..."
    )
    ap.add_argument("--kv-check-every", type=int, default=0, help="tracer.start(kv_check_every=N), if it takes it")
    ap.add_argument("--out", type=Path, default=None, help="keep each case's trace and log under DIR")
    ap.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the results (after every case)")
    ap.add_argument("--md", type=Path, default=None, metavar="FILE", help="write the markdown table")
    ap.add_argument("--merge", type=Path, default=None, metavar="FILE", help="start from an earlier --json's cases")
    ap.add_argument("--case-timeout", type=float, default=600.0, help="seconds per case (default %(default)s)")
    ap.add_argument(
        "--time-limit", type=float, default=None, help="skip cases that would end after this many seconds in all"
    )
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Run the cases, print each, print and write the table; 1 if a case crashed, 2 on bad flags."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.child is not None:
        child(json.loads(args.child))
        return 0
    lo, hi = args.prompt_len
    positive = {"--prompts": args.prompts, "--max-tokens": args.max_tokens, "--batches": args.batches}
    bad = [f"{k} must be positive" for k, v in positive.items() if v < 1]
    bad += [f"--prompt-len {lo}:{hi}: need 1 <= LO <= HI"] if not 1 <= lo <= hi else []
    bad += ["--shared-prefix must be 0 or more"] if args.shared_prefix < 0 else []
    if bad:
        ap.error(bad[0])
    w = Workload(
        model=args.model,
        prompts=args.prompts,
        prompt_len=(lo, hi),
        shared_prefix=args.shared_prefix,
        max_tokens=args.max_tokens,
        batches=args.batches,
        seed=args.seed,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        flash_attn_version=args.flash_attn_version,
        capture_sizes=args.capture_sizes,
        kv_check_every=args.kv_check_every,
    )
    results: dict[tuple[str, str], dict[str, Any]] = {}
    if args.merge is not None and args.merge.is_file():
        earlier = json.loads(args.merge.read_text())
        if earlier.get("workload") != json.loads(json.dumps(asdict(w))):
            ap.error(f"--merge {args.merge}: its workload differs from this run's")
        results = {(r["mode"], r["case"]): r for r in earlier["cases"]}
    keep = args.out is not None
    workdir = args.out if keep else Path(tempfile.mkdtemp(prefix="pagedtrace-gpu-overhead-"))
    workdir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "machine": None,
        "vllm_version": None,
        "torch_version": None,
        "workload": asdict(w),
        "argv": list(sys.argv[1:] if argv is None else argv),
        "cases": [],
    }

    def publish() -> None:
        ordered = sorted(results.values(), key=lambda r: (MODES.index(r["mode"]), list(CASES).index(r["case"])))
        compare(ordered)
        for key in ("machine", "vllm_version", "torch_version"):
            report[key] = next((r[key] for r in ordered if r.get(key)), report[key])
        report["cases"] = ordered
        if args.json is not None:
            args.json.write_text(json.dumps(report, indent=1) + "\n")

    lo_tokens, hi_tokens = lo + args.shared_prefix, hi + args.shared_prefix
    print(
        f"{w.model}: {w.batches} batches x {w.prompts} prompts of {lo_tokens}-{hi_tokens} tokens, "
        f"{w.max_tokens} new tokens; modes {','.join(args.modes)}; cases {','.join(args.cases)}",
        flush=True,
    )
    started = time.perf_counter()
    longest = 0.0
    try:
        for mode in args.modes:
            for case in args.cases:
                elapsed = time.perf_counter() - started
                if args.time_limit is not None and elapsed + longest > args.time_limit:
                    results[(mode, case)] = {"mode": mode, "case": case, "skipped": "time limit"}
                    print(f"{mode:9s} {case:11s} skipped: {elapsed:.0f} s spent, the longest case took {longest:.0f} s")
                    continue
                timeout = args.case_timeout
                if args.time_limit is not None:
                    timeout = max(1.0, min(timeout, args.time_limit - elapsed))
                r = run_case(w, mode, case, workdir, timeout, keep)
                longest = max(longest, r["wall_s"])
                results[(mode, case)] = r
                print(case_line(r), flush=True)
                publish()
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    publish()
    text = markdown(report)
    print()
    print(text, end="")
    if args.md is not None:
        args.md.write_text(text)
    skipped = [f"{r['mode']}/{r['case']}" for r in report["cases"] if r.get("skipped")]
    if skipped:
        print(f"skipped for time: {', '.join(skipped)} (run them with --modes/--cases and --merge)")
    crashed = [f"{r['mode']}/{r['case']}" for r in report["cases"] if r.get("crash")]
    if crashed:
        print(f"crashed: {', '.join(crashed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
