"""Why did this prefix hit or miss vLLM's prefix cache? Worked out from the trace alone.

For each request, its first scheduled step says how many tokens were already in the KV
cache (``seq_len - query_len``): those came from the prefix cache. The block-table row
names the physical blocks they sit in, and the ``slot_mapping`` of earlier steps (and of
the same step: vLLM caches a block when it allocates it) says which request wrote each.
With the prompts ``pagedtrace run`` records (``session.json``) the first block that was
*not* served is explained:

``block-floor``
    only full blocks are cached, and vLLM always recomputes the last prompt token, so the
    tail of a prompt shorter than one more block cannot hit (the block-size floor);
``different-token``
    the closest earlier request holds a different token at position ``p`` of that block;
``never-cached``
    no request before it had computed those tokens;
``evicted``
    an earlier request held the same full block, but its physical block was reused by
    another request before this one came;
``caching-off``
    the session ran with prefix caching disabled;
``unknown``
    the same full block was held and not visibly reused: vLLM's hash table, its free
    queue and the order of scheduling within one step are not in the trace.

Standard library only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from tracer.format.groups import TraceGroups, group_label, trace_groups
from tracer.format.records import TraceError
from tracer.format.requests import RequestView, request_layer, request_views, session_tokens
from tracer.format.store import Trace
from tracer.format.words import Words

__all__ = [
    "WHAT_THE_TRACE_CANNOT_SHOW",
    "CachedBlock",
    "GroupPrefix",
    "Miss",
    "PrefixExplanation",
    "explain_prefix_cache",
    "explain_prefix_cache_by_group",
]

#: Said on every explanation: what the verdicts rest on and what they cannot see.
WHAT_THE_TRACE_CANNOT_SHOW = (
    "vLLM's block hashes, its free-block queue and evictions are not recorded: an eviction is "
    "inferred only when a physical block visibly passes to another request",
    "the order requests were scheduled in within one step is not recorded (the block-table rows are "
    "reordered): a request of the same step counts as a possible donor",
    "steps outside the recorded range or in gaps (CUDA-graph replays) may have written blocks too",
)


@dataclass(frozen=True)
class CachedBlock:
    """One block a request was served from the prefix cache."""

    logical: int  #: 0-based block index in the request
    physical: int  #: physical block id
    positions: tuple[int, int]  #: token positions it holds, half-open
    writer: str | None  #: label of the request that wrote it (None: not in the recorded steps)
    writer_step: int | None  #: the step that wrote it
    same_tokens: bool | None  #: the writer's tokens there equal this request's (None: tokens unknown)
    text: str | None = None  #: the words it holds (None: the trace records no token text)


@dataclass(frozen=True)
class Miss:
    """Why the first block not served from the cache missed."""

    #: ``block-floor``, ``different-token``, ``never-cached``, ``evicted``, ``caching-off`` or ``unknown``
    kind: str
    logical: int | None  #: the missed block's index
    position: int | None  #: 0-based token position that decided it (``different-token``), else None
    text: str  #: one sentence for people


@dataclass(frozen=True)
class PrefixExplanation:
    """The prefix cache, as one request met it."""

    request_id: str
    label: str
    first_step: int
    block_size: int
    prompt_len: int | None  #: None without ``session.json``
    cached_tokens: int  #: tokens already in the cache at its first step
    computed_tokens: int  #: tokens computed in that step
    blocks: tuple[CachedBlock, ...]
    miss: Miss
    cannot_know: tuple[str, ...] = field(default=WHAT_THE_TRACE_CANNOT_SHOW)

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return asdict(self)


def _lcp(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class _Writes:
    """Who wrote which physical block, step by step, from ``slot_mapping``."""

    def __init__(self, views: dict[str, RequestView], block_size: int):
        #: block -> [(step, request_id, logical block in the writer)], in step order
        self.by_block: dict[int, list[tuple[int, str, int]]] = {}
        events = []
        for view in views.values():
            for app in view.appearances:
                for i, slot in enumerate(app.slots):
                    if slot >= 0:
                        position = app.context_len + i
                        events.append((app.step, slot // block_size, view.request_id, position // block_size))
        for step, block, request_id, logical in sorted(set(events)):
            self.by_block.setdefault(block, []).append((step, request_id, logical))

    def last_writer(self, block: int, step: int, other_than: str) -> tuple[int, str, int] | None:
        """The latest write into ``block`` at or before ``step`` by a request other than ``other_than``."""
        found = None
        for event in self.by_block.get(block, ()):
            if event[0] > step:
                break
            if event[1] != other_than:
                found = event
        return found

    def reused(self, block: int, after: int, until: int, owner: str) -> tuple[int, str] | None:
        """A write into ``block`` by another request in ``(after, until]``: the block changed hands."""
        for step, request_id, _ in self.by_block.get(block, ()):
            if after < step <= until and request_id != owner:
                return step, request_id
        return None


def explain_prefix_cache(trace: Trace, layer: str | None = None) -> list[PrefixExplanation]:
    """Explain every request's prefix-cache hits and its first miss, in order of first appearance.

    Raises:
        TraceError: the trace has no request steps or no KV-cache spec.
    """
    if trace.run.kv_cache is None:
        raise TraceError(f"{trace.path}: the manifest has no KV-cache spec (block size unknown)")
    block_size = trace.run.kv_cache.block_size
    layer = layer or request_layer(trace)
    views = request_views(trace, layer)
    session = session_tokens(trace)
    caching = True
    if session and isinstance(session.get("config"), dict):
        caching = bool(session["config"].get("prefix_caching", True))
    writes = _Writes(views, block_size)
    words = Words.of(trace)
    return [_explain(view, views, writes, block_size, caching, words) for view in views.values()]


@dataclass(frozen=True)
class GroupPrefix:
    """The prefix cache as one KV-cache group's block table met it.

    vLLM looks a prompt up in every group and serves the hit all groups share, so the cached
    token counts agree; the physical blocks and their writers are the group's own.
    """

    group: int | None  #: the KV-cache group (None: the trace has one, or its groups are not known)
    label: str  #: ``KV-cache group 1: full attention, 21 layers, block size 16`` ("" for a single group)
    layer: str  #: the captured layer whose records were read
    explanations: tuple[PrefixExplanation, ...]

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {
            "group": self.group,
            "label": self.label,
            "layer": self.layer,
            "requests": [e.to_json() for e in self.explanations],
        }


def explain_prefix_cache_by_group(trace: Trace, groups: TraceGroups | None = None) -> list[GroupPrefix]:
    """:func:`explain_prefix_cache` on the first captured layer of each KV-cache group, in group order.

    A trace of one group (or whose groups are not known) gives one entry, read from
    :func:`~tracer.format.requests.request_layer`. ``groups``: the trace's
    :func:`~tracer.format.groups.trace_groups`, where the caller has them already.

    Raises:
        TraceError: as :func:`explain_prefix_cache`.
    """
    groups = groups if groups is not None else trace_groups(trace)
    first: dict[int, str] = {}
    for r in trace.records:
        group = groups.of_record(r) if r.kind == "request" else None
        if group is not None:
            first.setdefault(group.group, r.layer)
    if len(first) < 2:
        layer = request_layer(trace)
        return [GroupPrefix(None, "", layer, tuple(explain_prefix_cache(trace, layer)))]
    by_index = {g.group: g for g in groups.groups}
    return [
        GroupPrefix(
            index,
            f"KV-cache group {index}: {group_label(by_index[index])}",
            layer,
            tuple(explain_prefix_cache(trace, layer)),
        )
        for index, layer in sorted(first.items())
    ]


def _explain(
    view: RequestView,
    views: dict[str, RequestView],
    writes: _Writes,
    block_size: int,
    caching: bool,
    words: Words | None = None,
) -> PrefixExplanation:
    first = view.first
    cached = first.context_len
    labels = {v.request_id: v.label for v in views.values()}
    blocks = []
    for j in range(-(-cached // block_size)):
        physical = first.blocks[j]
        writer = writes.last_writer(physical, first.step, view.request_id)
        same = None
        if writer is not None:
            donor = views[writer[1]].tokens
            if donor is not None and view.tokens is not None:
                w = writer[2]
                mine = view.tokens[j * block_size : min((j + 1) * block_size, cached)]
                same = donor[w * block_size : w * block_size + len(mine)] == mine
        blocks.append(
            CachedBlock(
                logical=j,
                physical=physical,
                positions=(j * block_size, min((j + 1) * block_size, cached)),
                writer=labels[writer[1]] if writer else None,
                writer_step=writer[0] if writer else None,
                same_tokens=same,
                text=words.block_text(view.request_id, j, block_size, cached) if words else None,
            )
        )
    miss = _miss(view, views, writes, block_size, caching, cached, words)
    return PrefixExplanation(
        request_id=view.request_id,
        label=view.label,
        first_step=first.step,
        block_size=block_size,
        prompt_len=None if view.prompt is None else len(view.prompt),
        cached_tokens=cached,
        computed_tokens=first.query_len,
        blocks=tuple(blocks),
        miss=miss,
    )


def _token(token: int, words: Words | None) -> str:
    """``token 504``, or with the trace's words ``token 504 ('The')``."""
    return f"token {token}" + (f" ({words.text([token])!r})" if words else "")


def _miss(
    view: RequestView,
    views: dict[str, RequestView],
    writes: _Writes,
    block_size: int,
    caching: bool,
    cached: int,
    words: Words | None = None,
) -> Miss:
    k = cached // block_size
    start, end = k * block_size, (k + 1) * block_size
    if not caching:
        return Miss("caching-off", k, None, "prefix caching was off in this session: every token was computed")
    if view.prompt is None:
        return Miss(
            "unknown",
            k,
            None,
            f"block {k} (positions {start}-{end - 1}) missed; the trace has no prompt tokens "
            "(no session.json), so a different token cannot be told from an eviction",
        )
    prompt_len = len(view.prompt)
    # vLLM caps a hit at prompt_len - 1: the last prompt token is always computed (its logits are needed).
    if end > prompt_len - 1:
        left = prompt_len - cached
        return Miss(
            "block-floor",
            k,
            None,
            f"the {left} remaining prompt token(s) cannot fill block {k} (positions {start}-{end - 1}): only "
            f"full blocks of {block_size} are cached and the last prompt token is always recomputed",
        )
    donors = []
    for other in views.values():
        if other.request_id == view.request_id or other.tokens is None:
            continue
        before = [a for a in other.appearances if a.step <= view.first.step]
        if not before:
            continue
        held = before[-1]
        # What the donor had in the cache by then: its tokens up to its latest seq_len.
        donor_tokens = other.tokens[: held.seq_len]
        donors.append((_lcp(view.prompt, donor_tokens), len(donor_tokens), other, held))
    if not donors:
        return Miss("never-cached", k, None, f"no earlier request had computed block {k} (positions {start}-{end - 1})")
    lcp, donor_len, donor, held = max(donors, key=lambda d: d[0])
    if lcp < end:
        if lcp < donor_len:
            assert donor.tokens is not None
            return Miss(
                "different-token",
                k,
                lcp,
                f"block {k} (positions {start}-{end - 1}) differs at position {lcp}: {_token(view.prompt[lcp], words)} "
                f"here, {_token(donor.tokens[lcp], words)} in {donor.label} (the closest earlier request)"
                + (f"; the shared prefix is {lcp} tokens, less than one block" if lcp < block_size else ""),
            )
        return Miss(
            "never-cached",
            k,
            None,
            f"block {k} (positions {start}-{end - 1}): the closest earlier request {donor.label} "
            f"had only {donor_len} tokens, all matching; nobody had computed the rest",
        )
    physical = held.blocks[k] if k < len(held.blocks) else None
    if physical is not None and k < len(view.first.blocks) and physical == view.first.blocks[k]:
        served = [
            v.label
            for v in views.values()
            if v.request_id != view.request_id and k < len(v.first.blocks) and v.first.blocks[k] == physical
        ] or [donor.label]
        served.sort(key=lambda label: (len(label), label))  # #2 before #10
        who = served[0] if len(served) == 1 else f"{', '.join(served[:-1])} and {served[-1]}"
        return Miss(
            "never-cached",
            k,
            None,
            f"this request computed block {k} (positions {start}-{end - 1}) first, in physical block "
            f"{physical}; {who} {'was' if len(served) == 1 else 'were'} served from it",
        )
    if physical is not None:
        moved = writes.reused(physical, held.step, view.first.step, donor.request_id)
        if moved is not None:
            return Miss(
                "evicted",
                k,
                None,
                f"{donor.label} held the same block {k} in physical block {physical} at step {held.step}; "
                f"it was reused by {views[moved[1]].label} at step {moved[0]} (evicted)",
            )
    return Miss(
        "unknown",
        k,
        None,
        f"{donor.label} held the same full block {k} (step {held.step}) but it was not served: evicted, "
        "not yet cached when this request was scheduled, or never cached; the trace cannot tell which",
    )
