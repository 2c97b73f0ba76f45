"""The engine's KV-cache groups, read from the model runner's ``kv_cache_config`` for the manifest.

vLLM 0.26's ``GPUModelRunner`` (and ``CPUModelRunner``, its subclass) keeps the
``KVCacheConfig`` it was initialised with: ``kv_cache_groups``, a list of ``KVCacheGroupSpec``
(``layer_names``, ``kv_cache_spec``). The spec's class says what the group's block table keeps:
``FullAttentionSpec`` (every block; a model served without the hybrid KV-cache manager keeps its
window layers here too, with ``sliding_window`` set), ``SlidingWindowSpec`` (blocks before the
window are given back: the table holds ``NULL_BLOCK_ID`` there), ``ChunkedLocalAttentionSpec``,
``MambaSpec``. Read once, when the manifest is written; vLLM is never imported here (the objects
come from the runner), except for ``NULL_BLOCK_ID``, looked up lazily.
"""

from __future__ import annotations

from typing import Any

from tracer.format import KVCacheGroup

__all__ = ["group_kind", "kv_cache_groups", "layer_groups", "null_block_id"]

#: vLLM spec class names (any class in the spec's MRO) -> ``KVCacheGroup.kind``, most specific first.
_SPEC_KINDS = (
    ("SlidingWindowSpec", "sliding_window"),
    ("SlidingWindowMLASpec", "sliding_window"),
    ("ChunkedLocalAttentionSpec", "chunked_local"),
    ("MambaSpec", "mamba"),
    ("FullAttentionSpec", "full"),
)


def group_kind(spec: Any) -> str:
    """``KVCacheGroup.kind`` of a vLLM ``KVCacheSpec`` instance, by its class and bases."""
    names = {cls.__name__ for cls in type(spec).__mro__}
    return next((kind for name, kind in _SPEC_KINDS if name in names), "other")


def _optional_int(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def kv_cache_groups(runner: Any) -> tuple[KVCacheGroup, ...] | None:
    """The runner's ``kv_cache_config.kv_cache_groups`` as records; None when the runner has none yet."""
    config = getattr(runner, "kv_cache_config", None)
    groups = getattr(config, "kv_cache_groups", None)
    if not groups:
        return None
    out = []
    for i, group in enumerate(groups):
        spec = group.kv_cache_spec
        out.append(
            KVCacheGroup(
                group=i,
                kind=group_kind(spec),
                spec=type(spec).__name__,
                layer_names=tuple(str(n) for n in group.layer_names),
                block_size=int(spec.block_size),
                sliding_window=_optional_int(getattr(spec, "sliding_window", None)),
                attention_chunk_size=_optional_int(getattr(spec, "attention_chunk_size", None)),
            )
        )
    return tuple(out)


def layer_groups(runner: Any) -> dict[str, int]:
    """Layer name -> index of the KV-cache group whose block table it reads (empty: not known yet)."""
    return {name: g.group for g in kv_cache_groups(runner) or () for name in g.layer_names}


def null_block_id() -> int | None:
    """vLLM's ``NULL_BLOCK_ID`` (the id a table holds where its group keeps no block), or None."""
    import importlib

    try:
        value = importlib.import_module("vllm.v1.attention.backends.utils").NULL_BLOCK_ID
    except Exception:  # noqa: BLE001 - a vLLM without it: not recorded
        return None
    return int(value) if isinstance(value, int) else None
