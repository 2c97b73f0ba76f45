"""Ready-made test: does a kernel compute what vLLM computed, on every captured step?

Run it with the plugin (both ship with pagedtrace; nothing is registered globally)::

    pytest -p reference_impl.pytest_plugin --pyargs reference_impl.kernel_check \\
        --pagedtrace-trace=TRACE --pagedtrace-kernel=mypkg.attn:paged_attention

One test per captured request step, id ``<trace>/step<i>/layer<j>``; a failure's first
line is the verdict (``kernel K does NOT match vLLM on step 4 layer 0: max abs A > tol
B``), then the worst head, its request id, position and physical block, and the tolerance
(``tracer.format.CaseResult.message``). A kernel that raises fails with its traceback.
The kernel's signature is documented in :mod:`reference_impl.testing`.
"""

from __future__ import annotations


# The kernel fixture comes first: without --pagedtrace-kernel it skips before the case is read.
def test_kernel_matches_vllm(pagedtrace_kernel, pagedtrace_check, pagedtrace_case):
    """The kernel's output on the captured inputs is within tolerance of exact attention."""
    pagedtrace_check(pagedtrace_kernel, pagedtrace_case)
