"""Prompts as text: ``--prompt`` / ``--prompts-file``, the tokenizer, and the text of each token.

``pagedtrace run`` tokenizes text prompts itself (transformers' tokenizer of the model,
chat template on request) and hands vLLM token ids, so a traced session's prompts are the
same ids whatever the model; ``session.json`` then records the texts and each token's text.
No vLLM here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: Files that make a model directory's tokenizer (any one of them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def read_prompts_file(path: str | Path) -> list[Any]:
    """``--prompts-file``: one prompt a line, or JSON lines (a string, ``{"prompt": TEXT}`` or ``{"messages": [...]}``).

    A line that starts with ``{`` or ``"`` is JSON; other non-empty lines are texts as they
    stand. A ``ValueError`` with one line names the file and line of what is wrong.
    """
    file = Path(path)
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--prompts-file {file}: cannot read it: {exc}") from None
    prompts: list[Any] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if not line.lstrip().startswith(("{", '"')):
            prompts.append(line)
            continue
        where = f"--prompts-file {file}:{number}"
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{where}: not JSON: {exc}") from None
        if isinstance(item, dict) and isinstance(item.get("prompt"), str):
            item = item["prompt"]
        elif isinstance(item, dict) and "messages" in item:
            item = item["messages"]
            ok = (
                isinstance(item, list)
                and item
                and all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in item
                )
            )
            if not ok:
                raise ValueError(f'{where}: \'messages\' must be a list of {{"role": ..., "content": ...}}')
        if not (isinstance(item, (str, list))) or not item:
            raise ValueError(f'{where}: expected a string, {{"prompt": TEXT}} or {{"messages": [...]}}')
        prompts.append(item)
    if not prompts:
        raise ValueError(f"--prompts-file {file}: no prompts in it")
    return prompts


def dir_has_tokenizer(path: Path) -> bool:
    """A model directory holds a tokenizer."""
    return any((path / f).is_file() for f in TOKENIZER_FILES)


def load_tokenizer(model_path: str) -> Any:
    """The model's tokenizer (transformers'), or None when it has none.

    A directory without tokenizer files (a random-weights preset's) has none; a hub id asks the hub.
    """
    if Path(model_path).is_dir() and not dir_has_tokenizer(Path(model_path)):
        return None
    try:  # transformers raises several types for a model without a tokenizer
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_path)
    except Exception:  # noqa: BLE001
        return None


def encode_prompts(prompts: Sequence[Any], chat: bool, tokenizer: Any) -> tuple[list[list[int]], list[str]]:
    """Text prompts as token ids, and the texts the model reads.

    ``prompts``: strings, or conversations (lists of ``{"role", "content"}``), which always go
    through the tokenizer's chat template; ``chat`` sends each string through it as a user message.
    """
    texts = []
    for item in prompts:
        if isinstance(item, list) or chat:
            messages = item if isinstance(item, list) else [{"role": "user", "content": item}]
            texts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
        else:
            texts.append(item)
    # A chat template writes its own special tokens; a plain text gets the tokenizer's (SmolLM2's: none).
    ids = [
        list(tokenizer(t, add_special_tokens=not (chat or isinstance(i, list)))["input_ids"])
        for t, i in zip(texts, prompts, strict=True)
    ]
    return ids, texts


def token_texts(tokenizer: Any, sequences: list[list[int]]) -> dict[str, str]:
    """Each token id of ``sequences`` -> its text on its own (``str(id)`` keys, as JSON has them)."""
    return {str(i): tokenizer.decode([i]) for i in sorted({i for seq in sequences for i in seq})}
