"""Read an overhead probe's run (``scripts/h200_overhead_probe.py --json``) the way session 9 did.

Pass times on the H200 host swing by up to ±40 % between passes of one variant while the tracer's
cost is a few per cent, so this script looks at a run from four sides, each per traced variant
against ``untraced`` with a 95 % bootstrap interval over rounds (the probe's ``paired_interval``):

1. **all rounds**: each pass over the untraced pass of its round (what the probe prints);
2. **quiet rounds**: only the rounds whose *untraced* pass is within ``--quiet`` (3 %) of the run's
   fastest untraced pass. The rounds are chosen by the control alone, never by a traced pass, so
   the choice cannot favour the tracer (it leans against it: a lucky untraced pass makes the
   tracer look slower);
3. **slow steps**: decode steps (the first two steps of each batch, the prefill, left out) over
   ``--slow`` (1.25) times the run's median untraced decode step, their share, and the time they
   add per pass beyond that median;
4. **blocked**: how often the engine's thread blocked during a pass (``voluntary_ctxt_switches``,
   ``host.vol`` in the probe's round lines): a thread that waits for the GIL another thread holds
   sleeps on it.

    python3 benchmarks/probe_analysis.py RUN.json [RUN.txt] [--quiet 0.03] [--slow 1.25]

``RUN.txt`` (the probe's printed output) supplies each pass's figures for a run whose JSON
predates ``pass_stats``.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import lzma
import re
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

#: Decode steps of a pass: a batch's first two engine steps run its prefill; 3 batches of 65 steps.
BATCH_STEPS = 65
PREFILL_STEPS = 2


def _paired_interval():
    spec = importlib.util.spec_from_file_location("probe", ROOT / "scripts" / "h200_overhead_probe.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.paired_interval


def _read(path: Path) -> Any:
    raw = path.read_bytes()
    return json.loads(lzma.decompress(raw) if path.suffix == ".xz" else raw)


def pass_stats_from_text(text: str) -> dict[str, list[dict[str, Any]]]:
    """Each variant's passes' figures from the probe's round lines (``round R VARIANT S s at T {...}``)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for line in text.splitlines():
        m = re.match(r"round (\d+) (\S+)\s+[\d.]+ s(?: at [\d.]+)? (\{.*\})$", line)
        if m:
            out.setdefault(m.group(2), []).append(ast.literal_eval(m.group(3)))
    return out


def quiet_rounds(untraced: list[float], share: float) -> list[int]:
    """Rounds whose untraced pass is within ``share`` of the fastest untraced pass."""
    best = min(untraced)
    return [r for r, s in enumerate(untraced) if s <= best * (1 + share)]


def decode_steps(steps: list[list[float]]) -> list[float]:
    """A pass's decode-step durations (seconds): every batch's first :data:`PREFILL_STEPS` left out."""
    return [d for i, (_, d) in enumerate(steps) if i % BATCH_STEPS >= PREFILL_STEPS]


def slow_steps(passes: list[list[list[float]]], bar: float) -> tuple[float, float]:
    """Over ``passes``: the share of decode steps over ``bar`` seconds, and the seconds they add per pass."""
    n = slow = 0
    extra = 0.0
    for steps in passes:
        for d in decode_steps(steps):
            n += 1
            if d > bar:
                slow += 1
                extra += d - bar
    return slow / max(n, 1), extra / max(len(passes), 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", type=Path, help="the probe's --json output (.json or .json.xz)")
    ap.add_argument("text", type=Path, nargs="?", help="the probe's printed output, for a run without pass_stats")
    ap.add_argument("--quiet", type=float, default=0.03)
    ap.add_argument("--slow", type=float, default=1.25)
    args = ap.parse_args(argv)
    try:
        run = _read(args.json)
        stats = run.get("pass_stats") or (pass_stats_from_text(args.text.read_text()) if args.text else {})
    except (OSError, ValueError, lzma.LZMAError) as exc:
        print(f"probe_analysis: cannot read the run: {exc}", file=sys.stderr)
        return 2
    paired_interval = _paired_interval()
    summary, steps = run["summary"], run.get("pass_steps", {})
    variants = [v for v in summary if "all_s" in summary[v]]
    if "untraced" not in variants:
        print("probe_analysis: the run has no untraced passes", file=sys.stderr)
        return 2
    untraced = summary["untraced"]["all_s"]
    quiet = quiet_rounds(untraced, args.quiet)
    base = statistics.median(d for p in steps.get("untraced", []) for d in decode_steps(p)) if steps else 0.0
    print(
        f"{len(untraced)} rounds; quiet (untraced within {args.quiet:.0%} of its best, {min(untraced):.3f} s): "
        f"{len(quiet)}; median untraced decode step {base * 1e3:.3f} ms, slow: over {args.slow:g}x that"
    )

    def interval(v: str, rounds: list[int]) -> str:
        ratios = [summary[v]["all_s"][r] / untraced[r] for r in rounds]
        if len(ratios) < 2:
            return "-"
        geo, low, high = paired_interval(ratios)
        return f"{geo:.3f}x [{low:.3f}, {high:.3f}]"

    print(f"{'variant':22s} {'all rounds':24s} {'quiet rounds':24s} {'slow steps':>10s} {'adds/pass':>10s} blocked")
    for v in variants:
        every = list(range(len(untraced)))
        share, extra = slow_steps(steps.get(v, []), base * args.slow) if base else (0.0, 0.0)
        vol = [s.get("host", {}).get("vol") for s in stats.get(v, [])]
        blocked = f"{statistics.median(vol):g}/pass" if vol and None not in vol else "-"
        all_s = "1" if v == "untraced" else interval(v, every)
        quiet_s = "1" if v == "untraced" else interval(v, quiet)
        print(f"{v:22s} {all_s:24s} {quiet_s:24s} {share:10.1%} {extra * 1e3:8.1f}ms {blocked}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
