"""``scripts/make_fixtures.py``: its table makes the committed GPU fixtures, and cuts them as they are cut."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagedtrace.commands import run as run_command
from tests.conftest import FIXTURES, fixture_path
from tracer.format import Trace

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "make_fixtures.py"


def _load():
    spec = importlib.util.spec_from_file_location("make_fixtures", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_fixtures"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


#: Fixtures the table names that a device run has not brought yet (``scripts/device/backends.sh`` makes them).
DEVICE_PENDING = {"h100-qwen2.5-7b-flex-default"}

#: The committed fixture names of the table, for parametrize.
NAMES = sorted(n for n in _load().FIXTURES if (FIXTURES / n / "session.json").is_file())


@pytest.fixture(scope="module")
def maker():
    return _load()


def _run_args(argv: list[str]) -> argparse.Namespace:
    """``argv`` as ``pagedtrace run`` parses it."""
    parser = argparse.ArgumentParser()
    run_command.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["run", *argv])


def _as_config(args: argparse.Namespace) -> dict:
    """The ``session.json`` ``config`` these arguments give, built as ``pagedtrace run`` builds it."""
    cfg = run_command.session_config(args, Path(""))
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def test_the_table_names_every_committed_gpu_fixture(maker):
    committed = {p.name for p in FIXTURES.iterdir() if (p / "session.json").is_file()}
    assert committed <= set(maker.FIXTURES)
    assert set(maker.FIXTURES) - committed <= DEVICE_PENDING


@pytest.mark.parametrize("name", NAMES)
def test_the_arguments_are_the_ones_the_fixture_was_made_with(maker, name):
    """Every setting the fixture's ``session.json`` records, as the table's arguments give it."""
    recorded = json.loads((fixture_path(name) / "session.json").read_text())["config"]
    given = _as_config(_run_args(maker.FIXTURES[name].argv()))
    del recorded["trace_dir"]
    assert {k: given[k] for k in recorded} == recorded


@pytest.mark.parametrize("name", NAMES)
def test_the_committed_fixture_is_cut_as_the_table_says(maker, name):
    fixture, path = maker.FIXTURES[name], fixture_path(name)
    trace = Trace.open(path)
    assert (path / "sources").is_dir() == fixture.keep_sources == bool(trace.run.sources)
    assert (path / "engine.log").is_file()
    if fixture.keep_layers:
        assert set(trace.layers) == set(fixture.keep_layers)


def test_cut_drops_the_sources_and_the_layers_left_out(maker, tmp_path):
    """A trace with sources and two layers, cut to one layer and no sources (gaps stay)."""
    trace = tmp_path / "t"
    shutil.copytree(fixture_path("h200-qwen2.5-7b-default-rows"), trace)
    lines = (trace / "steps.jsonl").read_text().splitlines()
    other = [json.loads(line) for line in lines if '"type":"step"' in line]
    for record in other:
        record["layer"] = "model.layers.27.self_attn.attn"
        if record["tensors"]:
            name = record["tensors"].replace(".layers.0.", ".layers.27.")
            shutil.copy(trace / "tensors" / record["tensors"], trace / "tensors" / name)
            record["tensors"] = name
    (trace / "steps.jsonl").write_text("".join(f"{line}\n" for line in lines + [json.dumps(r) for r in other]))
    assert len(Trace.open(trace).layers) == 2
    maker.cut(trace, maker.Fixture("", "", keep_layers=("model.layers.0.self_attn.attn",)))
    assert not (trace / "sources").exists()
    cut = Trace.open(trace)
    original = Trace.open(fixture_path("h200-qwen2.5-7b-default-rows"))
    assert cut.run.sources == {} and cut.layers == ["model.layers.0.self_attn.attn"]
    assert len(cut.records) == len(original.records) and len(cut.gaps) == len(original.gaps)
    assert sorted(p.name for p in (trace / "tensors").iterdir()) == sorted(
        p.name for p in (fixture_path("h200-qwen2.5-7b-default-rows") / "tensors").iterdir()
    )


def test_an_unknown_name_is_refused_before_any_run(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "out"), "h200-qwen2.5-7b-eager", "nope"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "unknown fixture nope" in proc.stderr
    assert not (tmp_path / "out").exists()
