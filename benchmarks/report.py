"""Time ``build_report`` on a synthetic 1,000-step trace.

Writes a trace directory shaped like a busy serving run: ``--steps`` engine steps over
``--layers`` layers, up to ``--batch`` running requests with prompts of
``--min-prompt``..``--max-prompt`` tokens (a chunked prefill every time a request
arrives), decode tokens until ``--max-tokens``, blocks from a shuffled pool, a shared
prefix block, a gap every 50 steps, and a replay.json. The real vLLM sources are stored
when vLLM is installed. Then builds the report and prints the time, the page count and
the largest page (targets: at most 5 s, no page over a few MB). Figures only, no asserts::

    python benchmarks/report.py --steps 1000
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reports.build import write_report
from tracer.format import (
    FORMAT_VERSION,
    GapRecord,
    KVCacheSpec,
    ModelSummary,
    RunInfo,
    StepRecord,
    TraceWriter,
    read_sources,
    store_sources,
)

BLOCK_SIZE = 16
NUM_BLOCKS = 8192
HEADS, KV_HEADS, HEAD_SIZE = 32, 8, 128


def _site_packages() -> Path | None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).parent


def _run_info(layers: list[str], sources: dict) -> RunInfo:
    spec = KVCacheSpec(
        layer_names=tuple(layers),
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        num_kv_heads=KV_HEADS,
        head_size=HEAD_SIZE,
        dtype="bfloat16",
        cache_dtype="auto",
        element_size=2,
        shape=(NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE),
        stride=(BLOCK_SIZE * KV_HEADS * 2 * HEAD_SIZE, 2 * HEAD_SIZE, KV_HEADS * 2 * HEAD_SIZE, 1),
        layout="flash_nhd",
        physical_order="(blocks, tokens, heads, K|V)",
        k_scale=1.0,
        v_scale=1.0,
        backend_kv_cache_shape=(NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE),
        backend_stride_order=(0, 2, 1, 3),
    )
    return RunInfo(
        format_version=FORMAT_VERSION,
        pagedtrace_version="0.1.0",
        vllm_version="0.26.0",
        torch_version="2.11.0",
        platform="CudaPlatform",
        device="cuda",
        device_name="NVIDIA H200",
        attention_backend="vllm.v1.attention.backends.flash_attn.FlashAttentionImpl",
        flash_attn_version=3,
        cudagraph_mode="PIECEWISE",
        enforce_eager=False,
        model=ModelSummary(
            name="synthetic-7b",
            architectures=("LlamaForCausalLM",),
            num_layers=len(layers),
            num_attention_heads=HEADS,
            num_kv_heads=KV_HEADS,
            head_size=HEAD_SIZE,
            hidden_size=4096,
            vocab_size=32000,
            dtype="bfloat16",
            max_model_len=4096,
            weights="dummy",
        ),
        kv_cache=spec,
        options={"benchmark": True},
        created_at="2026-11-30T00:00:00+00:00",
        sources=sources,
    )


def make_trace(
    path: Path, *, steps: int, layers: int, batch: int, min_prompt: int, max_prompt: int, max_tokens: int, seed: int
) -> None:
    """Write the synthetic trace into ``path``."""
    rng = random.Random(seed)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    free = list(range(2, NUM_BLOCKS))
    rng.shuffle(free)
    shared_block = 1  # a 16-token system prompt every request starts with
    running: list[dict] = []
    next_id = 0
    replay_steps = []
    site = _site_packages()
    with TraceWriter(path) as writer:
        sources = store_sources(writer, read_sources(site)) if site else {}
        writer.write_manifest(_run_info(names, sources))
        for step in range(steps):
            if step % 50 == 49:
                writer.append(GapRecord(step=step, kind="request", reason="cuda-graph-replay", num_tokens=len(running)))
                for r in running:
                    r["seq"] += 1
                continue
            running = [r for r in running if r["seq"] < r["prompt"] + max_tokens]
            for r in running:
                r["query"] = 1
            if len(running) < batch:
                prompt = rng.randint(min_prompt, max_prompt)
                running.append(
                    {
                        "id": f"cmpl-{next_id:05d}-{rng.getrandbits(32):08x}",
                        "prompt": prompt,
                        "seq": BLOCK_SIZE,
                        "query": prompt - BLOCK_SIZE,
                        "blocks": [shared_block],
                    }
                )
                next_id += 1
            qsl, seq_lens, table, slots = [0], [], [], []
            for r in running:
                r["seq"] += r["query"]
                while len(r["blocks"]) * BLOCK_SIZE < r["seq"]:
                    r["blocks"].append(free.pop())
                for pos in range(r["seq"] - r["query"], r["seq"]):
                    slots.append(r["blocks"][pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
                qsl.append(qsl[-1] + r["query"])
                seq_lens.append(r["seq"])
                table.append(tuple(r["blocks"]))
            for layer in names:
                writer.append(
                    StepRecord(
                        step=step,
                        layer=layer,
                        kind="request",
                        request_ids=tuple(r["id"] for r in running),
                        num_actual_tokens=qsl[-1],
                        query_start_loc=tuple(qsl),
                        seq_lens=tuple(seq_lens),
                        block_table=tuple(table),
                        slot_mapping=tuple(slots),
                        max_query_len=max(r["query"] for r in running),
                        max_seq_len=max(seq_lens),
                        causal=True,
                        sliding_window=(-1, -1),
                        logits_soft_cap=0.0,
                        scale=HEAD_SIZE**-0.5,
                        use_cascade=False,
                        num_splits=0,
                        num_heads=HEADS,
                        num_kv_heads=KV_HEADS,
                        head_size=HEAD_SIZE,
                    )
                )
                replay_steps.append(
                    {
                        "step": step,
                        "layer": layer,
                        "ok": True,
                        "max_abs": 1e-3,
                        "max_rel": 1e-3,
                        "tol": 1e-2,
                        "heads": [{"head": h, "ok": True, "max_abs": 1e-3} for h in range(HEADS)],
                    }
                )
        writer.write_json("replay.json", {"ok": True, "steps": replay_steps, "write_path": [], "legacy": []})


def main(argv: list[str] | None = None) -> int:
    """Build the trace, time the report, print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--min-prompt", type=int, default=64)
    parser.add_argument("--max-prompt", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", type=Path, default=None, help="write trace and report here instead of a temp dir")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        trace = root / "trace"
        start = time.perf_counter()
        make_trace(
            trace,
            steps=args.steps,
            layers=args.layers,
            batch=args.batch,
            min_prompt=args.min_prompt,
            max_prompt=args.max_prompt,
            max_tokens=args.max_tokens,
            seed=args.seed,
        )
        made = time.perf_counter() - start
        start = time.perf_counter()
        result = write_report(trace, root / "report")
        seconds = time.perf_counter() - start
        pages = list((root / "report").glob("*.html"))
        total = sum(p.stat().st_size for p in pages)
        name, size = result.largest_page
        print(
            f"trace: {args.steps} steps x {args.layers} layers, "
            f"{(trace / 'steps.jsonl').stat().st_size / 2**20:.1f} MiB of records (written in {made:.1f} s)"
        )
        print(f"build_report: {seconds:.2f} s for {result.pages} pages ({total / 2**20:.1f} MiB)")
        print(f"largest page: {name} {size / 2**20:.2f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
