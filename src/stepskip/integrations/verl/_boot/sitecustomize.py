"""Installs stepskip.integrations.verl at interpreter start when STEPSKIP_VERL is set (see boot_path()).

Python imports the first ``sitecustomize`` on ``sys.path`` while starting; this one is found only when
its directory is on ``PYTHONPATH``. It then runs the ``sitecustomize`` it shadows, so a site's own
start-up code still runs.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def _run_shadowed() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


if os.environ.get("STEPSKIP_VERL", "").strip() not in ("", "0"):
    from stepskip.integrations.verl import boot_from_environment

    boot_from_environment()
_run_shadowed()
