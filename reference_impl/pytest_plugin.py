"""pytest plugin: one test per captured vLLM step, for checking your own paged-attention kernel.

Not registered globally; load it with ``-p``. The ready-made test module
(:mod:`reference_impl.kernel_check`) checks one kernel on every case::

    pytest -p reference_impl.pytest_plugin --pyargs reference_impl.kernel_check \\
        --pagedtrace-trace=TRACE --pagedtrace-kernel=mypkg.attn:paged_attention

Options (write them with ``=``: pytest picks its rootdir from the command line before it
loads this plugin, so in ``--pagedtrace-trace DIR`` it would take ``DIR`` for a test path,
move the rootdir and name tests ``../..::test[...]``; the plugin refuses that form):

``--pagedtrace-trace=DIR``
    A trace directory (``pagedtrace run``, tensors on); repeat for several. Every
    ``request`` step with tensors becomes one case, id ``<trace>/step<i>/layer<j>``
    (select with ``-k``, e.g. ``-k step4``).
``--pagedtrace-kernel=MODULE:FUNCTION``
    The kernel (``reference_impl.testing.load_kernel``: a module on ``sys.path`` or a
    ``.py`` file); the ``pagedtrace_kernel`` fixture returns it.
``--pagedtrace-device=DEVICE``
    Move each case's inputs there before the call (e.g. ``cuda``); ``pagedtrace_device``.
``--pagedtrace-json=DIR``
    Write each trace's results to ``DIR/<trace name>.json`` at the end, in ``pagedtrace
    replay --json``'s schema (what ``replay --kernel MODULE:FUNCTION --json`` prints).

Fixtures, for your own tests (``pytest -p reference_impl.pytest_plugin --pagedtrace-trace T``)::

    def test_my_kernel(pagedtrace_case):
        assert_kernel_matches(my_kernel, pagedtrace_case)

``pagedtrace_case``
    A :class:`reference_impl.testing.KernelCase`; a test that requests it is
    parametrized over every case of the given traces (skipped when none is given).
``pagedtrace_kernel``
    The ``--pagedtrace-kernel`` function (the test is skipped without the option).
``pagedtrace_device``
    The ``--pagedtrace-device`` value, or None.
``pagedtrace_check``
    ``check(fn, case)``: ``assert_kernel_matches`` on the ``--pagedtrace-device``, naming
    the kernel as ``--pagedtrace-kernel`` spells it, and keeping the result for
    ``--pagedtrace-json``.

A bad trace or kernel spec is a usage error before any test runs. Each case's tensors
are read when its test runs, so a long trace does not sit in memory.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from reference_impl import replay as _replay
from reference_impl import testing as _testing
from tracer.format import StepRecord, Trace, TraceError


@dataclass
class _Source:
    """One ``--pagedtrace-trace``: the opened trace, its cases' records, the layout (found on first use)."""

    trace: Trace
    records: list[StepRecord]
    layout: str | None = None
    results: list[_testing.CaseResult] = field(default_factory=list)  #: for ``--pagedtrace-json``
    seconds: float = 0.0

    def case(self, record: StepRecord) -> _testing.KernelCase:
        if self.layout is None:
            self.layout = _replay.resolve_layout(self.trace, self.records)
        return _testing.load_case(self.trace, record, layout=self.layout)


@dataclass
class _State:
    sources: list[_Source] = field(default_factory=list)
    kernel: Callable[..., Any] | None = None
    kernel_spec: str | None = None
    device: str | None = None
    json_dir: Path | None = None


#: Options whose value must be joined with ``=`` (see the module docstring).
OPTIONS = {
    "--pagedtrace-trace": "DIR",
    "--pagedtrace-kernel": "MODULE:FUNCTION",
    "--pagedtrace-device": "DEVICE",
    "--pagedtrace-json": "DIR",
}


def spaced_options(args: Iterable[str]) -> list[str]:
    """The options of :data:`OPTIONS` given as two words (``--pagedtrace-trace DIR``) in ``args``."""
    return [a for a in args if a in OPTIONS]


def _nonempty(value: str) -> str:
    """argparse ``type``: an empty value (``--pagedtrace-trace=``) is an error, not the current directory."""
    if not value.strip():
        raise ValueError("empty")
    return value


_STATE = pytest.StashKey[_State]()


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--pagedtrace-trace``, ``--pagedtrace-kernel``, ``--pagedtrace-device``."""
    group = parser.getgroup("pagedtrace", "check a paged-attention kernel against captured vLLM steps")
    group.addoption(
        "--pagedtrace-trace",
        action="append",
        type=_nonempty,
        default=[],
        metavar="DIR",
        help="trace directory recorded with tensors on; one test per captured request step (repeatable). "
        "Write --pagedtrace-trace=DIR: with a space pytest also takes DIR for a test path",
    )
    group.addoption(
        "--pagedtrace-kernel",
        action="store",
        type=_nonempty,
        default=None,
        metavar="MODULE:FUNCTION",
        help="the kernel to check, e.g. --pagedtrace-kernel=mypkg.attn:paged_attention or =./attn.py:paged_attention",
    )
    group.addoption(
        "--pagedtrace-device",
        action="store",
        type=_nonempty,
        default=None,
        metavar="DEVICE",
        help="move each case's inputs to DEVICE (e.g. --pagedtrace-device=cuda) before calling the kernel",
    )
    group.addoption(
        "--pagedtrace-json",
        action="store",
        type=_nonempty,
        default=None,
        metavar="DIR",
        help="write each trace's results to DIR/<trace name>.json, in `pagedtrace replay --json`'s schema",
    )


def _all_args(config: pytest.Config) -> list[str]:
    """The command line as pytest saw it: ``PYTEST_ADDOPTS``, ini ``addopts``, then the arguments."""
    args = shlex.split(os.environ.get("PYTEST_ADDOPTS", ""))
    args += [str(a) for a in config.getini("addopts")]
    return args + [str(a) for a in config.invocation_params.args]


def pytest_configure(config: pytest.Config) -> None:
    """Open the traces and import the kernel now, so a bad one stops the run with one line."""
    spaced = spaced_options(_all_args(config))
    if spaced:
        option, value = spaced[0], OPTIONS[spaced[0]]
        raise pytest.UsageError(
            f"write {option}={value}, with '=': as two words pytest takes {value} for a test path "
            f"too (it chooses its rootdir, here {config.rootpath}, before loading the pagedtrace plugin)"
        )
    state = _State(device=config.getoption("pagedtrace_device"))
    base = Path(config.invocation_params.dir)
    json_dir = config.getoption("pagedtrace_json")
    if json_dir:
        state.json_dir = base / json_dir
    for text in config.getoption("pagedtrace_trace") or ():
        try:
            trace = Trace.open(base / text)
            state.sources.append(_Source(trace, _testing.case_records(trace)))
        except TraceError as exc:
            raise pytest.UsageError(f"--pagedtrace-trace {text}: {exc}") from None
    spec = config.getoption("pagedtrace_kernel")
    if spec:
        try:
            state.kernel = _testing.load_kernel(spec)
        except ValueError as exc:
            raise pytest.UsageError(f"--pagedtrace-kernel: {exc}") from None
        state.kernel_spec = spec
    names = [s.trace.path.name for s in state.sources]
    if state.json_dir is not None and len(set(names)) < len(names):
        raise pytest.UsageError(f"--pagedtrace-json: two traces are named alike ({', '.join(names)})")
    config.stash[_STATE] = state


def pytest_sessionfinish(session: pytest.Session) -> None:
    """``--pagedtrace-json``: one ``replay --json``-shaped file per trace that ran a check."""
    state = session.config.stash.get(_STATE, None)
    if state is None or state.json_dir is None:
        return
    for source in state.sources:
        if not source.results:
            continue
        report = _testing.KernelReport(
            kernel=source.results[0].kernel,
            trace=str(source.trace.path),
            layout=source.layout or "",
            results=tuple(source.results),
            seconds=source.seconds,
            recorded_layout=_replay.kv_spec(source.trace).layout,
        )
        state.json_dir.mkdir(parents=True, exist_ok=True)
        (state.json_dir / f"{source.trace.path.name}.json").write_text(json.dumps(report.to_json(), indent=2) + "\n")


def pytest_report_header(config: pytest.Config) -> list[str]:
    """One line naming the kernel and the traces, when given."""
    state = config.stash.get(_STATE, None)
    if state is None or not (state.sources or state.kernel_spec):
        return []
    traces = ", ".join(f"{s.trace.path.name} ({len(s.records)} case(s))" for s in state.sources) or "none"
    return [f"pagedtrace: kernel {state.kernel_spec or '-'}; traces {traces}"]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize every test that requests ``pagedtrace_case`` over the traces' cases."""
    if "pagedtrace_case" not in metafunc.fixturenames:
        return
    state = metafunc.config.stash[_STATE]
    params = [
        pytest.param((source, record), id=_testing.case_id(source.trace, record))
        for source in state.sources
        for record in source.records
    ]
    if not params:
        params = [
            pytest.param(
                None, id="no-trace", marks=pytest.mark.skip(reason="no trace given: pass --pagedtrace-trace DIR")
            )
        ]
    metafunc.parametrize("pagedtrace_case", params, indirect=True)


@pytest.fixture
def pagedtrace_case(request: pytest.FixtureRequest) -> _testing.KernelCase:
    """One captured (step, layer) as a ``KernelCase`` (parametrized by ``--pagedtrace-trace``)."""
    param = getattr(request, "param", None)
    if param is None:
        pytest.skip("no trace given: pass --pagedtrace-trace DIR")
    source, record = param
    return source.case(record)


@pytest.fixture
def pagedtrace_kernel(request: pytest.FixtureRequest) -> Callable[..., Any]:
    """The ``--pagedtrace-kernel`` function; skips the test when the option is absent."""
    kernel = request.config.stash[_STATE].kernel
    if kernel is None:
        pytest.skip("no kernel given: pass --pagedtrace-kernel MODULE:FUNCTION")
    return kernel


@pytest.fixture
def pagedtrace_device(request: pytest.FixtureRequest) -> str | None:
    """The ``--pagedtrace-device`` value (None: call the kernel on the CPU tensors)."""
    return request.config.stash[_STATE].device


@pytest.fixture
def pagedtrace_check(request: pytest.FixtureRequest) -> Callable[..., _testing.CaseResult]:
    """``check(fn, case)``: :func:`reference_impl.testing.assert_kernel_matches`, its result kept.

    Runs on ``--pagedtrace-device``, names the kernel as ``--pagedtrace-kernel`` was written,
    and files the result (pass, mismatch or a raise) under the case's trace for
    ``--pagedtrace-json``.
    """
    state = request.config.stash[_STATE]

    def check(fn: Callable[..., Any], case: _testing.KernelCase) -> _testing.CaseResult:
        __tracebackhide__ = True
        source = next((s for s in state.sources if str(s.trace.path) == case.trace), None)
        started = time.perf_counter()

        def keep(result: _testing.CaseResult) -> None:
            if source is not None:
                source.results.append(result)
                source.seconds += time.perf_counter() - started

        name = state.kernel_spec if fn is state.kernel else None
        return _testing.assert_kernel_matches(fn, case, device=state.device, name=name, on_result=keep)

    return check
