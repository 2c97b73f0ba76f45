"""Read an overhead probe's run (``lab/h200_overhead_probe.py --json``) five ways, runs pooled.

Pass times on the H200 host swing by up to ±40 % between passes of one variant while the tracer's
cost is a few per cent, so this script looks at a run from five sides, each per traced variant
against ``untraced`` with a 95 % bootstrap interval over rounds (the probe's ``paired_interval``):

1. **all rounds**: each pass over the untraced pass of its round (what the probe prints);
2. **quiet rounds**: only the rounds whose *untraced* pass is within ``--quiet`` (3 %) of the run's
   fastest untraced pass. The rounds are chosen by the control alone, never by a traced pass, so
   the choice cannot favour the tracer (it leans against it: a lucky untraced pass makes the
   tracer look slower);
3. **slow steps**: decode steps (the first two steps of each batch, the prefill, left out) over
   ``--slow`` (1.25) times the run's median untraced decode step, their share, and the time they
   add per pass beyond that median;
4. **prefill and decode steps apart**: each pass's seconds in its batches' prefill steps and in its
   decode steps, each over the untraced pass's of its round (the tracer's cost is per step);
5. **blocked**: how often the engine's thread blocked during a pass (``voluntary_ctxt_switches``,
   ``host.vol`` in the probe's round lines): a thread that waits for the GIL another thread holds
   sleeps on it; then the CPU the engine's process (every thread) and the record process took
   a pass (where the run has them), and how the held steps went over once the engine idled:
   the idle mode, the idle thread's looks and the idle hand-overs a pass (``idle_cell``).

Variants that time the engine thread's share (``*-parts``, ``*-acct``) also get a line of its
pieces, median µs a step over their passes.

    python3 lab/probe_analysis.py RUN.json [RUN.txt] [RUN2.json ...] [--pair A/B] [--quiet 0.03] [--slow 1.25]

``RUN.txt`` (the probe's printed output, right after its JSON) supplies each pass's figures for
a run whose JSON predates ``pass_stats``. With several runs it then **pools** them: every round of
every run is one sample of each traced variant over untraced (and of each ``--pair`` A over B).
Quiet rounds lean against the tracer more than it seems: a round chosen for its fast untraced
pass has a traced pass that was not chosen, so the ratio is biased up (regression to the mean:
one run read 1.10–1.16× there where all rounds gave 1.00–1.05×). The pooled all-rounds
interval is the figure to read.
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

HERE = Path(__file__).resolve().parent

#: Decode steps of a pass: a batch's first two engine steps run its prefill; 3 batches of 65 steps.
BATCH_STEPS = 65
PREFILL_STEPS = 2


def _paired_interval():
    spec = importlib.util.spec_from_file_location("probe", HERE / "h200_overhead_probe.py")
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


def phase_sums(steps: list[list[float]]) -> tuple[float, float]:
    """A pass's seconds in its prefill steps (each batch's first :data:`PREFILL_STEPS`) and in its decode steps."""
    prefill = sum(d for i, (_, d) in enumerate(steps) if i % BATCH_STEPS < PREFILL_STEPS)
    return prefill, sum(d for _, d in steps) - prefill


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


def runs_of(paths: list[Path]) -> list[tuple[Path, Path | None]]:
    """The runs named on the command line: each JSON file, with the ``.txt`` right after it if any."""
    runs: list[tuple[Path, Path | None]] = []
    for path in paths:
        if path.suffix == ".txt":
            if not runs or runs[-1][1] is not None:
                raise ValueError(f"{path}: a probe's printed output goes right after its JSON file")
            runs[-1] = (runs[-1][0], path)
        else:
            runs.append((path, None))
    return runs


def ratios(summary: dict[str, Any], top: str, bottom: str) -> list[float]:
    """Each round's pass time of ``top`` over ``bottom``'s in the same round."""
    return [a / b for a, b in zip(summary[top]["all_s"], summary[bottom]["all_s"], strict=True)]


def report_run(run: dict[str, Any], stats: dict[str, Any], args: argparse.Namespace, paired_interval) -> None:
    """One run's table: per variant all rounds, quiet rounds, slow steps, blocks."""
    summary, steps = run["summary"], run.get("pass_steps", {})
    variants = [v for v in summary if "all_s" in summary[v]]
    untraced = summary["untraced"]["all_s"]
    quiet = quiet_rounds(untraced, args.quiet)
    base = statistics.median(d for p in steps.get("untraced", []) for d in decode_steps(p)) if steps else 0.0
    print(
        f"{len(untraced)} rounds; quiet (untraced within {args.quiet:.0%} of its best, {min(untraced):.3f} s): "
        f"{len(quiet)}; median untraced decode step {base * 1e3:.3f} ms, slow: over {args.slow:g}x that"
    )

    def interval(v: str, rounds: list[int]) -> str:
        every = ratios(summary, v, "untraced")
        return _interval([every[r] for r in rounds], paired_interval)

    print(
        f"{'variant':22s} {'all rounds':24s} {'quiet rounds':24s} {'slow steps':>10s} {'adds/pass':>10s} "
        f"{'blocked':>10s} {'cpu/pass':>9s} {'child':>7s} {'idle: looks/hand-overs':>22s}"
    )
    for v in variants:
        every = list(range(len(untraced)))
        share, extra = slow_steps(steps.get(v, []), base * args.slow) if base else (0.0, 0.0)
        blocked = _host_median(stats.get(v, []), "vol", "{:g}/pass")
        cpu = _host_median(stats.get(v, []), "proc_cpu_ms", "{:g}ms")
        child = _host_median(stats.get(v, []), "child_cpu_ms", "{:g}ms")
        looks = idle_cell(stats.get(v, []))
        all_s = "1" if v == "untraced" else interval(v, every)
        quiet_s = "1" if v == "untraced" else interval(v, quiet)
        print(
            f"{v:22s} {all_s:24s} {quiet_s:24s} {share:10.1%} {extra * 1e3:8.1f}ms "
            f"{blocked:>10s} {cpu:>9s} {child:>7s} {looks:>22s}"
        )
    if steps:
        # The tracer's cost is per step, and prefills are few and long: the two apart, each pass's
        # sum of them over the untraced pass of its round (a pass's time is both, and the rest).
        print("prefill and decode steps apart, each pass's sum over the untraced pass of its round:")
        base_sums = [phase_sums(p) for p in steps.get("untraced", [])]
        for v in variants:
            if v == "untraced" or len(steps.get(v, [])) != len(base_sums):
                continue
            sums = [phase_sums(p) for p in steps[v]]
            pre = [a[0] / b[0] for a, b in zip(sums, base_sums, strict=True) if b[0] > 0]
            dec = [a[1] / b[1] for a, b in zip(sums, base_sums, strict=True) if b[1] > 0]
            print(
                f"  {v:20s} prefill steps {_interval(pre, paired_interval):24s} "
                f"decode steps {_interval(dec, paired_interval)}"
            )
    for v in variants:
        line = pieces_line(stats.get(v, []))
        if line:
            print(f"{v}: {line}")


def _host_median(passes: list[dict[str, Any]], key: str, form: str, within: str | None = "host") -> str:
    """The median over passes of one of the probe's figures, or "-" where a pass lacks it.

    In ``host`` (``within``): ``vol``, the engine thread's blocks; ``proc_cpu_ms``, the engine
    process's CPU, every thread; ``child_cpu_ms``, the record process's. At the top
    (``within=None``), the tracer's stats: ``idle_looks``, how often the inline writer's idle
    thread took the GIL (where the run has it).
    """
    values = [(p.get(within, {}) if within else p).get(key) for p in passes]
    if not values or None in values:
        return "-"
    return form.format(statistics.median(values))


def idle_cell(passes: list[dict[str, Any]]) -> str:
    """How the inline writer's held steps went over, a pass: ``[MODE ]LOOKS/HAND_OVERS`` (medians), or "-".

    ``MODE`` is the tracer's ``idle`` (``engine``, ``timer``, ``look``, ``off``, where the
    run has it; ``mixed`` where passes differ), ``LOOKS`` how often its idle thread woke and took the GIL,
    ``HAND_OVERS`` the idle hand-overs (on the engine's thread with ``engine``).
    """
    looks = _host_median(passes, "idle_looks", "{:g}", within=None)
    if looks == "-":
        return "-"
    hand_overs = _host_median(passes, "idle_hand_overs", "{:g}", within=None)
    modes = {p.get("idle") for p in passes}
    mode = "" if modes == {None} else f"{modes.pop()} " if len(modes) == 1 else "mixed "
    return f"{mode}{looks}/{hand_overs}"


def pieces_line(passes: list[dict[str, Any]]) -> str:
    """What a timed variant's passes say of the engine thread's share: median µs a step over passes.

    ``metadata-parts`` / ``metadata-inline-parts`` time each piece (``parts_us_per_step``, largest
    first) and count the engine thread's blocks inside each (``parts_blocks_per_pass``);
    ``metadata-acct`` / ``metadata-inline-acct`` the tracer's calls in all (``main_us_per_step``)
    and the hand-over (``writer_us_per_step``). Empty for other variants.
    """
    parts = [p["parts_us_per_step"] for p in passes if p.get("parts_us_per_step")]
    out = []
    if parts:
        names = {name for p in parts for name in p}
        medians = {name: statistics.median(p.get(name, 0.0) for p in parts) for name in names}
        listed = ", ".join(f"{name} {us:g}" for name, us in sorted(medians.items(), key=lambda kv: -kv[1]))
        out.append(f"pieces, median µs a step over {len(parts)} passes: {listed}")
    blocks = [p["parts_blocks_per_pass"] for p in passes if p.get("parts_blocks_per_pass")]
    if blocks:
        names = {name for p in blocks for name in p}
        medians = {name: statistics.median(p.get(name, 0) for p in blocks) for name in names}
        listed = ", ".join(f"{name} {n:g}" for name, n in sorted(medians.items(), key=lambda kv: -kv[1]) if n)
        out.append(f"blocked inside, median a pass: {listed or 'none'}")
    for key, label in (("main_us_per_step", "tracer calls"), ("writer_us_per_step", "hand-over")):
        values = [p[key] for p in passes if key in p]
        if values:
            out.append(f"{label} {statistics.median(values):g} µs a step (median of {len(values)} passes)")
    return "; ".join(out)


def _interval(values: list[float], paired_interval) -> str:
    if len(values) < 2:
        return "-"
    geo, low, high = paired_interval(values)
    return f"{geo:.3f}x [{low:.3f}, {high:.3f}]"


def report_pooled(summaries: list[dict[str, Any]], pairs: list[tuple[str, str]], paired_interval) -> None:
    """Every round of every run as one sample: each traced variant over untraced, and each ``pairs`` top over bottom.

    The rounds of separate runs (machines, times) are independent pairs of passes like the rounds
    of one run, so they pool; a variant counts in the runs that have it.
    """
    wanted = [(v, "untraced") for s in summaries for v in s if v != "untraced" and "all_s" in s[v]]
    wanted = list(dict.fromkeys(wanted + pairs))
    print(f"pooled over {len(summaries)} runs (each round one sample):")
    for top, bottom in wanted:
        values = [r for s in summaries if top in s and bottom in s for r in ratios(s, top, bottom)]
        used = sum(1 for s in summaries if top in s and bottom in s)
        print(
            f"  {top + ' / ' + bottom:40s} {_interval(values, paired_interval):24s} {len(values)} rounds, {used} runs"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "runs",
        type=Path,
        nargs="+",
        help="the probe's --json outputs (.json or .json.xz), each followed by its printed output (.txt) "
        "when it has no pass_stats",
    )
    ap.add_argument("--quiet", type=float, default=0.03)
    ap.add_argument("--slow", type=float, default=1.25)
    ap.add_argument(
        "--pair", action="append", default=[], metavar="TOP/BOTTOM", help="also pool TOP's time over BOTTOM's"
    )
    args = ap.parse_args(argv)
    pairs = []
    for pair in args.pair:
        top, _, bottom = pair.partition("/")
        if not top or not bottom:
            print(f"probe_analysis: --pair {pair!r}: expected TOP/BOTTOM, two variants", file=sys.stderr)
            return 2
        pairs.append((top, bottom))
    loaded = []
    try:
        for json_path, text_path in runs_of(args.runs):
            run = _read(json_path)
            stats = run.get("pass_stats") or (pass_stats_from_text(text_path.read_text()) if text_path else {})
            if "untraced" not in run.get("summary", {}):
                print(f"probe_analysis: the run has no untraced passes ({json_path})", file=sys.stderr)
                return 2
            loaded.append((json_path, run, stats))
    except (OSError, ValueError, lzma.LZMAError) as exc:
        print(f"probe_analysis: cannot read the run: {exc}", file=sys.stderr)
        return 2
    paired_interval = _paired_interval()
    for json_path, run, stats in loaded:
        if len(loaded) > 1:
            print(f"== {json_path}")
        report_run(run, stats, args, paired_interval)
    if len(loaded) > 1 or pairs:
        report_pooled([run["summary"] for _, run, _ in loaded], pairs, paired_interval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
