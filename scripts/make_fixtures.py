"""Make the committed GPU fixtures (``tests/fixtures/h200-*``): one ``pagedtrace run`` each, from one table.

On a GPU machine with vLLM 0.26 installed (the device machine: ``source .device/install.sh env``
first; FlashAttention-2 fixtures need a bundle made with ``WITH_FA2=1``), from the repository root::

    python3 scripts/make_fixtures.py OUT [NAME ...]      # every fixture when no NAME is given
    python3 scripts/make_fixtures.py --list               # the table: each name and its arguments

Each NAME runs ``pagedtrace run`` with :data:`COMMON` and the fixture's arguments from
:data:`FIXTURES` (weights from ``pagedtrace_random``, the engine in this process), through
``scripts/pagedtrace_run.py``: the GPU host has no libcst, which the full CLI imports. The trace is
then cut down as the committed one is (``sources/`` dropped unless the table keeps them, layers
left out where it says so), the run's output goes inside it as ``engine.log``, and it is packed as
``OUT/NAME.tar``: unpack that into ``tests/fixtures/``. Once every name has run, the traces are
replayed on the same host (``scripts/replay_checks.py``) into ``OUT/replay.json``, to set against a
replay of the same traces on another machine (``replay_checks.py --compare``).
``OUT/make_fixtures.log`` has each run's exit status, time and errors.

The tracer writes its current trace format. A committed fixture keeps the format it was made in,
and its tests say so (``tests/test_fixtures_*``): a remade fixture changes what they read.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
Log = Callable[[str], None]

#: Arguments of every run, before the fixture's own (a later ``--seed`` wins).
COMMON = ("--seed", "0", "--max-model-len", "2048")


@dataclass(frozen=True)
class Fixture:
    """One committed trace: what it shows, the ``pagedtrace run`` arguments that make it, how it is cut."""

    about: str
    args: str  #: after :data:`COMMON`
    keep_sources: bool = False  #: keep ``sources/`` (a few fixtures hold the vLLM sources; the rest drop them)
    keep_layers: tuple[str, ...] = ()  #: the records of these layers only (empty: every layer traced)
    env: tuple[tuple[str, str], ...] = ()  #: environment variables of the run (e.g. ``VLLM_KV_CACHE_LAYOUT``)

    def argv(self) -> list[str]:
        """``pagedtrace run``'s arguments, ``-o`` left out."""
        return [*COMMON, *shlex.split(self.args)]


QWEN = "--model qwen2.5-7b-instruct"
GEMMA = "--model gemma-2-9b"
LLAMA = "--model llama-3.1-8b"
DEFAULT_MODE = "--cudagraph-mode FULL_AND_PIECEWISE"  # vLLM's own default on a GPU
#: The attention-backend fixtures: a short session, tensors of layer 0 (one prefill, a few decodes).
BACKEND_SHORT = "--prompts 3 --shared-prefix 32 --prompt-len 8:24 --max-tokens 5 --layers 0 --budget-mb 3"

#: Fixture directory name -> how it is made. FlashAttention 3 (vLLM's choice on Hopper) unless
#: ``--flash-attn-version``; ``--eager`` or a ``--cudagraph-mode``; tensors unless ``--no-tensors``.
FIXTURES: dict[str, Fixture] = {
    "h200-qwen2.5-7b-eager": Fixture(
        "eager, tensors of the first layer: FA3's layout, replayed",
        f"{QWEN} --prompts 4 --shared-prefix 32 --prompt-len 8:24 --max-tokens 6 --budget-mb 8 --eager",
        keep_sources=True,
    ),
    "h200-qwen2.5-7b-piecewise": Fixture(
        "PIECEWISE CUDA graphs, metadata: attention runs outside the graphs every step",
        f"{QWEN} --prompts 4 --shared-prefix 32 --prompt-len 8:24 --max-tokens 6 --no-tensors"
        " --cudagraph-mode PIECEWISE",
    ),
    "h200-qwen2.5-7b-default": Fixture(
        "vLLM's default graph mode, metadata (the committed trace, format 1, has its full-graph steps as gaps)",
        f"{QWEN} --prompts 4 --shared-prefix 32 --prompt-len 8:24 --max-tokens 6 --no-tensors {DEFAULT_MODE}",
    ),
    "h200-gemma2-softcap-window": Fixture(
        "soft-cap 50 and a 64-token window on layer 0 (not 1), tensors of layers 0 and 1",
        f"{GEMMA} --prompts 2 --shared-prefix 16 --prompt-len 8:60 --seed 1 --max-tokens 2 --layers 0,1 --budget-mb 10"
        " --eager",
    ),
    "h200-llama3.1-8b-fp8": Fixture(
        "fp8 KV cache, eager: FA3 quantizes the query too",
        f"{LLAMA} --prompts 2 --shared-prefix 32 --prompt-len 8:24 --max-tokens 4 --kv-cache-dtype fp8 --budget-mb 4"
        " --eager",
    ),
    "h200-qwen2.5-7b-bs32-chunked": Fixture(
        "block size 32 and 32-token steps: a prompt's prefill split over steps",
        f"{QWEN} --prompts 2 --shared-prefix 32 --prompt-len 8:40 --block-size 32 --max-num-batched-tokens 32"
        " --max-tokens 2 --budget-mb 4 --eager",
    ),
    "h200-qwen2.5-7b-fa2": Fixture(
        "FlashAttention-2, eager",
        f"{QWEN} --prompts 2 --shared-prefix 32 --prompt-len 8:24 --max-tokens 4 --budget-mb 4 --flash-attn-version 2"
        " --eager",
    ),
    "h200-qwen2.5-7b-fa2-piecewise": Fixture(
        "FlashAttention-2 under PIECEWISE graphs (3 requests: decode batches padded to 4)",
        f"{QWEN} --prompts 3 --shared-prefix 32 --prompt-len 8:24 --max-tokens 4 --budget-mb 6 --flash-attn-version 2"
        " --cudagraph-mode PIECEWISE",
    ),
    "h200-qwen2.5-7b-default-v3": Fixture(
        "default graph mode, metadata of layers 0 and 27: decode steps in full graphs, recorded",
        f"{QWEN} --prompts 4 --shared-prefix 32 --prompt-len 8:40 --max-tokens 16 --layers 0,27 --no-tensors"
        f" {DEFAULT_MODE}",
    ),
    "h200-gemma2-default-v3": Fixture(
        "default graph mode, metadata of layers 0 (window) and 1 (full): two KV-cache groups",
        f"{GEMMA} --prompts 3 --shared-prefix 16 --prompt-len 8:60 --max-tokens 8 --layers 0,1 --no-tensors"
        f" {DEFAULT_MODE}",
    ),
    "h100-gemma2-hybrid": Fixture(
        "default graph mode on an H100, two KV-cache groups recorded (window 64 and full), tensors of layers 0"
        " and 1, prompts longer than the window",
        f"{GEMMA} --prompts 2 --shared-prefix 16 --prompt-len 90:130 --max-tokens 8 --layers 0,1"
        f" --query-rows 16 --budget-mb 12 {DEFAULT_MODE}",
    ),
    "h200-llama3.1-8b-fp8-writelog": Fixture(
        "PIECEWISE, fp8 KV cache, tensors of layer 0 as a write log, whole blocks every 2nd step",
        f"{LLAMA} --prompts 2 --shared-prefix 32 --prompt-len 8:24 --max-tokens 6 --layers 0 --kv-cache-dtype fp8"
        " --kv-check-every 2 --budget-mb 8 --cudagraph-mode PIECEWISE",
    ),
    "h200-llama3.1-8b-fp8-default-tensors": Fixture(
        "default graph mode, fp8 KV cache, tensors of layer 0 copied inside the full graphs",
        f"{LLAMA} --prompts 2 --shared-prefix 32 --prompt-len 8:24 --max-tokens 8 --layers 0 --kv-cache-dtype fp8"
        f" --kv-check-every 2 --budget-mb 12 {DEFAULT_MODE}",
    ),
    "h200-qwen2.5-7b-default-rows": Fixture(
        "default graph mode, tensors of layer 0, 8 query rows a step, whole blocks every 3rd step",
        f"{QWEN} --prompts 4 --shared-prefix 32 --prompt-len 40:120 --max-tokens 12 --layers 0,27 --query-rows 8"
        f" --kv-check-every 3 --budget-mb 24 {DEFAULT_MODE}",
        keep_sources=True,
        keep_layers=("model.layers.0.self_attn.attn",),  # layer 27 traced as well, left out: half the size
    ),
    "h200-llama3.1-8b-fp8-rows": Fixture(
        "default graph mode, fp8 KV cache, 4 query rows a step: the key/value stored apart from the cache",
        f"{LLAMA} --prompts 3 --shared-prefix 32 --prompt-len 40:100 --max-tokens 8 --layers 0 --kv-cache-dtype fp8"
        f" --query-rows 4 --kv-check-every 2 --budget-mb 12 {DEFAULT_MODE}",
        keep_sources=True,
    ),
    "h100-qwen2.5-7b-triton-default": Fixture(
        "TRITON_ATTN in the default graph mode, tensors of layer 0 (decode steps copied inside full graphs)",
        f"{QWEN} {BACKEND_SHORT} --attention-backend TRITON_ATTN {DEFAULT_MODE}",
    ),
    "h100-qwen2.5-7b-triton-eager": Fixture(
        "TRITON_ATTN eager, tensors of layer 0",
        f"{QWEN} {BACKEND_SHORT} --attention-backend TRITON_ATTN --eager",
    ),
    "h100-qwen2.5-7b-flex-eager": Fixture(
        "FLEX_ATTENTION eager, tensors of layer 0 (eager Flex expands the whole cache per query head: 1024 blocks)",
        f"{QWEN} {BACKEND_SHORT} --attention-backend FLEX_ATTENTION --eager --num-blocks 1024",
    ),
    "h100-qwen2.5-7b-flex-default": Fixture(
        "FLEX_ATTENTION in the default graph mode (flex_attention compiled by torch.compile), tensors of layer 0",
        f"{QWEN} {BACKEND_SHORT} --attention-backend FLEX_ATTENTION {DEFAULT_MODE}",
    ),
    "h100-qwen2.5-7b-flashinfer-eager": Fixture(
        "FLASHINFER eager, tensors of layer 0 and FlashInfer's paged_kv_indptr / indices / last_page_len",
        f"{QWEN} {BACKEND_SHORT} --attention-backend FLASHINFER --eager",
    ),
    "h100-qwen2.5-7b-hnd-eager": Fixture(
        "FlashAttention with the HND cache layout (VLLM_KV_CACHE_LAYOUT=HND), eager, tensors of layer 0",
        f"{QWEN} {BACKEND_SHORT} --attention-backend FLASH_ATTN --eager",
        env=(("VLLM_KV_CACHE_LAYOUT", "HND"),),
    ),
}


def cut(trace: Path, fixture: Fixture) -> None:
    """Cut a fresh trace down as the committed fixture is: ``sources/`` and left-out layers removed."""
    if not fixture.keep_sources:
        shutil.rmtree(trace / "sources", ignore_errors=True)
        manifest = json.loads((trace / "manifest.json").read_text())
        manifest["sources"] = {}
        (trace / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    if fixture.keep_layers:
        kept = []
        for line in (trace / "steps.jsonl").read_text().splitlines():
            record = json.loads(line)
            if "layer" not in record or record["layer"] in fixture.keep_layers:  # gaps have no layer
                kept.append(line)
            elif record.get("tensors"):
                (trace / "tensors" / record["tensors"]).unlink(missing_ok=True)
        (trace / "steps.jsonl").write_text("".join(f"{line}\n" for line in kept))


def install_plugin(site: Path, log: Log) -> dict[str, str]:
    """Install this checkout (no dependencies) into ``site``, where vLLM finds the plugin's entry point;
    the environment for the runs: the checkout first on ``PYTHONPATH``, so its code is what runs."""
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--upgrade"]
    proc = subprocess.run([*pip, "--target", str(site), str(ROOT)], capture_output=True, text=True)
    if proc.returncode != 0:
        log(f"pip install of the checkout failed:\n{proc.stdout}{proc.stderr}")
    path = os.pathsep.join(p for p in (str(ROOT), str(site), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def make(name: str, work: Path, out: Path, env: dict[str, str], timeout: float, log: Log) -> Path | None:
    """Run, cut and pack one fixture; its trace directory, or None when the run made no trace."""
    fixture = FIXTURES[name]
    trace, run_log = work / name, work / f"{name}.log"
    argv = [sys.executable, str(ROOT / "scripts" / "pagedtrace_run.py"), "run", "-o", str(trace), *fixture.argv()]
    start = time.monotonic()
    rc: int | str
    with open(run_log, "w") as f:
        try:
            run_env = {**env, **dict(fixture.env)}
            rc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, env=run_env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = f"timed out after {timeout:.0f} s"
    env_text = " ".join(f"{k}={v}" for k, v in fixture.env)
    log(f"== {name}: exit {rc} in {time.monotonic() - start:.0f} s: {env_text} {shlex.join(fixture.argv())}".strip())
    text = run_log.read_text(errors="replace")
    log("\n".join(line for line in text.splitlines() if "Traceback" in line or "Error" in line)[:2000])
    if rc != 0:
        log("\n".join(text.splitlines()[-25:]))
    if not (trace / "manifest.json").is_file():
        return None
    cut(trace, fixture)
    shutil.copy(run_log, trace / "engine.log")
    with tarfile.open(out / f"{name}.tar", "w") as tar:
        tar.add(trace, arcname=name)
    return trace


def main(argv: list[str] | None = None) -> int:
    """Make the fixtures named (all by default) into ``OUT``; 1 when one made no trace, 2 on bad names."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("out", nargs="?", type=Path, help="directory for NAME.tar, replay.json and make_fixtures.log")
    ap.add_argument("names", nargs="*", metavar="NAME", help="fixtures to make (default: all)")
    ap.add_argument("--list", action="store_true", help="print the table and exit")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per run (default %(default)s)")
    args = ap.parse_args(argv)
    if args.list:
        for name, fixture in FIXTURES.items():
            print(f"{name}: {fixture.about}\n    pagedtrace run {shlex.join(fixture.argv())}")
        return 0
    if args.out is None:
        ap.error("give OUT (and NAMEs), or --list")
    unknown = [n for n in args.names if n not in FIXTURES]
    if unknown:
        ap.error(f"unknown fixture {', '.join(unknown)} (--list shows them)")
    args.out.mkdir(parents=True, exist_ok=True)
    log_file = args.out / "make_fixtures.log"

    def log(text: str) -> None:
        if text:
            print(text, flush=True)
            with open(log_file, "a") as f:
                f.write(text + "\n")

    made: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="pagedtrace-fixtures-") as tmp:
        env = install_plugin(Path(tmp) / "site", log)
        for name in args.names or list(FIXTURES):
            trace = make(name, Path(tmp), args.out, env, args.timeout, log)
            if trace is not None:
                made.append(trace)
        if made:
            replay = [sys.executable, str(ROOT / "scripts" / "replay_checks.py"), "-o", str(args.out / "replay.json")]
            proc = subprocess.run([*replay, *map(str, made)], capture_output=True, text=True, env=env)
            log(f"== replay on this host: exit {proc.returncode}\n{proc.stdout}{proc.stderr[-2000:]}")
    missing = len(args.names or FIXTURES) - len(made)
    log(f"made {len(made)} fixture(s) into {args.out}" + (f"; {missing} made no trace" if missing else ""))
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
