"""pagedtrace's bottom layer: what every room stands on, with no torch and no vLLM.

* :mod:`~tracer.format.version` -- pagedtrace's version, ``FORMAT_VERSION`` and its history;
* :mod:`~tracer.format.records` -- the records a trace is made of (manifest, steps, gaps);
* :mod:`~tracer.format.store` -- the trace directory: ``TraceWriter`` and ``Trace``;
* :mod:`~tracer.format.decode` -- every record field decoded on load (types, ranges, lengths);
* :mod:`~tracer.format.schema` -- the whole-record checks on load (consistency, tensor shapes);
* :mod:`~tracer.format.reading` -- reading trace files as untrusted input (regular files, bounded);
* :mod:`~tracer.format.sources` -- the vLLM source files a trace keeps;
* :mod:`~tracer.format.verdicts` -- replay's verdicts (``replay.json``), typed both ways;
* :mod:`~tracer.format.layouts` -- the KV-cache layout registry and its geometry;
* :mod:`~tracer.format.metadata` -- metadata verdicts: slots, lengths, blocks, flags, groups (no tensors);
* :mod:`~tracer.format.groups` -- the KV-cache groups of a trace, recorded or inferred;
* :mod:`~tracer.format.selection` -- ``--steps`` / ``--layers`` parsing and matching.

``tracer`` (the hooks), ``reference_impl``, ``annotations``, ``reports`` and the CLI
import from here; this package imports only the standard library (safetensors and
torch are imported lazily, only to read or write tensors).
"""

from __future__ import annotations

from tracer.format.errors import first_line
from tracer.format.jsonfields import finite_or_none
from tracer.format.kernel_verdicts import CaseResult, WorstValue
from tracer.format.layouts import LAYOUTS, REGISTRY, STORED_LAYOUTS, Layout, describe_layout, element_offset
from tracer.format.records import (
    STEP_KINDS,
    GapRecord,
    KVCacheGroup,
    KVCacheSpec,
    ModelSummary,
    RunInfo,
    StepRecord,
    TensorParallel,
    TraceError,
    record_from_json,
    record_to_json,
)
from tracer.format.selection import (
    StepRange,
    check_steps,
    layer_index,
    layer_matches,
    parse_layer,
    parse_layers,
    parse_steps,
    step_in_range,
)
from tracer.format.sources import (
    ATTENTION,
    BLOCK_TABLE,
    CPU_ATTN,
    FLASH_ATTN,
    PAGED_ATTN,
    SOURCE_FILES,
    read_sources,
    sha256_text,
    store_sources,
)
from tracer.format.store import (
    MANIFEST,
    REPLAY,
    SESSION,
    SOURCES_DIR,
    STEPS,
    TENSORS_DIR,
    Trace,
    TraceWriter,
    read_manifest,
    tensor_file_name,
    write_side_file,
)
from tracer.format.verdicts import (
    AttentionVerdict,
    HeadResult,
    LegacyCheck,
    MetadataCheck,
    MetadataProblem,
    ReplayReport,
    StepResult,
    Tolerance,
    WriteCheck,
)
from tracer.format.version import FORMAT_VERSION, READABLE_VERSIONS, __version__

__all__ = [
    "ATTENTION",
    "BLOCK_TABLE",
    "CPU_ATTN",
    "FLASH_ATTN",
    "FORMAT_VERSION",
    "LAYOUTS",
    "MANIFEST",
    "PAGED_ATTN",
    "READABLE_VERSIONS",
    "REGISTRY",
    "REPLAY",
    "SESSION",
    "SOURCES_DIR",
    "SOURCE_FILES",
    "STEPS",
    "STEP_KINDS",
    "STORED_LAYOUTS",
    "TENSORS_DIR",
    "AttentionVerdict",
    "CaseResult",
    "GapRecord",
    "HeadResult",
    "KVCacheGroup",
    "KVCacheSpec",
    "Layout",
    "LegacyCheck",
    "MetadataCheck",
    "MetadataProblem",
    "ModelSummary",
    "ReplayReport",
    "RunInfo",
    "StepRange",
    "StepRecord",
    "StepResult",
    "TensorParallel",
    "Tolerance",
    "Trace",
    "TraceError",
    "TraceWriter",
    "WorstValue",
    "WriteCheck",
    "__version__",
    "check_steps",
    "describe_layout",
    "element_offset",
    "finite_or_none",
    "first_line",
    "layer_index",
    "layer_matches",
    "parse_layer",
    "parse_layers",
    "parse_steps",
    "read_manifest",
    "read_sources",
    "record_from_json",
    "record_to_json",
    "sha256_text",
    "step_in_range",
    "store_sources",
    "tensor_file_name",
    "write_side_file",
]
