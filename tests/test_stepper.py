"""One real query through the block loop (reference_impl.stepper), ``pagedtrace step`` and its page."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from pagedtrace.cli import main
from reference_impl import kernel as K
from reference_impl.inputs import step_inputs
from reference_impl.resolve import kv_spec, resolve_layout
from reference_impl.stepper import kernel_lines, walk_query
from tests.conftest import fixture_path
from tests.factories import make_batch
from tracer.format import Trace
from tracer.format.walk import QueryWalk

H200 = fixture_path("h200-qwen2.5-7b-eager")
CHROMIUM = Path("/usr/bin/chromium")


def test_the_hook_only_reads():
    """paged_attention_loop with on_block returns bit for bit what it returns without."""
    batch = make_batch([37, 5, 64], [37, 1, 3], alibi=True, sinks=True, softcap=5.0)
    seen = []
    with_hook = K.paged_attention_loop(*batch.args, on_block=lambda **kw: seen.append(kw["block"]), **batch.kwargs)
    plain = K.paged_attention_loop(*batch.args, **batch.kwargs)
    assert torch.equal(with_hook, plain)
    assert seen == [*range(10), 0, 1, *range(16)]


def _captured(step: int, request: str):
    trace = Trace.open(H200)
    record = next(r for r in trace.records if r.step == step)
    tensors = trace.tensors(record)
    inputs = step_inputs(record, tensors, kv_spec(trace), resolve_layout(trace, [record]))
    row = next(i for i, rid in enumerate(record.request_ids) if rid.startswith(f"{request}-"))
    return trace, record, tensors, inputs, row


@pytest.mark.parametrize(("step", "req", "head", "token"), [(5, "1", 3, None), (4, "2", 5, 0), (4, "0", 27, 53)])
def test_walk_matches_an_independent_softmax(step, req, head, token):
    """m, l and the output of the walk equal a softmax written out over the sequence's logical keys."""
    trace, record, _, inputs, row = _captured(step, req)
    walk = walk_query(trace, step, req, head, token=token)
    q0, q1 = record.query_start_loc[row], record.query_start_loc[row + 1]
    t = (q1 - q0 - 1) if token is None else token
    seq = record.seq_lens[row]
    pos = seq - (q1 - q0) + t
    group = inputs.query.shape[1] // inputs.key_cache.shape[2]
    blocks = inputs.block_table[row, : math.ceil(seq / inputs.key_cache.shape[1])]
    k = inputs.key_cache[blocks].flatten(0, 1)[: pos + 1, head // group].double()  # causal: keys 0..pos
    v = inputs.value_cache[blocks].flatten(0, 1)[: pos + 1, head // group].double()
    s = (k @ inputs.query[q0 + t, head].double()) * record.scale
    m = float(s.max())
    l = float(torch.exp(s - m).sum())
    out = (torch.softmax(s, 0) @ v).numpy()

    assert walk.blocks[-1].m == pytest.approx(m, abs=1e-12)
    assert walk.blocks[-1].l == pytest.approx(l, rel=1e-12)
    assert walk.output_norm == pytest.approx(float(torch.tensor(out).norm()), rel=1e-12)
    assert [b.physical for b in walk.blocks] == list(record.block_table[row])
    assert sum(b.n_visible for b in walk.blocks) == pos + 1
    # m is the running max of the blocks' maxima; the rescale is exp(m_old - m_new).
    running = -math.inf
    for b in walk.blocks:
        new = max(running, b.block_max)
        assert b.m == new and b.rescale == pytest.approx(math.exp(running - new) if running > -math.inf else 0.0)
        running = new
    # The partitioned form: weights sum to 1, lse = m + log l, same output as the loop.
    assert sum(p.weight for p in walk.partitions) == pytest.approx(1.0, abs=1e-12)
    assert walk.lse == pytest.approx(m + math.log(l), abs=1e-12)
    assert walk.loop_vs_partitioned < 1e-12
    assert walk.ok and walk.max_abs < walk.tolerance


def test_kernel_lines_point_at_the_kernel():
    source = Path(K.__file__).read_text().splitlines()
    for line in kernel_lines():
        assert source[line.line - 1].strip() == line.text


def test_walk_json_round_trips():
    walk = walk_query(Trace.open(H200), 4, "2", 0, token=0)
    again = QueryWalk.from_json(json.loads(json.dumps(walk.to_json())))
    assert again == walk


def test_step_command(capsys):
    assert main(["step", str(H200), "--step", "5", "--request", "1", "--head", "3"]) == 0
    out = capsys.readouterr().out
    assert "rescale" in out and "physical = int(block_table[b, j])" in out and "within" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--step", "3", "--request", "1"], "not recorded"),
        (["--step", "5", "--request", "9"], "no request '9'"),
        (["--step", "5", "--request", "1", "--head", "28"], "head 28 out of range"),
        (["--step", "5", "--request", "1", "--token", "1"], "query rows 0..0"),
        (["--step", "5", "--request", "1", "--partition-size", "24"], "multiple of the block size"),
    ],
)
def test_step_command_rejects_bad_input(argv, message, capsys):
    assert main(["step", str(H200), *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and message in captured.err and len(captured.err.strip().splitlines()) == 1


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs /usr/bin/chromium")
def test_stepper_page_in_headless_chromium(tmp_path):
    """The page as Chromium parses it shows the kernel's own running values, block by block."""
    from tests.test_reports import chromium

    page = tmp_path / "step.html"
    assert main(["step", str(H200), "--step", "5", "--request", "1", "--head", "3", "--html", str(page)]) == 0
    # The kernel's running values, read through its hook directly (not through the stepper).
    _, record, _, inputs, row = _captured(5, "1")
    q0, q1 = record.query_start_loc[row], record.query_start_loc[row + 1]
    seen = []
    K.paged_attention_loop(
        inputs.query[q0:q1], inputs.key_cache, inputs.value_cache, inputs.block_table[row : row + 1],
        inputs.seq_lens[row : row + 1], torch.tensor([0, q1 - q0]), compute_dtype=torch.float64,
        on_block=lambda **kw: seen.append((float(kw["m"][0, 3, 0]), float(kw["l"][0, 3, 0]))), **inputs.kwargs,
    )  # fmt: skip
    proc = chromium(["--dump-dom", page.as_uri()], tmp_path / "profile")
    rows = re.findall(r'<tr class="block" data-j="(\d+)" data-m="([^"]+)" data-l="([^"]+)"', proc.stdout)
    assert [int(j) for j, _, _ in rows] == list(range(len(seen))) and seen
    for (_, m, l), (m_kernel, l_kernel) in zip(rows, seen, strict=True):
        assert float(m) == m_kernel and float(l) == l_kernel
    assert 'id="verdict" class="ok"' in proc.stdout and "<script" not in proc.stdout


@pytest.mark.parametrize("truncating", [False, True])
def test_the_walk_is_held_to_replays_bar_for_its_head(monkeypatch, truncating):
    """The walk's bar is the head's bar replay judges the step by, and its error is read as replay reads it."""
    import reference_impl.stepper as stepper
    from reference_impl.emulation import CPU_VEC_TOWARD_ZERO, FLASH, interval_midpoints
    from reference_impl.replay import replay_record

    emulation = CPU_VEC_TOWARD_ZERO if truncating else FLASH  # as if a _C_AVX2 kernel had written it
    monkeypatch.setattr(stepper, "emulation_of", lambda run: emulation)
    trace, record, tensors, inputs, row = _captured(4, "2")
    result, _ = replay_record(record, tensors, kv_spec(trace), resolve_layout(trace, [record]), emulation=emulation)
    bars = [h.tol for h in result.heads]
    head = min(range(len(bars)), key=bars.__getitem__)  # below the step's largest bar
    assert bars[head] < max(bars)
    walk = walk_query(trace, 4, "2", head)
    assert walk.tolerance == pytest.approx(bars[head], rel=1e-12)
    last = record.query_start_loc[row + 1] - 1
    read = interval_midpoints(tensors["output"][last, head], emulation).double()
    ours = K.paged_attention_loop(*inputs.args, **inputs.kwargs, compute_dtype=torch.float64)[last, head]
    assert walk.max_abs == pytest.approx(float((ours - read).abs().max()), rel=1e-9, abs=1e-12)
    if truncating:  # the read moved the values: the raw error would differ
        assert not torch.equal(read, tensors["output"][last, head].double())
