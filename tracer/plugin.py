"""vLLM ``general_plugins`` entry point: runs in every vLLM process.

vLLM calls ``register()`` in the front end, the engine core and each worker.
It always registers the ``pagedtrace_random`` load format (harmless, and needed
wherever the model is loaded); it installs the tracer only when
``PAGEDTRACE_DIR`` is set and no tracer is active in the process yet (an
in-process ``tracer.start()`` already installed one).
"""

from __future__ import annotations

import logging

logger = logging.getLogger("pagedtrace")


def register() -> None:
    """Entry point named in ``pyproject.toml`` under ``vllm.general_plugins``."""
    from tracer import install
    from tracer.options import TracerOptions
    from tracer.random_weights import register_loader

    register_loader()
    options = TracerOptions.from_env()
    if options is None or install.active() is not None:
        return
    try:
        install.Tracer(options).start()
    except Exception as exc:  # noqa: BLE001 - never stop vLLM from starting
        logger.warning("pagedtrace: tracer not installed: %s", exc)
