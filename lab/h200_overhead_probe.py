"""Where the tracer's overhead goes: one engine, the benchmark's workload, tracer variants interleaved.

One engine (qwen2.5-7b-instruct preset, ``--mode`` PIECEWISE or FULL_AND_PIECEWISE, prefix
caching off so passes do not feed each other), then ``--rounds`` rounds; each round runs
every variant once on the same 3 batches (fresh prompts per round), in an order rotated per
round so drift cancels. Variants:

* ``untraced``
* ``metadata``        the metadata tracer as it is by default: each slot handed to the record writer
                      process on the engine's own thread, no writer thread (``PAGEDTRACE_WRITER=inline``)
* ``metadata-inline`` the same, said explicitly (the name older runs' JSON uses)
* ``metadata-process`` the slots handed to the record writer process by a writer thread that waits
                      on blocking CUDA events (``PAGEDTRACE_WRITER=process``); the variants below
                      keep that writer thread too:
* ``metadata-thread`` the records built on the writer thread (``PAGEDTRACE_WRITER=thread``)
* ``metadata-spin``   events busy-waited (``PAGEDTRACE_EVENT_WAIT=spin``)
* ``metadata-writerevent`` each step's event recorded by the writer thread
                      (``PAGEDTRACE_EVENT_ON=writer``): one CUDA call less on the engine's thread
* ``metadata-parts``  the metadata tracer, each piece of its engine-thread work timed apart (with
                      the writer thread; ``metadata-inline-parts``: the default, inline, where
                      ``submit`` holds the hand-over, ``_handle`` and ``_end``)
* ``metadata-pipe``   the default, but the steps' copies land in the slots' own pinned buffers and
                      their bytes go down the pipe to the record process (``PAGEDTRACE_HOST=pipe``;
                      the default lands them in memory that process maps, ``tracer.shared_host``);
                      ``metadata-pipe-parts`` times its pieces
* ``metadata-timer``  the default, but the steps held when the engine idles are handed over by an
                      idle thread asleep on a timer each step pushes ahead (``PAGEDTRACE_IDLE=timer``;
                      the default hands them over on the engine's own thread when vLLM's loop runs
                      out of work, ``engine``); ``metadata-look10``: that thread looking 10 times a
                      second instead (``look``); ``metadata-noidle``: neither (``off``)
* ``metadata-nodefer`` the default, but each step makes its own copy to the host and records its own
                      event (``PAGEDTRACE_DEFER=off``; the default packs each step into the shared
                      ring's device mirror and moves the queued steps in one copy with one event a
                      hand-over); ``metadata-nodefer-parts`` times its pieces
* ``metadata-nowriter`` the writer thread does nothing with a slot (records lost): the engine's share alone
* ``metadata-acct``   the metadata tracer, with the time of every call into it from the engine's
                      thread and of the writer's handling of each slot summed (``tracer_main_ms``,
                      ``writer_ms``, per step): what it can take from a launch-bound engine at most
                      (with a writer thread; ``metadata-inline-acct`` times the default, where the
                      hand-over, ``writer_ms``, is part of the engine thread's ``tracer_main_ms``)
* ``runner-off``      the wrappers only: the runner-level capture of each step does nothing
* ``idle``            a placebo: the tracer started (its idle thread and record writer process
                      running) and its hooks removed at once: what the probe's own protocol costs
* ``tensors-l0``      tensors for layer 0 (in a full-graph mode the copies were captured by a
                      tracer started before the engine, then stopped: ``tracer.graph_copies``)
* ``tensors-l0-ring8`` the same with an 8-slot ring (``PAGEDTRACE_RING_SLOTS=8``; the default is 64)

The ``PAGEDTRACE_*`` settings above (and the tracer internals the ``-parts``, ``-acct`` and
``nowriter`` variants patch) are alternatives the tracer measured and no longer has: the probe
does not run as is against the tracer in this repository (``lab/README.md``).

Prints each variant's median seconds and its ratio to the untraced median, the median of the
per-round ratios (each pass against the untraced pass of its own round) and best over best,
whether greedy tokens matched the untraced pass of the round, the seconds each pass spent in
Python's garbage collector, and a cProfile of one metadata pass.

    python3 lab/h200_overhead_probe.py [--mode PIECEWISE] [--rounds 3] [--until S] [--json OUT.json]

With ``--until S`` it starts no round after S seconds, so that one call of a fixed length runs
as many rounds as fit (e.g. ``--rounds 200 --until 420 --variants untraced,metadata
--no-profile``: ~80 rounds in one 10-minute call on the H200). Each traced variant is also given
as the geometric mean of its per-round ratios to the untraced pass, with a 95% bootstrap
interval over the rounds, and whether that interval shows ≥ 0.97× throughput; every other
traced variant also against ``metadata`` the same way (which change to the tracer helps).
Each round line gives the time it ended (``at``, Unix seconds), to set beside clock samples.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import itertools
import json
import os
import pstats
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

VARIANTS = ("untraced", "metadata", "metadata-spin", "runner-off", "tensors-l0")

#: Every variant the probe runs (the module's docstring says what each is).
KNOWN_VARIANTS = (
    "untraced",
    "metadata",
    "metadata-inline",
    "metadata-process",
    "metadata-thread",
    "metadata-spin",
    "metadata-writerevent",
    "metadata-parts",
    "metadata-inline-parts",
    "metadata-pipe",
    "metadata-pipe-parts",
    "metadata-timer",
    "metadata-look10",
    "metadata-noidle",
    "metadata-nodefer",
    "metadata-nodefer-parts",
    "metadata-nowriter",
    "metadata-acct",
    "metadata-inline-acct",
    "runner-off",
    "idle",
    "tensors-l0",
    "tensors-l0-ring8",
)

#: ``PAGEDTRACE_WRITER`` of the variants that are not the default ``inline``: they measure the
#: tracer with a writer thread, so their figures compare with each other's.
WRITER_OF = {
    "metadata-thread": "thread",
    "metadata-process": "process",
    "metadata-spin": "process",
    "metadata-writerevent": "process",
    "metadata-parts": "process",
    "metadata-nowriter": "process",
    "metadata-acct": "process",
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-7b-instruct")
    ap.add_argument("--mode", default="PIECEWISE")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", default="")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument(
        "--until", type=float, default=0.0, help="start no round after this many seconds of rounds (0: all --rounds)"
    )
    ap.add_argument("--no-profile", action="store_true", help="skip the cProfile of one metadata pass at the end")
    ap.add_argument(
        "--clocks",
        default="",
        help="sample the GPU's SM clock every 20 ms into this file (lab/gpu_clocks.py) and compare "
        "the steps that ran at full clock",
    )
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in KNOWN_VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {', '.join(unknown)} (known: {', '.join(KNOWN_VARIANTS)})")
    sampler = _start_sampler(args.clocks) if args.clocks else None
    import tracer
    from tracer.models import resolve_model
    from tracer.random_weights import register_loader
    from tracer.session_config import SessionConfig, make_prompts

    register_loader()
    model_path, load_format, vocab, _ = resolve_model(args.model, Path(tempfile.mkdtemp()))
    full = "FULL" in args.mode.upper()
    # In a full-graph mode the layer-0 copies must be captured with the graphs: a tracer with
    # tensors runs through engine start-up (it is stopped before the first timed pass).
    capture_tracer = tracer.start(tempfile.mkdtemp(), layers=(0,), tensors=True, export_env=False) if full else None
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model_path,
        load_format=load_format,
        skip_tokenizer_init=True,
        seed=0,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=0.85,
        enable_prefix_caching=False,
        compilation_config={"cudagraph_mode": args.mode},
    )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, detokenize=False, ignore_eos=True)

    def batches(round_: int) -> list[list]:
        out = []
        for s in (1, 2, 3):
            cfg = SessionConfig(
                trace_dir="",
                num_prompts=args.prompts,
                prompt_len=(200, 300),
                shared_prefix=64,
                seed=100 * round_ + s,
            )
            out.append([TokensPrompt(prompt_token_ids=p) for p in make_prompts(cfg, vocab)])
        return out

    llm.generate(batches(99)[0][:4], SamplingParams(max_tokens=4, temperature=0.0, detokenize=False), use_tqdm=False)
    if capture_tracer is not None:
        capture_tracer.stop()
        print(f"capture tracer: {capture_tracer.stats}; staged graphs: {len(capture_tracer._graph_copies)}")

    gc_pause = [0.0, 0.0]  # seconds in the collector during the timed pass, start of the current collection
    # the timed pass's collections: (generation, thread) -> [count, seconds]; the engine's thread is "engine"
    gc_runs: dict[tuple[int, str], list[float]] = {}
    engine_thread = threading.get_ident()

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_pause[1] = time.perf_counter()
        else:
            took = time.perf_counter() - gc_pause[1]
            gc_pause[0] += took
            who = "engine" if threading.get_ident() == engine_thread else threading.current_thread().name
            run = gc_runs.setdefault((info.get("generation", -1), who), [0, 0.0])
            run[0] += 1
            run[1] += took

    gc.callbacks.append(on_gc)

    # Every engine step timed, in every variant alike (LLM.generate calls llm_engine.step() once a
    # step: scheduling, the model runner, the outputs). A pass's median step is what a burst on
    # the host (a few slow steps) leaves alone; the pass's wall time is not.
    step_s: list[float] = []
    step_at: list[float] = []  # each step's start, Unix seconds (to find the clock it ran at)
    engine_step = llm.llm_engine.step

    def timed_step():
        step_at.append(time.time())
        t0 = time.perf_counter()
        try:
            return engine_step()
        finally:
            step_s.append(time.perf_counter() - t0)

    llm.llm_engine.step = timed_step

    host: dict[str, Any] = {}  # the timed pass's host figures (``_host_now`` before and after)
    child: list[int | None] = [None]  # the record process's pid, whose CPU the timed pass also reads

    def timed(bs: list[list]) -> tuple[float, list]:
        gc_pause[0] = 0.0
        gc_runs.clear()
        step_s.clear()
        step_at.clear()
        before = _host_now(child[0])
        t0 = time.perf_counter()
        tokens = []
        for b in bs:
            tokens += [list(o.outputs[0].token_ids) for o in llm.generate(b, params, use_tqdm=False)]
        took = time.perf_counter() - t0
        after = _host_now(child[0])
        host.clear()
        host.update({k: after[k] - before[k] for k in before if k != "cpu"})
        host["cpu"] = [before["cpu"], after["cpu"]]
        return took, tokens

    def step_stats() -> dict[str, Any]:
        """The timed pass's engine steps: how many, their median and their sum (ms); its collections."""
        return {
            "host": dict(host),
            "gc": {f"gen{g}@{who}": [n, round(t * 1e3, 2)] for (g, who), (n, t) in sorted(gc_runs.items())},
            "engine_steps": len(step_s),
            "median_step_ms": round(statistics.median(step_s) * 1e3, 4) if step_s else 0.0,
            "sum_steps_s": round(sum(step_s), 4),
        }

    def warm_up(bs: list[list]) -> None:
        """The short generate every variant runs right before its timed pass, untraced too.

        For a traced variant it writes the trace's manifest and pins the slots' buffers off the
        clock; the untraced pass gets it as well, so that every pass starts from the same state.
        """
        llm.generate(bs[0][:2], SamplingParams(max_tokens=4, temperature=0.0, detokenize=False), use_tqdm=False)

    def run(variant: str, bs: list[list]) -> tuple[float, list, dict]:
        child[0] = None
        if variant == "untraced":
            warm_up(bs)
            s, tok = timed(bs)
            return s, tok, {"gc_s": round(gc_pause[0], 4), **step_stats()}
        os.environ["PAGEDTRACE_EVENT_WAIT"] = "spin" if variant == "metadata-spin" else "blocking"
        os.environ["PAGEDTRACE_WRITER"] = WRITER_OF.get(variant, "inline")
        os.environ["PAGEDTRACE_EVENT_ON"] = "writer" if variant == "metadata-writerevent" else "engine"
        # metadata-pipe: the copies land in the slots' own buffers and their bytes go down the pipe
        os.environ["PAGEDTRACE_HOST"] = "pipe" if variant.startswith("metadata-pipe") else "shared"
        # the held steps once the engine idles: on its own thread (default); an idle thread asleep on a
        # timer the steps push; the thread looking 10 times a second; neither
        idle = {"metadata-timer": "timer", "metadata-look10": "look", "metadata-noidle": "off"}
        os.environ["PAGEDTRACE_IDLE"] = idle.get(variant, "engine")
        # each step's own copy and event instead of one a hand-over
        os.environ["PAGEDTRACE_DEFER"] = "off" if variant.startswith("metadata-nodefer") else "on"
        if variant.endswith("-ring8"):  # an 8-slot ring instead of the default 64
            os.environ["PAGEDTRACE_RING_SLOTS"] = "8"
        kw = {"layers": (0,), "tensors": True, "budget_mb": 8192.0} if variant.startswith("tensors-l0") else {}
        directory = tempfile.mkdtemp()
        t = tracer.start(directory, export_env=False, **kw)
        if variant == "runner-off":
            t._end_request_step = lambda *a, **k: None
        if variant == "idle":  # the writer thread and process running, no hook installed: what their presence costs
            t._uninstall()
        if variant == "metadata-nowriter":  # the writer thread takes no GIL: what the engine's thread alone costs
            t._thread._handle = lambda slot: None
            t._thread._end = None
        spent = {"main_s": 0.0, "writer_s": 0.0}
        undo: list = []
        acct: dict = {}
        blocks: dict[str, int] = {}
        if variant.endswith("-parts"):
            # Where the engine thread's share goes: each piece timed on its own (``parts_us_per_step``),
            # and how often the engine's thread blocked inside it (``parts_blocks_per_pass``).
            import tracer.install as hooks_module

            for owner, name in (
                (hooks_module, "queue_host_copies"),
                (hooks_module, "record_event"),
                (hooks_module, "capturing"),
                (hooks_module, "is_warmup_batch"),
                (t._thread, "submit"),
                (t._thread, "_handle"),  # the writer thread's (with _end: the message to the record process)
                (t._thread, "_end"),
                (t, "_req_ids"),
                (t, "_step_metadata"),
                (t, "_begin_step"),
                (t, "_end_step"),
                (t, "_on_forward"),
            ):
                original = getattr(owner, name)
                spent[name] = 0.0
                blocks[name] = 0
                setattr(owner, name, _timed(original, spent, name, blocks))
                undo.append((owner, name, original))
        if "acct" in variant:
            # Time every call into the tracer from the engine's thread, and the writer's handling of
            # each slot (after its event fired): CPU the tracer takes from a launch-bound engine.
            for name in ("_begin_step", "_end_step", "_on_forward"):
                setattr(t, name, _timed(getattr(t, name), spent, "main_s"))
            # (with the message to the record process)
            t._thread._handle = _timed(t._thread._handle, spent, "writer_s")
            if t._thread._end is not None:
                t._thread._end = _timed(t._thread._end, spent, "writer_s")
        warm_up(bs)  # untimed: the trace's first record writes its manifest; slot buffers get pinned
        child[0] = getattr(getattr(t._record_writer, "records_out", None), "pid", None)
        spent.update(dict.fromkeys(spent, 0.0))
        blocks.update(dict.fromkeys(blocks, 0))
        steps0 = t.step
        s, tok = timed(bs)
        per_step = step_stats()
        steps = t.step - steps0
        t.stop()
        for owner, name, original in undo:
            setattr(owner, name, original)
        if undo:
            acct["parts_us_per_step"] = {
                k: round(v / max(steps, 1) * 1e6, 1) for k, v in spent.items() if k not in ("main_s", "writer_s")
            }
            acct["parts_blocks_per_pass"] = dict(blocks)
        os.environ.pop("PAGEDTRACE_EVENT_WAIT", None)
        os.environ.pop("PAGEDTRACE_WRITER", None)
        os.environ.pop("PAGEDTRACE_EVENT_ON", None)
        os.environ.pop("PAGEDTRACE_HOST", None)
        os.environ.pop("PAGEDTRACE_IDLE", None)
        if variant.startswith("metadata") and variant != "metadata-nowriter":
            acct["check"] = _check_trace(directory)
        os.environ.pop("PAGEDTRACE_RING_SLOTS", None)
        if "acct" in variant:
            acct.update(
                {
                    "steps": steps,
                    "tracer_main_ms": round(spent["main_s"] * 1e3, 2),
                    "writer_ms": round(spent["writer_s"] * 1e3, 2),
                    "main_us_per_step": round(spent["main_s"] / max(steps, 1) * 1e6, 1),
                    "writer_us_per_step": round(spent["writer_s"] / max(steps, 1) * 1e6, 1),
                }
            )
        return s, tok, {"error": t.error, "gc_s": round(gc_pause[0], 4), **per_step, **acct, **t.stats}

    results: dict[str, list[float]] = {v: [] for v in variants}
    pass_steps: dict[str, list[list[tuple[float, float]]]] = {v: [] for v in variants}  # (start, seconds)
    pass_stats: dict[str, list[dict]] = {v: [] for v in variants}  # each pass's figures, as its round line
    step_medians: dict[str, list[float]] = {v: [] for v in variants}
    same: dict[str, list[bool]] = {v: [] for v in variants}
    stats: dict[str, dict] = {}
    started = time.monotonic()
    for r in range(args.rounds):
        if args.until and r and time.monotonic() - started > args.until:
            print(f"--until {args.until:g} s: {r} rounds run", flush=True)
            break
        bs = batches(r)
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        ref = None
        round_tokens = {}
        for v in order:
            s, tok, st = run(v, bs)
            results[v].append(s)
            step_medians[v].append(st["median_step_ms"])
            pass_steps[v].append([(round(a, 4), round(d, 6)) for a, d in zip(step_at, step_s, strict=True)])
            pass_stats[v].append(st)
            round_tokens[v] = tok
            stats[v] = st
            print(f"round {r} {v:14s} {s:.3f} s at {time.time():.1f} {st}", flush=True)
        ref = round_tokens.get("untraced")
        for v in variants:
            same[v].append(ref is None or round_tokens[v] == ref)
    base = statistics.median(results["untraced"]) if results.get("untraced") else None
    summary = {}
    rounds = len(results[variants[0]])
    print(f"\n{args.mode}: median of {rounds} rounds, 3 batches x {args.prompts} prompts, {args.max_tokens} new tokens")
    for v in variants:
        med = statistics.median(results[v])
        ratio = med / base if base else None
        # Paired: each round's pass over the untraced pass of the same round (same prompts, next to
        # each other in time), and best over best: the least noisy estimates on a CPU-bound engine.
        paired = (
            [t / u for t, u in zip(results[v], results["untraced"], strict=True)] if results.get("untraced") else []
        )
        paired_med = statistics.median(paired) if paired else None
        best = min(results[v]) / min(results["untraced"]) if results.get("untraced") else None
        geo, low, high = paired_interval(paired) if len(paired) > 1 else (None, None, None)
        summary[v] = {
            "median_s": med,
            "all_s": results[v],
            "x_untraced": ratio,
            "x_untraced_paired_median": paired_med,
            "x_untraced_paired_geomean": geo,
            "x_untraced_paired_geomean_95": [low, high],
            "x_untraced_best": best,
            "same_tokens": all(same[v]),
        }
        print(
            f"{args.mode:18s} {v:14s} {med:.3f} s  ({_x(ratio)}; paired median {_x(paired_med)}; best/best "
            f"{_x(best)})  all {[round(x, 3) for x in results[v]]}  same tokens {all(same[v])}"
        )
        if geo is not None and v != "untraced":
            print(
                f"{'':18s} {v:14s} paired geometric mean {_x(geo)}, 95% interval [{_x(low)}, {_x(high)}] over "
                f"{len(paired)} rounds; >= 0.97x throughput shown (upper end <= {SHOWN_BELOW:.4f}x): {_shown(high)}"
            )
    if "metadata" in results:
        # The traced variants against each other, paired the same way (which change to the tracer helps)
        for v in variants:
            if v in ("untraced", "metadata") or len(results[v]) < 2:
                continue
            geo, low, high = paired_interval([t / m for t, m in zip(results[v], results["metadata"], strict=True)])
            summary[v]["x_metadata_paired_geomean"] = geo
            summary[v]["x_metadata_paired_geomean_95"] = [low, high]
            print(
                f"{'':18s} {v:14s} over metadata: paired geometric mean {_x(geo)}, 95% interval [{_x(low)}, {_x(high)}]"
            )
    if step_medians.get("untraced"):
        print("\nthe median engine step of each pass, paired with the untraced pass of its round:")
        for v in variants:
            if v == "untraced":
                continue
            ratios = [t / u for t, u in zip(step_medians[v], step_medians["untraced"], strict=True) if u]
            if len(ratios) < 2:
                continue
            geo, low, high = paired_interval(ratios)
            summary[v]["median_step_ms"] = step_medians[v]
            summary[v]["x_untraced_median_step_geomean"] = geo
            summary[v]["x_untraced_median_step_geomean_95"] = [low, high]
            print(
                f"{'':18s} {v:14s} median step {statistics.median(step_medians[v]):.3f} ms (untraced "
                f"{statistics.median(step_medians['untraced']):.3f} ms): paired geometric mean {_x(geo)}, 95% "
                f"interval [{_x(low)}, {_x(high)}] over {len(ratios)} rounds; >= 0.97x shown: {_shown(high)}"
            )
        summary.setdefault("untraced", {})["median_step_ms"] = step_medians["untraced"]
    clocks = None
    if sampler is not None:
        clocks = _full_clock_summary(sampler, args.clocks, variants, pass_steps, summary)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "mode": args.mode,
                    "summary": summary,
                    "stats": stats,
                    "pass_stats": pass_stats,
                    "pass_steps": pass_steps,
                    "clocks": clocks,
                },
                indent=None,
            )
        )
    if args.no_profile:
        return
    t = tracer.start(tempfile.mkdtemp(), export_env=False)
    # A whole batch first (65 steps: every ring slot has its pinned buffers), then the profiled one.
    llm.generate(batches(50)[0], params, use_tqdm=False)
    prof = cProfile.Profile()
    prof.enable()
    llm.generate(batches(50)[1], params, use_tqdm=False)
    prof.disable()
    t.stop()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
    print(out.getvalue()[:7000])
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumtime").print_stats("tracer", 30)
    print(out.getvalue()[:7000])
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumtime").print_callees("tracer/(ring|capture|hooks).py")
    print(out.getvalue()[:12000])


def _cpu_ms(stat_path: str) -> int:
    """User + system CPU of a process (``/proc/PID/stat``), in ms; -1 if it cannot be read."""
    try:
        stat = Path(stat_path).read_text()
        fields = stat[stat.rindex(")") + 2 :].split()
        return round((int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return -1


def _host_now(child: int | None = None) -> dict[str, int]:
    """The engine thread's context switches and CPU, and the host's steal time (Linux ``/proc``).

    ``vol``: the thread blocked (a wait for the GIL is a futex wait); ``invol``: it was preempted
    (another thread or process wanted its CPU); ``steal_ticks``: time the hypervisor gave the
    VM's CPUs to someone else; ``cpu``: the CPU the thread is on; ``proc_cpu_ms``: the engine
    process's CPU, every thread; ``child_cpu_ms``: the record process's (-1 without one).
    """
    out = {"vol": -1, "invol": -1, "steal_ticks": -1, "cpu": -1}
    out["proc_cpu_ms"] = _cpu_ms("/proc/self/stat")
    out["child_cpu_ms"] = _cpu_ms(f"/proc/{child}/stat") if child else -1
    try:
        for line in Path("/proc/thread-self/status").read_text().splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                out["vol"] = int(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches:"):
                out["invol"] = int(line.split()[1])
        stat = Path("/proc/thread-self/stat").read_text()
        out["cpu"] = int(stat[stat.rindex(")") + 2 :].split()[36])
        out["steal_ticks"] = int(Path("/proc/stat").read_text().split("\n", 1)[0].split()[8])
    except (OSError, ValueError, IndexError):
        pass
    return out


def _start_sampler(path: str):
    """The SM-clock sampler (``lab/gpu_clocks.py``), a process of its own, appending to ``path``."""
    import subprocess
    import sys

    Path(path).unlink(missing_ok=True)
    script = Path(__file__).resolve().parent / "gpu_clocks.py"
    return subprocess.Popen([sys.executable, str(script), path, "--period-ms", "20"])


#: Rounds in which a pass has fewer steps than this at full clock are left out of the full-clock pairs.
MIN_FULL_STEPS = 20


def _full_clock_summary(sampler, path: str, variants: list[str], pass_steps: dict, summary: dict) -> dict:
    """Stop the sampler; each pass's share of steps at full clock and its median full-clock step, paired.

    The tracer's cost is CPU time on the engine's thread; where the GPU runs at full clock the step is
    launch-bound and pays it in full, so the ratio of full-clock steps is the tracer's cost at its worst.
    The share of steps at full clock, per variant, says whether tracing moves the clock itself.
    """
    import signal
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_clocks import FULL_CLOCK_SHARE, full_clock_steps, load_samples, step_clocks

    sampler.send_signal(signal.SIGTERM)
    sampler.wait(timeout=10)
    samples = load_samples(Path(path))
    if not samples:
        print("no clock samples: the full-clock comparison is left out")
        return {}
    top = max(s[1] for s in samples)
    hist: dict[int, int] = {}
    reasons: dict[int, int] = {}
    for s in samples:
        hist[s[1]] = hist.get(s[1], 0) + 1
        reasons[s[2]] = reasons.get(s[2], 0) + 1
    print(f"\nSM clock: {len(samples)} samples, top {top} MHz; full clock: >= {FULL_CLOCK_SHARE:g} x top")
    print("  MHz (samples): " + ", ".join(f"{k} ({v})" for k, v in sorted(hist.items(), key=lambda kv: -kv[1])[:12]))
    print("  clock-event reasons (samples): " + ", ".join(f"{k:#x} ({v})" for k, v in sorted(reasons.items())))
    per_pass: dict[str, list[dict]] = {}
    for v in variants:
        rows = []
        for steps in pass_steps[v]:
            clocks = step_clocks(steps, samples)
            full = full_clock_steps(steps, clocks, top)
            rows.append(
                {
                    "share_full": round(len(full) / max(len(steps), 1), 4),
                    "median_full_ms": round(statistics.median(full) * 1e3, 4) if len(full) >= MIN_FULL_STEPS else None,
                    "clocks": clocks,
                }
            )
        per_pass[v] = rows
    print("steps at full clock, each pass's median full-clock step paired with the untraced pass of its round:")
    for v in variants:
        shares = [r["share_full"] for r in per_pass[v]]
        line = f"  {v:22s} share of steps at full clock: median {statistics.median(shares):.3f}"
        meds = [r["median_full_ms"] for r in per_pass[v] if r["median_full_ms"] is not None]
        if meds:
            line += f"; median full-clock step {statistics.median(meds):.3f} ms over {len(meds)} passes"
        if v != "untraced" and "untraced" in per_pass:
            ratios = [
                t["median_full_ms"] / u["median_full_ms"]
                for t, u in zip(per_pass[v], per_pass["untraced"], strict=True)
                if t["median_full_ms"] and u["median_full_ms"]
            ]
            if len(ratios) > 1:
                geo, low, high = paired_interval(ratios)
                summary[v]["x_untraced_full_clock_step_geomean"] = geo
                summary[v]["x_untraced_full_clock_step_geomean_95"] = [low, high]
                line += (
                    f"\n  {'':22s} x untraced {_x(geo)}, 95% interval [{_x(low)}, {_x(high)}] over {len(ratios)} "
                    f"rounds; >= 0.97x shown: {_shown(high)}"
                )
        print(line)
    return {"top_mhz": top, "histogram": hist, "per_pass": per_pass}


def _check_trace(directory: str) -> dict[str, int]:
    """The pass's trace: its records, their metadata problems, and decode steps whose ``seq_lens``
    did not each grow by one from the request step before (a copy of another step's metadata)."""
    from tracer.format import Trace
    from tracer.format.metadata import check_records

    trace = Trace.open(directory, strict=False)
    records = [r for r in trace.records if r.kind == "request"]
    problems = sum(c.num_problems for c in check_records(trace, records))
    stale = 0
    for before, after in itertools.pairwise(records):
        if after.request_ids == before.request_ids and after.num_actual_tokens == len(after.seq_lens):
            stale += any(b - a != 1 for a, b in zip(before.seq_lens, after.seq_lens, strict=True))
    return {"records": len(records), "problems": problems, "not_advancing": stale, "read": len(trace.problems)}


def _timed(fn, spent: dict[str, float], key: str, blocks: dict[str, int] | None = None):
    """``fn``, adding the seconds each call takes to ``spent[key]``.

    ``blocks``: also add how often the calling thread blocked inside the call (slept on a lock,
    the GIL or a system call: Linux's voluntary context switches of the thread, one ``getrusage``
    before and after) to ``blocks[key]``. Pieces nest (``submit`` holds ``_handle`` and ``_end``):
    each counts what happened inside it.
    """
    import resource

    thread = getattr(resource, "RUSAGE_THREAD", None)
    if blocks is None or thread is None:

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - t0

        return timed
    usage = resource.getrusage

    def timed_blocks(*args, **kwargs):
        v0 = usage(thread).ru_nvcsw
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - t0
            blocks[key] += usage(thread).ru_nvcsw - v0

    return timed_blocks


def paired_interval(ratios: list[float], *, resamples: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    """The geometric mean of per-round ratios and its 95% bootstrap interval (rounds resampled).

    Each round pairs a traced pass with the untraced pass next to it, on the same prompts; host
    speed drifts between rounds, so the rounds, not the passes, are the samples.
    """
    import math
    import random

    logs = [math.log(r) for r in ratios]
    rng = random.Random(seed)
    n = len(logs)
    means = sorted(sum(rng.choice(logs) for _ in range(n)) / n for _ in range(resamples))
    low, high = means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]
    return math.exp(sum(logs) / n), math.exp(low), math.exp(high)


#: A traced variant shows >= 0.97x untraced throughput when its interval's upper end is at most this.
SHOWN_BELOW = 1 / 0.97


def _shown(high: float | None) -> str:
    """Whether an interval with upper end ``high`` (a time ratio) shows the target: yes / no."""
    return "yes" if high is not None and high <= SHOWN_BELOW else "no"


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.3f}x"


if __name__ == "__main__":
    main()
