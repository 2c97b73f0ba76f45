"""The vLLM source files a trace keeps, so annotations and reports work later without vLLM.

The tracer reads them from the engine's own installation (:func:`read_sources`) and stores
them with their sha256 (:func:`store_sources`); the annotator and the report read them
back through ``Trace.source``. Paths are relative to site-packages (``vllm/...``).

Standard library only.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tracer.format.store import TraceWriter

__all__ = [
    "ATTENTION",
    "BLOCK_TABLE",
    "CPU_ATTN",
    "FLASH_ATTN",
    "PAGED_ATTN",
    "SOURCE_FILES",
    "read_sources",
    "sha256_text",
    "store_sources",
]

PAGED_ATTN = "vllm/v1/attention/ops/paged_attn.py"
FLASH_ATTN = "vllm/v1/attention/backends/flash_attn.py"
CPU_ATTN = "vllm/v1/attention/backends/cpu_attn.py"
ATTENTION = "vllm/model_executor/layers/attention/attention.py"
BLOCK_TABLE = "vllm/v1/worker/block_table.py"
#: Stored in every trace, so that the annotator and reports work later without vLLM.
SOURCE_FILES = (PAGED_ATTN, FLASH_ATTN, CPU_ATTN, ATTENTION, BLOCK_TABLE)


def sha256_text(text: str) -> str:
    """Hex sha256 of a text's UTF-8 bytes (stored beside each source file)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def read_sources(site_packages: str | os.PathLike[str]) -> dict[str, str]:
    """Read the :data:`SOURCE_FILES` that exist under ``site_packages`` (the directory holding ``vllm/``).

    The tracer passes ``Path(vllm.__file__).parent.parent``; this function itself never
    imports vLLM.
    """
    root = Path(site_packages)
    out = {}
    for rel in SOURCE_FILES:
        file = root / rel
        if file.is_file():
            out[rel] = file.read_text(encoding="utf-8")
    return out


def store_sources(writer: TraceWriter, texts: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """Write the :data:`SOURCE_FILES` among ``texts`` into the trace; return ``RunInfo.sources``.

    Each entry is ``{vllm_path: {"file": path under the trace, "sha256": hex}}``; other
    paths in ``texts`` are ignored.
    """
    entries = {}
    for path in SOURCE_FILES:
        if path in texts:
            text = texts[path]
            entries[path] = {"file": writer.add_source(path, text), "sha256": sha256_text(text)}
    return entries
