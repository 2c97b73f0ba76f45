"""Fuzzing the CLI: on a mutated trace every command exits 0, 1 or 2, prints no traceback, writes only where told.

The cases are :mod:`tests.test_fuzz`'s (the same seeded mutator over the same small valid
trace: bytes flipped or cut, JSON values of the wrong type, huge numbers, deep nesting,
non-UTF-8 bytes, paths aimed outside, a file swapped for a FIFO, a directory, a symlink or a
huge sparse file). Each case goes through ``replay``, ``report``, ``annotate``, ``show`` and
``export`` in-process with a captured terminal ``Console``. Exit code 3 is an internal error,
a bug: the test fails naming the case and the message. An audit hook records every file
opened for writing (and every rename, mkdir, removal) outside the case's trace directory
(``replay`` saves ``replay.json`` there) and its output directory.

``PAGEDTRACE_CLI_FUZZ_N`` sets the number of cases (default 200: seconds); the counts are
printed (``pytest -s``).
"""

from __future__ import annotations

import collections
import io
import json
import os
import random
import re
import shutil
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from safetensors.torch import save_file

from pagedtrace.cli import main
from tests.test_fuzz import SECRET, SECRET_VALUE, Hang, make_case, snapshot, write_base_trace
from tracer.format import SESSION

N = int(os.environ.get("PAGEDTRACE_CLI_FUZZ_N", "200"))
SEED = int(os.environ.get("PAGEDTRACE_CLI_FUZZ_SEED", "0"))
#: An OSC-8 terminal hyperlink (its URL): what ``[link=...]`` in trace data would become.
OSC8 = re.compile(r"\x1b\]8;[^;]*;([^\x1b]*)\x1b\\")
#: rich's own links: ``console.log`` links its caller's source file.
OWN_LINK = f"file://{Path(__file__).resolve().parent.parent}/"

#: Each command's argv for a trace and an output directory.
COMMANDS: dict[str, Callable[[Path, Path], list[str]]] = {
    "replay": lambda t, o: ["replay", str(t)],
    "report": lambda t, o: ["report", str(t), "-o", str(o / "site")],
    "annotate": lambda t, o: ["annotate", "paged_attn.py", "--trace", str(t)],
    "show": lambda t, o: ["show", str(t)],
    "export": lambda t, o: ["export", str(t), "--perfetto", str(o / "timeline.json")],
}

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
#: Audit events that change the file system, and which of their arguments are paths.
_CHANGES = {
    "os.rename": (0, 1),
    "os.mkdir": (0,),
    "os.remove": (0,),
    "os.rmdir": (0,),
    "os.symlink": (0, 1),
    "os.truncate": (0,),
    "os.chmod": (0,),
    "shutil.rmtree": (0,),
}
_writes: dict[str, Any] = {"roots": None, "outside": []}


def _is_write(event: str, args: tuple) -> list[Any]:
    """The paths ``event`` writes, if it writes."""
    if event == "open":
        path, mode, flags = args
        if isinstance(mode, str) and any(c in mode for c in "wax+"):
            return [path]
        return [path] if isinstance(flags, int) and flags & _WRITE_FLAGS else []
    return [args[i] for i in _CHANGES.get(event, ())]


def _audit(event: str, args: tuple) -> None:
    roots = _writes["roots"]
    if roots is None or (event != "open" and event not in _CHANGES):
        return
    for path in _is_write(event, args):
        if not isinstance(path, (str, bytes, os.PathLike)):
            continue  # a file descriptor: opened (and checked) by name before
        full = os.path.abspath(os.fsdecode(path))
        if not any(full == r or full.startswith(r + os.sep) for r in roots):
            _writes["outside"].append(f"{event} {full}")


sys.addaudithook(_audit)


def write_cli_base_trace(path: Path) -> None:
    """:func:`tests.test_fuzz.write_base_trace` with a ``session.json`` as ``run`` writes it.

    The prompts fit the two requests' steps (2 tokens; 17, of which 16 were cached), so
    ``report`` and ``show`` explain them instead of stopping at the session.
    """
    write_base_trace(path)
    session = {"prompts": [[1, 2], list(range(3, 20))], "outputs": [[7, 8], [9, 10]], "request_ids": ["req-0", "req-1"]}
    (path / SESSION).write_text(json.dumps(session, indent=2) + "\n")


def _alarm(signum: int, frame: Any) -> None:
    raise Hang("no answer within 20 s")


def run_cli_fuzz(tmp: Path, n: int, seed: int, capsys) -> dict[str, Any]:
    """``n`` seeded cases through every command; return exit codes, tracebacks, bugs and writes outside."""
    (tmp / "secret.txt").write_text(SECRET)  # what make_case's symlinks point at
    save_file({"x": torch.full((2, 2), SECRET_VALUE)}, str(tmp / "secret.safetensors"))
    write_cli_base_trace(tmp / "base")
    base = snapshot(tmp / "base")
    rng = random.Random(seed)
    codes: dict[str, collections.Counter[int]] = {name: collections.Counter() for name in COMMANDS}
    bugs: list[str] = []
    tracebacks: list[str] = []
    outside: list[str] = []
    old = signal.signal(signal.SIGALRM, _alarm)
    try:
        for i in range(n):
            case, out = tmp / f"case{i}", tmp / f"out{i}"
            done = make_case(rng, base, case)
            out.mkdir()
            what = f"case {i} ({', '.join(done)})"
            for name, argv in COMMANDS.items():
                buf = io.StringIO()
                console = Console(file=buf, width=160, force_terminal=True)
                _writes["roots"], _writes["outside"] = (str(case.resolve()), str(out.resolve())), []
                signal.setitimer(signal.ITIMER_REAL, 20)  # a hang raises Hang, which main reports as 3
                try:
                    code = main(argv(case, out), console=console)
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                    _writes["roots"] = None
                captured = capsys.readouterr()
                text = buf.getvalue() + captured.out + captured.err
                codes[name][code] += 1
                if code not in (0, 1, 2):
                    bugs.append(f"{what}: {name} exited {code}: {text.strip()[-600:]}")
                links = [u for u in OSC8.findall(text) if u and not u.startswith(OWN_LINK)]
                if "Traceback" in text or links:
                    tracebacks.append(f"{what}: {name}: {text[-1500:]}")
                outside.extend(f"{what}: {name}: {w}" for w in _writes["outside"])
            shutil.rmtree(case)
            shutil.rmtree(out)
    finally:
        signal.signal(signal.SIGALRM, old)
    return {"cases": n, "codes": codes, "bugs": bugs, "tracebacks": tracebacks, "outside": outside}


def test_the_base_trace_goes_through_every_command(tmp_path, capsys):
    """The unmutated trace is read by every command and writes its outputs (else the fuzz cases prove little).

    Its tensors are random, not attention: ``replay`` rightly exits 1 (a mismatch), the others 0.
    """
    write_cli_base_trace(tmp_path / "t")
    (tmp_path / "o").mkdir()
    for name, argv in COMMANDS.items():
        console = Console(file=io.StringIO(), width=160)
        code = main(argv(tmp_path / "t", tmp_path / "o"), console=console)
        assert code == (1 if name == "replay" else 0), (name, console.file.getvalue())
    assert (tmp_path / "o" / "site" / "index.html").is_file() and (tmp_path / "o" / "timeline.json").is_file()
    assert (tmp_path / "t" / "replay.json").is_file()


def test_the_write_watcher_sees_a_write_outside(tmp_path):
    """The audit hook does catch a write outside the allowed directories (else the fuzz test proves nothing)."""
    inside = tmp_path / "in"
    inside.mkdir()
    _writes["roots"], _writes["outside"] = (str(inside.resolve()),), []
    try:
        (inside / "ok.txt").write_text("x")
        (tmp_path / "not-ok.txt").write_text("x")
        (inside / "ok.txt").read_text()
        (tmp_path / "not-ok.txt").read_text()  # a read is not a write
        os.replace(inside / "ok.txt", tmp_path / "moved.txt")
    finally:
        _writes["roots"] = None
    root = tmp_path.resolve()
    assert _writes["outside"] == [f"open {root / 'not-ok.txt'}", f"os.rename {root / 'moved.txt'}"]


def test_mutated_traces_through_the_cli_exit_0_1_2_without_a_traceback(tmp_path, capsys):
    result = run_cli_fuzz(tmp_path, N, SEED, capsys)
    with capsys.disabled():
        histogram = {name: dict(sorted(c.items())) for name, c in result["codes"].items()}
        print(
            f"\ncli fuzz: {result['cases']} cases x {len(COMMANDS)} commands (seed {SEED}); exit codes: {histogram}; "
            f"bugs (exit 3+): {len(result['bugs'])}; tracebacks: {len(result['tracebacks'])}; "
            f"writes outside: {len(result['outside'])}"
        )
    assert result["bugs"] == [], "\n\n".join(result["bugs"][:10])
    assert result["tracebacks"] == [], "\n\n".join(result["tracebacks"][:5])
    assert result["outside"] == [], "\n".join(result["outside"][:10])
    for name, counts in result["codes"].items():
        assert counts[2] > 0, f"{name}: no case was rejected, so the mutator did not reach it"


# -- what the fuzzer found, as named regression tests ---------------------------------------------


def _main(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    console = Console(file=out, width=300)
    code = main(list(argv), console=console, errors=console)
    return code, out.getvalue()


def test_session_tokens_that_are_not_ints_mean_unknown_prompts_not_a_crash(tmp_path):
    """Seed 0, case 6: ``Infinity`` as a prompt token made replay's metadata checks raise OverflowError (exit 3)."""
    write_cli_base_trace(tmp_path / "t")
    session = json.loads((tmp_path / "t" / SESSION).read_text())
    session["prompts"][0] = [float("inf"), 1.5, "2"]  # json.dumps writes Infinity, as a mutation did
    (tmp_path / "t" / SESSION).write_text(json.dumps(session))
    code, out = _main("replay", str(tmp_path / "t"), "--no-save")
    assert code == 1 and "internal error" not in out, out  # the random tensors' mismatch, as on the base trace


def test_a_kv_cache_stride_shorter_than_its_shape_is_a_trace_error(tmp_path):
    """Seed 0, case 170: a manifest stride of 3 for a 4-D cache loaded, then report's layout view raised IndexError."""
    write_cli_base_trace(tmp_path / "t")
    manifest = json.loads((tmp_path / "t" / "manifest.json").read_text())
    manifest["kv_cache"]["stride"] = manifest["kv_cache"]["stride"][:3]
    (tmp_path / "t" / "manifest.json").write_text(json.dumps(manifest))
    code, out = _main("report", str(tmp_path / "t"), "-o", str(tmp_path / "site"))
    assert code == 2, out
    assert out.startswith("error: ") and out.count("\n") == 1
    assert "RunInfo.kv_cache.stride: 3 strides for the 4-D shape" in out


def test_a_tensor_file_name_holding_a_newline_is_a_one_line_error(tmp_path, capsys):
    """A ``tensors`` name with a newline in ``steps.jsonl`` gave a two-line message; its escape is printed instead."""
    write_cli_base_trace(tmp_path / "t")
    steps = tmp_path / "t" / "steps.jsonl"
    lines = steps.read_text().splitlines()
    record = json.loads(lines[1])
    record["tensors"] = "bad\nname.safetensors"
    lines[1] = json.dumps(record)
    steps.write_text("\n".join(lines) + "\n")
    assert main(["replay", str(tmp_path / "t"), "--no-save"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and "bad\\nname" in captured.err, captured.err
