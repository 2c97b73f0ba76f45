"""Annotated vLLM sources: find where traced values belong, and say what they were.

libcst only (plus the standard library and ``tracer.records`` / ``tracer.store``);
neither vLLM nor torch is imported, so annotations work from a trace directory alone.

* ``anchors``: the anchor table (file, qualified name, expression, value to show);
* ``locate``: libcst visitors that find each anchor's line;
* ``values``: pure functions from a ``StepRecord`` + ``RunInfo`` to value texts;
* ``annotate``: ``annotate(...) -> AnnotatedSource`` and the tracer's source-copy helpers.
"""

from annotations.anchors import ANCHORS, ANNOTATED_FILES, Anchor, anchors_for, resolve_file
from annotations.annotate import (
    AnnotatedLine,
    AnnotatedSource,
    Note,
    StepNotFound,
    annotate,
    anchor_values,
    read_sources,
    select_record,
    sources_to_store,
    store_sources,
)
from annotations.locate import LocatedSource, Location, locate
from annotations.values import Value, value_for

__all__ = [
    "ANCHORS",
    "ANNOTATED_FILES",
    "Anchor",
    "AnnotatedLine",
    "AnnotatedSource",
    "LocatedSource",
    "Location",
    "Note",
    "StepNotFound",
    "Value",
    "anchor_values",
    "anchors_for",
    "annotate",
    "locate",
    "read_sources",
    "resolve_file",
    "select_record",
    "sources_to_store",
    "store_sources",
    "value_for",
]
