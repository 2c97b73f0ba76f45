"""tracer.format.words: a block's text from session.json's token_text, with no tokenizer."""

from __future__ import annotations

from tracer.format.words import Words, snippet, visible

SESSION = {
    "prompts": [[1, 2, 3, 4, 5], [1, 2, 9]],
    "outputs": [[6], []],
    "request_ids": ["0", "1"],
    "token_text": {"1": "The", "2": " cat", "3": "\n", "4": " sat", "5": " on", "6": " mats", "9": "\t!"},
}


def test_block_text_from_the_session():
    words = Words.from_session(SESSION)
    assert words is not None
    # vLLM's suffixed engine id finds session request "0"; block size 2, 6 tokens cached.
    assert [words.block_text("0-ab12cd34", j, 2, 6) for j in range(3)] == ["The cat", "\n sat", " on mats"]
    assert words.block_text("0", 2, 2, 5) == " on"  # only the tokens cached so far
    assert words.row_texts("1", 2, 2, 3) == ["The cat", "\t!"]
    assert words.block_text("7", 0, 2, 2) is None and words.row_texts("7", 1, 2, 2) is None
    assert words.text([1, 42]) == "The⟨42⟩"


def test_no_words_without_token_text():
    assert Words.from_session({k: v for k, v in SESSION.items() if k != "token_text"}) is None
    assert Words.from_session({**SESSION, "token_text": {"x": "y"}}) is None
    assert Words.from_session(None) is None
    assert Words.from_session({**SESSION, "prompts": [[1, 2, "x"], [1]]}) is None


def test_snippets_keep_line_breaks_visible():
    assert visible("a\nb\tc") == "a⏎b⇥c"
    assert snippet("The capital of France", 12) == "The capital…"
    assert snippet("short") == "short"
