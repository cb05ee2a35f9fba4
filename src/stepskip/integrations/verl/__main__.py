"""``python -m stepskip.integrations.verl <module> [hydra overrides...]``: run a verl entry point on stepskip.

Example:
    python -m stepskip.integrations.verl verl.trainer.main_ppo skip.rollout.enable=true \\
        'skip.rollout.steps=[1,2,3]' +skip.rollout.format=safe ...

What it does, in this order: installs stepskip in this (the driver) process; adds the Hydra
overrides that hand Ray the setup hook (so every actor verl starts installs before it imports
verl) and the guard key (so a process running verl's own ``SkipManager.init`` fails instead of
skipping silently); then runs ``<module>`` as ``__main__`` with those arguments, exactly as
``python -m <module>`` would.
"""

from __future__ import annotations

import runpy
import sys

from stepskip.integrations.verl import GUARD_KEY, HOOK, NEXT_HOOK_ENV_VAR, configure_logging, install

USAGE = """\
usage: python -m stepskip.integrations.verl [--no-ray-hook] [--no-guard] MODULE [OVERRIDE ...]

Runs MODULE (e.g. verl.trainer.main_ppo) as `python -m MODULE OVERRIDE ...` would, with verl's
skip package served by stepskip in this process and in every Ray worker of the job.

  --no-ray-hook  do not add +ray_kwargs.ray_init.runtime_env.worker_process_setup_hook
                 (for entry points that are not verl's main_ppo; install in workers yourself)
  --no-guard     do not add +skip.{guard}=true
                 (for entry points whose config has no skip section)
""".format(guard=GUARD_KEY)

HOOK_KEY = "ray_kwargs.ray_init.runtime_env.worker_process_setup_hook"


def _key(override: str) -> str:
    """The dotted key of a Hydra override (``+a.b=1``, ``++a.b=1``, ``~a.b`` give ``a.b``)."""
    return override.split("=", 1)[0].lstrip("+~")


def _first_override(args: list[str]) -> int:
    """Where the Hydra overrides start in ``args``: the first argument that is not a flag and holds a
    ``=`` (or is a ``~key`` deletion); 0, before any flag, when there is none.

    Hydra reads its overrides as one run of positional arguments: added ones must join the user's
    run, not follow a flag (``--cfg job``) nor precede the user's leading flags (``--config-name x``).
    """
    for i, arg in enumerate(args):
        if not arg.startswith("-") and ("=" in arg or arg.startswith("~")):
            return i
    return 0


def build_overrides(overrides: list[str], ray_hook: bool = True, guard: bool = True) -> list[str]:
    """The user's arguments with what the launcher adds placed just before their first override.

    Hydra flags before or after the overrides (``--config-name ppo_trainer``, ``--cfg job``) keep
    working, as they do on verl's own command line. A ``worker_process_setup_hook`` the user set is
    kept: it moves to ``STEPSKIP_VERL_NEXT_HOOK`` in the job's environment, which stepskip's hook
    runs after installing (Ray takes one hook).

    Example:
        >>> build_overrides(["trainer.total_training_steps=3", "--cfg", "job"])  # doctest: +NORMALIZE_WHITESPACE
        ['+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=stepskip.integrations.verl.setup_hook',
         '+skip._stepskip_install_required=true', 'trainer.total_training_steps=3', '--cfg', 'job']
    """
    kept: list[str] = []
    user_hook: str | None = None
    for override in overrides:
        if ray_hook and _key(override) == HOOK_KEY and "=" in override and not override.startswith("-"):
            user_hook = override.split("=", 1)[1]
            continue
        kept.append(override)
    added: list[str] = []
    if ray_hook:
        added.append(f"+{HOOK_KEY}={HOOK}")
        if user_hook and user_hook != HOOK:
            added.append(f"+ray_kwargs.ray_init.runtime_env.env_vars.{NEXT_HOOK_ENV_VAR}={user_hook}")
    if guard and not any(_key(o) == f"skip.{GUARD_KEY}" for o in kept):
        added.append(f"+skip.{GUARD_KEY}=true")
    at = _first_override(kept)
    return [*kept[:at], *added, *kept[at:]]


def main(argv: list[str] | None = None) -> None:
    """Parse the launcher's own flags, install, and run the module.

    Raises:
        SystemExit: 2 on a usage error; otherwise whatever the module exits with.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    ray_hook = guard = True
    while args and args[0].startswith("--"):
        flag = args.pop(0)
        if flag in ("--help", "-h"):
            sys.stdout.write(USAGE)
            raise SystemExit(0)
        if flag == "--no-ray-hook":
            ray_hook = False
        elif flag == "--no-guard":
            guard = False
        else:
            sys.stderr.write(f"unknown option {flag!r}\n{USAGE}")
            raise SystemExit(2)
    if not args or args[0].startswith("-") or "=" in args[0]:
        sys.stderr.write("the first argument must be the module to run, e.g. verl.trainer.main_ppo\n" + USAGE)
        raise SystemExit(2)
    module = args.pop(0)
    configure_logging()
    install()
    sys.argv = [module, *build_overrides(args, ray_hook=ray_hook, guard=guard)]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
