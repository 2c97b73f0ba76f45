"""Replay traces and keep every check's numbers, with the host they ran on; compare two such files.

Made for the question "a trace replays ``ok`` on one host and not on another: which check
differs, and why?" (issue "Sharp verdicts", the FA2 PIECEWISE trace). Run it on both hosts
over the same trace directories, then compare:

    python3 scripts/replay_checks.py -o here.json TRACE...        # also on the GPU host
    python3 scripts/replay_checks.py --compare device.json here.json

Uses the Python API only (``reference_impl.replay.replay_trace``): the GPU host has torch
but no libcst, so the CLI's report path is not needed there.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any


def host_info() -> dict[str, Any]:
    """What can make CPU float results differ between hosts: the CPU, its ISA, torch's threads and backends."""
    import torch

    flags: set[str] = set()
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
            elif line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return {
        "cpu": model,
        "cpu_count": os.cpu_count(),
        "isa_flags": sorted(f for f in flags if f.startswith(("amx", "avx512_bf16", "avx512_fp16", "avx512f", "avx2"))),
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "mkldnn": bool(torch.backends.mkldnn.is_available()),
        "cuda": bool(torch.cuda.is_available()),
    }


def replay_one(path: str) -> dict[str, Any]:
    """``replay_trace``'s report as JSON, or the error it raised."""
    from reference_impl.replay import replay_trace
    from tracer.format import Trace

    try:
        report = replay_trace(Trace.open(path))
    except Exception as exc:  # noqa: BLE001 - any failure is the answer for this trace
        return {"error": f"{type(exc).__name__}: {exc}"}
    out = report.to_json()
    out["ok"] = bool(report.ok)
    return out


def _checks(report: dict[str, Any]) -> dict[str, Any]:
    """Flatten a report into ``check name -> value`` for comparison."""
    flat: dict[str, Any] = {"ok": report.get("ok"), "layout": report.get("layout"), "error": report.get("error")}
    for s in report.get("steps", []):
        key = f"attention step {s['step']} {s['layer'].split('.')[2] if s['layer'].count('.') > 2 else s['layer']}"
        flat[key] = (s["ok"], s.get("max_abs"), s.get("tol"), s.get("baseline_max_abs"))
    for group in ("write_path", "legacy", "metadata"):
        for c in report.get(group, []):
            flat[f"{group} step {c.get('step')} {c.get('layer', '')}"] = c.get("ok")
    return flat


def compare(a_file: str, b_file: str) -> int:
    """Print the checks whose results differ between two ``replay_checks`` files; 1 if any."""
    a, b = json.loads(Path(a_file).read_text()), json.loads(Path(b_file).read_text())
    print(f"A {a_file}: {a['host']}\nB {b_file}: {b['host']}")
    differ = 0
    for name in sorted(set(a["traces"]) | set(b["traces"])):
        ca, cb = _checks(a["traces"].get(name, {})), _checks(b["traces"].get(name, {}))
        print(f"{name}: ok A={ca.get('ok')} B={cb.get('ok')}")
        for key in sorted(set(ca) | set(cb)):
            if ca.get(key) != cb.get(key):
                differ += 1
                print(f"  {key}: A={ca.get(key)} B={cb.get(key)}")
    return 1 if differ else 0


def main(argv: list[str] | None = None) -> int:
    """Replay TRACE... into ``-o`` (JSON), or ``--compare A B``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("traces", nargs="*")
    p.add_argument("-o", "--out")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = p.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if not args.traces or not args.out:
        p.error("give TRACE... and -o OUT, or --compare A B")
    result = {"host": host_info(), "traces": {Path(t).name: replay_one(t) for t in args.traces}}
    Path(args.out).write_text(json.dumps(result, indent=1))
    for name, rep in result["traces"].items():
        steps = rep.get("steps", [])
        worst = max(steps, key=lambda s: (s.get("max_abs") or 0) / (s.get("tol") or 1), default=None)
        what = rep.get("error") or (
            f"ok {rep['ok']}, {len(steps)} steps, worst {worst['max_abs']:.3g} vs tol {worst['tol']:.3g}"
            if worst
            else ""
        )
        print(f"{name}: {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
