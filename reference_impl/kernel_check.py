"""Ready-made test: does a kernel compute what vLLM computed, on every captured step?

Run it with the plugin (both ship with pagedtrace; nothing is registered globally)::

    pytest -p reference_impl.pytest_plugin --pyargs reference_impl.kernel_check \\
        --pagedtrace-trace TRACE --pagedtrace-kernel mypkg.attn:paged_attention

One test per captured request step, id ``<trace>/step<i>/layer<j>``; a failure prints
the step, layer, worst head and token, max abs/rel error and the tolerance
(``reference_impl.testing.CaseResult.message``). The kernel's signature is documented
in :mod:`reference_impl.testing`.
"""

from __future__ import annotations

from reference_impl.testing import assert_kernel_matches


# The kernel fixture comes first: without --pagedtrace-kernel it skips before the case is read.
def test_kernel_matches_vllm(pagedtrace_kernel, pagedtrace_device, pagedtrace_case):
    """The kernel's output on the captured inputs is within tolerance of exact attention."""
    assert_kernel_matches(pagedtrace_kernel, pagedtrace_case, device=pagedtrace_device)
