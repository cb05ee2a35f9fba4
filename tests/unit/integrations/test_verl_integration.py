"""`stepskip.integrations.verl` without verl installed: the finder, check(), the launcher's arguments.

verl itself is absent from this environment; where a test needs ``verl`` and ``verl.utils`` to
exist as packages for the finder to serve ``verl.utils.skip`` under them, empty stand-in packages
take their place (verl's real modules are exercised in tests/integration/verl_real, in verl's env).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import stepskip
from stepskip.integrations import verl as integration
from stepskip.integrations.verl import __main__ as launcher


@pytest.fixture(autouse=True)
def _restore_import_state(monkeypatch):
    """install() and the entry points change process-wide import and logging state; each test restores it."""
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setattr(integration, "_announced", False)
    monkeypatch.setattr(integration, "_displaced", [])
    saved = {name: module for name, module in sys.modules.items() if name == "verl" or name.startswith("verl.")}
    stepskip_logger = logging.getLogger("stepskip")
    monkeypatch.setattr(stepskip_logger, "handlers", list(stepskip_logger.handlers))
    monkeypatch.setattr(stepskip_logger, "propagate", stepskip_logger.propagate)
    level = stepskip_logger.level
    yield
    stepskip_logger.setLevel(level)
    for name in [n for n in sys.modules if n == "verl" or n.startswith("verl.")]:
        del sys.modules[name]
    sys.modules.update(saved)


@pytest.fixture
def verl_packages(monkeypatch):
    """Empty ``verl`` and ``verl.utils`` packages, as if verl were installed."""
    for name in ("verl", "verl.utils"):
        package = types.ModuleType(name)
        package.__path__ = []
        monkeypatch.setitem(sys.modules, name, package)
    sys.modules["verl"].utils = sys.modules["verl.utils"]


def test_install_is_idempotent_and_logs_one_line(caplog):
    caplog.set_level(logging.INFO, logger="stepskip")
    integration.install()
    integration.install()
    finders = [f for f in sys.meta_path if type(f).__name__ == "SkipFinder"]
    assert len(finders) == 1 and sys.meta_path[0] is finders[0]
    lines = [r.getMessage() for r in caplog.records if integration.SERVING_LINE in r.getMessage()]
    assert len(lines) == 1 and stepskip.__version__ in lines[0]
    assert integration.is_installed()


def test_served_modules_carry_verls_names_bound_to_stepskips_objects(verl_packages):
    integration.install()
    package = importlib.import_module("verl.utils.skip")
    assert package.SkipManager is stepskip.SkipManager and package.SkipManagerConfig is stepskip.SkipManagerConfig
    assert sys.modules["verl.utils"].skip is package
    expected = {
        "verl.utils.skip.base_skip": ["SkipAction", "BaseSkip", "SKIP_REGISTRY", "register_skip"],
        "verl.utils.skip.config": ["RolloutSkipConfig", "AsyncRolloutSkipConfig", "RolloutTqSkipConfig",
                                   "SkipManagerConfig"],
        "verl.utils.skip.rollout_skip": ["RolloutSkip", "RolloutTqSkip", "AsyncRolloutSkip",
                                         "parse_async_rollout_sample_step"],
        "verl.utils.skip.skip_manager": ["SkipManager", "SKIP_REGISTRY"],
    }
    for module_name, names in expected.items():
        module = importlib.import_module(module_name)
        for name in names:
            assert getattr(module, name) is getattr(stepskip, name), (module_name, name)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("verl.utils.skip.not_a_verl_module")


def test_a_role_registered_through_verls_name_is_stepskips(verl_packages):
    integration.install()
    from verl.utils.skip.base_skip import BaseSkip, register_skip  # type: ignore[import-not-found]

    @register_skip("custom_for_test")
    class Custom(BaseSkip):
        pass

    assert stepskip.SKIP_REGISTRY["custom_for_test"] is Custom


def test_without_verl_the_skip_package_is_not_served_on_its_own():
    integration.install()
    with pytest.raises(ModuleNotFoundError, match="verl"):
        importlib.import_module("verl.utils.skip")


def test_check_reports_a_process_without_install():
    problems = integration.check()
    assert any("install() has not run" in p for p in problems)
    with pytest.raises(integration.VerlSkipNotServedError, match="install"):
        integration.check(raise_error=True)
    integration.install()
    assert integration.check() == []


def test_launcher_adds_the_ray_hook_and_the_guard():
    assert launcher.build_overrides(["trainer.total_training_steps=3"]) == [
        "+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=stepskip.integrations.verl.setup_hook",
        "+skip._stepskip_install_required=true",
        "trainer.total_training_steps=3",
    ]


def test_launcher_chains_a_setup_hook_the_user_gave():
    out = launcher.build_overrides(["+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=my.hook", "a=1"])
    assert out == [
        "+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=stepskip.integrations.verl.setup_hook",
        "+ray_kwargs.ray_init.runtime_env.env_vars.STEPSKIP_VERL_NEXT_HOOK=my.hook",
        "+skip._stepskip_install_required=true",
        "a=1",
    ]


@pytest.mark.parametrize(("given", "expected"), [
    # Hydra flags after the overrides stay last
    (["a=1", "--cfg", "job"], ["+H", "+G", "a=1", "--cfg", "job"]),
    # flags (and their values) before the overrides stay first: Hydra takes one run of overrides
    (["--config-name", "ppo", "a=1", "~b", "--cfg", "job"], ["--config-name", "ppo", "+H", "+G", "a=1", "~b",
                                                              "--cfg", "job"]),
    (["--config-path=/x", "-cn", "ppo", "a=1"], ["--config-path=/x", "-cn", "ppo", "+H", "+G", "a=1"]),
    # no override of the user's: the added ones come first, before any flag
    (["--cfg", "job"], ["+H", "+G", "--cfg", "job"]),
    ([], ["+H", "+G"]),
])
def test_launcher_puts_its_overrides_where_hydra_reads_overrides(given, expected):
    short = {f"+{launcher.HOOK_KEY}={integration.HOOK}": "+H", f"+skip.{integration.GUARD_KEY}=true": "+G"}
    assert [short.get(a, a) for a in launcher.build_overrides(given)] == expected


def test_launcher_flags_leave_out_what_they_name():
    assert launcher.build_overrides(["a=1"], ray_hook=False, guard=False) == ["a=1"]
    given = ["+skip._stepskip_install_required=true"]
    assert launcher.build_overrides(given, ray_hook=False) == given


@pytest.mark.parametrize("argv", [[], ["--no-guard"], ["-x"], ["a.b=1"], ["--bogus", "m"]])
def test_launcher_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        launcher.main(argv)
    assert exc.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_launcher_runs_the_module_as_main_with_the_overrides(tmp_path, monkeypatch):
    (tmp_path / "launch_target_mod.py").write_text(
        "import sys, json\n"
        "if __name__ == '__main__':\n"
        "    from stepskip.integrations.verl import is_installed\n"
        "    seen = {'argv': sys.argv, 'installed': is_installed()}\n"
        "    out = [a for a in sys.argv if a.startswith('out=')][0]\n"
        "    open(out.split('=', 1)[1], 'w').write(json.dumps(seen))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    out = tmp_path / "out.json"
    launcher.main(["--no-guard", "launch_target_mod", f"out={out}", "b=2"])
    got = json.loads(out.read_text())
    assert got["installed"]
    assert Path(got["argv"][0]).name == "launch_target_mod.py"
    assert got["argv"][1:] == [f"+{launcher.HOOK_KEY}=stepskip.integrations.verl.setup_hook", f"out={out}", "b=2"]


def test_launcher_keeps_hydra_flags_before_and_after_the_overrides(tmp_path):
    """A real Hydra application run through the launcher as `python -m <module>` runs it: a config chosen
    with leading flags, the user's overrides, and `--cfg job` last, which prints the composed config."""
    pytest.importorskip("hydra")
    (tmp_path / "hydra_app_mod.py").write_text(
        "import hydra\n"
        "@hydra.main(config_path=None, config_name=None, version_base=None)\n"
        "def main(cfg):\n"
        "    raise SystemExit('--cfg job prints the config and never runs the task')\n"
        "if __name__ == '__main__':\n"
        "    main()\n"
    )
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "app.yaml").write_text("trainer:\n  total_training_steps: 1\nskip: {}\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "stepskip.integrations.verl", "hydra_app_mod", "--config-path", str(tmp_path / "conf"),
         "--config-name", "app", "trainer.total_training_steps=3", "--cfg", "job"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    from omegaconf import OmegaConf

    printed = OmegaConf.create(done.stdout)
    assert printed.trainer.total_training_steps == 3
    assert printed.skip[integration.GUARD_KEY] is True
    assert printed.ray_kwargs.ray_init.runtime_env.worker_process_setup_hook == integration.HOOK


def test_setup_hook_refuses_a_next_hook_that_is_not_a_dotted_name(monkeypatch):
    monkeypatch.setenv(integration.NEXT_HOOK_ENV_VAR, "nodots")
    with pytest.raises(integration.VerlSkipNotServedError, match="STEPSKIP_VERL_NEXT_HOOK"):
        integration.setup_hook()


def test_boot_path_holds_the_sitecustomize():
    assert (Path(integration.boot_path()) / "sitecustomize.py").is_file()
