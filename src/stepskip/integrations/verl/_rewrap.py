"""The fallback for a process where verl's own ``verl.utils.skip`` was imported before ``install()``.

By then verl's decorators have run: its classes hold verl's wrappers and its modules hold verl's
``SkipManager``. Those wrappers are recognised by what their closures hold (``cls`` is verl's
``SkipManager``, ``role`` a string, ``func`` the undecorated method, ``phase`` for ``annotate_tq``),
and the undecorated method is wrapped again with stepskip's decorator of the same role. A wrapper
that sits under another decorator (``@auto_await`` over ``annotate("rollout")`` in verl 0.9.1) is
replaced inside the outer decorator's closure cell, which keeps the outer behaviour as it was.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from types import CellType, FunctionType, ModuleType
from typing import Any

from stepskip.integrations.verl import _served

_MAX_DEPTH = 16  # decorator layers followed through ``__wrapped__``; more means a cycle


@dataclass
class Scan:
    """What a scan of the loaded modules found."""

    wrappers: list[str] = field(default_factory=list)  # "module.Class.method" still wrapped by verl
    unreachable: list[str] = field(default_factory=list)  # verl wrappers that cannot be re-wrapped
    references: list[str] = field(default_factory=list)  # "module.name" bound to one of verl's skip objects
    rewrapped: list[str] = field(default_factory=list)
    rebound: list[str] = field(default_factory=list)


def is_verl_manager(obj: Any) -> bool:
    """True for verl's own ``SkipManager`` class (not the one stepskip serves under verl's name)."""
    return (issubclass(type(obj), type) and obj.__name__ == "SkipManager"
            and str(_safe_attr(obj, "__module__")).startswith("verl."))


def verl_wrapper_parts(fn: Any) -> tuple[str, str | None, Callable[..., Any]] | None:
    """``(role, phase, func)`` when ``fn`` is a wrapper made by verl's ``annotate``/``annotate_tq``."""
    code = getattr(fn, "__code__", None)
    closure = getattr(fn, "__closure__", None)
    if code is None or not closure:
        return None
    cells = dict(zip(code.co_freevars, closure))
    try:
        owner = cells["cls"].cell_contents
        role = cells["role"].cell_contents
        func = cells["func"].cell_contents
        phase = cells["phase"].cell_contents if "phase" in cells else None
    except (KeyError, ValueError):  # ValueError: an empty cell
        return None
    if not is_verl_manager(owner) or not isinstance(role, str) or not callable(func):
        return None
    return role, phase, func


def stepskip_wrapper(role: str, phase: str | None, func: Callable[..., Any]) -> Callable[..., Any]:
    """The same decoration by stepskip's ``SkipManager``."""
    from stepskip._manager import SkipManager

    if phase is None:
        return SkipManager.annotate(role=role)(func)
    return SkipManager.annotate_tq(role=role, phase=phase)(func)


def _unwrap_descriptor(value: Any) -> tuple[Any, Callable[[Any], Any]]:
    """The function inside a class attribute, and how to put a replacement back in the same kind."""
    if isinstance(value, staticmethod):
        return value.__func__, staticmethod
    if isinstance(value, classmethod):
        return value.__func__, classmethod
    return value, lambda fn: fn


def _replace_in_cells(outer: Any, old: Any, new: Any) -> bool:
    """Swap ``old`` for ``new`` in ``outer``'s closure; True if a cell held it."""
    closure: tuple[CellType, ...] | None = getattr(outer, "__closure__", None)
    done = False
    for cell in closure or ():
        try:
            if cell.cell_contents is old:
                cell.cell_contents = new
                done = True
        except ValueError:  # an empty cell
            continue
    if done and getattr(outer, "__wrapped__", None) is old:
        outer.__wrapped__ = new
    return done


def _fix_attribute(holder: Any, name: str, value: Any, where: str, scan: Scan, repair: bool) -> None:
    """Look down one attribute's decorator chain for a verl wrapper; re-wrap it when ``repair``."""
    top, rebuild = _unwrap_descriptor(value)
    outer: Any = None
    layer = top
    for _ in range(_MAX_DEPTH):
        parts = verl_wrapper_parts(layer)
        if parts is not None:
            if not repair:
                scan.wrappers.append(where)
                return
            new = stepskip_wrapper(*parts)
            if outer is None:
                setattr(holder, name, rebuild(new))
            elif not _replace_in_cells(outer, layer, new):
                scan.unreachable.append(where)
                return
            scan.rewrapped.append(where)
            return
        nxt = getattr(layer, "__wrapped__", None)
        if nxt is None or nxt is layer:
            return
        outer, layer = layer, nxt


def _is_module(obj: Any) -> bool:
    # type(), not isinstance(): isinstance() reads obj.__class__, which some deprecated objects
    # (torch.distributed.reduce_op) answer with a warning.
    return issubclass(type(obj), ModuleType)


def _module_items(module: ModuleType) -> list[tuple[str, Any]]:
    try:
        return list(vars(module).items())
    except TypeError:  # a module object without a __dict__
        return []


def _safe_attr(obj: Any, name: str) -> Any:
    """``getattr`` that survives objects whose ``__getattr__`` raises something else than AttributeError."""
    try:
        return getattr(obj, name, None)
    except Exception:  # noqa: BLE001 - a foreign object's lookup failing means "not ours", nothing more
        return None


def own_skip_modules(displaced: Iterable[ModuleType] = ()) -> list[ModuleType]:
    """verl's own skip modules still in ``sys.modules``, plus those ``install()`` displaced from it."""
    modules = [m for m in (sys.modules.get(n) for n in _served.SERVED_MODULES)
               if isinstance(m, ModuleType) and not _served.is_served(m)]
    return modules + [m for m in displaced if all(m is not k for k in modules)]


def verl_skip_objects(modules: Iterable[ModuleType]) -> dict[int, tuple[Any, str]]:
    """``id -> (object, name)`` for every object verl's own skip ``modules`` define or re-export."""
    found: dict[int, tuple[Any, str]] = {}
    for module in modules:
        for name, obj in _module_items(module):
            if name.startswith("__") or _is_module(obj):
                continue
            origin = _safe_attr(obj, "__module__")
            if name == "SKIP_REGISTRY" or (isinstance(origin, str) and origin.startswith(_served.PACKAGE)):
                found[id(obj)] = (obj, name)
    return found


def _served_counterpart(name: str) -> Any:
    import stepskip

    return getattr(stepskip, name, None)


def _candidate_modules(verl_objects: dict[int, tuple[Any, str]]) -> Iterator[tuple[str, ModuleType]]:
    """verl's modules, and any other module that holds one of verl's skip objects or modules."""
    for modname, module in list(sys.modules.items()):
        if not _is_module(module) or modname in _served.SERVED_NAMES:
            continue
        if modname == "verl" or modname.startswith("verl."):
            yield modname, module
            continue
        for _, obj in _module_items(module):
            if id(obj) in verl_objects or (_is_module(obj) and obj.__name__ in _served.SERVED_NAMES):
                yield modname, module
                break


def scan_modules(verl_objects: dict[int, tuple[Any, str]], repair: bool) -> Scan:
    """Find (and, with ``repair``, fix) what still reaches verl's own skip code in loaded modules.

    Module globals bound to one of ``verl_objects`` (from :func:`verl_skip_objects`) are rebound
    to stepskip's object of the same name; methods and functions still decorated by verl are
    re-wrapped by stepskip.
    """
    scan = Scan()
    for modname, module in _candidate_modules(verl_objects):
        for name, obj in _module_items(module):
            if id(obj) in verl_objects and obj is verl_objects[id(obj)][0]:
                counterpart = _served_counterpart(verl_objects[id(obj)][1])
                if counterpart is None:
                    continue
                if repair:
                    setattr(module, name, counterpart)
                    scan.rebound.append(f"{modname}.{name}")
                else:
                    scan.references.append(f"{modname}.{name}")
                continue
            if issubclass(type(obj), type) and _safe_attr(obj, "__module__") == modname:
                for attr, value in list(vars(obj).items()):
                    if isinstance(value, (FunctionType, staticmethod, classmethod)):
                        _fix_attribute(obj, attr, value, f"{modname}.{obj.__qualname__}.{attr}", scan, repair)
            elif type(obj) is FunctionType and obj.__module__ == modname:
                _fix_attribute(module, name, obj, f"{modname}.{name}", scan, repair)
    return scan


def forward_verl_manager(verl_manager: type) -> None:
    """Make verl's own ``SkipManager`` class hand every call to stepskip's.

    Covers references the module scan cannot see (a name bound inside a function, an alias held
    by an object): ``init``, ``set_step`` and both decorators then reach stepskip.
    """
    from stepskip._manager import SkipManager

    def init(cls: type, config: Any, **runtime: Any) -> None:
        SkipManager.init(config, **runtime)

    def set_step(cls: type, step: int) -> None:
        SkipManager.set_step(step)

    def annotate(cls: type, role: str, **kwargs: Any) -> Callable[..., Any]:
        return SkipManager.annotate(role=role, **kwargs)

    def annotate_tq(cls: type, role: str, phase: str) -> Callable[..., Any]:
        return SkipManager.annotate_tq(role=role, phase=phase)

    for fn in (init, set_step, annotate, annotate_tq):
        fn.__qualname__ = f"{verl_manager.__qualname__}.{fn.__name__}"
        setattr(verl_manager, fn.__name__, classmethod(fn))
    verl_manager.__stepskip_forwarded__ = True  # type: ignore[attr-defined]
