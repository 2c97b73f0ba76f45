"""The CLI's contract: one set of exit codes for every command, data printed literally.

No engine here: the commands run on the committed H200 eager trace (tensors, sources), with
its strings rewritten to carry rich markup. ``pagedtrace run``'s fault path (an ``-o`` that
cannot be written) needs a real engine and lives in ``tests/test_tracer.py``.
"""

from __future__ import annotations

import io
import json
import re
import shutil
from pathlib import Path

import pytest
from rich.console import Console

from pagedtrace.cli import EXIT_CODES, main
from pagedtrace.commands.run import build_kv_table, build_summary_table
from tests.conftest import fixture_path
from tracer.format import MANIFEST, STEPS, Trace

FIXTURE = fixture_path("h200-qwen2.5-7b-eager")
README = Path(__file__).parent.parent / "README.md"

#: What rich would read as a closing tag (a MarkupError) and as an OSC-8 terminal hyperlink.
MARKUP = "[/x][link=http://x]"
EVIL_LAYER = f"evil{MARKUP}attn"  # no layer index, so tables print the whole name
EVIL_REQUEST = f"0-a0c{MARKUP}"  # request 0 of the fixture, its frontend id kept
OSC8 = "\x1b]8;"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # colours, and the cursor moves of progress bars


def _cli(*argv: str, color: bool = False) -> tuple[int, str]:
    """Run ``pagedtrace`` in-process; return (exit code, everything it printed, escape codes removed).

    ``color``: a terminal, where rich would turn ``[link=...]`` into an OSC-8 hyperlink.
    """
    out = io.StringIO()
    console = Console(file=out, width=300, force_terminal=True) if color else Console(file=out, width=300)
    code = main(list(argv), console=console, errors=console)
    text = out.getvalue()
    assert OSC8 not in text, "a string from the trace became a terminal hyperlink"
    return code, ANSI.sub("", text)


def _last_line(out: str) -> str:
    return out.rstrip("\n").splitlines()[-1]


@pytest.fixture(scope="module")
def evil_trace(tmp_path_factory) -> Path:
    """The H200 eager trace under a path, layer name, request id and model name that all carry markup."""
    dest = tmp_path_factory.mktemp("cli") / f"trace{MARKUP}"
    shutil.copytree(FIXTURE, dest)
    layer = "model.layers.0.self_attn.attn"
    steps = dest / STEPS
    text = steps.read_text().replace(f'"{layer}"', json.dumps(EVIL_LAYER))
    steps.write_text(text.replace('"0-a0c640ce"', json.dumps(EVIL_REQUEST)))
    manifest = json.loads((dest / MANIFEST).read_text())
    manifest["model"]["name"] = f"qwen{MARKUP}"
    names = manifest["kv_cache"]["layer_names"]
    names[names.index(layer)] = EVIL_LAYER
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return dest


# -- exit codes ------------------------------------------------------------------------------


def test_help_and_readme_document_the_exit_codes(capsys):
    assert main(["--help"]) == 0
    help_text = capsys.readouterr().out
    readme = README.read_text()
    for code, meaning in EXIT_CODES.items():
        assert re.search(rf"^\s+{code}\s+{re.escape(meaning)}$", help_text, re.M), code
        assert re.search(rf"^\| `{code}` \|", readme, re.M), f"README has no row for exit code {code}"
    assert main(["replay", "--help"]) == 0
    assert "Exit codes: 0 ok, 1 a mismatch, 2 bad input" in capsys.readouterr().out


def test_usage_errors_exit_2(capsys):
    assert main([]) == 2  # no command: the help, and 2
    assert main(["replay"]) == 2  # argparse: TRACE missing
    assert main(["replay", str(FIXTURE), "--steps", "x"]) == 2
    assert "usage:" in capsys.readouterr().err
    code, out = _cli("replay", str(FIXTURE), "--kernel", "nonsense")
    assert code == 2 and out.startswith("error: unknown kernel 'nonsense'") and out.count("\n") == 1


def test_workers_give_the_same_verdicts(capsys, monkeypatch):
    import reference_impl.replay

    assert main(["replay", str(FIXTURE), "--workers", "0"]) == 2
    assert "--workers: 0: expected a positive whole number" in capsys.readouterr().err
    started, run_records = [], reference_impl.replay.run_records

    def counted(*args, **kwargs):
        started.append(args[3])  # the number of processes
        return run_records(*args, **kwargs)

    monkeypatch.setattr(reference_impl.replay, "run_records", counted)
    reports = []
    for workers in ("1", "2"):
        code, out = _cli("replay", str(FIXTURE), "--workers", workers, "--json", "--no-save")
        assert code == 0
        reports.append(json.loads(out)["steps"])
    assert started == [1, 2]
    assert reports[0] == reports[1] and len(reports[0]) > 1


def test_the_workers_help_gives_the_defaults_replay_uses(capsys):
    # The CLI writes them out rather than import reference_impl (and torch) to build its parser.
    from reference_impl.workers import MAX_GPU_WORKERS, MIN_RECORDS_PER_GPU_WORKER, MIN_RECORDS_PER_WORKER

    assert main(["replay", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert f"one per CPU core with at least {MIN_RECORDS_PER_WORKER} steps each" in text
    assert f"one per {MIN_RECORDS_PER_GPU_WORKER} steps, at most {MAX_GPU_WORKERS}" in text


def test_a_real_mismatch_exits_1(tmp_path):
    dest = tmp_path / "trace"
    shutil.copytree(FIXTURE, dest)
    lines = (dest / STEPS).read_text().splitlines()
    for i, line in enumerate(lines):
        data = json.loads(line)
        if data.get("kind") == "request" and data.get("tensors"):
            data["scale"] *= 2  # softmax of twice the logits: not what vLLM computed
            lines[i] = json.dumps(data)
            break
    (dest / STEPS).write_text("\n".join(lines) + "\n")
    code, out = _cli("replay", str(dest), "--no-save")
    assert code == 1 and "MISMATCH" in out


def test_a_bug_exits_3_with_one_line_and_debug_prints_the_traceback(monkeypatch, tmp_path):
    from pagedtrace.commands import report

    def broken(*args, **kwargs):
        raise ZeroDivisionError(f"boom {MARKUP}\nsecond line")

    # A fault put where no bug is today: the contract is about what main does with one.
    monkeypatch.setattr(report, "write_report", broken)
    code, out = _cli("report", str(FIXTURE), "-o", str(tmp_path / "site"), color=True)
    assert code == 3 and "Traceback" not in out
    assert _last_line(out) == (
        f"error: internal error: ZeroDivisionError: boom {MARKUP} "
        "(a bug in pagedtrace; rerun with --debug for the traceback)"
    )
    for argv in (["--debug", "report"], ["report", "--debug"]):
        code, out = _cli(*argv, str(FIXTURE), "-o", str(tmp_path / "site"))
        assert code == 3
        assert out.startswith("Traceback (most recent call last):") and "in broken" in out
        assert out.splitlines()[-1].startswith("error: internal error: ZeroDivisionError: boom")
        assert "rerun with --debug" not in out


def test_an_unwritable_output_is_exit_2_not_a_traceback(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file, so nothing can be created under it (also as root)")
    code, out = _cli("report", str(FIXTURE), "-o", str(blocker / "site"))
    assert code == 2 and out.startswith("error: cannot write the report") and "Traceback" not in out


# -- markup in data --------------------------------------------------------------------------


def test_error_messages_print_markup_literally(tmp_path):
    missing = tmp_path / f"no{MARKUP}trace"
    code, out = _cli("replay", str(missing), color=True)
    assert code == 2
    assert out == f"error: {missing}: not a trace directory\n"  # one line, the path as written


def test_replay_prints_a_marked_up_layer_and_path_literally(evil_trace):
    code, out = _cli("replay", str(evil_trace), "--no-save", color=True)
    assert code == 0, out
    assert EVIL_LAYER in out and "all 6 step(s) match" in out


def test_replay_json_warns_nothing_and_a_read_only_side_file_is_a_warning(evil_trace, tmp_path, capsys):
    dest = tmp_path / "trace"
    shutil.copytree(evil_trace, dest)
    (dest / "replay.json").mkdir()  # os.replace onto a directory fails, also as root
    code, out = _cli("replay", str(dest), "--steps", "6:8", color=True)
    assert code == 0, out
    assert "warning: replay.json not written:" in capsys.readouterr().err and "verdicts written" not in out
    code, out = _cli("replay", str(dest), "--steps", "6:8", "--json")
    assert code == 0 and json.loads(out)["ok"] is True


def test_annotate_and_report_print_markup_literally(evil_trace, tmp_path):
    code, out = _cli("annotate", "flash_attn.py", "--trace", str(evil_trace), "--context", "0", color=True)
    assert code == 0, out
    assert EVIL_LAYER in out
    site = tmp_path / f"site{MARKUP}"
    code, out = _cli("report", str(evil_trace), "-o", str(site), "--max-step-pages", "1", color=True)
    assert code == 0, out
    assert f"report written: {site / 'index.html'}" in out  # a path: "//" is "/" there


def test_run_tables_print_markup_literally(evil_trace):
    out = io.StringIO()
    console = Console(file=out, width=400, force_terminal=True)
    trace = Trace.open(evil_trace)
    console.print(build_summary_table(trace))
    console.print(build_kv_table(trace))
    text = out.getvalue()
    assert OSC8 not in text
    plain = ANSI.sub("", text)
    assert EVIL_LAYER in plain and f"qwen{MARKUP}" in plain and f"trace {evil_trace}" in plain


def test_diff_show_step_and_export_print_markup_literally(evil_trace, tmp_path):
    code, out = _cli("show", str(evil_trace), color=True)
    assert code == 0, out
    assert f"#0 ({EVIL_REQUEST})" in out  # a request id, whole
    code, out = _cli("diff", str(FIXTURE), str(evil_trace), "--no-tensors", color=True)
    assert code == 1, out  # the model names differ
    assert f"run settings: model qwen2.5-7b-instruct vs qwen{MARKUP}" in out and "matched by prompt tokens" in out
    code, out = _cli("step", str(evil_trace), "--step", "5", "--request", "0", "--head", "1", color=True)
    assert code == 0, out
    assert f"step 5 {EVIL_LAYER}: request {EVIL_REQUEST}," in out
    dest = tmp_path / f"out{MARKUP}" / "timeline.json"  # MARKUP's "//" makes folders
    dest.parent.mkdir(parents=True)
    code, out = _cli("export", str(evil_trace), "--perfetto", str(dest), color=True)
    assert code == 0, out
    assert f"timeline written: {dest} (" in out
    assert EVIL_LAYER in dest.read_text() and EVIL_REQUEST in dest.read_text()
