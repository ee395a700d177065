"""Patch a module right after its first import (Python has no post-import hook): what our vLLM plugins use.

A vLLM general plugin runs early in every vLLM process, often before the module it patches
is imported, and importing that module there would pull it (vLLM's model runner, its
rejection sampler, vllm-ascend's NPU runner) into processes that never use it.
`patch_on_import` patches the module now if it is imported already, else installs a
finder at the front of ``sys.meta_path`` that wraps the module's loader and patches it
right after it executes.  A patch that fails is logged, never raised: a plugin must not
stop vLLM from starting.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

Patch = Callable[[ModuleType], Any]


def _apply(patch: Patch, module: ModuleType, consequence: str, log: logging.Logger) -> None:
    try:
        patch(module)
    except Exception:  # a module we do not understand: leave it as it is, say so
        log.exception("samrollout: could not patch %s; %s", module.__name__, consequence)


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, then the patch; anything else is the real loader's."""

    def __init__(self, loader: importlib.abc.Loader, patch: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._patch(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class PatchAfterImport(importlib.abc.MetaPathFinder):
    """Patches one module right after its first import."""

    def __init__(self, module_name: str, patch: Callable[[ModuleType], None]) -> None:
        self.module_name = module_name
        self.patch = patch

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        """The spec the other finders give ``module_name``, its loader wrapped to patch; None for others."""
        if fullname != self.module_name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec: importlib.machinery.ModuleSpec | None = finder.find_spec(fullname, path, target)
            if spec is None:
                continue
            if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _PatchingLoader(spec.loader, self.patch)
            return spec
        return None


def patch_on_import(module_name: str, patch: Patch, consequence: str, log: logging.Logger) -> None:
    """Run ``patch(module)`` on ``module_name`` now if it is imported, else right after its import; never raises
    (a patch that fails is logged), so a plugin may call it without a guard of its own.

    ``consequence`` completes the log line if the patch fails ("method 'custom_class' stays
    unavailable").
    """
    def guarded(module: ModuleType) -> None:
        _apply(patch, module, consequence, log)

    module = sys.modules.get(module_name)
    if module is not None:
        guarded(module)
    else:
        sys.meta_path.insert(0, PatchAfterImport(module_name, guarded))
