"""Import a kernel named ``MODULE:FUNCTION`` (``pagedtrace replay --kernel``, the pytest plugin).

Standard library only.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["FILE_MODULE_PREFIX", "load_kernel"]

#: Module-name prefix of a kernel imported from a ``.py`` file (``kernel_name`` shows the file instead).
FILE_MODULE_PREFIX = "_pagedtrace_kernel_"


def load_kernel(spec: str) -> Callable[..., Any]:
    """Import a kernel named ``MODULE:FUNCTION``.

    ``MODULE`` is a dotted module name on ``sys.path`` (``mypkg.attn``) or a path to a
    ``.py`` file (``./my_attn.py``); ``FUNCTION`` may be dotted (``Class.method``).

    Raises:
        ValueError: a malformed spec, a module that cannot be imported (or fails while
            importing), a missing attribute, something not callable. One line each.
    """
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name.strip() or not attr.strip() or not all(p.isidentifier() for p in attr.split(".")):
        raise ValueError(f"bad kernel {spec!r}: expected MODULE:FUNCTION, e.g. mypkg.attn:paged_attention")
    if module_name.endswith(".py") or os.sep in module_name or "/" in module_name:
        module = _import_file(Path(module_name), spec)
    else:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            where = "" if exc.name != module_name.split(".")[0] else " (is it on PYTHONPATH?)"
            raise ValueError(f"kernel {spec!r}: cannot import {module_name!r}: {exc}{where}") from None
        except Exception as exc:  # noqa: BLE001 - the module's own code failed: name it
            raise ValueError(
                f"kernel {spec!r}: importing {module_name!r} failed: {type(exc).__name__}: {exc}"
            ) from None
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"kernel {spec!r}: {module_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise ValueError(f"kernel {spec!r}: {attr!r} is a {type(obj).__name__}, not a function")
    return obj


def _import_file(path: Path, spec: str) -> Any:
    if not path.is_file():
        raise ValueError(f"kernel {spec!r}: no file {str(path)!r}")
    name = f"{FILE_MODULE_PREFIX}{path.stem}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"kernel {spec!r}: cannot load {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pickling look modules up by name
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - the file's own code failed: name it
        del sys.modules[name]
        raise ValueError(f"kernel {spec!r}: importing {str(path)!r} failed: {type(exc).__name__}: {exc}") from None
    return module
