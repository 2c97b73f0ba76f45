"""Tracer overhead on a real vLLM engine: generation time untraced vs traced.

Runs the same greedy session (tiny preset by default) in fresh processes: untraced,
traced (metadata only, first layer), traced with tensors, traced with all layers; prints
the generation time and tokens/s of each, the overhead, and the trace size.

    python benchmarks/tracer_overhead.py [--model tiny] [--prompts 8] [--max-tokens 64] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SNIPPET = """
import json, sys
from tracer.session import run_session
from tracer.session_config import SessionConfig
cfg = SessionConfig(**json.loads(sys.argv[1]))
r = run_session(cfg)
print("RESULT=" + json.dumps({"generate_s": r.generate_s, "tokens": sum(map(len, r.outputs))}))
"""

MODES = {
    "untraced": {"trace": False},
    "traced, metadata": {"tensors": False},
    "traced, tensors": {"tensors": True},
    "traced, all layers + tensors": {"tensors": True, "layers": "all"},
}


def run_once(cfg: dict) -> dict:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, "-c", SNIPPET, json.dumps(cfg)], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"session failed:\n{proc.stderr[-3000:]}")
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT="))
    return json.loads(line[len("RESULT=") :])


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2, help="runs per mode; the fastest counts")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pagedtrace-bench-"))
    print(f"model {args.model}, {args.prompts} prompts x {args.max_tokens} new tokens, best of {args.repeat}")
    base = None
    try:
        for name, extra in MODES.items():
            best, size = None, 0
            for i in range(args.repeat):
                out = work / f"{name.replace(' ', '_').replace(',', '')}-{i}"
                cfg = {
                    "trace_dir": str(out),
                    "model": args.model,
                    "num_prompts": args.prompts,
                    "max_tokens": args.max_tokens,
                    **extra,
                }
                r = run_once(cfg)
                size = max(size, dir_size(out))
                best = r if best is None or r["generate_s"] < best["generate_s"] else best
            tps = best["tokens"] / best["generate_s"]
            base = base or best["generate_s"]
            overhead = (best["generate_s"] / base - 1) * 100
            print(
                f"{name:30s} generate {best['generate_s']:7.3f} s  {tps:8.1f} tok/s  "
                f"overhead {overhead:+6.1f}%  trace {size / 2**20:7.2f} MiB"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
