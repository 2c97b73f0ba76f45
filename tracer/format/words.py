"""The words a trace's blocks hold: each block's text, from ``session.json`` alone.

``pagedtrace run`` with a model that has a tokenizer writes ``token_text`` into
``session.json``: the text of every token id its prompts and outputs hold. With the
request's tokens (prompt, then output) and the block size, the text of logical block ``j``
of a request is the text of its tokens ``j * block_size`` up to the request's length: the
block-table grids, the prefix-cache explainer, ``show``, ``step`` and ``diff`` show it,
with no tokenizer loaded. A trace without ``token_text`` (token-id prompts, ``vllm serve``)
has no words: :meth:`Words.of` returns None and the pictures show block ids only.

Standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tracer.format.requests import known_tokens, session_id_of
from tracer.format.store import SESSION, Trace

__all__ = ["SNIPPET_CHARS", "Words", "snippet", "visible"]

#: Characters of a block's text shown in a grid cell; the whole text goes in its tooltip.
SNIPPET_CHARS = 12
#: How whitespace that would vanish in a cell is drawn.
VISIBLE = {"\n": "⏎", "\t": "⇥", "\r": ""}


def visible(text: str) -> str:
    """``text`` with line breaks and tabs drawn (``⏎``, ``⇥``), so that it fits one line and none vanishes."""
    return "".join(VISIBLE.get(c, c) for c in text)


def snippet(text: str, chars: int = SNIPPET_CHARS) -> str:
    """``text`` for a small cell: :func:`visible`, cut to ``chars`` with an ellipsis."""
    shown = visible(text)
    return shown if len(shown) <= chars else shown[: chars - 1] + "…"


@dataclass(frozen=True)
class Words:
    """Each session request's tokens and each token's text."""

    token_text: Mapping[int, str]  #: token id -> its text
    tokens: Mapping[str, Sequence[int]]  #: session request id -> prompt then output token ids

    @classmethod
    def of(cls, trace: Trace) -> Words | None:
        """The trace's words from its ``session.json``; None when it records no token text."""
        return cls.from_session(trace.read_json(SESSION))

    @classmethod
    def from_session(cls, session: Any) -> Words | None:
        """From ``session.json``'s object; None without a well-formed ``token_text``."""
        tokens = known_tokens(session)
        table = session.get("token_text") if isinstance(session, dict) else None
        if tokens is None or not isinstance(table, dict) or not table:
            return None
        try:
            token_text = {int(k): v for k, v in table.items() if isinstance(v, str)}
        except ValueError:
            return None
        return cls(token_text, tokens)

    def text(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` (an id without text shows as ``⟨id⟩``)."""
        return "".join(self.token_text.get(i, f"⟨{i}⟩") for i in ids)

    def request_tokens(self, request_id: str) -> Sequence[int] | None:
        """The tokens of the engine's ``request_id`` (vLLM's suffix allowed), None for a request not in the session."""
        matched = session_id_of(request_id, self.tokens.keys())
        return None if matched is None else self.tokens[matched]

    def block_text(self, request_id: str, index: int, block_size: int, seq_len: int) -> str | None:
        """The text logical block ``index`` of ``request_id`` holds once ``seq_len`` tokens are cached."""
        tokens = self.request_tokens(request_id)
        if tokens is None:
            return None
        start = index * block_size
        return self.text(tokens[start : min(start + block_size, seq_len)])

    def row_texts(self, request_id: str, num_blocks: int, block_size: int, seq_len: int) -> list[str] | None:
        """:meth:`block_text` of each of a block-table row's ``num_blocks`` blocks."""
        if self.request_tokens(request_id) is None:
            return None
        return [self.block_text(request_id, j, block_size, seq_len) or "" for j in range(num_blocks)]
