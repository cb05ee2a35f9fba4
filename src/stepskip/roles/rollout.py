"""Generation caching for the colocated trainer (``rollout``) and the fully async one (``async_rollout``)."""

from __future__ import annotations

from typing import Any, ClassVar

from stepskip._calls import call_prompts
from stepskip.config import AsyncRolloutSkipConfig, RolloutSkipConfig
from stepskip.roles.base import register_skip
from stepskip.roles.cached import ALL_ACTIONS, CachedRole

__all__ = ["RolloutSkip", "AsyncRolloutSkip", "parse_async_rollout_sample_step", "ALL_ACTIONS"]


@register_skip("rollout")
class RolloutSkip(CachedRole):
    """Caches the whole output of ``generate_sequences(self, prompts)`` per trainer step.

    The step comes from ``SkipManager.set_step``. Entries live in
    ``{dump_dir}/{experiment}_{project}/GBS{gbs}_N{n}_in{p}_out{r}/{step}/``. Subclass it for a
    role of your own: registered under another name, its entries go to ``{run}/{name}/{step}/``.

    Example:
        >>> from stepskip import SkipManager
        >>> SkipManager.init({"skip": {"rollout": {"enable": True, "steps": [1], "dump_dir": "/tmp/d"}}})
        >>> SkipManager.skip_instances["rollout"].step_dump_dir(1)
        '/tmp/d/default_experiment_name_default_project_name/GBS0_N0_in0_out0/1'
        >>> SkipManager.reset()
    """

    config_class: ClassVar[type[Any]] = RolloutSkipConfig


def parse_async_rollout_sample_step(sample_id: str) -> int:
    """The feed index in ``sample_{epoch}_{index}`` or ``uid_sample_{epoch}_{index}``.

    The index is the order in which the Rollouter fed the prompt, not the trainer's step.

    Raises:
        ValueError: any other shape.

    Example:
        >>> parse_async_rollout_sample_step("uid_sample_0_42")
        42
    """
    text = str(sample_id)
    if text.startswith("uid_"):
        text = text[4:]
    parts = text.split("_")
    if len(parts) != 3 or parts[0] != "sample" or not parts[1] or not (parts[2].isascii() and parts[2].isdigit()):
        raise ValueError(
            f"Invalid async rollout sample_id {sample_id!r}: expected sample_<epoch>_<feed_index> "
            "or uid_sample_<epoch>_<feed_index>"
        )
    return int(parts[2])


@register_skip("async_rollout")
class AsyncRolloutSkip(RolloutSkip):
    """Caches ``generate_sequences_single(self, prompts)`` per fed sample of the fully async rollouter.

    The step of each call is the feed index parsed from ``prompts.non_tensor_batch["uid"][0]``,
    so many samples can be in flight at once without sharing a step counter.
    """

    support_online_step = True
    support_actions = ALL_ACTIONS  # one sample per call: nothing to match row by row
    config_class: ClassVar[type[Any]] = AsyncRolloutSkipConfig

    def extract_step(self, *args: Any, **kwargs: Any) -> int:
        prompts = call_prompts(args, kwargs)
        non_tensor = getattr(prompts, "non_tensor_batch", None)
        if not isinstance(non_tensor, dict) or "uid" not in non_tensor or len(non_tensor["uid"]) == 0:
            raise ValueError(
                "async_rollout needs prompts (second positional argument or keyword `prompts`) whose "
                "non_tensor_batch['uid'] holds the sample id, e.g. 'uid_sample_0_42'"
            )
        return parse_async_rollout_sample_step(str(non_tensor["uid"][0]))
