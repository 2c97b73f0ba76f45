"""What the tracer records, and the ``PAGEDTRACE_*`` variables that carry it to vLLM's processes.

``tracer.start`` exports these variables; the ``vllm.general_plugins`` entry point
(``tracer.plugin``) reads them back in the engine core and each worker. Standard
library and ``tracer.format`` only: importing this module starts nothing.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from tracer.backends import check_backend
from tracer.format import parse_layers, parse_steps
from tracer.format.selection import format_steps

__all__ = [
    "ENV_ATTENTION_BACKEND",
    "ENV_BUDGET",
    "ENV_DIR",
    "ENV_KV_CHECK",
    "ENV_LAYERS",
    "ENV_MODEL_NAME",
    "ENV_QUERY_ROWS",
    "ENV_STEPS",
    "ENV_TENSORS",
    "ENV_WEIGHTS",
    "TracerOptions",
]

#: Environment variables read by ``TracerOptions.from_env`` (and the plugin).
ENV_DIR = "PAGEDTRACE_DIR"
ENV_LAYERS = "PAGEDTRACE_LAYERS"
ENV_STEPS = "PAGEDTRACE_STEPS"
ENV_TENSORS = "PAGEDTRACE_TENSORS"
ENV_BUDGET = "PAGEDTRACE_BUDGET_MB"
ENV_KV_CHECK = "PAGEDTRACE_KV_CHECK_EVERY"
ENV_QUERY_ROWS = "PAGEDTRACE_QUERY_ROWS"
ENV_ATTENTION_BACKEND = "PAGEDTRACE_ATTENTION_BACKEND"

#: Set by ``pagedtrace run`` (``tracer.session``) for the manifest's ``ModelSummary``: the
#: preset or model the user named, and how its weights were made.
ENV_MODEL_NAME = "PAGEDTRACE_MODEL_NAME"
ENV_WEIGHTS = "PAGEDTRACE_WEIGHTS"


@dataclass(frozen=True)
class TracerOptions:
    """What to record.

    ``layers``: ``"first"`` (the first attention layer that runs), ``"all"``, or a
    tuple of layer indices / names. ``steps``: half-open range of step indices
    (``None`` = unbounded). ``tensors``: also save query, output, key/value and the
    KV write log (``tracer.writelog``), for request steps, within ``budget_bytes``.
    ``kv_check_every``: every N-th tensor step of a layer also stores the blocks it reads
    whole, so the write log's rebuild can be checked against them bit for bit (0: never).
    ``query_rows``: with ``tensors``, keep the query and output of at most this many rows a
    step (``tracer.format.rows.sample_rows``; 0: every row). The write log stays whole.
    ``attention_backend``: the backend the engine is meant to run (vLLM's name, one of
    ``tracer.backends.TENSOR_BACKENDS``); the tracer says in one line when it runs another.
    """

    directory: str
    layers: str | tuple[str | int, ...] = "first"
    steps: tuple[int | None, int | None] = (None, None)
    tensors: bool = False
    budget_bytes: int = 256 * 2**20
    kv_check_every: int = 0
    query_rows: int = 0
    attention_backend: str | None = None

    def __post_init__(self) -> None:
        for name in ("kv_check_every", "query_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.attention_backend is not None:
            object.__setattr__(self, "attention_backend", check_backend(self.attention_backend))

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> TracerOptions | None:
        """Options from ``PAGEDTRACE_*`` variables; None when ``PAGEDTRACE_DIR`` is unset."""
        env = os.environ if environ is None else environ
        directory = env.get(ENV_DIR)
        if not directory:
            return None
        return cls(
            directory=directory,
            layers=parse_layers(env.get(ENV_LAYERS, "first")),
            steps=parse_steps(env.get(ENV_STEPS, "")),
            tensors=env.get(ENV_TENSORS, "0").lower() in ("1", "true", "yes", "on"),
            budget_bytes=int(float(env.get(ENV_BUDGET, "256")) * 2**20),
            kv_check_every=_count(env, ENV_KV_CHECK),
            query_rows=_count(env, ENV_QUERY_ROWS),
            attention_backend=env.get(ENV_ATTENTION_BACKEND) or None,
        )

    def to_env(self) -> dict[str, str]:
        """The ``PAGEDTRACE_*`` variables that make child processes trace the same way."""
        layers = self.layers if isinstance(self.layers, str) else ",".join(map(str, self.layers))
        return {
            ENV_DIR: str(self.directory),
            ENV_LAYERS: layers,
            ENV_STEPS: format_steps(self.steps),
            ENV_TENSORS: "1" if self.tensors else "0",
            ENV_BUDGET: str(self.budget_bytes / 2**20),
            ENV_KV_CHECK: str(self.kv_check_every),
            ENV_QUERY_ROWS: str(self.query_rows),
            ENV_ATTENTION_BACKEND: self.attention_backend or "",
        }

    def to_json(self) -> dict[str, Any]:
        """JSON form for the manifest."""
        d = dataclasses.asdict(self)
        d["layers"] = self.layers if isinstance(self.layers, str) else list(self.layers)
        d["steps"] = list(self.steps)
        return d


def _count(env: Any, name: str) -> int:
    """A ``PAGEDTRACE_*`` count (unset or empty: 0); a ``ValueError`` of one line naming it otherwise."""
    text = (env.get(name) or "0").strip()
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected an integer >= 0") from None
    if value < 0:
        raise ValueError(f"{name}={text!r}: expected an integer >= 0")
    return value
