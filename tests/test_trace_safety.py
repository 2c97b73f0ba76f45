"""A trace is untrusted input: reading one never reads a file outside its directory."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal

import pytest
import torch

from tracer.format import (
    FORMAT_VERSION,
    MANIFEST,
    PAGED_ATTN,
    STEPS,
    RunInfo,
    StepRecord,
    Trace,
    TraceError,
    TraceWriter,
    sha256_text,
    store_sources,
)

SECRET = "TOKEN=do-not-leak\n"


def _run(sources: dict) -> RunInfo:
    return RunInfo(
        format_version=FORMAT_VERSION,
        pagedtrace_version="0",
        vllm_version="0.26.0",
        torch_version="2.11.0",
        platform="CpuPlatform",
        device="cpu",
        device_name="cpu",
        attention_backend="x.Impl",
        flash_attn_version=None,
        cudagraph_mode="NONE",
        enforce_eager=True,
        model=None,
        kv_cache=None,
        options={},
        sources=sources,
        created_at="2026-12-01T00:00:00+00:00",
    )


def _step() -> StepRecord:
    return StepRecord(
        step=1,
        layer="model.layers.0.self_attn.attn",
        kind="request",
        request_ids=("0-a",),
        num_actual_tokens=1,
        query_start_loc=(0, 1),
        seq_lens=(17,),
        block_table=((3, 5),),
        slot_mapping=(80,),
        max_query_len=1,
        max_seq_len=17,
        causal=True,
        sliding_window=(-1, -1),
        logits_soft_cap=0.0,
        scale=0.125,
        use_cascade=False,
        num_splits=0,
        num_heads=2,
        num_kv_heads=1,
        head_size=4,
    )


@pytest.fixture
def trace(tmp_path):
    """A trace with one stored source and one tensor file, plus a secret file beside it."""
    (tmp_path / "secret.txt").write_text(SECRET)
    path = tmp_path / "t"
    with TraceWriter(path) as w:
        sources = store_sources(w, {PAGED_ATTN: "a = 1\n"})
        w.write_manifest(_run(sources))
        w.append(_step(), {"query": torch.zeros(1, 2, 4), "output": torch.zeros(1, 2, 4)})
    return path


def _set_source_file(path, file: str, sha256: str | None = None) -> None:
    data = json.loads((path / MANIFEST).read_text())
    data["sources"][PAGED_ATTN] = {"file": file, "sha256": sha256 or sha256_text(SECRET)}
    (path / MANIFEST).write_text(json.dumps(data))


def test_stored_source_reads(trace):
    assert Trace.open(trace).source(PAGED_ATTN) == "a = 1\n"


@pytest.mark.parametrize(
    "file", ["../secret.txt", "sources/../../secret.txt", "/etc/passwd", "secret.txt", "sources//x", "sources/a\\..\\b"]
)
def test_a_source_path_outside_sources_is_refused(trace, file):
    _set_source_file(trace, file)
    with pytest.raises(TraceError, match=r"not under sources/|not a plain path"):
        Trace.open(trace).source(PAGED_ATTN)


def test_a_symlinked_source_is_refused(trace):
    link = trace / "sources" / "vllm" / "link.py"
    os.symlink(trace.parent / "secret.txt", link)
    _set_source_file(trace, "sources/vllm/link.py")
    with pytest.raises(TraceError, match="symbolic link"):
        Trace.open(trace).source(PAGED_ATTN)


def test_a_symlinked_sources_directory_is_refused(trace, tmp_path):
    outside = tmp_path / "outside" / "vllm" / "v1" / "attention" / "ops"
    outside.mkdir(parents=True)
    (outside / "paged_attn.py").write_text(SECRET)
    (trace / "sources").rename(tmp_path / "gone")
    os.symlink(tmp_path / "outside", trace / "sources")
    _set_source_file(trace, f"sources/{PAGED_ATTN}")
    with pytest.raises(TraceError, match="symbolic link"):
        Trace.open(trace).source(PAGED_ATTN)


def test_a_source_whose_sha256_differs_is_refused(trace):
    (trace / "sources" / PAGED_ATTN).write_text("a = 2\n")
    with pytest.raises(TraceError, match="does not match the sha256"):
        Trace.open(trace).source(PAGED_ATTN)


def test_a_source_that_is_not_utf8_is_a_trace_error(trace):
    raw = b"\xff\xfe"
    (trace / "sources" / PAGED_ATTN).write_bytes(raw)
    import hashlib

    _set_source_file(trace, f"sources/{PAGED_ATTN}", hashlib.sha256(raw).hexdigest())
    with pytest.raises(TraceError, match="not UTF-8"):
        Trace.open(trace).source(PAGED_ATTN)


@pytest.mark.parametrize("name", ["../../secret.txt", "/etc/passwd", "a/../../b"])
def test_a_tensor_file_outside_tensors_is_refused(trace, name):
    t = Trace.open(trace)
    record = dataclasses.replace(t.records[0], tensors=name)
    with pytest.raises(TraceError, match="not a plain path"):
        t.tensors(record)


def test_a_symlinked_tensor_file_is_refused(trace):
    t = Trace.open(trace)
    target = trace / "tensors" / t.records[0].tensors
    target.rename(trace.parent / "moved.safetensors")
    os.symlink(trace.parent / "moved.safetensors", target)
    with pytest.raises(TraceError, match="symbolic link"):
        t.tensors(t.records[0])


def test_a_symlinked_side_file_is_refused(trace):
    os.symlink(trace.parent / "secret.txt", trace / "replay.json")
    with pytest.raises(TraceError, match="symbolic link"):
        Trace.open(trace).read_json("replay.json")


def test_steps_file_survives_the_checks(trace):
    """The checks change nothing for a well-formed trace: every record still reads its tensors."""
    t = Trace.open(trace)
    assert (trace / STEPS).is_file() and t.tensors(t.records[0])["query"].shape == (1, 2, 4)


# -- malicious cases, by name ------------------------------------------------------------------
# (tests/test_fuzz.py mutates traces at random; these are the known attacks, one test each.)


@pytest.fixture
def full(tmp_path):
    """The fuzzer's base trace: a KV cache of 64 blocks, a gap, two steps with tensors, a source."""
    from tests.test_fuzz import write_base_trace

    (tmp_path / "secret.txt").write_text(SECRET)
    write_base_trace(tmp_path / "t")
    return tmp_path / "t"


def _edit_line(path, index: int, **changes) -> None:
    """Change fields of line ``index`` (0: the gap, 1 and 2: the steps) of steps.jsonl."""
    lines = (path / STEPS).read_text().splitlines()
    lines[index] = json.dumps({**json.loads(lines[index]), **changes})
    (path / STEPS).write_text("\n".join(lines) + "\n")


def _edit_manifest(path, change) -> None:
    data = json.loads((path / MANIFEST).read_text())
    change(data)
    (path / MANIFEST).write_text(json.dumps(data))


def _refused(path, pattern: str, line: int | None = 2) -> Trace:
    """Strict open fails naming the line and field; non-strict keeps the other step."""
    where = rf"steps\.jsonl: line {line}: " if line else ""
    with pytest.raises(TraceError, match=where + pattern):
        Trace.open(path)
    return Trace.open(path, strict=False)


def test_a_string_step_is_refused(full):
    _edit_line(full, 1, step="1")
    t = _refused(full, r"StepRecord\.step: expected an integer, got string '1'")
    assert [r.step for r in t.records] == [2] and len(t.problems) == 1 and "line 2" in t.problems[0]


@pytest.mark.parametrize("value", [True, 1.0, None, 2**64, -1])
def test_a_step_that_is_not_a_small_non_negative_int_is_refused(full, value):
    _edit_line(full, 1, step=value)
    assert [r.step for r in _refused(full, r"StepRecord\.step: ").records] == [2]


def test_block_size_0_is_refused(full):
    _edit_manifest(full, lambda d: d["kv_cache"].update(block_size=0))
    with pytest.raises(TraceError, match=r"manifest\.json: KVCacheSpec\.block_size: 0 is outside 1\.\.65536"):
        Trace.open(full, strict=False)


def test_causal_as_a_string_is_refused(full):
    _edit_line(full, 2, causal="false")
    assert [r.step for r in _refused(full, r"StepRecord\.causal: expected true or false", 3).records] == [1]


def test_format_version_1_0_is_refused(full):
    _edit_manifest(full, lambda d: d.update(format_version=1.0))
    with pytest.raises(TraceError, match=r"trace format version 1\.0; this pagedtrace reads versions 1, 2"):
        Trace.open(full)


@contextlib.contextmanager
def no_hang(seconds: int = 10):
    """Fail instead of hanging forever (what a FIFO did before)."""

    def fail(*_):
        raise AssertionError("blocked reading the trace")

    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_a_fifo_steps_file_is_refused_without_blocking(full):
    (full / STEPS).unlink()
    os.mkfifo(full / STEPS)
    with no_hang():
        with pytest.raises(TraceError, match=r"steps\.jsonl: a FIFO, not a regular file"):
            Trace.open(full)
        t = Trace.open(full, strict=False)
    assert t.records == [] and "a FIFO" in t.problems[0] and t.run.kv_cache.num_blocks == 64


@pytest.mark.parametrize("where", [MANIFEST, STEPS, "session.json", "tensors", "sources"])
def test_a_directory_or_fifo_where_a_file_should_be_is_refused(full, where):
    t = Trace.open(full)
    if where in ("tensors", "sources"):  # the file inside the directory
        target = full / "tensors" / t.records[0].tensors if where == "tensors" else full / "sources" / PAGED_ATTN
    else:
        target = full / where
    target.unlink()
    if where in ("sources", STEPS):
        os.mkfifo(target)
    else:
        target.mkdir()
    read = {
        MANIFEST: lambda: Trace.open(full),
        STEPS: lambda: Trace.open(full),
        "session.json": lambda: t.read_json("session.json"),
        "tensors": lambda: t.tensors(t.records[0]),
        "sources": lambda: t.source(PAGED_ATTN),
    }[where]
    with no_hang(), pytest.raises(TraceError, match=r"(a directory|a FIFO), not a regular file"):
        read()


def test_a_huge_sparse_file_is_refused_after_a_bounded_read(full):
    """A /dev/zero-like steps.jsonl (1 TiB of zeros, no newline) or manifest: a limit, not MemoryError."""
    with open(full / STEPS, "wb") as f:
        f.truncate(1 << 40)
    with pytest.raises(TraceError, match=r"line 1: longer than 33,554,432 bytes"):
        Trace.open(full)
    assert Trace.open(full, strict=False).problems[0].endswith("the rest of the file is not read")
    with open(full / MANIFEST, "wb") as f:
        f.truncate(1 << 40)
    with pytest.raises(TraceError, match=r"larger than 16,777,216 bytes, the limit for a manifest"):
        Trace.open(full)


def test_a_symlink_to_dev_zero_is_refused(full):
    (full / STEPS).unlink()
    os.symlink("/dev/zero", full / STEPS)
    with pytest.raises(TraceError, match="symbolic link"):
        Trace.open(full)


def test_a_list_of_10_to_the_8_elements_is_refused_unread(full):
    lines = (full / STEPS).read_bytes().splitlines(keepends=True)
    head = json.loads(lines[1])
    head["slot_mapping"] = []
    prefix, suffix = json.dumps(head).encode().split(b'"slot_mapping": []')
    with open(full / STEPS, "wb") as f:
        f.write(lines[0] + prefix + b'"slot_mapping": [')
        chunk = b"0," * 1_000_000
        for _ in range(100):
            f.write(chunk)
        f.write(b"0]" + suffix + b"\n" + lines[2])
    assert (full / STEPS).stat().st_size > 2 * 10**8
    with pytest.raises(TraceError, match=r"line 2: longer than 33,554,432 bytes"):
        Trace.open(full)


def test_a_long_list_within_the_line_limit_is_refused(full):
    _edit_line(full, 1, query_start_loc=list(range(70000)))
    _refused(full, r"StepRecord\.query_start_loc: a list of 70000 entries \(at most 65537\)")


def test_a_lone_surrogate_in_the_model_name_is_refused(full):
    _edit_manifest(full, lambda d: d["model"].update(name="tiny\ud800"))
    with pytest.raises(TraceError, match=r"ModelSummary\.name: string 'tiny\\ud800' holds a lone surrogate"):
        Trace.open(full)


def test_query_start_loc_past_the_query_is_refused(full):
    _edit_line(full, 1, query_start_loc=[0, 2, 5])
    _refused(full, r"StepRecord\.query_start_loc: ends at 5, past num_actual_tokens 3")


def test_a_block_id_of_2_to_the_64_is_refused(full):
    _edit_line(full, 1, block_table=[[3], [4, 2**64]])
    _refused(full, r"StepRecord\.block_table\[1\]\[1\]: 18446744073709551616 is outside 0\.\.2147483647")


def test_a_block_id_past_the_pool_is_refused(full):
    _edit_line(full, 1, block_table=[[3], [4, 64]])
    _refused(full, r"StepRecord\.block_table\[1\]\[1\]: block 64 is outside the cache's 64 blocks")


def test_wrong_length_alibi_slopes_are_refused(full):
    _edit_line(full, 2, alibi_slopes=[0.5, 0.25, 0.125])
    _refused(full, r"StepRecord\.alibi_slopes: 3 values for 2 heads", 3)


def test_a_tensor_with_an_extra_dimension_is_refused(full):
    from safetensors.torch import load_file, save_file

    t = Trace.open(full)
    file = full / "tensors" / t.records[0].tensors
    tensors = load_file(str(file))
    tensors["query"] = tensors["query"].unsqueeze(-1)
    save_file(tensors, str(file))
    with pytest.raises(TraceError, match=r"tensor query has shape \[3, 2, 4, 1\], expected \[T >= 3, 2, 4\]"):
        t.tensors(t.records[0])
    assert t.tensors(t.records[1])["query"].shape == (2, 2, 4)  # the other step still reads


def test_a_truncated_slot_mapping_is_refused(full):
    _edit_line(full, 1, slot_mapping=[48, 49])
    _refused(full, r"StepRecord\.slot_mapping: 2 slots for 3 new tokens")


@pytest.mark.parametrize(
    ("raw", "pattern"),
    [
        (b'{"type": "gap", "step": ' + b"9" * 5000 + b"}", "a number too long to read"),
        (b"[" * 100000, "JSON nested too deeply"),
        (b'{"type": "gap", "reason": "\xff\xfe"}', r"not UTF-8 text \(byte 27\)"),
    ],
)
def test_huge_numbers_deep_nesting_and_bad_bytes_are_trace_errors(full, raw, pattern):
    lines = (full / STEPS).read_bytes().splitlines(keepends=True)
    (full / STEPS).write_bytes(lines[0] + raw + b"\n" + lines[2])
    t = _refused(full, pattern)
    assert [r.step for r in t.records] == [2]
    (full / MANIFEST).write_bytes(raw)
    with pytest.raises(TraceError, match=pattern):
        Trace.open(full, strict=False)


def test_a_source_entry_without_sha256_is_refused(full):
    _edit_manifest(full, lambda d: d["sources"][PAGED_ATTN].pop("sha256"))
    with pytest.raises(TraceError, match=r"RunInfo\.sources\[.*\]: expected the keys file and sha256"):
        Trace.open(full)


@pytest.mark.parametrize("value", [10**400, float("nan"), "0.125"])
def test_a_float_field_that_is_not_a_finite_number_is_refused(full, value):
    _edit_line(full, 1, scale=value)
    _refused(full, r"StepRecord\.scale: (an integer of 401 digits is too large|expected a finite number)")
