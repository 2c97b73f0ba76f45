"""A trace is untrusted input: reading one never reads a file outside its directory."""

from __future__ import annotations

import dataclasses
import json
import os

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
