"""One module per ``pagedtrace`` subcommand: ``add_parser(subparsers)`` and ``run(args, console) -> int``."""

from __future__ import annotations

from tracer.format import layer_index


def short_layer(name: str) -> str:
    """``model.layers.7.self_attn.attn`` -> ``L7`` for narrow terminal tables; other names unchanged."""
    index = layer_index(name)
    return f"L{index}" if index is not None else name
