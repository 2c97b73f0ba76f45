"""pagedtrace: see vLLM's PagedAttention at work.

The command-line front end lives here; the parts live in the top-level packages
``tracer`` (the only one that imports vLLM), ``reference_impl``, ``annotations``
and ``reports``.
"""

from tracer.format.version import __version__

__all__ = ["__version__"]
