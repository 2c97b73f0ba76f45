"""tracer.prompts: ``--prompts-file``'s lines and JSON lines, the chat template, each token's text."""

from __future__ import annotations

import json

import pytest

from tracer.prompts import encode_prompts, read_prompts_file, token_texts


def test_plain_lines_and_json_lines(tmp_path):
    f = tmp_path / "p.txt"
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    f.write_text(
        "The capital of France is\n\n"
        + json.dumps("a JSON string")
        + "\n"
        + json.dumps({"prompt": "  spaces kept "})
        + "\n"
        + json.dumps({"messages": chat})
        + "\n"
    )
    assert read_prompts_file(f) == ["The capital of France is", "a JSON string", "  spaces kept ", chat]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json\n", r"p.txt:1: not JSON"),
        ('ok\n{"messages": [{"role": "user"}]}\n', r"p.txt:2: 'messages' must be a list"),
        ('{"other": 1}\n', r'p.txt:1: expected a string, \{"prompt": TEXT\} or \{"messages": \[...\]\}'),
        ("\n  \n", r"no prompts in it"),
    ],
)
def test_bad_files_name_the_line(tmp_path, text, message):
    f = tmp_path / "p.txt"
    f.write_text(text)
    with pytest.raises(ValueError, match=message):
        read_prompts_file(f)
    with pytest.raises(ValueError, match="cannot read it"):
        read_prompts_file(tmp_path / "missing.txt")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from tracer.gguf_model import packaged_model_dir
    from tracer.models import read_model_config

    return AutoTokenizer.from_pretrained(packaged_model_dir("smollm2-135m", read_model_config("smollm2-135m")))


def test_chat_template_on_request(tokenizer):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ids, texts = encode_prompts(["The capital of France is", chat], False, tokenizer)
    assert texts[0] == "The capital of France is" and ids[0] == [504, 3575, 282, 4649, 314]
    chat_text = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert texts[1] == chat_text
    assert tokenizer.decode(ids[1]) == texts[1] and ids[1][0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    _, [wrapped] = encode_prompts(["Hi"], True, tokenizer)  # --chat: a text becomes a user message
    assert wrapped.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert token_texts(tokenizer, [[504, 3575], [504]]) == {"504": "The", "3575": " capital"}


def test_run_refuses_text_for_a_model_without_a_tokenizer(tmp_path):
    """Checked before an engine starts: one line, exit 2, no trace directory."""
    from tests.test_serve import _cli

    out = tmp_path / "t"
    code, text = _cli("run", "-o", str(out), "--model", "tiny", "--prompt", "hello")
    assert code == 2 and "need a model with a tokenizer; tiny has none" in text
    assert len(text.strip().splitlines()) == 1 and not out.exists()
    bad = tmp_path / "p.jsonl"
    bad.write_text("{oops\n")
    code, text = _cli("run", "-o", str(out), "--model", "smollm2-135m", "--prompts-file", str(bad))
    assert code == 2 and "p.jsonl:1: not JSON" in text and not out.exists()
