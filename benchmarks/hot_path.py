"""What a metadata trace costs a launch-bound engine's thread, on CPU, without vLLM or a GPU.

PIECEWISE on the H200 is bound by the engine's Python thread: every microsecond the tracer
takes on it, and every microsecond another of its threads holds the GIL, lengthens the step.
This script measures both on any machine, through the tracer's real wrappers, ring, hand-over
and record writer process: a stand-in engine step calls the runner wrapper, the
``set_forward_context`` wrapper and ``--layers`` attention ``forward`` wrappers, and between
the layers does ``--ops`` small torch operations each (which release the GIL, as vLLM's
launches do), so a step takes about as long as a PIECEWISE decode step of the benchmark
workload (~9.5 ms). The metadata is the shape of that workload's: ``--reqs`` requests of
``--context`` tokens, one new token each, 16-token blocks.

It is not vLLM: the step's own work is synthetic. It answers one question, how many
microseconds per step the tracer adds to a thread that is busy with Python, so that a change
to the hot path can be measured before it goes to the H200 (``benchmarks/gpu_overhead.py``
measures the real engine).

    python benchmarks/hot_path.py [--steps 300] [--rounds 7] [--layers 28] [--ops 24] [--python-us 0]
        [--device cpu|cuda]

``--python-us N`` adds N µs of pure Python a layer, the GIL held throughout, as vLLM's own
Python between launches holds it: a thread of the tracer that wants the GIL then makes the
engine's thread wait.

Prints the untraced and traced step times (median of rounds, interleaved), the difference
in µs per step, and the ratio (wall time: noisy on a small machine); the CPU time the tracer's
calls take on the engine's thread per step (``time.thread_time``, the steadier figure); then
the torch calls the tracer makes on the engine's thread
per step (each is a dispatch and a release of the GIL, ~15 µs apiece on the H200 host under
vLLM), a count that does not depend on the machine. On CPU the tracer takes the path it
takes on CUDA (one packed copy), less the pinning and the CUDA event.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import types
from pathlib import Path


def _fake_engine(args: argparse.Namespace, directory: str | None):
    import torch

    from tracer import wrappers
    from tracer.install import Tracer
    from tracer.options import TracerOptions

    names = [f"model.layers.{i}.self_attn.attn" for i in range(args.layers)]

    class Impl:  # one per layer, as vLLM's attention backends make them; ``forward`` is set below
        alibi_slopes = sinks = None
        scale, num_heads, num_kv_heads, head_size, logits_soft_cap = 0.088, 28, 4, 128, 0

    impls = [Impl() for _ in names]
    dev = torch.device(getattr(args, "device", "cpu"))
    # (blocks, kv heads, block size, 2 x head size)
    cache = torch.zeros(64, 4, 16, 256, dtype=torch.bfloat16, device=dev)
    layers = [types.SimpleNamespace(layer_name=n) for n in names]
    modules = {n: types.SimpleNamespace(impl=impl, kv_cache=[cache]) for n, impl in zip(names, impls, strict=True)}
    cfg = types.SimpleNamespace(
        compilation_config=types.SimpleNamespace(
            static_forward_context=modules, max_cudagraph_capture_size=512, cudagraph_capture_sizes=[512]
        ),
        model_config=None,
    )
    reqs, blocks_per_req = args.reqs, -(-args.context // 16)
    width = 4096 // 16  # the runner's block table is as wide as max_model_len allows
    # the runner's persistent buffers; its metadata holds views of the batch's rows, as vLLM's does
    buffers = {
        "seq_lens": torch.full((512,), args.context, dtype=torch.int32, device=dev),
        "query_start_loc": torch.arange(513, dtype=torch.int32, device=dev),
        "block_table": torch.randint(1, 60000, (512, width), dtype=torch.int32, device=dev),
        "slot_mapping": torch.arange(8192, dtype=torch.int64, device=dev),
    }
    md = types.SimpleNamespace(
        num_actual_tokens=reqs,
        seq_lens=buffers["seq_lens"][:reqs],
        query_start_loc=buffers["query_start_loc"][: reqs + 1],
        block_table=buffers["block_table"][:reqs],
        slot_mapping=buffers["slot_mapping"][:reqs],
        max_query_len=1,
        max_seq_len=args.context,
        causal=True,
    )
    md_by_layer = dict.fromkeys(names, md)
    work = [torch.ones(16, device=dev) for _ in range(4)]
    sched = types.SimpleNamespace(
        total_num_scheduled_tokens=reqs, num_scheduled_tokens={f"r{i}": 1 for i in range(reqs)}, finished_req_ids=()
    )
    req_ids = [f"cmpl-{i:04d}-0" for i in range(reqs)]
    del blocks_per_req

    def set_forward_context(attn_metadata, *a, **k):
        return None

    def attention_forward(impl, layer, query, key, value, kv_cache, attn_metadata, output):
        return output

    def execute_model(runner, scheduler_output):
        sfc(md_by_layer, cudagraph_runtime_mode="PIECEWISE", batch_descriptor=types.SimpleNamespace(num_tokens=reqs))
        a, b, c, d = work
        for impl, layer in zip(impls, layers, strict=True):
            for _ in range(args.ops):  # the launches around one layer's attention
                torch.add(a, b, out=c)
            if args.python_us:  # Python between the launches, the GIL held throughout
                until = time.perf_counter() + args.python_us * 1e-6
                while time.perf_counter() < until:
                    pass
            impl.forward(layer, a, b, c, cache, md, d)  # as vLLM's Attention layer calls it
        return None

    runner = types.SimpleNamespace(vllm_config=cfg, input_batch=types.SimpleNamespace(req_ids=req_ids))
    if directory is None:  # untraced
        sfc = set_forward_context
        Impl.forward = attention_forward  # type: ignore[attr-defined]

        @torch.inference_mode()  # as vLLM's worker runs the runner's steps
        def step() -> None:
            execute_model(runner, sched)

        return step, None
    t = Tracer(TracerOptions(directory, layers=args.trace_layers))
    sfc = wrappers.forward_context(t, set_forward_context)
    Impl.forward = wrappers.forward(t, attention_forward)  # type: ignore[attr-defined]
    Impl.forward.__pagedtrace_original__ = attention_forward  # type: ignore[attr-defined]  # as Tracer._patch
    exe = wrappers.runner(t, "execute_model")(execute_model)
    t._handover = t._writer_thread()  # as Tracer.start makes it
    t.engine_loop_here()  # as LLM._run_engine says on the H200: the engine's own thread hands over, deferred

    @torch.inference_mode()
    def traced_step() -> None:
        exe(runner, sched)

    return traced_step, t


def _blocked() -> int:
    """How often the calling thread has blocked so far (Linux: ``voluntary_ctxt_switches``; else 0).

    A thread that waits for the GIL another thread holds sleeps on it: each wait is one.
    """
    try:
        for line in Path("/proc/thread-self/status").read_text().splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _pass(args: argparse.Namespace, traced: bool, blocked: list[float] | None = None) -> float:
    """Seconds per step of one pass (a fresh tracer each traced pass, warmed up untimed).

    ``blocked``: gets the times the engine's thread blocked per step.
    """
    directory = tempfile.mkdtemp(prefix="pagedtrace-hot-") if traced else None
    step, t = _fake_engine(args, directory)
    for _ in range(20):
        step()
    if t is not None:
        t.drain()
    b0 = _blocked()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    if getattr(args, "device", "cpu") != "cpu":
        import torch

        torch.cuda.synchronize()  # the launches have run, not only been queued
    seconds = (time.perf_counter() - t0) / args.steps
    if blocked is not None:
        blocked.append((_blocked() - b0) / args.steps)
    if t is not None:
        t.drain()
        t._handover.close()
        t._record_writer.finish()
        if t.error:
            raise SystemExit(t.error)
        lines = len(Path(directory, "steps.jsonl").read_text().splitlines())
        if lines < args.steps:
            raise SystemExit(f"only {lines} records for {args.steps + 20} steps")
    return seconds


#: The tracer's methods the engine's thread calls (the wrappers call into them).
TRACER_CALLS = ("_begin_step", "_end_step", "_on_forward")


#: Steps before the measured ones: every slot in use gets its pinned buffer. (The shared ring's
#: stretches, ``tracer.shared_host``, make their views as the ring goes round: one slice a step
#: for its first ~500 steps, ~0.1 % of a step on the H200 host; not warmed here.)
WARM_STEPS = 148


def _measured_steps(args: argparse.Namespace, steps: int, around, after_step=None) -> None:
    """A fresh traced stand-in: warmed up, then ``steps`` steps with each of :data:`TRACER_CALLS`
    run inside ``around()`` (a context manager), ``after_step()`` after each; the trace closed."""
    step, t = _fake_engine(args, tempfile.mkdtemp(prefix="pagedtrace-hot-"))
    for _ in range(WARM_STEPS):
        step()
    t.drain()
    for name in TRACER_CALLS:
        original = getattr(t, name)

        def measured(*a, _original=original, **k):
            with around():
                return _original(*a, **k)

        setattr(t, name, measured)
    for _ in range(steps):
        step()
        if after_step is not None:
            after_step()
    t.drain()
    t._handover.close()
    t._record_writer.finish()


def tracer_cpu_per_step(args: argparse.Namespace, steps: int = 1000) -> float:
    """CPU seconds the tracer's calls take on the engine's thread per traced step (``time.thread_time``:
    not the time it waits for the GIL or a lock, which wall time would add, noisily)."""
    import contextlib

    spent = [0.0]

    @contextlib.contextmanager
    def timed():
        t0 = time.thread_time()
        try:
            yield
        finally:
            spent[0] += time.thread_time() - t0

    _measured_steps(args, steps, timed)
    return spent[0] / steps


def torch_calls_per_step(args: argparse.Namespace, steps: int = 50) -> dict[str, float]:
    """Torch functions and tensor methods the tracer calls on the engine's thread in a traced step.

    Per name, the median over ``steps`` steps: a step that is the first use of a ring slot also
    allocates its pinned buffer, once per slot; the median is the steady state.
    """
    import collections

    from torch.overrides import TorchFunctionMode

    counts: collections.Counter[str] = collections.Counter()
    per_step: list[dict[str, int]] = []

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            counts[getattr(func, "__name__", str(func))] += 1
            return func(*args, **(kwargs or {}))

    def one_step_counted() -> None:
        per_step.append(dict(counts))
        counts.clear()

    _measured_steps(args, steps, Count, one_step_counted)
    names = {name for c in per_step for name in c}
    medians = {name: statistics.median(c.get(name, 0) for c in per_step) for name in names}
    return dict(sorted(((n, m) for n, m in medians.items() if m), key=lambda nm: -nm[1]))


#: :func:`python_opcodes_per_step`'s key for the Python function calls a step makes into the tracer's code
CALLS = "(calls)"


def python_opcodes_per_step(args: argparse.Namespace, steps: int = 400) -> dict[str, float]:
    """Python bytecode instructions the tracer's own code runs on the engine's thread per traced step.

    Per function (``module:function``, most first, the wrappers included), the mean over
    ``steps`` steps of a warmed-up stand-in, hand-overs included (one every ``HAND_OVER_EVERY``
    steps, shared out); :data:`CALLS`: how many calls of its functions that makes (a call costs
    more than most instructions). Counted with ``sys.settrace``'s opcode events: within ~2 % from
    run to run on any machine of one Python version (what varies is how far the record process
    has read, which the shared ring looks at), where :func:`tracer_cpu_per_step`'s thread time
    spreads by 2x between runs on the VM. A torch call is one instruction here, whatever it costs.
    """
    import collections
    import sys

    root = str(Path(__file__).resolve().parents[1] / "tracer")
    counts: collections.Counter[str] = collections.Counter()

    def trace(frame, event, arg):
        code = frame.f_code
        if not code.co_filename.startswith(root):
            return None
        frame.f_trace_opcodes = True
        key = f"{Path(code.co_filename).stem}:{code.co_name}"
        counts[CALLS] += 1

        def count(frame, event, arg):
            if event == "opcode":
                counts[key] += 1
            return count

        return count

    step, t = _fake_engine(args, tempfile.mkdtemp(prefix="pagedtrace-hot-"))
    for _ in range(WARM_STEPS):
        step()
    t.drain()
    sys.settrace(trace)  # the wrappers' own code too, not only the tracer's methods they call
    try:
        for _ in range(steps):
            step()
    finally:
        sys.settrace(None)
    t.drain()
    t._handover.close()
    t._record_writer.finish()
    return {k: n / steps for k, n in counts.most_common()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--ops", type=int, default=24, help="torch operations per layer (the step's own work)")
    ap.add_argument("--reqs", type=int, default=32)
    ap.add_argument("--context", type=int, default=360)
    ap.add_argument("--trace-layers", default="first", help="what the tracer records (--layers of pagedtrace run)")
    ap.add_argument(
        "--python-us",
        type=float,
        default=0.0,
        help="µs of pure Python per layer besides the --ops (the GIL held, as in vLLM's own Python between launches)",
    )
    ap.add_argument(
        "--device",
        default="cpu",
        help="where the stand-in's tensors live: cpu, or cuda (the tracer's CUDA path: pinned copies, "
        "the device mirror, events; the step's --ops are kernel launches)",
    )
    args = ap.parse_args()
    from tracer.format import parse_layers

    args.trace_layers = parse_layers(args.trace_layers)
    kinds = ["untraced", "traced"]
    times: dict[str, list[float]] = {k: [] for k in kinds}
    blocked: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(args.rounds):
        for kind in kinds[r % 2 :] + kinds[: r % 2]:  # alternated: drift cancels
            times[kind].append(_pass(args, kind == "traced", blocked[kind]))
    print(
        f"{args.layers} layers, {args.ops} ops and {args.python_us:g} µs of Python per layer, "
        f"{args.reqs} requests of {args.context} tokens, "
        f"tracer layers={args.trace_layers!r}, {args.rounds} rounds of {args.steps} steps"
    )
    u = statistics.median(times["untraced"])
    print(f"untraced {u * 1e3:.3f} ms/step, engine thread blocked {statistics.median(blocked['untraced']):.2f}/step")
    t = statistics.median(times["traced"])
    paired = statistics.median(b - a for a, b in zip(times["untraced"], times["traced"], strict=True))
    print(
        f"traced   {t * 1e3:.3f} ms/step: {(t - u) * 1e6:+.1f} us/step (paired median "
        f"{paired * 1e6:+.1f} us), {t / u:.3f}x; engine thread blocked {statistics.median(blocked['traced']):.2f}/step"
    )
    cpu = statistics.median(tracer_cpu_per_step(args) for _ in range(3))
    print(f"tracer CPU on the engine's thread: {cpu * 1e6:.1f} us/step (median of 3 x 1000 steps, time.thread_time)")
    ops = python_opcodes_per_step(args)
    calls = ops.pop(CALLS)
    top = ", ".join(f"{name} {n:.0f}" for name, n in list(ops.items())[:5])
    print(
        f"tracer's Python on the engine's thread: {calls:.1f} calls, {sum(ops.values()):.0f} opcodes/step ({top}, ...)"
    )
    torch_calls = torch_calls_per_step(args)
    listed = ", ".join(f"{name} {n:g}" for name, n in torch_calls.items())
    print(f"torch calls on the engine's thread per step (median): {sum(torch_calls.values()):g} ({listed})")


if __name__ == "__main__":
    main()
