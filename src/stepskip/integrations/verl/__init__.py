"""Run verl's own trainers on stepskip: ``verl.utils.skip`` served by stepskip's objects.

After :func:`install`, ``import verl.utils.skip`` and its submodules (``skip_manager``,
``base_skip``, ``config``, ``rollout_skip``) give stepskip's ``SkipManager``, roles and configs
under verl's names. verl's five decorated methods (``AgentLoopManager.generate_sequences``,
``FullyAsyncAgentLoopManager.generate_sequences_single``, ``PPOTrainer._add_batch_to_generate``,
``ReplayBuffer.sample``, ``ReplayBufferAsync.sample``) and its ``SkipManager.init``/``set_step``
calls then reach stepskip, with no change to verl's code or config keys.

Every process verl starts must install it; three ways, from the most to the least automatic:

* the launcher, ``python -m stepskip.integrations.verl verl.trainer.main_ppo <hydra overrides>``,
  which installs in the driver and hands Ray :func:`setup_hook` as the job's
  ``worker_process_setup_hook`` (so the TaskRunner, the fully async Rollouter and every other
  actor install before they import verl);
* ``runtime_env={"worker_process_setup_hook": "stepskip.integrations.verl.setup_hook"}`` in your
  own ``ray.init`` (with verl's CLI: ``+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=...``);
* the environment: ``STEPSKIP_VERL=1`` with :func:`boot_path` on ``PYTHONPATH`` installs at
  interpreter start (no file is written anywhere; see :data:`ENV_VAR`).

Each process that installs logs one line, ``stepskip is serving verl's skip roles ...``. It also wraps
``verl.utils.tracking.Tracking.log``: each step's metrics carry the step's skip metrics to every backend
of ``trainer.logger``, and ``log_samples`` sends sampled trajectories (``docs/watching.md``).
:func:`check` tells whether verl's own skip code can still run in this process.

``install()`` also gates verl's inference engines (the role's ``engines`` option, see
:meth:`stepskip.SkipManager.engine_plan`): when the cache serves every step the run will take and
validation is off, ``LLMServerManager.create`` builds no rollout replica, the agent-loop manager no
worker and ``CheckpointEngineManager`` nothing, and a call that would need the engine raises
:class:`~stepskip.errors.EngineNotStartedError`; in every trainer weights reach the engine only
for the generation that needs them, in the fully async one as its Rollouter answers (see
:mod:`stepskip.integrations.verl._engines`, :mod:`stepskip.integrations.verl._fully_async`, and
:func:`engine_counts`).

Example:
    >>> from stepskip.integrations import verl as stepskip_verl
    >>> stepskip_verl.install()
    >>> stepskip_verl.check()
    []
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

from stepskip._logging import FallbackHandler
from stepskip.integrations.verl import _engines, _rewrap, _served
from stepskip.integrations.verl._engines import engine_counts
from stepskip.integrations.verl._served import SERVED_MODULES

__all__ = [
    "ENV_VAR", "GUARD_KEY", "HOOK", "NEXT_HOOK_ENV_VAR", "SERVED_MODULES", "SERVING_LINE", "VerlSkipNotServedError",
    "boot_path", "check", "configure_logging", "engine_counts", "install", "is_installed", "setup_hook",
]

logger = logging.getLogger(__name__)

#: ``STEPSKIP_VERL=1`` (with :func:`boot_path` on ``PYTHONPATH``) installs at interpreter start.
ENV_VAR = "STEPSKIP_VERL"
#: The ``worker_process_setup_hook`` value for Ray's ``runtime_env``.
HOOK = "stepskip.integrations.verl.setup_hook"
#: A setup hook of your own, run by :func:`setup_hook` after installing (Ray takes only one).
NEXT_HOOK_ENV_VAR = "STEPSKIP_VERL_NEXT_HOOK"
#: What the launcher adds to the Hydra overrides, so that a process running verl's own
#: ``SkipManager.init`` fails on it (verl's config dataclass has no such key) instead of
#: silently skipping with verl's code; stepskip ignores ``skip._*`` keys.
GUARD_KEY = "_stepskip_install_required"

#: The start of the line each process that installs logs (at INFO, logger ``stepskip.integrations.verl``).
SERVING_LINE = "stepskip is serving verl's skip roles"

_lock = threading.RLock()
_announced = False
_displaced: list[ModuleType] = []  # verl's own skip modules that install() took out of sys.modules


class VerlSkipNotServedError(RuntimeError):
    """verl's own ``verl.utils.skip`` code can still run in this process (see the message for what)."""


def is_installed() -> bool:
    """True when this process serves ``verl.utils.skip`` from stepskip (``install()`` ran).

    Example:
        >>> from stepskip.integrations.verl import install, is_installed
        >>> install(); is_installed()
        True
    """
    return _served.installed_finder() is not None


def install() -> None:
    """Serve ``verl.utils.skip`` from stepskip in this process; safe to call any number of times.

    Puts a finder first on ``sys.meta_path`` that answers the five skip modules with stepskip's
    objects, and patches verl's engine-building classes as their modules load (at once for those
    already loaded), so that a run the cache serves starts no inference engine. When verl's own
    skip package was imported before (its decorators have already run),
    verl's wrappers are found on the loaded classes and re-wrapped by stepskip, module globals
    bound to verl's ``SkipManager`` and roles are rebound to stepskip's, verl's ``SkipManager``
    forwards any call still reaching it, and the served modules replace verl's in ``sys.modules``.

    Raises:
        VerlSkipNotServedError: verl's own skip code was imported first and a wrapper of it
            could not be replaced (the message names it).

    Example:
        >>> from stepskip.integrations.verl import install
        >>> install(); install()  # the second call does nothing
    """
    global _announced
    with _lock:
        if _served.installed_finder() is None:
            sys.meta_path.insert(0, _served.SkipFinder())
        how = "import hook"
        # verl modules imported before install() get their patches now (engine gate, Tracking.log); the
        # others as they are imported, through the finder
        _served.patch_loaded()
        own = _rewrap.own_skip_modules()
        if own:
            how = _take_over(own)
        if not _announced:
            _announced = True
            import stepskip

            logger.info("%s (stepskip %s, pid %d, %s)", SERVING_LINE, stepskip.__version__, os.getpid(), how)
        elif own:
            logger.info("%s (pid %d, %s)", SERVING_LINE, os.getpid(), how)


def _take_over(own: list[ModuleType]) -> str:
    """The fallback: verl's skip package is loaded and its decorators have run."""
    verl_objects = _rewrap.verl_skip_objects(own)
    scan = _rewrap.scan_modules(verl_objects, repair=True)
    for obj, _ in verl_objects.values():
        if _rewrap.is_verl_manager(obj):
            _rewrap.forward_verl_manager(obj)
    for module in own:
        if all(module is not m for m in _displaced):
            _displaced.append(module)
    for name in SERVED_MODULES:
        sys.modules.pop(name, None)
    package = importlib.import_module(_served.PACKAGE)  # through the finder: fresh served modules
    for name in SERVED_MODULES[1:]:
        importlib.import_module(name)
    verl_utils = sys.modules.get("verl.utils")
    if verl_utils is not None:
        verl_utils.skip = package  # type: ignore[attr-defined]
    if scan.unreachable:
        raise VerlSkipNotServedError(
            "verl's own verl.utils.skip was imported before stepskip.integrations.verl.install(), and these "
            f"methods are decorated by it in a way stepskip cannot re-wrap: {', '.join(scan.unreachable)}; "
            "call install() before anything imports verl (or use `python -m stepskip.integrations.verl`)"
        )
    return (f"verl's own skip package was imported first: re-wrapped {len(scan.rewrapped)} decorated methods, "
            f"rebound {len(scan.rebound)} module names")


def check(raise_error: bool = False) -> list[str]:
    """What in this process can still run verl's own skip code; an empty list when stepskip serves it all.

    Looks for: ``install()`` not having run; verl's own skip modules in ``sys.modules``; methods
    still decorated by verl's ``SkipManager``; module names still bound to verl's skip objects.

    Args:
        raise_error: raise instead of returning a non-empty list.

    Returns:
        One sentence per problem found.

    Raises:
        VerlSkipNotServedError: with ``raise_error``, when anything was found.

    Example:
        >>> from stepskip.integrations.verl import check
        >>> problems = check()  # [] once install() has run in this process
    """
    problems: list[str] = []
    if not is_installed():
        problems.append(f"stepskip.integrations.verl.install() has not run in process {os.getpid()}")
    own_loaded = _rewrap.own_skip_modules()
    for module in own_loaded:
        where = getattr(module, "__file__", None) or "?"
        problems.append(f"{module.__name__} in sys.modules is verl's own module ({where})")
    verl_objects = _rewrap.verl_skip_objects(_rewrap.own_skip_modules(_displaced))
    scan = _rewrap.scan_modules(verl_objects, repair=False)
    problems += [f"{where} is decorated by verl's own SkipManager" for where in scan.wrappers]
    problems += [f"{where} is bound to verl's own skip object" for where in scan.references
                 if not _is_forwarded(where, verl_objects)]
    problems += [f"{where} builds inference engines without stepskip's engine gate" for where in _engines.unpatched()]
    if problems and raise_error:
        raise VerlSkipNotServedError(
            "verl's own skip code can run in this process: " + "; ".join(problems)
            + " (run stepskip.integrations.verl.install() before verl is imported, e.g. through "
            "`python -m stepskip.integrations.verl <module> <overrides>` or the Ray setup hook "
            f"{HOOK})"
        )
    return problems


def _is_forwarded(where: str, verl_objects: dict[int, tuple[object, str]]) -> bool:
    """A name bound to verl's own SkipManager is harmless once that class forwards to stepskip."""
    modname, _, name = where.rpartition(".")
    obj = getattr(sys.modules.get(modname), name, None)
    return bool(getattr(obj, "__stepskip_forwarded__", False))


def configure_logging() -> None:
    """Make stepskip's INFO lines visible in a process stepskip's entry points start in.

    Like verl's ``configure_verl_logging`` for the ``verl`` logger. When the application has
    configured the root logger (verl's import does), the ``stepskip`` logger only gets a level, so
    its records reach those handlers; otherwise it gets a stderr handler of its own. The level is
    ``STEPSKIP_LOGGING_LEVEL`` (default INFO). A ``stepskip`` logger configured by the application is
    left alone.

    Example:
        >>> from stepskip.integrations.verl import configure_logging
        >>> configure_logging()  # what the launcher, the Ray hook and the STEPSKIP_VERL boot call first
    """
    stepskip_logger = logging.getLogger("stepskip")
    if any(not isinstance(h, (logging.NullHandler, FallbackHandler)) for h in stepskip_logger.handlers):
        return
    if stepskip_logger.level == logging.NOTSET:
        stepskip_logger.setLevel(os.environ.get("STEPSKIP_LOGGING_LEVEL", "INFO"))
    if logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(stream=sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s:%(asctime)s:%(name)s: %(message)s"))
    stepskip_logger.addHandler(handler)
    stepskip_logger.propagate = False


def setup_hook() -> None:
    """Ray's ``worker_process_setup_hook``: install in the worker before it runs any task.

    Then runs the hook named by ``STEPSKIP_VERL_NEXT_HOOK`` (``module.function``), if set, so
    that a setup hook of your own still runs.

    Raises:
        VerlSkipNotServedError: verl's own skip code was already loaded and cannot be replaced;
            the worker fails at start rather than run verl's skip silently.

    Example:
        >>> import ray
        >>> ray.init(runtime_env={"worker_process_setup_hook": HOOK})  # doctest: +SKIP
    """
    configure_logging()
    install()
    check(raise_error=True)
    next_hook = os.environ.get(NEXT_HOOK_ENV_VAR, "").strip()
    if next_hook:
        module_name, _, func_name = next_hook.rpartition(".")
        if not module_name:
            raise VerlSkipNotServedError(
                f"{NEXT_HOOK_ENV_VAR}={next_hook!r} is not a 'module.function' name; set it to the hook to run next"
            )
        getattr(importlib.import_module(module_name), func_name)()


def boot_path() -> str:
    """The directory to put on ``PYTHONPATH`` for ``STEPSKIP_VERL=1`` to install at interpreter start.

    It holds only a ``sitecustomize`` that installs when the variable is set and then runs the
    ``sitecustomize`` it shadows, if any; nothing is written into site-packages.

    Example:
        >>> import os
        >>> os.path.basename(boot_path())
        '_boot'
    """
    return str(Path(__file__).resolve().parent / "_boot")


def boot_from_environment() -> None:
    """What the ``_boot`` sitecustomize calls: install when ``STEPSKIP_VERL`` is set (not ``0``)."""
    if os.environ.get(ENV_VAR, "").strip() not in ("", "0"):
        configure_logging()
        install()
