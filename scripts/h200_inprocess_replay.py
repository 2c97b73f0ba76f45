"""Trace FA2 under PIECEWISE and replay in the same process: does the engine leave torch changed?

The issue's FA2 PIECEWISE trace got ``ok False`` from ``replay_trace`` on the H200 host and
passed on the CPU machine. Replayed in a fresh process the two hosts agree bit for bit
(``scripts/replay_checks.py``), so this checks the remaining difference: a replay run in the
process that just ran vLLM (torch.compile, CUDA graphs), against torch's global state.

    source .device/install.sh env; python3 scripts/h200_inprocess_replay.py OUT TRACE...
writes OUT/inprocess.json: torch's state before and after the engine, and each replay.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def torch_state() -> dict:
    """Global torch settings that change CPU float results."""
    import torch

    return {
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "default_dtype": str(torch.get_default_dtype()),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "mkldnn_enabled": torch.backends.mkldnn.enabled,
        "grad_enabled": torch.is_grad_enabled(),
        "inference_mode": torch.is_inference_mode_enabled(),
    }


def main() -> int:
    """Run the session, then replay the new trace and any given ones in this process."""
    from replay_checks import host_info, replay_one

    from tracer.session import SessionConfig, run_session

    out = Path(sys.argv[1])
    before = torch_state()
    trace = out / "pw-inprocess"
    cfg = SessionConfig(
        trace_dir=str(trace),
        model="qwen2.5-7b-instruct",
        num_prompts=3,
        prompt_len=(8, 24),
        shared_prefix=32,
        max_tokens=4,
        budget_mb=6,
        max_model_len=2048,
        enforce_eager=False,
        cudagraph_mode="PIECEWISE",
        flash_attn_version=2,
    )
    run_session(cfg)
    after = torch_state()
    traces = [str(trace), *sys.argv[2:]]
    result = {
        "host": host_info(),
        "torch_before": before,
        "torch_after": after,
        "traces": {Path(t).name: replay_one(t) for t in traces},
    }
    (out / "inprocess.json").write_text(json.dumps(result, indent=1))
    print("torch before", before, "\ntorch after ", after)
    for name, rep in result["traces"].items():
        steps = rep.get("steps", [])
        print(
            name, rep.get("error") or f"ok {rep['ok']}", [(s["step"], s["ok"], s["max_abs"], s["tol"]) for s in steps]
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
