"""Greedy tokens with and without the tracer, per attention backend, on the GPU machine.

From the repository root, with vLLM on the path (``source .device/install.sh env``)::

    python3 scripts/device/tokens.py OUT.json [--budget-s 300] [--model tiny] [CASE ...]

Each case runs the same session (``--model``, 4 prompts, 8 new tokens, every layer traced with
tensors) in a fresh process per run, in the order untraced, traced, untraced. The second untraced
run tells the engine's own run-to-run spread apart from the tracer's effect: tokens that differ
between the two untraced runs say nothing about the tracer. Prints one line per case and writes
every run's tokens (or the tail of its stderr) into OUT.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import json, sys
from tracer.session import run_session
from tracer.session_config import SessionConfig
r = run_session(SessionConfig(**json.loads(sys.argv[1])))
print("TOKENS" + json.dumps(r.outputs))
"""

#: Case name -> (SessionConfig fields, environment).
CASES: dict[str, tuple[dict[str, object], dict[str, str]]] = {
    "FLASH_ATTN default": ({"attention_backend": "FLASH_ATTN", "cudagraph_mode": "FULL_AND_PIECEWISE"}, {}),
    "TRITON_ATTN default": ({"attention_backend": "TRITON_ATTN", "cudagraph_mode": "FULL_AND_PIECEWISE"}, {}),
    "TRITON_ATTN eager": ({"attention_backend": "TRITON_ATTN", "enforce_eager": True}, {}),
    # Eager Flex (no torch.compile) runs PyTorch's math attention, which repeats the whole cache's keys and
    # values for every query head of a group: a cache of 1024 blocks keeps that inside memory.
    "FLEX_ATTENTION eager": ({"attention_backend": "FLEX_ATTENTION", "enforce_eager": True, "num_blocks": 1024}, {}),
    "FLASH_ATTN HND eager": (
        {"attention_backend": "FLASH_ATTN", "enforce_eager": True},
        {"VLLM_KV_CACHE_LAYOUT": "HND"},
    ),
    "FLEX_ATTENTION default": ({"attention_backend": "FLEX_ATTENTION", "cudagraph_mode": "FULL_AND_PIECEWISE"}, {}),
    "FLASHINFER eager": ({"attention_backend": "FLASHINFER", "enforce_eager": True}, {}),
}


def run_once(cfg: dict[str, object], env: dict[str, str], timeout: float) -> tuple[object, float]:
    """Tokens of one run (a list of lists) or the tail of its stderr (a string), and its seconds."""
    start = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, json.dumps(cfg)],
            capture_output=True,
            text=True,
            env={**os.environ, **env},
            timeout=timeout,
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s", time.monotonic() - start
    line = next((x for x in proc.stdout.splitlines() if x.startswith("TOKENS")), None)
    got: object = json.loads(line[len("TOKENS") :]) if line else proc.stderr[-2000:]
    return got, time.monotonic() - start


def first_difference(a: object, b: object) -> str:
    """Where two runs' tokens first part: ``prompt P token T``, or why they cannot be compared."""
    if not isinstance(a, list) or not isinstance(b, list):
        return "a run failed"
    for p, (x, y) in enumerate(zip(a, b, strict=False)):
        for t, (u, v) in enumerate(zip(x, y, strict=False)):
            if u != v:
                return f"prompt {p} token {t}: {u} vs {v}"
    return "none"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("cases", nargs="*", default=None, help=f"of: {', '.join(CASES)} (default: all)")
    parser.add_argument("--budget-s", type=float, default=300.0)
    parser.add_argument("--model", default="tiny")
    args = parser.parse_intermixed_args()
    names = args.cases or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"error: unknown case {unknown[0]!r}; cases: {', '.join(CASES)}", file=sys.stderr)
        return 2
    start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="pt-tokens-"))
    results: dict[str, dict[str, object]] = {}
    for i, name in enumerate(names):
        fields, env = CASES[name]
        got: dict[str, object] = {}
        for j, traced in enumerate((False, True, False)):
            left = args.budget_s - (time.monotonic() - start)
            if left < 30:
                got["skipped"] = "time"
                break
            cfg = {
                "trace_dir": str(work / f"c{i}r{j}"),
                "model": args.model,
                "num_prompts": 4,
                "max_tokens": 8,
                "layers": "all",
                "trace": traced,
                **fields,
            }
            key = "traced" if traced else ("untraced" if j == 0 else "untraced_again")
            got[key], got[key + "_s"] = run_once(cfg, env, left)
        got["traced_vs_untraced"] = first_difference(got.get("untraced"), got.get("traced"))
        got["untraced_vs_untraced"] = first_difference(got.get("untraced"), got.get("untraced_again"))
        results[name] = got
        print(
            f"{name}: traced vs untraced first difference: {got['traced_vs_untraced']}; "
            f"untraced vs untraced: {got['untraced_vs_untraced']}",
            flush=True,
        )
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
