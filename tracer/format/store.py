"""Write and read a trace directory: JSON manifest, JSONL records, safetensors.

A trace directory::

    manifest.json        RunInfo (format version, versions, device, KV-cache spec)
    steps.jsonl          one StepRecord / GapRecord per line, append-only
    tensors/*.safetensors  captured tensors, one file per (step, layer)
    sources/...          the vLLM source files the annotator reads, as the engine had them
    session.json         optional: what ``pagedtrace run`` asked for and got back
    replay.json          optional: ``pagedtrace replay``'s verdicts
    rank<N>/             tensor-parallel rank N > 0: a whole trace of its heads (:mod:`tracer.format.ranks`)

Only JSON and safetensors are written or read; torch and safetensors are imported only when tensors are
read or written, so a report can be built where neither is installed.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from tracer.format.ranks import RankDisagreement, join, join_tensors, kv_ranks, rank_dir
from tracer.format.reading import (
    MAX_LINE_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_SIDE_FILE_BYTES,
    MAX_SOURCE_BYTES,
    is_present,
    open_regular,
    parse_json,
    read_bytes,
    read_json_file,
)
from tracer.format.records import GapRecord, RunInfo, StepRecord, TraceError, record_from_json, record_to_json
from tracer.format.schema import INDEX_TENSORS, KV_INPUTS_WRITTEN, check_step_in_cache, check_tensors
from tracer.format.version import FORMAT_VERSION, READABLE_VERSIONS
from tracer.format.writelog import WriteLogReader

if TYPE_CHECKING:
    import torch

MANIFEST = "manifest.json"
STEPS = "steps.jsonl"
TENSORS_DIR = "tensors"
SOURCES_DIR = "sources"
SESSION = "session.json"
REPLAY = "replay.json"


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _json_line(obj: dict[str, Any]) -> str:
    return json.dumps(obj, separators=(",", ":"))


def tensor_file_name(step: int, layer: str) -> str:
    """File name (under ``tensors/``) for one step's tensors of one layer."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in layer)
    return f"step{step:06d}-{safe}.safetensors"


class TraceWriter:
    """Append records and tensors to a trace directory.

    Used off the engine's hot path (the hooks queue, the writer writes). A tensor
    byte budget stops tensor capture, never record capture, once spent. ``encode_line``
    turns a record's JSON object into its line (no newline); the default is ``json.dumps``,
    and the tracer passes a faster encoder that reads back the same (``tracer.jsonline``).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        tensor_budget_bytes: int | None = None,
        encode_line: Callable[[dict[str, Any]], str] | None = None,
    ):
        self.path = Path(path)
        self._encode_line = encode_line or _json_line
        self.tensor_budget_bytes = tensor_budget_bytes
        self.tensor_bytes = 0
        self.budget_exhausted = False
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / TENSORS_DIR).mkdir(exist_ok=True)
        self._steps = open(self.path / STEPS, "a", encoding="utf-8")  # noqa: SIM115 - open until close()

    def write_manifest(self, run: RunInfo) -> None:
        """Write (or rewrite) ``manifest.json`` atomically."""
        _atomic_write_text(self.path / MANIFEST, json.dumps(run.to_json(), indent=2) + "\n")

    def add_source(self, vllm_path: str, text: str) -> str:
        """Store one vLLM source file; return its path relative to the trace directory."""
        rel = f"{SOURCES_DIR}/{vllm_path}"
        dest = self.path / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text, encoding="utf-8")
        return rel

    def append(
        self,
        record: StepRecord | GapRecord,
        tensors: Mapping[str, torch.Tensor] | None = None,
    ) -> StepRecord | GapRecord:
        """Write ``tensors`` (if any, within budget) and one JSONL line; return the stored record.

        The line is flushed at once: an engine killed right after keeps it.
        """
        if tensors and isinstance(record, StepRecord):
            size = sum(t.numel() * t.element_size() for t in tensors.values())
            budget = self.tensor_budget_bytes
            if budget is not None and self.tensor_bytes + size > budget:
                self.budget_exhausted = True
            else:
                from safetensors.torch import save_file

                name = tensor_file_name(record.step, record.layer)
                save_file(
                    {k: v.contiguous() for k, v in tensors.items()},
                    str(self.path / TENSORS_DIR / name),
                    metadata={"format_version": str(FORMAT_VERSION), "layer": record.layer},
                )
                self.tensor_bytes += size
                record = replace(record, tensors=name, tensor_names=tuple(sorted(tensors)))
        self._steps.write(self._encode_line(record_to_json(record)) + "\n")
        self._steps.flush()
        return record

    def write_json(self, name: str, data: Any) -> None:
        """Write a side file such as ``session.json`` atomically."""
        write_side_file(self.path, name, data)

    def close(self) -> None:
        """Close the JSONL file; the directory stays readable."""
        self._steps.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class Trace:
    """A trace directory, read.

    ``problems`` lists what could not be read (a truncated last line, say) when
    the trace was opened with ``strict=False``; everything valid is in
    ``records`` and ``gaps``.

    A trace is untrusted input. Reading one reads no file outside its directory
    (:meth:`member`), only regular files (:mod:`tracer.format.reading`), and checks every
    record against the schema (:mod:`tracer.format.schema`); whatever is wrong is a
    ``TraceError`` with a one-line message.

    A tensor-parallel trace reads as one (:mod:`tracer.format.ranks`): ``records`` per (step,
    layer) with the global heads, ``tensors`` joined over the ranks, ``ranks`` each rank's own
    trace (rank order) and ``disagreements`` where a rank's part differs from rank 0's. A
    single-rank trace has no ``ranks``.
    """

    path: Path
    run: RunInfo
    records: list[StepRecord]
    gaps: list[GapRecord]
    problems: list[str] = field(default_factory=list)
    ranks: tuple[Trace, ...] = ()
    disagreements: tuple[RankDisagreement, ...] = ()
    _write_log: WriteLogReader | None = field(default=None, init=False, repr=False, compare=False)
    _by_key: tuple[dict[tuple[int, str], StepRecord], ...] = field(default=(), repr=False, compare=False)

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, strict: bool = True) -> Trace:
        """Read ``path``; raise ``TraceError`` on anything malformed (unless ``strict=False``
        for the step lines, which then keeps the valid ones and lists the rest in ``problems``).

        A line that fails the schema names the file, the line and the field. A line longer
        than :data:`~tracer.format.reading.MAX_LINE_BYTES` ends the reading (with
        ``strict=False``, the records before it are kept).
        """
        path = Path(path)
        if not path.is_dir():
            raise TraceError(f"{path}: not a trace directory")
        run = read_manifest(path)
        trace = cls(path=path, run=run, records=[], gaps=[])
        steps_path = path / STEPS
        try:
            f = open_regular(steps_path)
        except TraceError as exc:
            if strict:
                raise
            trace.problems.append(str(exc))
            return trace
        if f is not None:
            with f:
                trace._read_steps(f, steps_path, strict)
        tp = run.tensor_parallel
        if tp is not None and tp.rank == 0 and tp.world_size > 1:
            return trace._joined(strict)
        return trace

    def _joined(self, strict: bool) -> Trace:
        """This rank-0 trace joined with the other ranks' parts (``rank<N>/``)."""
        parts = [self]
        for rank in range(1, self.run.tensor_parallel.world_size):  # type: ignore[union-attr]
            where = self.path / rank_dir(rank)
            try:
                if where.is_symlink() or not where.is_dir():
                    raise TraceError(f"{where}: rank {rank}'s part of the trace is missing")
                parts.append(Trace.open(where, strict=strict))
            except TraceError as exc:
                if strict:
                    raise
                self.problems.append(f"{exc}; reading rank 0 alone")
                return self
        joined = join(parts)
        problems = [f"rank {r}: {p}" for r, part in enumerate(parts) for p in part.problems]
        trace = Trace(self.path, joined.run, joined.records, list(self.gaps), problems)
        trace.ranks, trace.disagreements, trace._by_key = tuple(parts), joined.disagreements, joined.by_key
        return trace

    def _read_steps(self, f: BinaryIO, steps_path: Path, strict: bool) -> None:
        spec = self.run.kv_cache
        lineno = 0
        while True:
            line = f.readline(MAX_LINE_BYTES + 1)
            if not line:
                return
            lineno += 1
            msg = None
            if len(line) > MAX_LINE_BYTES:
                msg = f"longer than {MAX_LINE_BYTES:,} bytes; the rest of the file is not read"
            elif line.strip():
                try:
                    rec = record_from_json(parse_json(line), self.run.format_version)
                    if isinstance(rec, StepRecord) and spec is not None:
                        check_step_in_cache(rec, spec)
                except RecursionError:
                    msg = "nested too deeply"
                except TraceError as exc:
                    msg = str(exc)
                else:
                    (self.records if isinstance(rec, StepRecord) else self.gaps).append(rec)  # type: ignore[arg-type]
                    continue
            else:
                continue
            where = f"{steps_path}: line {lineno}: {msg}"
            if strict:
                raise TraceError(
                    f"{where} ({len(self.records) + len(self.gaps)} valid records before it; "
                    "--lax reads them, strict=False in Python)"
                )
            self.problems.append(where)
            if len(line) > MAX_LINE_BYTES:
                return

    def steps(self, *, kind: str | None = None, layer: str | None = None) -> list[StepRecord]:
        """Records, optionally only of one kind (``request`` ...) and/or one layer."""
        return [r for r in self.records if (kind is None or r.kind == kind) and (layer is None or r.layer == layer)]

    @property
    def layers(self) -> list[str]:
        """Captured layer names, in first-seen order."""
        return list(dict.fromkeys(r.layer for r in self.records))

    def tensors(self, record: StepRecord, *, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """Load the tensors captured with ``record``; ``TraceError`` if there are none or the file is bad.

        ``device``: where the tensors of values (query, output, key, value, blocks) are put; the
        ids and slots stay on the CPU with the record's block table. A write-log record's blocks
        are then rebuilt there (only what each step wrote crosses the bus). None: the CPU.

        A write-log record (format 3, ``kv_log_epoch`` set) gets ``kv_blocks`` / ``kv_block_ids``
        rebuilt from its run's log (:mod:`tracer.format.writelog`), unless it is a check step that
        stores them: then the stored ones are returned, as in format 2. A format-4 file that
        marks its ``key``/``value`` as equal to ``kv_written`` (``kv_inputs_written``) gets them
        back from it; one that keeps only some query rows has ``query_rows``
        (:mod:`tracer.format.rows`). A tensor-parallel trace joins its ranks' tensors
        (:func:`tracer.format.ranks.join_tensors`).
        """
        if self.ranks:
            disagree = any(d.step == record.step and d.layer == record.layer for d in self.disagreements)
            return join_tensors(self.ranks, self._by_key, record, disagree, device)
        file = self.tensor_path(record)
        try:
            from safetensors.torch import load_file

            loaded = load_file(str(file))
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise TraceError(f"{file}: cannot read tensors: {str(exc)[:200]}") from None
        missing = set(record.tensor_names) - loaded.keys()
        if missing:
            raise TraceError(f"{file}: tensors {sorted(missing)} missing")
        check_tensors(record, loaded, self.run.kv_cache)
        if loaded.pop(KV_INPUTS_WRITTEN, None) is not None:
            loaded["key"], loaded["value"] = inputs_from_written(record, loaded["kv_written"])
        if device is not None:  # before the rebuild, which then finds this step's writes there
            loaded = {name: t if name in INDEX_TENSORS else t.to(device) for name, t in loaded.items()}
        if record.kv_log_epoch is not None and "kv_blocks" not in loaded:
            loaded["kv_block_ids"], loaded["kv_blocks"] = self.write_log.rebuild(record, loaded, device=device)
        return loaded

    def tensor_path(self, record: StepRecord) -> Path:
        """The tensor file of ``record``, inside the trace; ``TraceError`` if none was captured or it is missing."""
        if record.tensors is None:
            raise TraceError(
                f"step {record.step} layer {record.layer}: no tensors captured "
                "(trace with tensors on, e.g. `pagedtrace run --tensors`)"
            )
        file = self.member(TENSORS_DIR, record.tensors)
        if not is_present(file):
            raise TraceError(f"{file}: tensor file missing")
        return file

    @property
    def write_log(self) -> WriteLogReader:
        """The KV write-log reader of this trace (its per-layer state lives as long as the trace)."""
        if self._write_log is None:
            self._write_log = WriteLogReader(self)
        return self._write_log

    def rebuilt_kv(self, record: StepRecord) -> tuple[torch.Tensor, torch.Tensor]:
        """``(kv_block_ids int32 [n], kv_blocks [n, *cache.shape[1:]])`` of a write-log record, always from the log.

        The blocks are those of ``record.block_table`` (sorted ids), as ``kv_blocks`` of
        format 2; a check step's stored blocks are not used. ``TraceError`` for a record
        without ``kv_log_epoch`` or a block the log does not hold. A tensor-parallel trace joins
        its ranks' blocks over the KV heads.
        """
        if self.ranks:
            import torch

            key = (record.step, record.layer)
            parts = [part.rebuilt_kv(by_key[key]) for part, by_key in zip(self.ranks, self._by_key, strict=True)]
            return parts[0][0], torch.cat([parts[r][1] for r in kv_ranks(self.ranks)], dim=1)
        return self.write_log.rebuild(record)

    def source(self, vllm_path: str) -> str | None:
        """Text of a stored vLLM source file, or None if the trace has none for it."""
        entry = self.run.sources.get(vllm_path)
        if entry is None:
            return None
        if not isinstance(entry, dict) or not isinstance(entry.get("file"), str):
            raise TraceError(f"{self.path / MANIFEST}: sources[{vllm_path!r}] has no file name")
        rel = entry["file"]
        prefix = SOURCES_DIR + "/"
        if not rel.startswith(prefix):
            raise TraceError(f"{self.path / MANIFEST}: source {rel!r} is not under {SOURCES_DIR}/")
        file = self.member(SOURCES_DIR, rel[len(prefix) :])
        data = read_bytes(file, MAX_SOURCE_BYTES, "a stored source")
        if data is None:
            return None
        expected = entry.get("sha256")
        if hashlib.sha256(data).hexdigest() != expected:
            raise TraceError(f"{file}: content does not match the sha256 the manifest stores")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise TraceError(f"{file}: not UTF-8 text") from None

    def member(self, subdir: str, rel: str) -> Path:
        """``subdir/rel`` inside the trace directory, refusing anything that leads outside it.

        A trace is untrusted input: an absolute path, a ``..`` part or a symbolic link
        anywhere below the trace directory is a ``TraceError``, so reading a trace never
        reads another file of the machine.
        """
        parts = rel.split("/")
        bad = not rel or rel.startswith("/") or "\\" in rel or "\x00" in rel or len(rel) > 4096
        if bad or any(p in ("", ".", "..") for p in parts):
            raise TraceError(f"{self.path}: {subdir}/{rel[:200]!r} is not a plain path inside the trace")
        file = self.path / subdir
        for part in ("", *parts):
            file = file / part if part else file
            try:
                link = stat.S_ISLNK(os.lstat(file).st_mode)
            except FileNotFoundError:
                break  # nothing below it either: the reader reports the file missing
            except OSError as exc:
                raise TraceError(f"{file}: cannot read: {exc.strerror or exc}") from None
            if link:
                raise TraceError(f"{file}: a symbolic link inside the trace; refusing to follow it")
        return file

    def read_json(self, name: str) -> Any | None:
        """A side file (``session.json``, ``replay.json``), or None if absent."""
        if "/" in name or name in ("", ".", ".."):
            raise TraceError(f"{self.path}: side file {name!r} is not a plain file name")
        return read_json_file(self.path / name, MAX_SIDE_FILE_BYTES, "a side file")

    def iter_with_tensors(self, **filters: Any) -> Iterator[tuple[StepRecord, dict[str, torch.Tensor]]]:
        """Yield (record, tensors) for the records that have tensors."""
        for rec in self.steps(**filters):
            if rec.tensors is not None:
                yield rec, self.tensors(rec)


def read_manifest(path: Path) -> RunInfo:
    """Read and version-check ``manifest.json``."""
    file = path / MANIFEST
    raw = read_bytes(file, MAX_MANIFEST_BYTES, "a manifest")
    if raw is None:
        raise TraceError(f"{path}: no {MANIFEST} (not a pagedtrace trace, or the engine never ran attention)")
    data = parse_json(raw, str(file))
    version = data.get("format_version") if isinstance(data, dict) else None
    if type(version) is not int or version not in READABLE_VERSIONS:
        readable = ", ".join(map(str, READABLE_VERSIONS))
        raise TraceError(f"{file}: trace format version {version!r}; this pagedtrace reads versions {readable}")
    try:
        return RunInfo.from_json(data, version)
    except TraceError as exc:
        raise TraceError(f"{file}: {exc}") from None
    except RecursionError:
        raise TraceError(f"{file}: nested too deeply") from None


def write_side_file(path: str | os.PathLike[str], name: str, data: Any) -> None:
    """Write a JSON side file (``session.json``, ``replay.json``) into a trace directory atomically."""
    _atomic_write_text(Path(path) / name, json.dumps(data, indent=2) + "\n")


def inputs_from_written(record: StepRecord, written: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``key``, ``value`` ``[num_actual_tokens, H_kv, D]`` as ``do_kv_cache_update`` got them, from ``kv_written``.

    For a file marked ``kv_inputs_written``: the tracer found the step's inputs equal, bit for bit,
    to the cache entries at their slots. Row ``i`` is ``kv_written``'s row for the ``i``-th slot
    that is not -1; padding rows (slot -1, never written) are zeros.
    """
    import torch

    n = record.num_actual_tokens
    rows = torch.tensor([i for i, s in enumerate(record.slot_mapping[:n]) if s >= 0], dtype=torch.long)
    if len(rows) != written.shape[0]:
        raise TraceError(
            f"step {record.step} layer {record.layer[:80]!r}: kv_written has {written.shape[0]} rows, "
            f"slot_mapping {len(rows)} written slots"
        )
    key = written.new_zeros((n, *written.shape[2:]))
    value = written.new_zeros((n, *written.shape[2:]))
    key[rows], value[rows] = written[:, 0], written[:, 1]
    return key, value
