"""pagedtrace: see vLLM's PagedAttention at work.

The command-line front end lives here; the parts live in the top-level packages
``tracer`` (the only one that imports vLLM), ``reference_impl``, ``annotations``
and ``reports``.
"""

__version__ = "0.1.0"
