"""Time the reference kernels on a synthetic 7B-shaped replay.

Builds, in memory, a trace-like workload: ``--steps`` engine steps, each a varlen batch of
about ``--batch`` decoding sequences (lengths ``--min-len``..``--max-len``), with a
chunked-prefill chunk mixed into every ``--prefill-every``-th step, all paged through a
shuffled block pool. Then replays every step through ``paged_attention_fast`` and a
random sample of steps through ``paged_attention_loop`` (extrapolated by KV tokens read),
and every step through ``paged_attention_compiled`` (decode rows in C++; built on first use),
and prints steps/s, KV bytes/s, seconds per 1,000 steps, the speed-up and the read floor
(the time to only gather the same bytes, see :func:`read_floor`), once per torch thread
count (``--threads 1,2``), with the machine's load average around each run (on a shared
machine, a load above the thread count means the figures are pessimistic).
Figures only, no asserts; the targets of the issue are printed next to them::

    python benchmarks/replay.py --steps 1000

With ``--engine`` it measures replay against the engine instead, side by side in one
invocation (``--repeat`` rounds, to see a shared machine's noise): each round runs
``pagedtrace run --prompts 128 --max-tokens 300`` (tiny preset, layer 0, tensors; ``--run-args``
replaces those flags) into a fresh directory, reads the engine's generate time from the trace's
``session.json`` (``generate_s``), replays the trace (``--device``; on the CPU one worker
process per core, :mod:`reference_impl.workers`) and prints steps/s and replay time / generate
time. With ``--trace DIR`` it replays an existing trace, its ``session.json`` giving the
generate time::

    python benchmarks/replay.py --engine --repeat 3
    python benchmarks/replay.py --trace TRACE --device cuda
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reference_impl import paged_attention_fast, paged_attention_loop
from reference_impl.compiled import CompiledKernelError, load, paged_attention_compiled

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TARGET_S_PER_1000 = 10.0  #: the issue's target for the fast kernel, on a 2-core CPU
TARGET_SPEEDUP = 20.0  #: ... and its speed-up over the loop


@dataclasses.dataclass(frozen=True)
class Step:
    """One engine step's attention metadata, vLLM's names."""

    block_table: torch.Tensor  #: [B, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor  #: [B] int32, keys per sequence (new tokens included)
    query_start_loc: torch.Tensor  #: [B + 1] int32
    num_actual_tokens: int  #: query rows, query_start_loc[-1]
    kv_tokens: int  #: sum(seq_lens): keys read by the step


@dataclasses.dataclass
class _Seq:
    blocks: list[int]
    length: int  #: tokens in the cache before this step
    target: int  #: length at which the sequence finishes


def build_workload(args: argparse.Namespace) -> tuple[list[Step], int]:
    """Simulate a scheduler: returns the steps and the number of physical blocks used."""
    rng = random.Random(args.seed)
    bs = args.block_size
    max_blocks = -(-(args.max_len + args.prefill_chunk) // bs)
    num_blocks = (args.batch + 2) * max_blocks
    free = list(range(num_blocks))
    rng.shuffle(free)  # physical blocks come back in no particular order, as in vLLM

    def new_seq(length: int, target: int) -> _Seq:
        seq = _Seq([], 0, target)
        grow(seq, length)
        return seq

    def grow(seq: _Seq, length: int) -> None:
        while len(seq.blocks) * bs < length:
            seq.blocks.append(free.pop())
        seq.length = length

    def release(seq: _Seq) -> None:
        free.extend(seq.blocks)
        rng.shuffle(free)

    def new_decode() -> _Seq:
        # A sequence joins decoding somewhere in [min_len, max_len) and leaves within a
        # few hundred tokens, never past max_len.
        length = rng.randint(args.min_len, args.max_len - 1)
        return new_seq(length, min(args.max_len, length + rng.randint(16, 400)))

    running = [new_decode() for _ in range(args.batch)]
    prefill: _Seq | None = None
    steps = []
    for step in range(args.steps):
        rows: list[tuple[list[int], int, int]] = []  # (blocks, seq_len, query_len)
        for seq in running:
            grow(seq, seq.length + 1)
            rows.append((seq.blocks, seq.length, 1))
        if args.prefill_every and step % args.prefill_every == 0:
            if prefill is None:
                prefill = new_seq(0, rng.randint(args.min_len, args.max_len))
            chunk = min(args.prefill_chunk, prefill.target - prefill.length)
            grow(prefill, prefill.length + chunk)
            rows.append((prefill.blocks, prefill.length, chunk))
            if prefill.length >= prefill.target:
                release(prefill)
                prefill = None
        for i, seq in enumerate(running):
            if seq.length >= seq.target:
                release(seq)
                running[i] = new_decode()
        width = max(len(blocks) for blocks, _, _ in rows)
        table = torch.zeros(len(rows), width, dtype=torch.int32)
        for r, (blocks, _, _) in enumerate(rows):
            table[r, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        seq_lens = torch.tensor([s for _, s, _ in rows], dtype=torch.int32)
        qsl = torch.zeros(len(rows) + 1, dtype=torch.int32)
        qsl[1:] = torch.tensor([q for _, _, q in rows]).cumsum(0)
        steps.append(Step(table, seq_lens, qsl, int(qsl[-1]), int(seq_lens.sum())))
    return steps, num_blocks


def replay(kernel, steps, query_pool, key_cache, value_cache, scale) -> float:
    """Seconds to run ``kernel`` over ``steps``."""
    start = time.perf_counter()
    for step in steps:
        kernel(
            query_pool[: step.num_actual_tokens],
            key_cache,
            value_cache,
            step.block_table,
            step.seq_lens,
            step.query_start_loc,
            scale=scale,
        )
    return time.perf_counter() - start


def read_floor(steps, key_cache, value_cache, chunk_blocks: int = 32) -> float:
    """Seconds to only gather every K and V block the steps read, in the cache dtype, in
    chunks of ``chunk_blocks`` into one reused buffer: no conversion, no math. What any
    kernel that reads the cache through torch ops pays at least, on this machine."""
    block_size = key_cache.shape[1]
    chunks = []
    for step in steps:
        ids = torch.cat(
            [step.block_table[b, : -(-seq_len // block_size)] for b, seq_len in enumerate(step.seq_lens.tolist())]
        ).long()
        chunks.extend(ids.split(chunk_blocks))
    buffer = torch.empty((chunk_blocks, *key_cache.shape[1:]), dtype=key_cache.dtype)
    start = time.perf_counter()
    for ids in chunks:
        torch.index_select(key_cache, 0, ids, out=buffer[: len(ids)])
        torch.index_select(value_cache, 0, ids, out=buffer[: len(ids)])
    return time.perf_counter() - start


def replay_against_engine(trace_dir: Path, device: str | None, label: str) -> dict:
    """Replay ``trace_dir`` (no replay.json written); print and return steps/s and the ratio to its generate time."""
    import json

    from reference_impl.replay import replay_trace
    from reference_impl.step_pass import select_device
    from reference_impl.workers import worker_count
    from tracer.format import Trace

    session = json.loads((trace_dir / "session.json").read_text())
    generate_s = float(session["generate_s"])
    dev = select_device(device)
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    report = replay_trace(Trace.open(trace_dir), device=dev)
    replay_s = time.perf_counter() - start
    steps = len(report.steps)
    processes = worker_count(None, steps, dev)
    print(
        f"{label}: {steps} steps replayed on {dev.type} ({processes} process{'es' * (processes > 1)}) "
        f"in {replay_s:.2f} s = {steps / replay_s:.1f} steps/s; "
        f"engine generate {generate_s:.2f} s; replay / generate = {replay_s / generate_s:.2f}x "
        f"(target <= 1: {'met' if replay_s <= generate_s else 'not met'}); "
        f"verdict {'ok' if report.ok else 'MISMATCH'}; "
        f"load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after",
        flush=True,
    )
    return {"steps": steps, "replay_s": replay_s, "generate_s": generate_s, "ok": report.ok, "device": dev.type}


def engine_rounds(args: argparse.Namespace) -> int:
    """``--engine``: ``--repeat`` rounds of a fresh ``pagedtrace run`` and its replay, side by side."""
    import shlex
    import subprocess
    import tempfile

    if args.trace is not None:
        replay_against_engine(Path(args.trace), args.device, str(args.trace))
        return 0
    pagedtrace = [sys.executable, "-m", "pagedtrace"]
    for i in range(args.repeat):
        with tempfile.TemporaryDirectory(prefix="pagedtrace-replay-bench-") as tmp:
            out = Path(tmp) / "trace"
            cmd = [*pagedtrace, "run", *shlex.split(args.run_args), "-o", str(out), "-q"]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            replay_against_engine(out, args.device, f"round {i + 1}/{args.repeat}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", action="store_true", help="replay against the engine's generate time (see above)")
    parser.add_argument("--trace", default=None, help="with --engine: replay this trace instead of making one")
    parser.add_argument("--repeat", type=int, default=2, help="with --engine: rounds (default %(default)s)")
    parser.add_argument(
        "--run-args",
        default="--prompts 128 --max-tokens 300",
        help="with --engine: pagedtrace run's flags (default: %(default)s)",
    )
    parser.add_argument("--device", default=None, help="with --engine: cpu or cuda (default: cuda when present)")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=8, help="decoding sequences per step")
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=2000)
    parser.add_argument(
        "--prefill-every", type=int, default=25, help="add a chunked-prefill chunk every N steps (0: never)"
    )
    parser.add_argument("--prefill-chunk", type=int, default=256)
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument(
        "--loop-every", type=int, default=50, help="time paged_attention_loop on one step in N (a seeded random sample)"
    )
    parser.add_argument(
        "--threads", default="1,2", help="comma-separated torch thread counts to measure (0: torch's default)"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.engine or args.trace is not None:
        return engine_rounds(args)
    thread_counts = [int(t) for t in args.threads.split(",")]

    steps, num_blocks = build_workload(args)
    gen = torch.Generator().manual_seed(args.seed)
    dtype = DTYPES[args.dtype]
    cache_shape = (num_blocks, args.block_size, args.num_kv_heads, args.head_size)
    key_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    value_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    max_rows = max(s.num_actual_tokens for s in steps)
    query_pool = torch.randn(max_rows, args.num_heads, args.head_size, generator=gen).to(dtype)
    scale = args.head_size**-0.5

    elem = key_cache.element_size()
    kv_row_bytes = 2 * args.num_kv_heads * args.head_size * elem  # K and V of one token
    total_kv = sum(s.kv_tokens for s in steps)
    total_rows = sum(s.num_actual_tokens for s in steps)
    kv_bytes = total_kv * kv_row_bytes
    print(
        f"workload: {len(steps)} steps, {total_rows} query rows, {total_kv} KV tokens read "
        f"({kv_bytes / 1e9:.2f} GB), cache {num_blocks} blocks x "
        f"{args.block_size} tokens, H={args.num_heads} H_kv={args.num_kv_heads} "
        f"D={args.head_size} {args.dtype}; {os.cpu_count()} CPUs"
    )
    # A seeded random sample: a stride could line up with the prefill period.
    sample_ids = sorted(
        random.Random(args.seed).sample(range(len(steps)), max(1, len(steps) // max(args.loop_every, 1)))
    )
    sample = [steps[i] for i in sample_ids]
    sample_kv = sum(s.kv_tokens for s in sample)

    for threads in thread_counts:
        if threads:
            torch.set_num_threads(threads)
        load_before = os.getloadavg()[0]
        replay(paged_attention_fast, steps[:3], query_pool, key_cache, value_cache, scale)
        fast_s = replay(paged_attention_fast, steps, query_pool, key_cache, value_cache, scale)
        floor_s = read_floor(steps, key_cache, value_cache)
        try:
            load()
            replay(paged_attention_compiled, steps[:3], query_pool, key_cache, value_cache, scale)
            compiled_s = replay(paged_attention_compiled, steps, query_pool, key_cache, value_cache, scale)
        except CompiledKernelError as exc:
            compiled_s, compiled_error = None, str(exc)
        loop_s = replay(paged_attention_loop, sample, query_pool, key_cache, value_cache, scale)
        fast_sample_s = replay(paged_attention_fast, sample, query_pool, key_cache, value_cache, scale)
        load_after = os.getloadavg()[0]
        loop_full_s = loop_s * total_kv / sample_kv
        per_1000 = fast_s * 1000 / len(steps)
        speedup = loop_full_s / fast_s
        print(
            f"\ntorch threads {torch.get_num_threads()}, load average (1 min) "
            f"{load_before:.2f} before, {load_after:.2f} after"
        )
        met = "met" if per_1000 <= TARGET_S_PER_1000 else "not met"
        print(
            f"  fast: {fast_s:.2f} s for {len(steps)} steps = {len(steps) / fast_s:.1f} steps/s, "
            f"{kv_bytes / fast_s / 1e9:.2f} GB/s of KV, {per_1000:.2f} s per 1000 steps "
            f"(target <= {TARGET_S_PER_1000:g} s: {met})"
        )
        if compiled_s is None:
            print(f"  compiled (fast + C++ decode rows): not measured, {compiled_error}")
        else:
            c_per_1000 = compiled_s * 1000 / len(steps)
            print(
                f"  compiled (fast + C++ decode rows): {compiled_s:.2f} s = "
                f"{len(steps) / compiled_s:.1f} steps/s, {kv_bytes / compiled_s / 1e9:.2f} GB/s of KV, "
                f"{c_per_1000:.2f} s per 1000 steps (target: "
                f"{'met' if c_per_1000 <= TARGET_S_PER_1000 else 'not met'}); "
                f"{loop_full_s / compiled_s:.1f}x the loop (target: "
                f"{'met' if loop_full_s / compiled_s >= TARGET_SPEEDUP else 'not met'})"
            )
        print(
            f"  read floor: {floor_s:.2f} s = {kv_bytes / floor_s / 1e9:.2f} GB/s (gathering "
            f"the blocks' bytes alone, no conversion or math); fast takes "
            f"{fast_s / floor_s:.1f}x that; a fast kernel {TARGET_SPEEDUP:g}x the loop would take "
            f"{loop_full_s / TARGET_SPEEDUP / floor_s:.1f}x"
        )
        print(
            f"  loop: {loop_s:.2f} s for {len(sample)} sampled steps ({sample_kv} KV tokens) "
            f"-> {loop_full_s:.1f} s extrapolated to all steps, "
            f"{len(steps) / loop_full_s:.2f} steps/s"
        )
        print(
            f"  speed-up fast/loop: {speedup:.1f}x over the whole run "
            f"({loop_s / fast_sample_s:.1f}x on the same sampled steps; target >= "
            f"{TARGET_SPEEDUP:g}x: {'met' if speedup >= TARGET_SPEEDUP else 'not met'})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
