"""Loads the native drafter core.

Normally the extension built by the package (``samrollout._sam_core``); the
environment variable ``SAMROLLOUT_CORE_LIB`` may name another build of it (the
sanitizer build in ``tests/sanitize.sh``) so the same tests run against it.
"""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType


def _load() -> ModuleType:
    path = os.environ.get("SAMROLLOUT_CORE_LIB")
    if not path:
        return importlib.import_module("samrollout._sam_core")
    spec = importlib.util.spec_from_file_location("samrollout._sam_core", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"SAMROLLOUT_CORE_LIB={path} is not a loadable extension")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


core: ModuleType = _load()
MAX_DRAFT_TOKENS: int = core.MAX_DRAFT_TOKENS
