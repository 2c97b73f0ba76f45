"""The verdict of a user's kernel on one captured case: ``reference_impl.testing`` makes it.

:class:`CaseResult` is a :class:`tracer.format.verdicts.StepResult` (the kernel's output in
place of vLLM's), so ``replay --kernel MODULE:FUNCTION --json`` and the pytest plugin write
``replay --json``'s schema, with the extras a kernel author needs; :class:`WorstValue` says
where the output is furthest from the reference, in the step's and vLLM's terms.

Standard library only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tracer.format.jsonfields import as_object, finite_or_none, get_field, get_float, get_list
from tracer.format.selection import layer_index
from tracer.format.verdicts import HeadResult, StepResult

__all__ = ["CaseResult", "WorstValue"]


@dataclass(frozen=True)
class WorstValue:
    """Where a kernel's output is furthest from the reference, in the step's and vLLM's terms."""

    token: int  #: 0-based row of the step's query (the batch row, ``query_start_loc`` indexes it)
    head: int  #: 0-based query head
    dim: int  #: 0-based element of the head
    request: int  #: 0-based block-table row of the request the token belongs to
    request_id: str | None = None  #: vLLM's request id of that row (None: not recorded)
    position: int | None = None  #: 0-based position of the token in its sequence
    block: int | None = None  #: vLLM's physical id of the KV block holding ``position``

    def describe(self) -> str:
        """``request 'cmpl-1' (row 1), position 57, block 7 (physical), query row 58``."""
        who = f"request {self.request_id!r} (row {self.request})" if self.request_id else f"request row {self.request}"
        parts = [who]
        if self.position is not None:
            parts.append(f"position {self.position}")
        if self.block is not None:
            parts.append(f"block {self.block} (physical)")
        return ", ".join(parts) + f", query row {self.token}"

    def to_json(self) -> dict[str, Any]:
        """A case result's ``worst`` object."""
        return {
            "token": self.token,
            "head": self.head,
            "dim": self.dim,
            "request": self.request,
            "request_id": self.request_id,
            "position": self.position,
            "block": self.block,
        }

    @classmethod
    def from_json(cls, data: Any) -> WorstValue:
        """Read :meth:`to_json`'s output."""
        d, o = as_object(data, "worst value"), "worst value"
        optional = (int, type(None))
        return cls(
            token=get_field(d, "token", int, o),
            head=get_field(d, "head", int, o),
            dim=get_field(d, "dim", int, o),
            request=get_field(d, "request", int, o),
            request_id=get_field(d, "request_id", (str, type(None)), o),
            position=get_field(d, "position", optional, o),
            block=get_field(d, "block", optional, o),
        )


@dataclass(frozen=True, kw_only=True)
class CaseResult(StepResult):
    """How one user kernel did on one captured case. ``str(result)`` / :meth:`message` explain it.

    A :class:`StepResult` (the kernel's output in place of vLLM's, per-head objects in
    ``heads``), so ``replay --kernel`` writes ``replay --json``'s schema; the fields below
    are the extras a kernel author needs.
    """

    id: str  #: the case's id
    kernel: str  #: what the user called the kernel (``--kernel``'s spec), or ``module:qualname``
    vllm_max_abs: float  #: max |out - vLLM's captured output|
    vllm_ref_max_abs: float  #: max |vLLM's output - fp64 reference|, for scale
    worst: WorstValue | None = None  #: where the largest error is (NaN ranks first)
    nonfinite: int = 0  #: NaN / inf values among the compared outputs
    tol_k: float = 2.0
    tol_eps: float = 1e-5
    note: str = ""  #: why it failed beyond the numbers (shape, an exception), or the case's note

    @property
    def worst_head(self) -> int | None:
        """The query head with the largest error (None when nothing was compared)."""
        return None if self.worst is None else self.worst.head

    def headline(self) -> str:
        """The verdict in one line: ``kernel K does NOT match vLLM on step 4 layer 0: max abs A > tol B``."""
        verdict = "matches" if self.ok else "does NOT match"
        index = layer_index(self.layer)
        layer = f"layer {index}" if index is not None else f"layer {self.layer}"
        line = f"kernel {self.kernel} {verdict} vLLM on step {self.step} {layer}"
        if math.isfinite(self.max_abs) or self.heads:
            cmp = "<=" if self.max_abs <= self.tol else ">"
            return f"{line}: max abs {_num(self.max_abs)} {cmp} tol {_num(self.tol)}"
        return f"{line}: {self.note}" if self.note else line

    def message(self) -> str:
        """A readable verdict: :meth:`headline` first (pytest's short summary shows it), then where and why."""
        lines = [
            self.headline(),
            f"  case {self.id} ({self.kind} step: {self.num_reqs} request(s), {self.num_tokens} query token(s); "
            f"layer {self.layer})",
        ]
        if math.isfinite(self.max_abs) or self.heads:
            lines.append(
                f"  tolerance {_num(self.tol)} = {_num(self.tol_k)} x {_num(self.baseline_max_abs)} (the error of "
                f"FlashAttention's rounding, emulated) + a floor of {_num(self.tol_eps)}; max rel {_num(self.max_rel)}"
            )
        if self.nonfinite:
            lines.append(f"  {self.nonfinite} NaN/inf value(s) in the output")
        if self.worst is not None and self.heads:
            w, bad = self.worst, self.bad_heads
            lines.append(
                f"  worst: head {w.head} (max abs {_num(self.heads[w.head].max_abs)}), {w.describe()}, dim {w.dim}; "
                f"{len(bad)}/{len(self.heads)} head(s) outside tolerance" + (f": {_head_list(bad)}" if bad else "")
            )
            lines.append(
                f"  vs vLLM's captured output: max abs {_num(self.vllm_max_abs)} "
                f"(vLLM itself is {_num(self.vllm_ref_max_abs)} from the fp64 reference)"
            )
        if self.note and not self.headline().endswith(self.note):
            lines.append(f"  note: {self.note}")
        return "\n".join(lines)

    __str__ = message

    def to_json(self) -> dict[str, Any]:
        """:meth:`StepResult.to_json` (``replay.json``'s ``steps`` entry) plus the kernel's extras."""
        f = finite_or_none
        return {
            "id": self.id,
            "kernel": self.kernel,
            **super().to_json(),
            "vllm_max_abs": f(self.vllm_max_abs),
            "vllm_ref_max_abs": f(self.vllm_ref_max_abs),
            "bad_heads": list(self.bad_heads),
            "worst": None if self.worst is None else self.worst.to_json(),
            "nonfinite": self.nonfinite,
            "tol_k": self.tol_k,
            "tol_eps": self.tol_eps,
        }

    @classmethod
    def from_json(cls, data: Any) -> CaseResult:
        """Read :meth:`to_json`'s output (``bad_heads`` is derived, not read)."""
        d, o = as_object(data, "case result"), "case result"
        worst = get_field(d, "worst", (dict, type(None)), o)
        return cls(
            **cls._base_fields(d, o),
            heads=get_list(d, "heads", o, HeadResult.from_json),
            note=get_field(d, "note", str, o),
            id=get_field(d, "id", str, o),
            kernel=get_field(d, "kernel", str, o),
            vllm_max_abs=get_float(d, "vllm_max_abs", o),
            vllm_ref_max_abs=get_float(d, "vllm_ref_max_abs", o),
            worst=None if worst is None else WorstValue.from_json(worst),
            nonfinite=get_field(d, "nonfinite", int, o),
            tol_k=get_float(d, "tol_k", o),
            tol_eps=get_float(d, "tol_eps", o),
        )


def _num(x: float) -> str:
    return f"{x:.3g}" if math.isfinite(x) else str(x)


def _head_list(heads: tuple[int, ...], limit: int = 8) -> str:
    shown = ", ".join(map(str, heads[:limit]))
    return shown + (f" ... (+{len(heads) - limit})" if len(heads) > limit else "")
