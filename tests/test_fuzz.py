"""Fuzzing the trace reader: from mutated traces only ``TraceError`` escapes, and nothing outside is read.

A seeded mutator takes a small valid trace (a manifest with a KV cache and one stored
source, a gap and two steps with tensors, a ``session.json``) and makes mutated copies:
bytes flipped, cut or inserted in any file; JSON values replaced by wrong types, huge or
long numbers, deep nesting, non-UTF-8 bytes, lone surrogates, long lists; paths pointed
outside the trace; a file swapped for a FIFO, a directory, a symbolic link or a huge
sparse file. Each copy is opened strict and non-strict, every record is iterated and every
tensor, source and side file read. A secret planted beside the trace (text and a
safetensors file) must never show up, and an audit hook checks that Python opens no file
outside the copy.

``PAGEDTRACE_FUZZ_N`` sets the number of cases (default 2,000: seconds), e.g. 10000 for a
longer run; the counts are printed (``pytest -s``).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import shutil
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tests.factories import kv_spec, model_summary, run_info, scheduled_step
from tracer.format import (
    MANIFEST,
    PAGED_ATTN,
    REPLAY,
    SESSION,
    STEPS,
    GapRecord,
    Trace,
    TraceError,
    TraceWriter,
    store_sources,
)

N = int(os.environ.get("PAGEDTRACE_FUZZ_N", "2000"))
SEED = int(os.environ.get("PAGEDTRACE_FUZZ_SEED", "0"))

SECRET = "PAGEDTRACE-SECRET-9d1e"  #: in secret.txt beside the trace: must never be read
SECRET_VALUE = 4242.5  #: every element of secret.safetensors beside the trace

#: A small cache: 64 blocks x 16 tokens, 1 KV head, D=4 (query heads 2).
SPEC = dict(
    num_blocks=64, block_size=16, num_kv_heads=1, head_size=4, shape=(64, 1, 16, 8), stride=(128, 128, 8, 1),
    backend_kv_cache_shape=(64, 1, 16, 8),
)  # fmt: skip
HEADS = dict(num_heads=2, num_kv_heads=1, head_size=4)


def write_base_trace(path: Path) -> None:
    """The valid trace every case mutates: a gap, a prefill of 3 tokens and a decode step, with tensors."""
    with TraceWriter(path) as w:
        sources = store_sources(w, {PAGED_ATTN: "def split_kv_cache(kv_cache):\n    return kv_cache\n"})
        spec = kv_spec(**SPEC)
        w.write_manifest(
            run_info(
                kv_cache=spec, model=model_summary(num_attention_heads=2, num_kv_heads=1, head_size=4), sources=sources
            )
        )
        w.append(GapRecord(step=0, kind="profile", reason="profile run", num_tokens=0))
        steps = [
            scheduled_step(1, [2, 1], [2, 17], [[3], [4, 5]], **HEADS),
            scheduled_step(2, [1, 1], [3, 18], [[3], [4, 5]], **HEADS, alibi_slopes=(0.5, 0.25), sinks=(1.0, -1.0)),
        ]
        for rec in steps:
            t = rec.num_actual_tokens
            ids = sorted({b for row in rec.block_table for b in row})
            w.append(
                rec,
                {
                    "query": torch.randn(t, 2, 4),
                    "output": torch.randn(t, 2, 4),
                    "key": torch.randn(t, 1, 4),
                    "value": torch.randn(t, 1, 4),
                    "kv_blocks": torch.randn(len(ids), 1, 16, 8).to(torch.bfloat16),
                    "kv_block_ids": torch.tensor(ids, dtype=torch.int32),
                },
            )
        w.write_json(SESSION, {"outputs": [[1, 2, 3]], "prompt": "hello"})


def snapshot(path: Path) -> dict[str, bytes]:
    """Every file of a trace, by path relative to it."""
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


# -- the mutator ------------------------------------------------------------------------------

RAW = "\u0001RAW\u0001"  #: placeholder replaced by raw (invalid-JSON-escaping) bytes after dumping

#: JSON values that a field of the wrong shape could hold.
VALUES: list[Any] = [
    "1", "false", "", "x" * 70000, 1.0, 0.5, True, False, None, -1, 0, 1, 2**31, 2**63, 2**64, -(2**63) - 1,
    1e308, float("nan"), float("inf"), [], {}, [0], [[0]], [-1, -1], {"a": 1}, "\ud800", "a\udfffb",
    [0] * 70000, list(range(300)), "../secret.txt", "/etc/passwd", "sources/../../secret.txt",
    "sources/vllm/../../../secret.txt", "../secret.safetensors", "a/../../secret.safetensors",
    "\x00", "[/x]", "[link=file:///etc/passwd]x[/link]",
]  # fmt: skip
#: Raw text spliced in where a value goes: things json.dumps would never write.
RAW_TEXT: list[bytes] = [
    b"9" * 5000, b"-" + b"9" * 4400, b"1" * 4300, b"[" * 100000, b'{"a":' * 20000, b"NaN", b"-Infinity",
    b'"\xff\xfe"', b'"\xc3"', b"1e99999", b'"\\ud800"', b"[" + b"0," * 300000 + b"0]",
]  # fmt: skip


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out.extend(_paths(v, (*prefix, k)))
    elif isinstance(value, list) and len(value) < 50:
        for i, v in enumerate(value):
            out.extend(_paths(v, (*prefix, i)))
    return out


def _set(doc: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return doc


def _dump(doc: Any, raw: bytes | None, indent: int | None) -> bytes:
    text = json.dumps(doc, indent=indent).encode("utf-8")
    if raw is not None:
        text = text.replace(json.dumps(RAW).encode(), raw)
    return text


def mutate_json(rng: random.Random, data: bytes, one_line: bool) -> bytes:
    """Replace, delete or add one value somewhere in a JSON document (or one line of JSONL)."""
    lines = data.split(b"\n") if one_line else [data]
    idx = rng.randrange(len(lines))
    try:
        doc = json.loads(lines[idx])
    except (ValueError, RecursionError):  # an earlier mutation broke it: mutate bytes instead
        return mutate_bytes(rng, data)
    path = rng.choice(_paths(doc))
    raw = None
    roll = rng.random()
    if roll < 0.15 and path and isinstance(doc, dict):
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        del parent[path[-1]]
    elif roll < 0.25 and isinstance(doc, dict):
        doc[rng.choice(["surprise", "type", "tensors", "step"])] = rng.choice(VALUES)
    elif roll < 0.45:
        raw = rng.choice(RAW_TEXT)
        doc = _set(doc, path, RAW)
    else:
        doc = _set(doc, path, rng.choice(VALUES))
    lines[idx] = _dump(doc, raw, None if one_line else 2)
    return b"\n".join(lines)


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    """Flip, cut, insert, delete or duplicate bytes."""
    op = rng.randrange(6)
    n = len(data)
    pos = rng.randrange(n + 1)
    if op == 0 and n:
        buf = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            buf[rng.randrange(n)] ^= 1 << rng.randrange(8)
        return bytes(buf)
    if op == 1:
        return data[:pos]
    if op == 2:
        junk = rng.choice([bytes(rng.randrange(256) for _ in range(rng.randint(1, 16))), b"\xff\xfe", b"\x00", b"\n"])
        return data[:pos] + junk + data[pos:]
    if op == 3:
        return data[:pos] + data[pos + rng.randint(1, 64) :]
    if op == 4:
        return data[:pos] + data[pos : pos + rng.randint(1, 200)] * rng.randint(2, 50) + data[pos:]
    return data[:pos] + bytes([rng.randrange(256)]) + data[pos + 1 :]


def swap_file(rng: random.Random, case: Path, rel: str) -> None:
    """Put something other than a regular file (or a huge one) where ``rel`` was."""
    target = case / rel
    if not (case / rel).parent.is_dir() or (case / rel).parent.is_symlink():
        return  # an earlier swap replaced the directory itself
    if target.is_dir() and not target.is_symlink():
        shutil.rmtree(target)
    elif target.exists() or target.is_symlink():
        target.unlink()
    kind = rng.randrange(6)
    if kind == 0:
        os.mkfifo(target)
    elif kind == 1:
        target.mkdir()
    elif kind == 2:
        os.symlink(case.parent / "secret.txt", target)
    elif kind == 3:
        os.symlink("/dev/zero", target)
    elif kind == 4:
        os.symlink(case.parent / "secret.safetensors", target)
    else:
        with open(target, "wb") as f:  # a sparse file of zeros, /dev/zero-like
            f.truncate(1 << 40)


def point_outside(rng: random.Random, files: dict[str, bytes]) -> None:
    """Aim a source or a tensor file name at the secret beside the trace (if earlier mutations left them)."""
    with contextlib.suppress(ValueError, KeyError, TypeError, IndexError, AttributeError):
        _point_outside(rng, files)  # raises when an earlier mutation broke the JSON: nothing to aim


def _point_outside(rng: random.Random, files: dict[str, bytes]) -> None:
    if rng.random() < 0.5:
        manifest = json.loads(files[MANIFEST])
        entry = manifest["sources"][PAGED_ATTN]
        entry["file"] = rng.choice(["../secret.txt", "sources/../../secret.txt", "/etc/passwd", "sources/x/../../s"])
        files[MANIFEST] = json.dumps(manifest).encode()
    else:
        lines = files[STEPS].decode().splitlines()
        i = rng.randrange(1, len(lines))
        d = json.loads(lines[i])
        d["tensors"] = rng.choice(["../secret.safetensors", "../../secret.safetensors", "/tmp/secret.safetensors"])
        lines[i] = json.dumps(d)
        files[STEPS] = ("\n".join(lines) + "\n").encode()


def make_case(rng: random.Random, base: dict[str, bytes], case: Path) -> list[str]:
    """Write one mutated copy of ``base`` at ``case``; return what was done (for the failure message)."""
    files = dict(base)
    done = []
    swaps = []
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        rel = rng.choice([*files, "tensors", "sources"])
        roll = rng.random()
        if roll < 0.08:
            swaps.append(rel)
            done.append(f"swap {rel}")
            continue
        if roll < 0.14:
            point_outside(rng, files)
            done.append("point outside")
            continue
        if rel in ("tensors", "sources"):
            rel = rng.choice(list(files))
        if rel.endswith((".json", ".jsonl")) and roll < 0.65:
            files[rel] = mutate_json(rng, files[rel], rel.endswith(".jsonl"))
            done.append(f"json {rel}")
        else:
            files[rel] = mutate_bytes(rng, files[rel])
            done.append(f"bytes {rel}")
    for rel, data in files.items():
        (case / rel).parent.mkdir(parents=True, exist_ok=True)
        (case / rel).write_bytes(data)
    for rel in swaps:
        swap_file(rng, case, rel)
    return done


# -- reading a case, and watching what it reads -------------------------------------------------

_watch: dict[str, Any] = {"root": None, "outside": []}


def _audit(event: str, args: tuple) -> None:
    root = _watch["root"]
    if root is None or event != "open" or not isinstance(args[0], (str, bytes, os.PathLike)):
        return
    name = os.fsdecode(args[0])
    full = os.path.abspath(name)
    if not (full == root or full.startswith(root + os.sep)):
        _watch["outside"].append(full)


sys.addaudithook(_audit)


class Hang(Exception):
    """A read that did not return (the watchdog fired)."""


def _alarm(signum: int, frame: Any) -> None:
    raise Hang("no answer within 10 s")


def exercise(path: Path) -> list[str]:
    """Open strict and non-strict, iterate everything, read every tensor, source and side file.

    Returns every text the reading produced (records, messages, sources, side files).
    """
    seen: list[str] = []
    for strict in (True, False):
        try:
            trace = Trace.open(path, strict=strict)
        except TraceError as exc:
            seen.append(str(exc))
            continue
        seen.extend(trace.problems)
        seen.append(repr(trace.run))
        seen.extend(repr(g) for g in trace.gaps)
        for rec in trace.steps():
            seen.append(repr(rec))
            seen.append(f"{rec.num_reqs} {sorted(rec.shared_blocks)} {rec.query_lens}")
            if rec.tensors is None:
                continue
            try:
                loaded = trace.tensors(rec)
            except TraceError as exc:
                seen.append(str(exc))
                continue
            for name, t in loaded.items():
                with contextlib.suppress(RuntimeError, TypeError):  # the check's own: odd dtypes
                    if t.numel() and bool((t.double() == SECRET_VALUE).any()):
                        seen.append(f"{SECRET} (tensor {name})")
        for vllm_path in list(trace.run.sources):
            try:
                seen.append(trace.source(vllm_path) or "")
            except TraceError as exc:
                seen.append(str(exc))
        for side in (SESSION, REPLAY):
            try:
                seen.append(repr(trace.read_json(side)))
            except TraceError as exc:
                seen.append(str(exc))
    return seen


def run_fuzz(tmp: Path, n: int, seed: int) -> dict[str, Any]:
    """Run ``n`` seeded cases under ``tmp``; return counts: cases, escapes by type, reads outside, leaks."""
    (tmp / "secret.txt").write_text(SECRET)
    save_file({"x": torch.full((2, 2), SECRET_VALUE)}, str(tmp / "secret.safetensors"))
    write_base_trace(tmp / "base")
    exercise(tmp / "base")  # imports torch/safetensors lazily once, before the audit starts
    base = snapshot(tmp / "base")
    rng = random.Random(seed)
    escapes: collections.Counter[str] = collections.Counter()
    examples: dict[str, str] = {}
    outside: list[str] = []
    leaks: list[str] = []
    old = signal.signal(signal.SIGALRM, _alarm)
    try:
        for i in range(n):
            case = tmp / f"case{i}"
            done = make_case(rng, base, case)
            _watch["root"], _watch["outside"] = str(case.resolve()), []
            signal.setitimer(signal.ITIMER_REAL, 10)
            escape = None
            try:
                seen = exercise(case)
            except Exception as exc:  # noqa: BLE001 - what the test counts
                escape, seen = exc, []
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                _watch["root"] = None  # before the traceback is formatted: that reads our own sources
            if escape is not None:
                name = type(escape).__name__
                escapes[name] += 1
                text = "".join(traceback.format_exception(escape))[-1500:]
                examples.setdefault(name, f"case {i} ({', '.join(done)}):\n{text}")
            outside.extend(f"case {i} ({', '.join(done)}): {p}" for p in _watch["outside"])
            if any(SECRET in s for s in seen):
                leaks.append(f"case {i} ({', '.join(done)})")
            shutil.rmtree(case)
    finally:
        signal.signal(signal.SIGALRM, old)
    return {"cases": n, "escapes": dict(escapes), "examples": examples, "outside": outside, "leaks": leaks}


def test_the_base_trace_is_valid_and_fully_read(tmp_path):
    """The fuzzer's starting point reads cleanly, tensors and source included (else every case is moot)."""
    write_base_trace(tmp_path / "t")
    t = Trace.open(tmp_path / "t")
    assert [r.step for r in t.records] == [1, 2] and t.problems == []
    assert all(t.tensors(r)["query"].shape == (r.num_actual_tokens, 2, 4) for r in t.records)
    assert t.source(PAGED_ATTN).startswith("def split_kv_cache") and t.read_json(SESSION)["prompt"] == "hello"


def test_mutated_traces_raise_only_trace_error_and_read_nothing_outside(tmp_path):
    result = run_fuzz(tmp_path, N, SEED)
    print(
        f"\nfuzz: {result['cases']} cases (seed {SEED}); escapes by type: {result['escapes'] or 'none'}; "
        f"reads outside the trace: {len(result['outside'])}; secret seen: {len(result['leaks'])}"
    )
    assert result["escapes"] == {}, "\n\n".join(result["examples"].values())
    assert result["outside"] == [], "\n".join(result["outside"][:10])
    assert result["leaks"] == [], "\n".join(result["leaks"][:10])


def test_the_watchers_see_a_read_outside(tmp_path):
    """The audit hook and the planted secrets do catch a read outside the trace (else the fuzz test proves nothing)."""
    (tmp_path / "secret.txt").write_text(SECRET)
    case = tmp_path / "case"
    case.mkdir()
    _watch["root"], _watch["outside"] = str(case.resolve()), []
    try:
        text = (case / ".." / "secret.txt").resolve().read_text()
    finally:
        _watch["root"] = None
    assert _watch["outside"] == [str(tmp_path.resolve() / "secret.txt")] and SECRET in text


@pytest.mark.parametrize("seed", [1, 2])
def test_a_few_more_seeds(tmp_path, seed):
    """Other seeds, fewer cases: the mutator's choices move with the seed."""
    result = run_fuzz(tmp_path, max(N // 20, 50), seed)
    assert result["escapes"] == {}, "\n\n".join(result["examples"].values())
    assert result["outside"] == [] and result["leaks"] == []
