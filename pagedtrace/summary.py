"""The table at the top of ``pagedtrace show``: a trace at a glance (``tracer.format.summary``).

Every value comes from the trace (a model name, a backend, a gap's reason): cells are
``Text``, never markup.
"""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from pagedtrace.commands import short_layer
from tracer.format.summary import TraceSummary, step_ranges

#: Gap step lists longer than this are shown as their count and ranges' ends.
MAX_GAP_TEXT = 120


#: Disagreements between ranks listed, at most this many.
MAX_DISAGREEMENTS = 8


def _span(start: int, count: int) -> str:
    """Global heads ``start .. start + count - 1``: ``2-3`` (``2`` for one)."""
    return str(start) if count == 1 else f"{start}-{start + count - 1}"


#: ``StepRecord.cudagraph`` in words, for the summary's CUDA-graph row.
GRAPH_WORDS = {"full": "as full graphs", "piecewise": "piecewise", "none": "eager"}


def _layers_text(layers: tuple[str, ...], total: int | None) -> str:
    if not layers:
        return "none recorded"
    short = [short_layer(n) for n in layers]
    shown = ", ".join(short) if len(short) <= 8 else f"{', '.join(short[:4])}, …, {', '.join(short[-2:])}"
    return f"{len(layers)}{f' of {total}' if total else ''}: {shown}"


def _gap_text(steps: tuple[int, ...]) -> str:
    ranges = step_ranges(list(steps))
    if len(ranges) > MAX_GAP_TEXT:
        ranges = ranges[:MAX_GAP_TEXT].rsplit(",", 1)[0] + ", …"
    return f"{len(steps)} step(s): {ranges}"


def build_trace_summary_table(s: TraceSummary) -> Table:
    """Versions, device, backend, model, KV cache, steps, layers, gaps, tensors, replay verdict."""
    table = Table(title=Text(f"trace {s.path}"), show_header=False, title_justify="left")
    table.add_column("what", style="bold", no_wrap=True)
    table.add_column("value")

    def row(what: str, value: str, style: str = "") -> None:
        table.add_row(what, Text(value, style=style))

    v = s.versions
    row("written by", f"pagedtrace {v['pagedtrace']} (format {v['format']}), vLLM {v['vllm']}, torch {v['torch']}")
    row("device", f"{s.device}, {s.platform}")
    fa = f", FlashAttention {s.flash_attn_version}" if s.flash_attn_version else ""
    row("backend", f"{s.backend}{fa}")
    row("graph mode", f"{s.cudagraph_mode}{' (enforce_eager)' if s.enforce_eager else ''}")
    m = s.model
    if m:
        row(
            "model",
            f"{m['name']}: {m['num_layers']} layers, {m['num_attention_heads']} heads / {m['num_kv_heads']} KV heads, "
            f"D={m['head_size']}, {m['dtype']}, max_model_len {m['max_model_len']}; weights: {m['weights']}",
        )
    kv = s.kv_cache
    if kv:
        cache = kv["dtype"] if kv["cache_dtype"] in ("auto", kv["dtype"]) else f"{kv['dtype']} ({kv['cache_dtype']})"
        row(
            "KV cache",
            f"{kv['layout']} {tuple(kv['shape'])}: {kv['num_blocks']} blocks × {kv['block_size']} tokens, {cache}; "
            f"physically {kv['physical_order']}",
        )
    for i, tp in enumerate(s.ranks):
        heads = f"query heads {_span(tp['head_start'], tp['num_heads'])}, "
        heads += f"KV heads {_span(tp['kv_head_start'], tp['num_kv_heads'])}"
        where = "" if tp["directory"] == "." else f" in {tp['directory']}/"
        table.add_row(
            "ranks" if i == 0 else "",
            Text(f"rank {tp['rank']} of {tp['world_size']}: {heads}; {tp['records']} records{where}"),
        )
    for i, line in enumerate(s.disagreements[:MAX_DISAGREEMENTS]):
        table.add_row("ranks disagree" if i == 0 else "", Text(line, style="bold red"))
    if len(s.disagreements) > MAX_DISAGREEMENTS:
        table.add_row("", Text(f"… {len(s.disagreements) - MAX_DISAGREEMENTS} more", style="red"))
    kinds = ", ".join(f"{n} {kind}" for kind, n in s.steps_by_kind.items()) or "none"
    row("steps", f"{kinds} ({s.num_records} (step, layer) records)")
    if s.steps_by_graph:
        graphs = ", ".join(f"{n} {GRAPH_WORDS.get(mode, mode)}" for mode, n in s.steps_by_graph.items())
        row("CUDA graphs", f"request steps: {graphs}")
    row("layers", _layers_text(s.layers, m["num_layers"] if m else None))
    if s.gaps:
        for i, g in enumerate(s.gaps):
            table.add_row("gaps" if i == 0 else "", Text(f"{g.reason} ({', '.join(g.kinds)}): {_gap_text(g.steps)}"))
    else:
        row("gaps", "none: the tracer saw every step")
    tensors = (
        f"{s.records_with_tensors} of {s.num_records} records"
        if s.records_with_tensors
        else f"not captured: {s.tensors_absent or 'no request step recorded'}"
    )
    if s.records_with_tensors and s.tensors_absent:
        tensors += f"; the others: {s.tensors_absent}"
    if s.write_log_records:
        tensors += f" as a KV write log ({s.check_records} check steps keep their blocks whole)"
    row("tensors", tensors)
    if s.session is None:
        row(
            "session",
            "no session.json (not written by `pagedtrace run`, a `vllm serve` trace say, or its run failed)",
            "dim",
        )
    elif "error" in s.session:
        row("session", f"unreadable: {s.session['error']}", "red")
    else:
        ss = s.session
        row("session", f"{ss['prompts']} prompts ({ss['prompt_tokens']} tokens), {ss['generated_tokens']} generated")
    r = s.replay
    if r is None:
        row("replay", "not replayed (pagedtrace replay TRACE writes replay.json)", "dim")
    elif "error" in r:
        row("replay", f"replay.json unreadable: {r['error']}", "red")
    else:
        counts = f"{r['steps']} attention, {r['write_path']} write path, {r['metadata']} metadata checks"
        failed = ", ".join(f"{n} {name}" for name, n in r["failed"].items())
        verdict = "ok" if r["ok"] else f"MISMATCH ({failed} failed)"
        row("replay", f"{verdict}: {counts} ({r['kernel']} kernel)", "green" if r["ok"] else "bold red")
    return table
