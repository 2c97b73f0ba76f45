"""The KV write log on a live H200 engine, where it must store blocks: context from before tracing.

One engine (the qwen2.5-7b-instruct preset, pagedtrace_random weights, PIECEWISE unless
``--mode``): batch A runs untraced and fills the prefix cache; then ``tracer.start`` attaches to
the running engine and batch B, which shares A's prefix, runs traced with tensors and a check
dump every ``--check-every`` steps. The prefix blocks were written before tracing, so the first
traced step must store them whole (``kv_new_blocks``); later steps only their new tokens. Prints
the write-log verification, the bytes per layer-step against the ideal, and the replay verdict.

    python3 lab/h200_writelog_check.py OUTDIR [--mode PIECEWISE] [--kv-cache-dtype fp8]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default="qwen2.5-7b-instruct")
    ap.add_argument("--mode", default="PIECEWISE")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--check-every", type=int, default=4)
    ap.add_argument("--layers", default="0")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import tempfile

    import tracer
    from tracer.format import Trace, parse_layers
    from tracer.models import resolve_model
    from tracer.random_weights import register_loader
    from tracer.session_config import SessionConfig, make_prompts

    register_loader()
    model_path, load_format, vocab, max_len = resolve_model(args.model, Path(tempfile.mkdtemp()))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(
        model=model_path,
        load_format=load_format,
        skip_tokenizer_init=True,
        seed=0,
        max_model_len=2048,
        enable_prefix_caching=True,
    )
    if args.mode == "NONE":  # eager (the only mode on CPU)
        kwargs.update(enforce_eager=True, max_model_len=max_len or 512, block_size=32)
    else:
        kwargs.update(
            gpu_memory_utilization=0.85,
            compilation_config={"cudagraph_mode": args.mode, "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]},
        )
    if args.kv_cache_dtype != "auto":
        kwargs["kv_cache_dtype"] = args.kv_cache_dtype
    llm = LLM(**kwargs)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, detokenize=False, ignore_eos=True)
    cfg_a = SessionConfig(trace_dir="", num_prompts=args.prompts, prompt_len=(40, 120), shared_prefix=96, seed=1)
    a = make_prompts(cfg_a, vocab)
    b = [p[:96] + list(reversed(p[96:])) for p in a]  # same prefix, new suffixes
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in a], params, use_tqdm=False)
    trace_dir = out / "writelog-trace"
    t = tracer.start(
        trace_dir,
        layers=parse_layers(args.layers),
        tensors=True,
        budget_mb=4096,
        kv_check_every=args.check_every,
        export_env=False,
    )
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in b], params, use_tqdm=False)
    gen_s = time.perf_counter() - t0
    t.stop()
    result: dict = {
        "generate_s": round(gen_s, 3),
        "stats": t.stats,
        "error": t.error,
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
    }
    trace = Trace.open(trace_dir)
    recs = trace.steps(kind="request")
    result["records"] = len(recs)
    result["new_blocks_per_step"] = []
    tensor_bytes = ideal = 0
    from safetensors import safe_open

    for r in recs:
        if r.tensors is None:
            continue
        with safe_open(str(trace.path / "tensors" / r.tensors), "pt") as f:
            names = list(f.keys())
            size = {n: f.get_slice(n).get_shape() for n in names}
            result["new_blocks_per_step"].append(size["kv_new_block_ids"][0])
        tensor_bytes += (trace.path / "tensors" / r.tensors).stat().st_size
        el = 2
        ideal += r.num_actual_tokens * (2 * r.num_heads + 2 * r.num_kv_heads) * r.head_size * el
    result["tensor_bytes"] = tensor_bytes
    result["ideal_bytes"] = ideal
    try:
        from tracer.format.writelog import verify_write_log

        checks = verify_write_log(trace)
        result["verify"] = [str(c) for c in checks][:40]
    except Exception as exc:  # noqa: BLE001
        result["verify_error"] = repr(exc)
    try:
        from reference_impl.replay import replay_trace

        rep = replay_trace(trace)
        result["replay_ok"] = rep.ok
        result["replay_steps"] = len(rep.steps)
        result["replay_worst"] = max((s.max_abs for s in rep.steps), default=None)
        result["writes"] = [(w.ok if hasattr(w, "ok") else str(w)) for w in getattr(rep, "writes", [])][:40]
    except Exception as exc:  # noqa: BLE001
        result["replay_error"] = repr(exc)
    (out / "writelog-check.json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({k: v for k, v in result.items() if k != "tokens"}, default=str)[:4000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
