"""The output contract of every command (README "Output"), as a user piping pagedtrace meets it.

Results on stdout; errors, warnings and progress on stderr; off a terminal, plain lines of
their natural width (no padding, no log times or locations); ``--json`` prints JSON and
nothing else on stdout; a closed stdout ends the command quietly with 141; a damaged trace
is exit 2 unless ``--lax``. Commands run in-process with stdout and stderr captured (not
terminals, as in a pipe), or as real subprocesses where the pipe itself matters.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagedtrace.cli import EXIT_PIPE, main
from tests.conftest import fixture_path
from tests.test_testing import WRONG_KERNEL_MODULE

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = fixture_path("h200-qwen2.5-7b-eager")
PIECEWISE = fixture_path("h200-qwen2.5-7b-piecewise")
#: The longest line a piped command may print (tables aside, with --verbose).
MAX_LINE = 200
NO_TRACE = "/no/such/trace"


def _failing(tmp: Path) -> dict[str, list[str]]:
    """One failing invocation per command."""
    a_file = tmp / "file"
    a_file.write_text("x")
    return {
        "run": ["run", "-o", str(tmp / "t"), "--block-size", "7"],
        "replay": ["replay", NO_TRACE],
        "annotate": ["annotate", "flash_attn.py", "--trace", NO_TRACE],
        "report": ["report", NO_TRACE, "-o", str(tmp / "site")],
        "diff": ["diff", NO_TRACE, str(FIXTURE)],
        "show": ["show", NO_TRACE],
        "step": ["step", str(FIXTURE), "--step", "999", "--request", "0"],
        "export": ["export", NO_TRACE, "--perfetto", str(tmp / "x.json")],
        "preset": ["preset", "tiny", str(a_file)],
    }


#: Commands with --json.
JSON_COMMANDS = ("replay", "diff", "show", "step")


def _run(capsys, argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("command", list(_failing(Path("/tmp"))))
def test_a_failing_command_prints_one_line_on_stderr_and_nothing_on_stdout(tmp_path, capsys, command):
    argv = _failing(tmp_path)[command]
    for extra in ([], ["--json"]) if command in JSON_COMMANDS else ([],):
        code, out, err = _run(capsys, argv + extra)
        assert code == 2, (argv, out, err)
        assert out == "", f"stdout of a failing {command} {extra}: {out!r}"
        assert err.count("\n") == 1 and "error:" in err, err
        assert len(err) <= MAX_LINE * 2  # the kv-cache dtypes' list is the longest, and it is not here


def _successes(tmp: Path) -> dict[str, list[str]]:
    return {
        "replay": ["replay", str(FIXTURE), "--no-save"],
        "annotate": ["annotate", "flash_attn.py", "--trace", str(FIXTURE), "--context", "1"],
        "report": ["report", str(FIXTURE), "-o", str(tmp / "site")],
        "diff": ["diff", str(FIXTURE), str(PIECEWISE)],
        "show": ["show", str(FIXTURE)],
        "step": ["step", str(FIXTURE), "--step", "5", "--request", "1"],
        "export": ["export", str(FIXTURE), "--perfetto", str(tmp / "x.json")],
        "preset": ["preset", "tiny", str(tmp / "model")],
    }


@pytest.mark.parametrize("command", list(_successes(Path("/tmp"))))
def test_piped_output_is_plain_lines_of_natural_width(tmp_path, capsys, command):
    code, out, err = _run(capsys, _successes(tmp_path)[command])
    assert code in (0, 1), err
    assert out.strip(), "no result on stdout"
    for stream in (out, err):
        assert "\x1b[" not in stream
        # preset's recipe is shell lines to copy: they print whole.
        long = [line for line in stream.splitlines() if len(line) > MAX_LINE and not line.startswith("  -d '")]
        assert not long, f"{command}: a line of {len(long[0])} characters: {long[0][:120]}…"
        assert not any(line != line.rstrip() for line in stream.splitlines()), "padding at a line's end"


@pytest.mark.parametrize("command", JSON_COMMANDS)
def test_json_is_all_that_stdout_holds(tmp_path, capsys, command):
    code, out, _ = _run(capsys, [*_successes(tmp_path)[command], "--json"])
    assert code in (0, 1)
    json.loads(out)  # the whole of stdout is one JSON document


def test_mismatch_lines_of_a_piped_replay_are_plain_and_short(tmp_path, capsys):
    """Problem 1: each mismatch line was padded to 10,000 characters out to ``replay.py:405``."""
    (tmp_path / "wrongattn.py").write_text(WRONG_KERNEL_MODULE)
    argv = ["replay", str(FIXTURE), "--kernel", f"{tmp_path / 'wrongattn.py'}:attn", "--steps", "4:6"]
    code, out, err = _run(capsys, argv)
    assert code == 1
    mismatches = [line for line in out.splitlines() if line.startswith("mismatch step")]
    assert mismatches and all(len(line) <= MAX_LINE for line in (out + err).splitlines())
    assert "replay.py:" not in out + err  # no log location
    code, out, err = _run(capsys, [*argv, "--json"])
    assert code == 1 and json.loads(out)["ok"] is False
    assert all(len(line) <= MAX_LINE for line in err.splitlines())


def test_a_missing_trace_with_json_leaves_stdout_empty(capsys):
    """Problem 2: ``replay /nonexistent --json 2>/dev/null`` printed the error on stdout."""
    code, out, err = _run(capsys, ["replay", NO_TRACE, "--json"])
    assert (code, out, err) == (2, "", f"error: {NO_TRACE}: not a trace directory\n")


def test_a_closed_pipe_ends_quietly_with_141():
    """Problem 9: ``pagedtrace show t | head -1`` exited 1; a reader that stops early is no error."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedtrace", "annotate", "flash_attn.py", "--trace", str(FIXTURE)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()  # `| head -1`
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == EXIT_PIPE == 141
    assert first and err == b"", err.decode()[-2000:]


# -- damaged traces: exit 2, or --lax --------------------------------------------------------


@pytest.fixture
def cut_trace(tmp_path) -> Path:
    """The eager fixture with ``steps.jsonl`` cut in the middle of its last line."""
    dest = tmp_path / "cut"
    shutil.copytree(FIXTURE, dest)
    data = (dest / "steps.jsonl").read_bytes()
    (dest / "steps.jsonl").write_bytes(data[: data.rstrip(b"\n").rfind(b"\n") + 40])
    return dest


def _reading(trace: Path, tmp: Path) -> dict[str, list[str]]:
    return {
        "show": ["show", str(trace)],
        "replay": ["replay", str(trace), "--no-save"],
        "annotate": ["annotate", "flash_attn.py", "--trace", str(trace), "--context", "0"],
        "export": ["export", str(trace), "--perfetto", str(tmp / "x.json")],
        "step": ["step", str(trace), "--step", "5", "--request", "1"],
        "diff": ["diff", str(trace), str(FIXTURE)],
        "report": ["report", str(trace), "-o", str(tmp / "site")],
    }


def test_a_damaged_trace_is_exit_2_and_lax_reads_the_rest(cut_trace, tmp_path, capsys):
    """Problem 8: the message said "open with strict=False", which no command offered; report exited 0."""
    for name, argv in _reading(cut_trace, tmp_path).items():
        code, out, err = _run(capsys, argv)
        assert code == 2 and out == "", (name, out)
        assert err.count("\n") == 1 and "line " in err and "--lax reads them" in err, (name, err)
        code, out, err = _run(capsys, [*argv, "--lax"])
        assert code in (0, 1) and out, (name, err)
        assert err.startswith("warning: skipped: ") and "steps.jsonl: line " in err, (name, err)


# -- run --------------------------------------------------------------------------------------


def test_run_asks_vllms_default_graph_mode_unless_told():
    """Problem 4: ``run`` on a GPU ran eager unless --cudagraph-mode was given."""
    from pagedtrace.cli import build_parser
    from pagedtrace.commands.run import session_config

    parser = build_parser()
    config = session_config(parser.parse_args(["run"]), Path("t"))
    assert config.enforce_eager is None and config.cudagraph_mode is None  # tracer.session_config.is_eager decides
    assert session_config(parser.parse_args(["run", "--eager"]), Path("t")).enforce_eager is True
    assert session_config(parser.parse_args(["run", "--cudagraph-mode", "piecewise"]), Path("t")).enforce_eager is False
    sub = next(a for a in parser._actions if hasattr(a, "choices") and isinstance(a.choices, dict))
    assert "default: vLLM's, FULL_AND_PIECEWISE, on a GPU" in " ".join(sub.choices["run"].format_help().split())


@pytest.mark.engine
def test_an_interrupted_run_says_what_it_kept_or_leaves_nothing(tmp_path):
    """Problems 3 and 9: Ctrl-C left a directory that blocked the same -o, and said only "interrupted"."""
    import signal
    import time

    from tests.factories import engine_env

    def interrupt(out: Path, when) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "pagedtrace", "run", "-o", str(out), "--prompts", "8", "--max-tokens", "300"]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=engine_env())
        deadline = time.monotonic() + 600
        while not when() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=300)
        return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)

    early = tmp_path / "early"
    done = interrupt(early, lambda: early.exists())  # the tracer made the directory: the engine is starting
    assert done.returncode == 130, done.stderr[-3000:]
    assert not early.exists()
    assert (
        done.stderr.strip().splitlines()[-1]
        == f"interrupted: stopped before the first request step; nothing kept in {early}"
    )

    late = tmp_path / "late"
    steps = late / "steps.jsonl"
    done = interrupt(late, lambda: steps.is_file() and b'"request"' in steps.read_bytes())
    assert done.returncode == 130, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("interrupted: kept ") and f"in {late}, without session.json" in last, last
    assert f"`pagedtrace show {late}` and `pagedtrace replay {late}` read them" in last
    assert main(["show", str(late), "--lax"]) == 0
