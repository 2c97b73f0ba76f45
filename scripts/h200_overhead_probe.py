"""Where the tracer's PIECEWISE overhead goes: one engine, the benchmark's workload, tracer variants.

One engine (qwen2.5-7b-instruct preset, PIECEWISE), then, each on the same 3 batches: untraced;
the metadata tracer; the same with the backend hooks (forward / do_kv_cache_update) taken out;
the same with the writer thread doing nothing; untraced again; and one traced batch under
cProfile (main thread) with the writer's time summed. Prints seconds per variant.

    python3 scripts/h200_overhead_probe.py [--mode PIECEWISE] [--model qwen2.5-7b-instruct]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-7b-instruct")
    ap.add_argument("--mode", default="PIECEWISE")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    import tracer
    from tracer.loader import register_loader
    from tracer.session import SessionConfig, make_prompts, resolve_model

    register_loader()
    model_path, load_format, vocab, _ = resolve_model(args.model, Path(tempfile.mkdtemp()))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict = dict(
        model=model_path,
        load_format=load_format,
        skip_tokenizer_init=True,
        seed=0,
        max_model_len=4096 if args.mode != "NONE" else 1024,
    )
    if args.mode == "NONE":
        kwargs.update(enforce_eager=True, block_size=32)
    else:
        kwargs.update(gpu_memory_utilization=0.85, compilation_config={"cudagraph_mode": args.mode})
    llm = LLM(**kwargs)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, detokenize=False, ignore_eos=True)
    batches = [
        [
            TokensPrompt(prompt_token_ids=p)
            for p in make_prompts(
                SessionConfig(trace_dir="", num_prompts=args.prompts, prompt_len=(200, 300), shared_prefix=64, seed=s),
                vocab,
            )
        ]
        for s in (1, 2, 3)
    ]
    llm.generate(batches[0][:2], SamplingParams(max_tokens=4, temperature=0.0, detokenize=False), use_tqdm=False)

    def timed() -> float:
        t0 = time.perf_counter()
        for b in batches:
            llm.generate(b, params, use_tqdm=False)
        return time.perf_counter() - t0

    def traced(variant: str) -> float:
        t = tracer.start(tempfile.mkdtemp(), export_env=False)
        if variant == "no-backend-hooks":
            for owner, name, original in list(t._patched):
                if name in ("forward", "do_kv_cache_update"):
                    setattr(owner, name, original)
        if variant == "writer-does-nothing":
            t._thread._handle = lambda slot: None
        spent = [0.0]
        if variant == "profile-writer":
            handle = t._thread._handle

            def timed_handle(slot):
                t0 = time.perf_counter()
                handle(slot)
                spent[0] += time.perf_counter() - t0

            t._thread._handle = timed_handle
        s = timed()
        t.stop()
        if variant == "profile-writer":
            print(f"  writer thread: {spent[0]:.3f} s in handle_slot over {t.stats['records']} records")
        return s

    results = {"untraced": timed()}
    for v in ("metadata", "no-backend-hooks", "writer-does-nothing", "profile-writer"):
        results[v] = traced(v)
    results["untraced again"] = timed()
    for k, v in results.items():
        print(f"{args.mode:10s} {k:22s} {v:.3f} s  ({v / results['untraced']:.2f}x)")
    t = tracer.start(tempfile.mkdtemp(), export_env=False)
    prof = cProfile.Profile()
    prof.enable()
    llm.generate(batches[1], params, use_tqdm=False)
    prof.disable()
    t.stop()
    out = io.StringIO()
    st = pstats.Stats(prof, stream=out).sort_stats("tottime")
    st.print_stats(25)
    print(out.getvalue()[:6000])
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumtime").print_stats("tracer", 15)
    print(out.getvalue()[:4000])


if __name__ == "__main__":
    main()
