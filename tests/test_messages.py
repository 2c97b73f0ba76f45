"""The record process's message protocol (``tracer.messages``): every kind, through the one encoder and decoder."""

from __future__ import annotations

import ast
import subprocess
import sys
import typing
from pathlib import Path

import msgspec
import pytest

from tracer import messages
from tracer.messages import (
    DECODER,
    ENCODER,
    LENGTH,
    Directory,
    Gap,
    Layer,
    Message,
    PackedCopy,
    Part,
    RequestIds,
    SharedCopy,
    Step,
    Sync,
    View,
    Views,
)

ROOT = Path(__file__).resolve().parent.parent

PARTS = (
    Part("slot_mapping", "<i8", (4,), 8, -1),
    Part("query_start_loc", "<i4", (9,), 9, 4),  # the step's 4 leading rows of a tensor copied as given
    Part("block_table", "<i4", (3, 2), 6, -1),
)
VIEW = View("<i4", (2, 3), bytes(range(24)))

#: One of every item, as the sink sends them (a gap's JSON, fields with tuples, None and floats).
ITEMS = [
    Directory("/traces/run/rank1"),
    Gap({"step": 3, "kind": "request", "reason": "no-metadata", "num_tokens": 0}),
    Layer("model.layers.0.self_attn.attn", {"num_heads": 4, "alibi_slopes": None, "sinks": [0.5], "k_scale": 1.0}),
    RequestIds(("a", "b", "")),
    Step(1, 16, "model.layers.0.self_attn.attn", {"step": 7, "kind": "request", "num_actual_tokens": 3}),
    Sync(),
]
#: One of every host kind.
HOSTS = [
    SharedCopy(64 + 4096, PARTS),
    PackedCopy(bytes(range(92)), PARTS),
    Views(VIEW, VIEW, VIEW, VIEW),
]


def test_every_message_kind_comes_back_as_it_was_sent():
    message = Message(HOSTS, ITEMS)
    back = DECODER.decode(ENCODER.encode(message))
    assert back == message
    assert [type(h) for h in back.hosts] == [SharedCopy, PackedCopy, Views]
    assert [type(i) for i in back.items] == [Directory, Gap, Layer, RequestIds, Step, Sync]
    # typed: the ids and shapes come back as tuples, the fields maps as msgpack gives them (lists)
    assert back.items[3].ids == ("a", "b", "") and back.hosts[0].parts[2].shape == (3, 2)
    assert back.items[2].fields["sinks"] == [0.5]


def test_the_samples_cover_every_kind_the_unions_name():
    """A new kind added to the protocol must be added to the unions and to the samples above."""
    assert set(typing.get_args(messages.Item)) == {type(i) for i in ITEMS} == set(messages._Item.__subclasses__())
    assert set(typing.get_args(messages.Host)) == {type(h) for h in HOSTS} == set(messages._Host.__subclasses__())


def test_a_message_is_arrays_each_kind_led_by_its_tag():
    """No field names on the wire: a step item is five values."""
    wire = msgspec.msgpack.decode(ENCODER.encode(Message([HOSTS[0]], [ITEMS[4], Sync()])))
    assert wire == [
        [["SharedCopy", 4160, [[p.name, p.dtype, list(p.shape), p.width, p.rows] for p in PARTS]]],
        [["Step", 1, 16, "model.layers.0.self_attn.attn", ITEMS[4].fields], ["Sync"]],
    ]


@pytest.mark.parametrize(
    "wire",
    [
        [[], [["step", 0, 16, "l", {}]]],  # a string-tagged list of another protocol
        [[], [["Step", 0, 16, "l"]]],  # a field short
        [[{"shared": [64, []]}], []],  # a host as a map
        [[], [["Steps", 0, 16, "l", {}]]],  # no such kind
    ],
)
def test_a_message_of_another_shape_is_refused(wire):
    with pytest.raises(msgspec.ValidationError):
        DECODER.decode(msgspec.msgpack.encode(wire))


def test_the_child_refuses_a_message_of_another_shape_in_one_line():
    """The record process decodes with the typed decoder: a bad message ends it with one line, code 3."""
    body = msgspec.msgpack.encode([[], [["step", 0, 16, "l", {}]]])
    proc = subprocess.run(
        [sys.executable, "-m", "tracer.record_process"],
        input=LENGTH.pack(len(body)) + body,
        capture_output=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 3, proc.stderr[-2000:]
    (line,) = proc.stdout.decode().splitlines()
    assert line.startswith("pagedtrace: the record writer process failed (ValidationError(")
    assert line.endswith("tracing stops, the engine runs on")


def test_the_protocol_imports_the_standard_library_and_msgspec_only():
    """The record process imports it, and never numpy or torch."""
    tree = ast.parse((ROOT / "tracer" / "messages.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert imported, "no imports found"
    assert imported - set(sys.stdlib_module_names) == {"msgspec"}
