"""reference_impl.testing, its pytest plugin and ``pagedtrace replay --kernel MODULE:FUNCTION``.

A user's kernel is checked on real vLLM steps: the reference kernels pass on the H200
FlashAttention-3 fixture and on a CPU-engine trace; kernels with the bugs a paged kernel
really has (blocks read in physical order instead of through the block table, the
softmax scale dropped) fail, with a message that says where.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

from pagedtrace.cli import main
from reference_impl import fast as F
from reference_impl import kernel as K
from reference_impl.pytest_plugin import spaced_options
from reference_impl.replay import TOL_K
from reference_impl.testing import (
    CaseResult,
    KernelCase,
    assert_kernel_matches,
    check_kernel,
    check_trace,
    kernel_kwargs,
    load_cases,
    load_kernel,
)
from tests.conftest import fixture_path
from tracer.format import ReplayReport, StepResult, TraceError

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent
H200 = fixture_path("h200-qwen2.5-7b-eager")


# --------------------------------------------------------------------------- kernels under test


def contiguous_blocks(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, **kwargs):
    """Wrong: reads each sequence's blocks as consecutive cache rows from its first block."""
    table = block_table[:, :1] + torch.arange(block_table.shape[1], dtype=block_table.dtype)
    return F.paged_attention_fast(
        query, key_cache, value_cache, table.clamp_max(key_cache.shape[0] - 1), seq_lens, query_start_loc, **kwargs
    )


def unscaled(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, *, scale, causal=True):
    """Wrong: drops the softmax scale."""
    return F.paged_attention_fast(
        query, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale=1.0, causal=causal
    )


def bf16_output(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, *, scale, causal=True):
    """Right, as a real kernel is: fp32 inside, output rounded to the activation dtype."""
    out = F.paged_attention_fast(
        query, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale=scale, causal=causal
    )
    return out.to(query.dtype)


WRONG_KERNEL_MODULE = """
import torch
from reference_impl.fast import paged_attention_fast

def attn(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, **kwargs):
    table = block_table[:, :1] + torch.arange(block_table.shape[1], dtype=block_table.dtype)
    return paged_attention_fast(query, key_cache, value_cache, table.clamp_max(key_cache.shape[0] - 1),
                                seq_lens, query_start_loc, **kwargs)
"""


@pytest.fixture(scope="module")
def h200_cases() -> list[KernelCase]:
    return load_cases(H200)


@pytest.fixture(scope="module")
def cpu_cases(cpu_trace) -> list[KernelCase]:
    return load_cases(cpu_trace)


@pytest.fixture
def wrong_kernel_dir(tmp_path) -> Path:
    (tmp_path / "wrongattn.py").write_text(WRONG_KERNEL_MODULE)
    return tmp_path


# --------------------------------------------------------------------------- cases


def test_cases_are_the_captured_steps(h200_cases):
    assert [c.id for c in h200_cases] == [f"h200-qwen2.5-7b-eager/step{s}/layer0" for s in range(4, 10)]
    first = h200_cases[0]
    assert first.step == 4 and first.layer == "model.layers.0.self_attn.attn" and first.kind == "request"
    assert first.layout == "flash_nhd" and first.num_reqs == 4 and first.num_tokens == 111
    assert first.query.shape == first.expected.shape == first.reference.shape == (111, 28, 128)
    assert first.key_cache.shape == first.value_cache.shape == (9, 16, 4, 128)
    for t in (first.block_table, first.seq_lens, first.query_start_loc):
        assert t.dtype == torch.int32
    # The compact cache holds the captured blocks in physical-id order; the table points into it.
    assert first.physical_block_ids == tuple(range(1, 10))
    phys = torch.tensor(first.physical_block_ids)
    assert phys[first.block_table[1].long()].tolist() == [1, 2, 5, 6]
    assert first.seq_lens.tolist() == [47, 50, 56, 54]
    assert set(first.kwargs) == {"scale", "causal", "window", "softcap", "k_scale", "v_scale"}
    for case in h200_cases:
        # k x the emulation's error + one bf16 eps at the step's largest reference value.
        floor = float(torch.finfo(torch.bfloat16).eps) * float(case.reference[: case.num_tokens].abs().max())
        assert case.tol_eps == pytest.approx(floor)
        assert case.tol == pytest.approx(TOL_K * case.baseline_max_abs + floor)
        assert 0 < case.vllm_max_abs <= case.tol  # vLLM's own output meets the bar
        assert case.reference.dtype == torch.float64 and case.baseline.dtype == torch.bfloat16
    assert "step4/layer0" in repr(first) and "tensor(" not in repr(first)


def test_selection_by_steps_layers_and_kind():
    assert [c.step for c in load_cases(H200, steps=(5, 7))] == [5, 6]
    assert len(load_cases(H200, layers=[0])) == len(load_cases(H200, layers=["model.layers.0.self_attn.attn"])) == 6
    with pytest.raises(TraceError, match="no tensors captured"):
        load_cases(H200, layers=[3])
    with pytest.raises(TraceError, match="no tensors captured"):
        load_cases(H200, kind="warmup")
    with pytest.raises(TraceError, match="not a trace directory"):
        load_cases(H200 / "nope")


@pytest.mark.parametrize(
    "fn",
    [F.paged_attention_fast, K.paged_attention_loop, K.paged_attention_partitioned],
    ids=["fast", "loop", "partitioned"],
)
def test_reference_kernels_match_flash_attention_3_on_h200(h200_cases, fn):
    for case in h200_cases:
        result = assert_kernel_matches(fn, case)
        assert result.ok and result.max_abs < 1e-4 * result.tol
        # vLLM's bf16 output is as far from the reference as it is from the fp64 kernel.
        assert result.vllm_max_abs == pytest.approx(case.vllm_max_abs, rel=1e-3, abs=1e-5)


@pytest.mark.engine
@pytest.mark.parametrize("fn", [F.paged_attention_fast, K.paged_attention_loop], ids=["fast", "loop"])
def test_reference_kernels_match_the_cpu_engine(cpu_cases, fn):
    assert len(cpu_cases) >= 10
    for case in cpu_cases:
        assert check_kernel(fn, case).ok


def test_a_real_low_precision_kernel_passes(h200_cases):
    # Output rounded to bf16: the tolerance is derived from naive bf16 math, so it must admit this.
    results = [check_kernel(bf16_output, c) for c in h200_cases]
    assert all(r.ok for r in results)
    assert max(r.max_abs / r.tol for r in results) < 0.5


# --------------------------------------------------------------------------- wrong kernels


def _non_contiguous(case: KernelCase) -> set[int]:
    """Requests whose blocks are not consecutive rows of the compact cache."""
    bad = set()
    for b, seq_len in enumerate(case.seq_lens.tolist()):
        n = -(-seq_len // case.block_size)
        row = case.block_table[b, :n].tolist()
        if row != list(range(row[0], row[0] + n)):
            bad.add(b)
    return bad


def test_ignoring_the_block_table_fails_where_it_matters(h200_cases):
    case = h200_cases[1]  # step 5: request 0 has blocks 1,2,3,4; the others do not
    assert _non_contiguous(case) == {1, 2, 3}
    with pytest.raises(AssertionError) as info:
        assert_kernel_matches(contiguous_blocks, case)
    message = str(info.value)
    result = check_kernel(contiguous_blocks, case)
    # The first line is the verdict: what pytest's one-line summary shows.
    assert message.splitlines()[0] == (
        f"kernel {contiguous_blocks.__module__}:contiguous_blocks does NOT match vLLM on step 5 layer 0: "
        f"max abs {result.max_abs:.3g} > tol {result.tol:.3g}"
    )
    assert "case h200-qwen2.5-7b-eager/step5/layer0 (request step: 4 request(s)" in message
    assert "layer model.layers.0.self_attn.attn" in message and "max rel" in message
    assert "head(s) outside tolerance" in message
    assert not result.ok and result.max_abs > 10 * result.tol
    w = result.worst
    assert w.request in _non_contiguous(case)
    # The worst value named as vLLM knows it: request id, position in the sequence, physical block.
    qsl, seq_lens = case.query_start_loc.tolist(), case.seq_lens.tolist()
    assert qsl[w.request] <= w.token < qsl[w.request + 1]
    assert w.position == seq_lens[w.request] - (qsl[w.request + 1] - qsl[w.request]) + (w.token - qsl[w.request])
    assert w.request_id == case.request_ids[w.request] and w.request_id.startswith(f"{w.request}-")
    compact = int(case.block_table[w.request, w.position // case.block_size])
    assert w.block == case.physical_block_ids[compact]
    assert (
        f"worst: head {w.head} (max abs {result.heads[w.head].max_abs:.3g}), request {w.request_id!r} "
        f"(row {w.request}), position {w.position}, block {w.block} (physical), query row {w.token}" in message
    )
    # Request 0's rows are right: the error lies only in the requests whose blocks are scattered.
    start, stop = case.query_start_loc[:2].tolist()
    out = contiguous_blocks(*case.args, **case.kwargs)
    assert torch.allclose(out[start:stop].double(), case.reference[start:stop], atol=1e-4)


@pytest.mark.engine
def test_wrong_kernels_fail_on_the_cpu_engine_too(cpu_cases):
    assert not any(check_kernel(unscaled, c).ok for c in cpu_cases)
    assert not any(check_kernel(contiguous_blocks, c).ok for c in cpu_cases if _non_contiguous(c))


def test_dropping_the_scale_fails_every_head(h200_cases):
    for case in h200_cases:
        result = check_kernel(unscaled, case)
        assert not result.ok and len(result.bad_heads) == 28
        assert f"on step {case.step} layer 0: max abs" in result.message() and "worst: head" in result.message()


def test_wrong_shape_nan_and_non_tensor_are_failed_results(h200_cases):
    case = h200_cases[1]
    short = check_kernel(lambda *a, **kw: F.paged_attention_fast(*a, **kw)[:, :4], case)
    assert not short.ok and "returned shape [4, 4, 128]; expected [4, 28, 128]" in short.note
    assert "returned shape" in short.message()

    def nan_head(*args, **kwargs):
        out = F.paged_attention_fast(*args, **kwargs)
        out[2, 5] = float("nan")
        return out

    nan = check_kernel(nan_head, case)
    assert not nan.ok and nan.nonfinite == 128 and (nan.worst.token, nan.worst.head) == (2, 5)
    assert nan.bad_heads == (5,) and math.isnan(nan.heads[5].max_abs) and not nan.heads[5].ok
    assert "128 NaN/inf value(s)" in nan.message()
    assert not check_kernel(lambda *a, **kw: None, case).ok
    # (out, lse), as the reference gives with return_lse, is judged by its first element.
    assert check_kernel(lambda *a, **kw: F.paged_attention_fast(*a, **kw, return_lse=True), case).ok


def test_keywords_a_kernel_does_not_declare(h200_cases):
    case = h200_cases[0]
    # Neutral values are left out for a kernel that does not take them...
    assert kernel_kwargs(unscaled, case) == {"scale": case.kwargs["scale"], "causal": True}
    assert kernel_kwargs(contiguous_blocks, case) == dict(case.kwargs)
    # ...a value that matters is a TypeError naming it.
    softcapped = dataclasses.replace(case, kwargs={**case.kwargs, "softcap": 30.0})
    with pytest.raises(TypeError, match=r"takes no 'softcap' argument, but h200-qwen2.5-7b-eager/step4/layer0"):
        check_kernel(bf16_output, softcapped)


def test_check_trace_turns_a_raising_kernel_into_a_failed_case():
    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: illegal memory access")

    report = check_trace(broken, H200, steps=(4, 6), name="mine:broken")
    assert not report.ok and len(report.results) == 2
    assert report.results[0].kernel == "mine:broken"
    message = report.results[0].message()
    assert message.startswith("kernel mine:broken does NOT match vLLM on step 4 layer 0: the kernel raised")
    assert "raised RuntimeError: CUDA error: illegal memory access (at test_testing.py:" in message
    data = json.loads(json.dumps(report.to_json()))
    assert data["ok"] is False and data["steps"][0]["max_abs"] is None
    assert check_trace(F.paged_attention_fast, H200).ok


def test_results_serialise(h200_cases):
    result = check_kernel(contiguous_blocks, h200_cases[0])
    assert isinstance(result, CaseResult) and isinstance(result, StepResult)
    data = json.loads(json.dumps(result.to_json()))
    assert data["ok"] is False and data["worst"]["request"] in _non_contiguous(h200_cases[0])
    assert data["worst"]["request_id"] == result.worst.request_id and data["worst"]["block"] == result.worst.block
    assert len(data["heads"]) == 28 and data["tol"] == pytest.approx(result.tol)
    # Per-head objects, as replay writes them: the head's error, relative error, its bar, its verdict.
    head = data["heads"][result.worst.head]
    assert set(head) == {"head", "ok", "max_abs", "max_rel", "tol"} and head["ok"] is False
    assert head["max_abs"] == pytest.approx(result.max_abs) and head["max_abs"] > head["tol"]
    scale = float(h200_cases[0].reference[:, result.worst.head].abs().max())
    assert head["max_rel"] == pytest.approx(head["max_abs"] / scale)
    assert CaseResult.from_json(data) == result
    assert StepResult.from_json(data).heads == result.heads  # a replay reader reads it as a step


def test_kernel_json_has_the_replay_schema(h200_copy):
    """`replay --kernel M:F --json` and `replay --json`: the same keys, the kernel's extras on top."""
    code, out = _cli("replay", str(h200_copy), "--json", "--no-save")
    assert code == 0, out
    vllm = json.loads(out)
    code, out = _cli("replay", str(h200_copy), "--kernel", "reference_impl.fast:paged_attention_fast", "--json")
    assert code == 0, out
    mine = json.loads(out)
    assert set(vllm) <= set(mine) and set(mine) - set(vllm) == {"trace"}
    assert [(s["step"], s["layer"]) for s in mine["steps"]] == [(s["step"], s["layer"]) for s in vllm["steps"]]
    extras = {"id", "kernel", "vllm_max_abs", "vllm_ref_max_abs", "bad_heads", "worst", "nonfinite", "tol_k", "tol_eps"}
    for a, b in zip(vllm["steps"], mine["steps"], strict=True):
        assert set(b) == set(a) | extras
        assert [set(h) for h in a["heads"]] == [set(h) for h in b["heads"]]
        assert [h["tol"] for h in b["heads"]] == pytest.approx([h["tol"] for h in a["heads"]])
    # One reader for both: tracer.format.ReplayReport takes the kernel's JSON too.
    report = ReplayReport.from_json(mine)
    assert report.ok and report.kernel == "reference_impl.fast:paged_attention_fast" and len(report.steps) == 6


def gathered_on_device(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, *, scale, causal=True):
    """Right, and device-agnostic: per sequence, gather its blocks through the table, dense softmax."""
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    group = query.shape[1] // key_cache.shape[2]
    for b in range(seq_lens.shape[0]):
        s, q0, q1 = int(seq_lens[b]), int(query_start_loc[b]), int(query_start_loc[b + 1])
        blocks = block_table[b, : -(-s // key_cache.shape[1])].long()
        k = key_cache[blocks].flatten(0, 1)[:s].float().repeat_interleave(group, dim=1)  # [n, H, D]
        v = value_cache[blocks].flatten(0, 1)[:s].float().repeat_interleave(group, dim=1)
        logits = torch.einsum("thd,nhd->htn", query[q0:q1].float(), k) * scale
        pos = s - (q1 - q0) + torch.arange(q1 - q0, device=query.device)
        hidden = torch.arange(s, device=query.device)[None, :] > pos[:, None]
        out[q0:q1] = torch.einsum("htn,nhd->thd", logits.masked_fill(hidden, -math.inf).softmax(-1), v)
    return out


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")],
        ),
    ],
)
def test_inputs_moved_to_the_kernels_device(h200_cases, device):
    seen = []

    def kernel(query, *args, scale, causal=True):
        seen.append(query.device.type)
        return gathered_on_device(query, *args, scale=scale, causal=causal)

    assert all(check_kernel(kernel, c, device=device).ok for c in h200_cases)
    assert seen == [device] * len(h200_cases)


# --------------------------------------------------------------------------- load_kernel


def test_load_kernel_by_module_and_by_file(wrong_kernel_dir):
    assert load_kernel("reference_impl.fast:paged_attention_fast") is F.paged_attention_fast
    assert load_kernel("reference_impl.testing:CaseResult.message") is CaseResult.message
    fn = load_kernel(f"{wrong_kernel_dir / 'wrongattn.py'}:attn")
    assert fn.__name__ == "attn"


@pytest.mark.parametrize(
    "spec, match",
    [
        ("paged_attention", "expected MODULE:FUNCTION"),
        ("reference_impl.kernel:", "expected MODULE:FUNCTION"),
        (":paged_attention_fast", "expected MODULE:FUNCTION"),
        ("reference_impl.kernel:paged-attention", "expected MODULE:FUNCTION"),
        ("no_such_module_xyz:attn", r"cannot import 'no_such_module_xyz'.*PYTHONPATH"),
        ("reference_impl.kernel:nope", "has no attribute 'nope'"),
        ("reference_impl.kernel:__all__", "is a list, not a function"),
        ("/no/such/file.py:attn", "no file"),
    ],
)
def test_load_kernel_bad_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        load_kernel(spec)


def test_load_kernel_module_that_fails_to_import(tmp_path):
    (tmp_path / "broken_kernel.py").write_text("import torch\nraise RuntimeError('needs a GPU')\n")
    with pytest.raises(ValueError, match=r"importing .* failed: RuntimeError: needs a GPU"):
        load_kernel(f"{tmp_path / 'broken_kernel.py'}:attn")
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(ValueError, match="importing 'broken_kernel' failed: RuntimeError: needs a GPU"):
            load_kernel("broken_kernel:attn")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("broken_kernel", None)


# --------------------------------------------------------------------------- pytest plugin


def test_plugin_end_to_end_in_a_fresh_process(tmp_path):
    """The command docs/kernels.md gives, run as a user would: the reference kernel passes."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "reference_impl.pytest_plugin",
            "--pyargs",
            "reference_impl.kernel_check",
            f"--pagedtrace-trace={H200}",
            "--pagedtrace-kernel=reference_impl.fast:paged_attention_fast",
            "-q",
            "-p",
            "no:cacheprovider",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "6 passed" in proc.stdout


def _run_plugin(pytester, *args):
    return pytester.runpytest(
        "-p", "reference_impl.pytest_plugin", "--pyargs", "reference_impl.kernel_check", "-p", "no:cacheprovider", *args
    )


def test_plugin_fails_a_wrong_kernel_with_the_message(pytester, wrong_kernel_dir, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")  # a wide terminal: the short summary is not cut
    pytester.syspathinsert(wrong_kernel_dir)
    result = _run_plugin(pytester, f"--pagedtrace-trace={H200}", "--pagedtrace-kernel=wrongattn:attn", "-rf")
    result.assert_outcomes(failed=6)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "*pagedtrace: kernel wrongattn:attn; traces h200-qwen2.5-7b-eager (6 case(s))*",
            "E * kernel wrongattn:attn does NOT match vLLM on step 5 layer 0: max abs * > tol *",
            "E * case h200-qwen2.5-7b-eager/step5/layer0 (request step: 4 request(s), 4 query token(s)*",
            "E * worst: head *, request '*' (row *), position *, block * (physical), query row *, dim *",
        ]
    )
    # The short summary line opens with the verdict, not a module name.
    summary = [line for line in result.outlines if line.startswith("FAILED") and "step9" in line]
    assert summary and "AssertionError: kernel wrongattn:attn does NOT match vLLM on step 9 layer 0" in summary[0]


def test_plugin_selects_with_k_and_takes_a_file_kernel(pytester, wrong_kernel_dir):
    result = _run_plugin(
        pytester,
        f"--pagedtrace-trace={H200}",
        "-k",
        "step4 or step5",
        f"--pagedtrace-kernel={wrong_kernel_dir / 'wrongattn.py'}:attn",
    )
    result.assert_outcomes(failed=2)
    # Named as the user wrote it, never by the private module the file was imported as.
    result.stdout.fnmatch_lines([f"E * kernel {wrong_kernel_dir / 'wrongattn.py'}:attn does NOT match vLLM on step 4*"])
    assert "_pagedtrace_kernel" not in result.stdout.str()


def test_plugin_shows_the_traceback_of_a_kernel_that_raises(pytester):
    pytester.makepyfile(
        boomattn="""
        def attn(query, *args, **kwargs):
            return deep(query)

        def deep(query):
            raise RuntimeError("CUDA error: illegal memory access")
        """
    )
    pytester.syspathinsert()
    result = _run_plugin(pytester, f"--pagedtrace-trace={H200}", "--pagedtrace-kernel=boomattn:attn", "-k", "step4")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*boomattn.py:*: in attn",
            '>*raise RuntimeError("CUDA error: illegal memory access")',
            "E*RuntimeError: CUDA error: illegal memory access",
            "*The above exception was the direct cause of the following exception:*",
            "E * kernel boomattn:attn does NOT match vLLM on step 4 layer 0: the kernel raised RuntimeError: "
            "CUDA error: illegal memory access (at boomattn.py:5 in deep)",
        ]
    )


def test_plugin_writes_replay_schema_json(pytester, wrong_kernel_dir, tmp_path):
    pytester.syspathinsert(wrong_kernel_dir)
    out = tmp_path / "results"
    result = _run_plugin(
        pytester, f"--pagedtrace-trace={H200}", "--pagedtrace-kernel=wrongattn:attn", f"--pagedtrace-json={out}"
    )
    result.assert_outcomes(failed=6)
    data = json.loads((out / "h200-qwen2.5-7b-eager.json").read_text())
    report = ReplayReport.from_json(data)
    assert not report.ok and [s.step for s in report.steps] == list(range(4, 10))
    assert data["kernel"] == "wrongattn:attn" and data["layout"] == "flash_nhd"
    # The same numbers as `replay --kernel M:F --json` prints.
    code, cli_out = _cli("replay", str(H200), "--kernel", f"{wrong_kernel_dir / 'wrongattn.py'}:attn", "--json")
    cli = json.loads(cli_out)
    assert code == 1 and set(cli) == set(data)
    for a, b in zip(cli["steps"], data["steps"], strict=True):
        assert set(a) == set(b) and a["max_abs"] == b["max_abs"] and a["heads"] == b["heads"]


def test_plugin_without_options_skips(pytester):
    _run_plugin(pytester).assert_outcomes(skipped=1)
    _run_plugin(pytester, f"--pagedtrace-trace={H200}").assert_outcomes(skipped=6)


def test_spaced_options_are_found():
    assert spaced_options(["--pagedtrace-trace", "T", "--pagedtrace-kernel=m:f", "-k", "x"]) == ["--pagedtrace-trace"]
    assert spaced_options(["--pagedtrace-trace=T", "--pagedtrace-device=cuda"]) == []


def test_plugin_refuses_an_option_written_with_a_space(tmp_path):
    """As two words pytest takes the trace for a test path before the plugin loads: rootdir moves."""
    (tmp_path / "traces").mkdir()
    (tmp_path / "traces" / "pyproject.toml").write_text("")  # what would become the rootdir
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    trace = tmp_path / "traces" / "trace"
    shutil.copytree(H200, trace, ignore=shutil.ignore_patterns("replay.json"))
    args = ["-p", "reference_impl.pytest_plugin", "--pyargs", "reference_impl.kernel_check", "-p", "no:cacheprovider"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = str(ROOT)
    run = [sys.executable, "-m", "pytest", *args]
    proc = subprocess.run([*run, "--pagedtrace-trace", str(trace)], cwd=cwd, capture_output=True, text=True, env=env)
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, proc.stdout + proc.stderr
    assert "write --pagedtrace-trace=DIR, with '='" in proc.stderr and f"here {tmp_path / 'traces'}," in proc.stderr
    proc = subprocess.run([*run, f"--pagedtrace-trace={trace}"], cwd=cwd, capture_output=True, text=True, env=env)
    assert proc.returncode == pytest.ExitCode.OK, proc.stdout + proc.stderr  # skipped: no kernel given
    assert f"rootdir: {cwd}" in proc.stdout and "6 skipped" in proc.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--pagedtrace-kernel=nocolon"], "--pagedtrace-kernel: bad kernel 'nocolon': expected MODULE:FUNCTION*"),
        (["--pagedtrace-kernel=no_such_module_xyz:attn"], "*cannot import 'no_such_module_xyz'*"),
        (["--pagedtrace-trace=no-such-trace"], "*--pagedtrace-trace no-such-trace: *not a trace directory*"),
        (["--pagedtrace-trace", "no-such-trace"], "*write --pagedtrace-trace=DIR, with '='*"),
        (["--pagedtrace-trace="], "*argument --pagedtrace-trace: invalid _nonempty value: ''*"),
    ],
)
def test_plugin_usage_errors(pytester, args, message):
    result = _run_plugin(pytester, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{message}"])


def test_plugin_fixture_in_your_own_tests(pytester):
    pytester.makepyfile(
        test_mine="""
        from reference_impl.kernel import paged_attention_loop
        from reference_impl.testing import assert_kernel_matches

        def test_loop(pagedtrace_case):
            assert pagedtrace_case.num_tokens > 0
            assert_kernel_matches(paged_attention_loop, pagedtrace_case)

        def test_untouched():
            pass
    """
    )
    result = pytester.runpytest(
        "-p", "reference_impl.pytest_plugin", f"--pagedtrace-trace={H200}", "-p", "no:cacheprovider", "-v"
    )
    result.assert_outcomes(passed=7)
    result.stdout.fnmatch_lines(["*test_loop?h200-qwen2.5-7b-eager/step4/layer0? PASSED*"])


# --------------------------------------------------------------------------- CLI


def _cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    console = Console(file=out, width=300, color_system=None)
    code = main(list(argv), console=console, errors=console)
    return code, out.getvalue()


@pytest.fixture(scope="module")
def h200_copy(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("h200") / "trace"
    shutil.copytree(H200, dest, ignore=shutil.ignore_patterns("replay.json"))
    return dest


def test_cli_user_kernel_that_matches_exits_0(h200_copy):
    code, out = _cli("replay", str(h200_copy), "--kernel", "reference_impl.kernel:paged_attention_loop")
    assert code == 0, out
    assert "reference_impl.kernel:paged_attention_loop matches vLLM on all 6 step(s)" in out
    assert "vs vLLM" in out and "head " in out
    assert not (h200_copy / "replay.json").exists()  # vLLM's verdict file is not the user's


def test_cli_user_kernel_that_does_not_match_exits_1(h200_copy, wrong_kernel_dir):
    code, out = _cli(
        "replay", str(h200_copy), "--kernel", f"{wrong_kernel_dir / 'wrongattn.py'}:attn", "--steps", "4:6"
    )
    assert code == 1, out
    assert "MISMATCH: 2/2 step(s) outside tolerance" in out
    assert "does NOT match vLLM on step 4 layer 0: max abs" in out and "worst: head" in out
    code, out = _cli("replay", str(h200_copy), "--kernel", f"{wrong_kernel_dir / 'wrongattn.py'}:attn", "--json")
    assert code == 1
    data = json.loads(out)
    assert data["ok"] is False and len(data["steps"]) == 6
    assert data["kernel"].endswith("wrongattn.py:attn")


def test_cli_kernel_in_the_current_directory_imports(h200_copy, wrong_kernel_dir, monkeypatch):
    monkeypatch.chdir(wrong_kernel_dir)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(wrong_kernel_dir))])
    code, out = _cli("replay", str(h200_copy), "--kernel", "wrongattn:attn", "--steps", "5:6")
    sys.modules.pop("wrongattn", None)
    assert code == 1 and "MISMATCH: 1/1" in out


@pytest.mark.parametrize(
    "kernel, message",
    [
        ("fastest", "unknown kernel 'fastest': use one of fast, loop, partitioned, compiled or MODULE:FUNCTION"),
        ("no_such_module_xyz:attn", "cannot import 'no_such_module_xyz'"),
        ("reference_impl.kernel:nope", "has no attribute 'nope'"),
        ("reference_impl.kernel:", "expected MODULE:FUNCTION"),
    ],
)
def test_cli_bad_kernel_spec_exits_2_with_one_line(h200_copy, kernel, message):
    code, out = _cli("replay", str(h200_copy), "--kernel", kernel)
    assert code == 2
    assert out.startswith("error: ") and message in out and "Traceback" not in out
    assert len(out.strip().splitlines()) == 1


def test_cli_user_kernel_on_a_bad_trace_or_device_flag_exits_2(h200_copy, tmp_path):
    code, out = _cli("replay", str(tmp_path), "--kernel", "reference_impl.fast:paged_attention_fast")
    assert code == 2 and "error:" in out
    code, out = _cli("replay", str(h200_copy), "--device", "tpu")
    assert code == 2 and "device 'tpu': use one of cpu, cuda" in out
