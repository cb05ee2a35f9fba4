"""The ``verl.utils.skip`` package as stepskip serves it: which names each module carries, and the finder.

verl 0.9.1 imports ``SkipManager`` from ``verl.utils.skip`` and ``verl.utils.skip.skip_manager``, and its
config names ``verl.utils.skip.SkipManagerConfig`` as ``_target_``; its tests and user code also reach
into ``base_skip``, ``config`` and ``rollout_skip``. Every name below exists in verl's package and is
bound here to the stepskip object of the same name, so code written against verl keeps importing.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

PACKAGE = "verl.utils.skip"

# module -> the names verl's module of that name defines or re-exports, all taken from stepskip.
SERVED_NAMES: dict[str, tuple[str, ...]] = {
    PACKAGE: ("BaseSkip", "SkipManager", "SkipManagerConfig", "RolloutSkip", "RolloutTqSkip", "AsyncRolloutSkip"),
    f"{PACKAGE}.base_skip": ("SkipAction", "BaseSkip", "SKIP_REGISTRY", "register_skip"),
    f"{PACKAGE}.config": ("RolloutSkipConfig", "AsyncRolloutSkipConfig", "RolloutTqSkipConfig", "SkipManagerConfig"),
    f"{PACKAGE}.rollout_skip": ("BaseSkip", "SkipAction", "register_skip", "RolloutSkip", "RolloutTqSkip",
                                "AsyncRolloutSkip", "parse_async_rollout_sample_step"),
    f"{PACKAGE}.skip_manager": ("SkipManager", "SKIP_REGISTRY", "SkipManagerConfig"),
}
SERVED_MODULES: tuple[str, ...] = tuple(SERVED_NAMES)

# The attribute that marks a module as stepskip's (check() and the fallback look for it).
MARKER = "__stepskip_serves__"


def is_served(module: Any) -> bool:
    """True when ``module`` is one of the modules this finder built."""
    return isinstance(module, ModuleType) and getattr(module, MARKER, False) is True


def populate(module: ModuleType) -> None:
    """Bind the stepskip objects of ``module.__name__`` onto it."""
    import stepskip

    names = SERVED_NAMES[module.__name__]
    for name in names:
        setattr(module, name, getattr(stepskip, name))
    module.__all__ = list(names)  # type: ignore[attr-defined]
    module.__doc__ = (f"{module.__name__}, served by stepskip {stepskip.__version__} "
                      "(stepskip.integrations.verl.install()): verl's skip names bound to stepskip's objects.")
    setattr(module, MARKER, True)


def build(name: str) -> ModuleType:
    """A fresh served module for ``name`` (used when verl's own package must be replaced in place)."""
    spec = _spec(name)
    module = importlib.util.module_from_spec(spec)
    populate(module)
    return module


def _spec(name: str) -> importlib.machinery.ModuleSpec:
    return importlib.machinery.ModuleSpec(
        name, _LOADER, origin="stepskip.integrations.verl", is_package=(name == PACKAGE),
    )


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # the default module object

    def exec_module(self, module: ModuleType) -> None:
        populate(module)


class _PatchingLoader(importlib.abc.Loader):
    """verl's own loader of a module, followed by the patch stepskip applies to it once it has run."""

    def __init__(self, loader: Any, patch: Callable[[ModuleType], object]) -> None:
        self._loader, self._patch = loader, patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._patch(module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package ... as verl's loader answers them
        return getattr(self._loader, name)


def after_import_patches() -> dict[str, Callable[[ModuleType], object]]:
    """verl module -> what stepskip does to it once verl's code has run: the engine patches
    (:mod:`~stepskip.integrations.verl._engines`) and the ``Tracking.log`` wrapper
    (:mod:`~stepskip.integrations.verl._tracking`)."""
    from stepskip.integrations.verl import _engines, _tracking

    return {_tracking.MODULE: _tracking.patch, **_engines.PATCHES}


def patch_loaded() -> list[str]:
    """Apply :func:`after_import_patches` to the verl modules already imported; the names patched."""
    done = []
    for name, patch in after_import_patches().items():
        module = sys.modules.get(name)
        if isinstance(module, ModuleType):
            patch(module)
            done.append(name)
    return done


class SkipFinder(importlib.abc.MetaPathFinder):
    """Serves the five ``verl.utils.skip`` modules ahead of verl's files; every other name passes by,
    except the few verl modules stepskip patches (:func:`after_import_patches`): those load from
    verl's files as always, then get their patch.

    ``verl`` and ``verl.utils`` are still verl's own: only the skip package is replaced, so the
    served modules need verl installed exactly when verl's would.
    """

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname in SERVED_NAMES:
            return _spec(fullname)
        if not fullname.startswith("verl."):
            return None
        patch = after_import_patches().get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:  # the finder verl's own import would have used
            if finder is self or type(finder).__name__ == "SkipFinder" or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


_LOADER = _Loader()


def installed_finder() -> SkipFinder | None:
    """The finder on ``sys.meta_path``, if any (found by type, so a reloaded module still counts)."""
    for finder in sys.meta_path:
        if type(finder).__name__ == "SkipFinder" and type(finder).__module__ == __name__:
            return finder  # type: ignore[return-value]
    return None
