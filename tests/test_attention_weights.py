"""reference_impl.attention_weights and ``pagedtrace attention``: the weights against a dense softmax, and
``weights @ V`` against the recorded output of a committed H200 step with replay's bar."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from pagedtrace.cli import main
from reference_impl.attention_weights import attention_map, sequence_weights, step_weights, weighted_values
from reference_impl.inputs import StepInputs, emulated_output, judge_output
from tests.conftest import fixture_path
from tests.factories import make_batch
from tracer.format import Trace
from tracer.format.attention import bin_edges, kept_rows, summarize_row

GEMMA = fixture_path("h200-gemma2-softcap-window")  # window 64 on layer 0, soft-cap 50, tensors at steps 4, 5


def _dense_weights(batch, b: int) -> torch.Tensor:
    """``[H, t, s]``: softmax of the full logit matrix of sequence ``b``, the sink as an extra column."""
    kw = batch.kwargs
    k, _ = batch.logical_kv(b)
    s = int(batch.seq_lens[b])
    q0, q1 = int(batch.query_start_loc[b]), int(batch.query_start_loc[b + 1])
    q = batch.query[q0:q1].double()
    heads = q.shape[1]
    k = k.double().repeat_interleave(heads // k.shape[1], dim=1)
    logits = torch.einsum("thd,nhd->htn", q, k) * kw["scale"]
    if kw["softcap"] > 0:
        logits = kw["softcap"] * torch.tanh(logits / kw["softcap"])
    row = torch.arange(q1 - q0)[:, None] + (s - (q1 - q0))
    col = torch.arange(s)[None, :]
    if kw["alibi_slopes"] is not None:
        logits = logits - kw["alibi_slopes"].double()[:, None, None] * (row - col).abs()
    left, right = kw["window"]
    hidden = torch.zeros(q1 - q0, s, dtype=torch.bool)
    if kw["causal"]:
        hidden |= col > row
    if left >= 0:
        hidden |= col < row - left
    if right >= 0:
        hidden |= col > row + right
    logits = logits.masked_fill(hidden, -math.inf)
    if kw["sinks"] is not None:
        logits = torch.cat([logits, kw["sinks"].double()[:, None, None].expand(heads, q1 - q0, 1)], dim=-1)
    return torch.nan_to_num(torch.softmax(logits, dim=-1), nan=0.0)[..., :s]


def _inputs(batch) -> StepInputs:
    return StepInputs(
        query=batch.query,
        key_cache=batch.key_cache,
        value_cache=batch.value_cache,
        block_table=batch.block_table.long(),
        seq_lens=batch.seq_lens,
        query_start_loc=batch.query_start_loc,
        kwargs=batch.kwargs,
        num_tokens=int(batch.query_start_loc[-1]),
    )


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"window": (5, 0), "softcap": 3.0},
        {"alibi": True, "sinks": True},
        {"causal": False, "window": (3, 2), "fp8": True},
    ],
    ids=["plain", "window-softcap", "alibi-sinks", "bidirectional-fp8"],
)
def test_weights_are_a_dense_softmax(options):
    batch = make_batch([37, 9, 20], [37, 1, 6], block_size=4, seed=7, **options)
    inputs = _inputs(batch)
    for b in range(3):
        weights, sink = sequence_weights(inputs, b)
        expected = _dense_weights(batch, b)
        torch.testing.assert_close(weights, expected, atol=1e-12, rtol=0)
        total = weights.sum(dim=-1) + (sink if sink is not None else 0.0)
        torch.testing.assert_close(total, torch.ones_like(total), atol=1e-12, rtol=0)
        # weights @ V is attention: the dense reference's output.
        q0, q1 = int(batch.query_start_loc[b]), int(batch.query_start_loc[b + 1])
        torch.testing.assert_close(weighted_values(inputs, b, weights), batch.dense()[q0:q1], atol=1e-12, rtol=0)


def test_a_hidden_key_has_no_weight():
    batch = make_batch([40], [1], block_size=4, window=(7, 0), seed=3)
    weights, _ = sequence_weights(_inputs(batch), 0)
    assert (weights[..., :32] == 0).all() and (weights[..., 32:] > 0).all()


@pytest.mark.parametrize("step", [4, 5])
@pytest.mark.parametrize("layer", ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"])
def test_weights_times_values_is_the_recorded_output_within_the_replay_bar(step, layer):
    trace = Trace.open(GEMMA)
    weights = step_weights(trace, step, layer=layer)
    inputs = weights.inputs
    out = torch.zeros(inputs.query.shape, dtype=torch.float64)
    for b, seq in enumerate(weights.sequences):
        total = seq.weights.sum(dim=-1)
        torch.testing.assert_close(total, torch.ones_like(total), atol=1e-12, rtol=0)
        out[list(seq.rows)] = weighted_values(inputs, b, seq.weights)
    verdict = judge_output(inputs, trace.tensors(weights.record)["output"], out, emulated_output(inputs))
    assert all(verdict["per_head_ok"]) and len(verdict["per_head_ok"]) == 16, verdict["per_head_max_abs"]


def test_the_window_layer_gives_no_weight_before_its_window():
    trace = Trace.open(GEMMA)
    seq = step_weights(trace, 5, layer="model.layers.0.self_attn.attn").sequences[1]  # 76 keys, window 64
    assert seq.seq_len == 76 and seq.positions == (75,)
    assert (seq.weights[..., : 76 - 64] == 0).all() and (seq.weights[..., 76 - 64 :] > 0).all()
    m = attention_map(trace, step_weights(trace, 5, layer="model.layers.0.self_attn.attn"), seq)
    assert m.group.startswith("group 0: sliding window 64 tokens") and m.physical == (1, 5, 6, 7, 8)
    assert all(s.visible == 64 for s in m.summaries)


def test_summaries_and_bins():
    s = summarize_row(2, [0.5, 0.0, 0.25, 0.25, 0.0], top=2)
    assert s.top == ((0, 0.5), (2, 0.25)) and s.first_mass == 1.0 and s.visible == 3
    assert s.entropy == pytest.approx(-(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25)))
    assert bin_edges(5) == (0, 1, 2, 3, 4, 5) and bin_edges(1030, 512) == (*range(0, 1030, 3), 1030)
    assert kept_rows(3, 256) == (0, 1, 2) and kept_rows(1000, 4) == (0, 333, 666, 999)


def test_cli_prints_per_head_summaries_and_saves_the_weights(tmp_path, capsys):
    out = tmp_path / "w.safetensors"
    code = main(["attention", str(GEMMA), "--step", "4", "--layer", "1", "--request", "#1", "--save", str(out)])
    text = capsys.readouterr().out
    assert code == 0 and "step 4 model.layers.1.self_attn.attn" in text and "group 1: full attention" in text
    assert text.count("│") >= 16 * 5  # a row per head
    saved = load_file(str(out))
    assert saved["weights.1"].shape == (16, 59, 75) and saved["weights.1"].dtype == torch.float64
    torch.testing.assert_close(saved["weights.1"].sum(-1), torch.ones(16, 59, dtype=torch.float64), atol=1e-12, rtol=0)
    assert saved["positions.1"].tolist() == list(range(16, 75))


def test_cli_json_and_bad_input(capsys):
    assert main(["attention", str(GEMMA), "--step", "5", "--head", "3", "--json"]) == 0
    maps = json.loads(capsys.readouterr().out)
    assert [m["request"] for m in maps] == [0, 1] and len(maps[1]["heads"]) == 1
    assert maps[1]["summaries"][0]["head"] == 3 and maps[1]["col_edges"][-1] == 76
    assert main(["attention", str(GEMMA), "--step", "5", "--head", "16"]) == 2
    assert main(["attention", str(GEMMA), "--step", "3"]) == 2
    assert main(["attention", str(GEMMA), "--step", "5", "--save", "w.npy"]) == 2
