"""Annotated vLLM sources: find where traced values belong, and say what they were.

libcst only (plus the standard library and ``tracer.format`` (the bottom layer));
neither vLLM nor torch is imported, so annotations work from a trace directory alone.

* ``anchors``: the anchor table (file, qualified name, expression, value to show);
* ``locate``: libcst visitors that find each anchor's line;
* ``values``: pure functions from a ``StepRecord`` + ``RunInfo`` to value texts;
* ``annotate``: the one annotated-file model, ``annotate_file(...) -> AnnotatedFile`` (every
  anchor's value per step), which ``pagedtrace annotate`` (``annotate(...)``, one step) and the
  report's source pages both read.
"""

from annotations.anchors import ANCHORS, ANNOTATED_FILES, Anchor, anchors_for, resolve_file
from annotations.annotate import (
    AnchorValues,
    AnnotatedFile,
    AnnotatedLine,
    AnnotatedSource,
    Note,
    StepNotFound,
    anchor_values,
    annotate,
    annotate_file,
    select_record,
)
from annotations.locate import LocatedSource, Location, locate
from annotations.values import Value, value_for

__all__ = [
    "ANCHORS",
    "ANNOTATED_FILES",
    "Anchor",
    "AnchorValues",
    "AnnotatedFile",
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
    "annotate_file",
    "locate",
    "resolve_file",
    "select_record",
    "value_for",
]
