"""Versions: pagedtrace's own, and the trace format's with its history.

Standard library only; every room (and the CLI) reads the version from here.
"""

from __future__ import annotations

#: pagedtrace's release (also in pyproject.toml; the manifest records it).
__version__ = "0.3.0"

#: Version of the on-disk trace format (``manifest.json``, ``steps.jsonl``,
#: ``tensors/``, ``sources/``, ``replay.json``). Readers open every version in
#: :data:`READABLE_VERSIONS`; anything else is a clear ``TraceError``. A record field gives the
#: version it appeared in (``SINCE``); optional manifest ``extra`` keys need no new version.
#:
#: 1: manifest, ``steps.jsonl`` of ``StepRecord``/``GapRecord``, safetensors, hashed sources (0.1)
#: 2: fp8 ``q/k/v_scale`` and ``query_dtype``; every field required; ``replay.json`` versioned (0.2)
#: 3: ``cudagraph``, ``padded_tokens``; tensors are a KV write log (``tracer.format.writelog``) (0.3)
#: 4: optional tensors ``query_rows`` (the query rows kept) and ``kv_inputs_written`` (key/value = kv_written) (0.3)
#: 5: manifest ``kv_cache_groups`` (``KVCacheGroup``) and ``null_block``; ``StepRecord.kv_cache_group`` (0.3)
#:   and manifest ``tensor_parallel`` (rank, world size, head ranges); rank N > 0 writes ``rank<N>/``,
#:   read as one trace with rank 0's (``tracer.format.ranks``)
#:   and FlashInfer's ``paged_kv_indptr`` / ``paged_kv_indices`` / ``paged_kv_last_page_len``
FORMAT_VERSION = 5

#: Format versions this pagedtrace reads.
READABLE_VERSIONS = (1, 2, 3, 4, 5)
