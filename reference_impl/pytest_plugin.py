"""pytest plugin: one test per captured vLLM step, for checking your own paged-attention kernel.

Not registered globally; load it with ``-p``. The ready-made test module
(:mod:`reference_impl.kernel_check`) checks one kernel on every case::

    pytest -p reference_impl.pytest_plugin --pyargs reference_impl.kernel_check \\
        --pagedtrace-trace TRACE --pagedtrace-kernel mypkg.attn:paged_attention

Options:

``--pagedtrace-trace DIR``
    A trace directory (``pagedtrace run``, tensors on); repeat for several. Every
    ``request`` step with tensors becomes one case, id ``<trace>/step<i>/layer<j>``
    (select with ``-k``, e.g. ``-k step4``).
``--pagedtrace-kernel MODULE:FUNCTION``
    The kernel (``reference_impl.testing.load_kernel``: a module on ``sys.path`` or a
    ``.py`` file); the ``pagedtrace_kernel`` fixture returns it.
``--pagedtrace-device DEVICE``
    Move each case's inputs there before the call (e.g. ``cuda``); ``pagedtrace_device``.

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

A bad trace or kernel spec is a usage error before any test runs. Each case's tensors
are read when its test runs, so a long trace does not sit in memory.
"""

from __future__ import annotations

from collections.abc import Callable
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


_STATE = pytest.StashKey[_State]()


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--pagedtrace-trace``, ``--pagedtrace-kernel``, ``--pagedtrace-device``."""
    group = parser.getgroup("pagedtrace", "check a paged-attention kernel against captured vLLM steps")
    group.addoption(
        "--pagedtrace-trace",
        action="append",
        default=[],
        metavar="DIR",
        help="trace directory recorded with tensors on; one test per captured request step (repeatable)",
    )
    group.addoption(
        "--pagedtrace-kernel",
        default=None,
        metavar="MODULE:FUNCTION",
        help="the kernel to check, e.g. mypkg.attn:paged_attention or ./attn.py:paged_attention",
    )
    group.addoption(
        "--pagedtrace-device",
        default=None,
        metavar="DEVICE",
        help="move each case's inputs to DEVICE (e.g. cuda) before calling the kernel",
    )


def pytest_configure(config: pytest.Config) -> None:
    """Open the traces and import the kernel now, so a bad one stops the run with one line."""
    state = _State(device=config.getoption("pagedtrace_device"))
    base = Path(config.invocation_params.dir)
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
    config.stash[_STATE] = state


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
