"""``RunIdentity.world_size``: runs of several processes get their own run directory; one process keeps verl's."""

from __future__ import annotations

import pytest

from stepskip import SkipConfigError, SkipManager
from stepskip._identity import RunIdentity
from stepskip._layout import RUN_DIR


def rollout_dir(tmp_path, identity: RunIdentity) -> str:
    SkipManager.init({"skip": {"rollout": {"enable": True, "steps": [1], "dump_dir": str(tmp_path)}}},
                     identity=identity)
    return SkipManager.skip_instances["rollout"].project_dump_dir


def test_one_process_keeps_verls_directory_name(tmp_path):
    path = rollout_dir(tmp_path, RunIdentity("e", "p", gbs=4, n=2, prompt_len=8, response_len=6))
    assert path.endswith("/e_p/GBS4_N2_in8_out6")


def test_several_processes_name_their_run_directory(tmp_path):
    path = rollout_dir(tmp_path, RunIdentity("e", "p", gbs=4, n=2, prompt_len=8, response_len=6, world_size=2))
    assert path.endswith("/e_p/GBS4_N2_in8_out6_W2")
    assert RUN_DIR.match("GBS4_N2_in8_out6_W2") and RUN_DIR.match("GBS4_N2_in8_out6")
    assert RUN_DIR.match("GBS4_N2_in8_out6_W") is None


@pytest.mark.parametrize("bad", [0, -1, 1.0, True, "2"])
def test_world_size_is_validated(bad):
    with pytest.raises(SkipConfigError, match="world_size"):
        RunIdentity(world_size=bad)
