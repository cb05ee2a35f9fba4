"""The ``engines`` role option and ``SkipManager.engine_plan``: when a run starts its inference engine."""

from __future__ import annotations

import pytest
from skip_configs import training_config

from stepskip import Batch, SkipConfigError, SkipManager
from stepskip._engines import EnginePlan, describe_steps
from stepskip.errors import EngineNotStartedError
from stepskip._policies import Engines

VALIDATION = "validation runs before training (val_before_train); turn it off with val_before_train=False"


class Loop:
    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts):
        return Batch.from_dict(non_tensors={"uid": list(prompts.non_tensor_batch["uid"]),
                                            "step": [SkipManager.step] * len(prompts)})


def record(dump_dir, steps) -> None:
    SkipManager.init(training_config(dump_dir, steps=list(steps)))
    loop = Loop()
    for step in steps:
        SkipManager.set_step(step)
        loop.generate_sequences(Batch.from_dict(non_tensors={"uid": ["a", "b"]}))
    SkipManager.reset()


def test_engines_option_defaults_to_auto_and_is_validated():
    assert SkipManager.engine_plan("rollout", [1]).option is Engines.AUTO
    for value in ("auto", "start", "skip"):
        SkipManager.init(training_config("/tmp/unused-engines", engines=value))
        assert SkipManager.skip_instances["rollout"].local_config.engines is Engines(value)
    with pytest.raises(SkipConfigError) as err:
        SkipManager.init(training_config("/tmp/unused-engines", engines="never"))
    message = str(err.value)
    assert "skip.rollout.engines" in message and "'never'" in message and "auto, start, skip" in message


def test_auto_starts_no_engine_when_every_planned_step_replays(tmp_path):
    record(tmp_path, [1, 2, 3])
    config = training_config(tmp_path, steps=[1, 2, 3])
    plan = SkipManager.engine_plan("rollout", [1, 2, 3], config=config)
    assert isinstance(plan, EnginePlan) and plan.start is False and plan.generate == ()
    assert "all 3 planned steps (1-3) are served from the cache" in plan.reason
    assert SkipManager.engines_needed("rollout", [1, 2, 3], config=config) is False
    # asked with a config, the plan leaves the (absent) current run alone
    assert SkipManager.skip_instances == {}


def test_auto_starts_the_engine_for_an_uncached_step_and_names_it(tmp_path):
    record(tmp_path, [1, 2, 3])
    plan = SkipManager.engine_plan("rollout", [1, 2, 3, 4], config=training_config(tmp_path, steps=[1, 2, 3, 4]))
    assert plan.start is True and plan.generate == (4,)
    assert "1 of the 4 planned steps are not served from the cache: 4" in plan.reason


def test_auto_starts_the_engine_for_validation_and_says_how_to_turn_it_off(tmp_path):
    record(tmp_path, [1, 2])
    plan = SkipManager.engine_plan("rollout", [1, 2], validation=VALIDATION,
                                   config=training_config(tmp_path, steps=[1, 2]))
    assert plan.start is True and plan.generate == () and VALIDATION in plan.reason


def test_auto_starts_the_engine_when_the_steps_are_unknown_or_the_role_is_off(tmp_path):
    record(tmp_path, [1])
    assert SkipManager.engine_plan("rollout", None, config=training_config(tmp_path, steps=[1])).start
    plan = SkipManager.engine_plan("rollout", [1], config=training_config(tmp_path, steps=[1], enable=False))
    assert plan.start and "skip.rollout is off" in plan.reason


def test_start_always_starts_the_engine(tmp_path):
    record(tmp_path, [1])
    plan = SkipManager.engine_plan("rollout", [1], config=training_config(tmp_path, steps=[1], engines="start"))
    assert plan.start is True and plan.option is Engines.START


def test_skip_refuses_at_start_up_naming_the_steps_and_the_validation(tmp_path):
    record(tmp_path, [1, 2])
    config = training_config(tmp_path, steps=[1, 2, 3, 4, 5, 9], engines="skip")
    assert SkipManager.engine_plan("rollout", [1, 2], config=config).start is False
    with pytest.raises(SkipConfigError) as err:
        SkipManager.engine_plan("rollout", [1, 2, 3, 4, 5, 9], config=config)
    message = str(err.value)
    assert "skip.rollout.engines = skip" in message and "3-5, 9" in message and "engines=auto" in message
    with pytest.raises(SkipConfigError) as err:
        SkipManager.engine_plan("rollout", [1, 2], validation=VALIDATION, config=config)
    assert VALIDATION in str(err.value)


def test_a_step_outside_the_role_steps_needs_the_engine(tmp_path):
    record(tmp_path, [1, 2])
    plan = SkipManager.engine_plan("rollout", [1, 2], config=training_config(tmp_path, steps=[1]))
    assert plan.start and plan.generate == (2,)


@pytest.mark.parametrize(("action", "start"), [("replay", False), ("repeat", False), ("match", False),
                                               ("record", True)])
def test_engine_plan_per_action_over_a_complete_cache(tmp_path, action, start):
    record(tmp_path, [1, 2])
    plan = SkipManager.engine_plan("rollout", [1, 2], config=training_config(tmp_path, steps=[1, 2], action=action))
    assert plan.start is start


def test_engine_plan_of_the_current_run_uses_its_roles(tmp_path):
    record(tmp_path, [1])
    SkipManager.init(training_config(tmp_path, steps=[1]))
    run_id = SkipManager.run_id
    assert SkipManager.engine_plan("rollout", [1]).start is False
    assert SkipManager.engine_plan("rollout", [1, 2]).start is True
    assert SkipManager.run_id == run_id


def test_not_started_error_names_the_step_and_the_option(tmp_path):
    record(tmp_path, [1])
    plan = SkipManager.engine_plan("rollout", [1], config=training_config(tmp_path, steps=[1]))
    err = plan.not_started(7, "a cache miss")
    assert isinstance(err, EngineNotStartedError)
    message = str(err)
    assert "step 7" in message and "a cache miss" in message and "skip.rollout.engines=start" in message
    assert "outside the training steps" in str(plan.not_started(None, "validation"))


def test_describe_steps_compresses_and_bounds_its_output():
    assert describe_steps([5, 1, 2, 3]) == "1-3, 5"
    long = describe_steps(range(0, 200, 2))
    assert long.endswith("(88 more)") and long.count(",") == 12
