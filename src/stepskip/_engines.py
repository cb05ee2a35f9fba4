"""Whether a run needs its inference engine: the decision behind a role's ``engines`` option.

A trainer that replays every step it will take from the cache has no use for vLLM or SGLang: no
replica to start, no weights to sync. :meth:`stepskip.SkipManager.engine_plan` asks the role which
of the run's planned steps it would serve, and :func:`decide` turns that into an :class:`EnginePlan`
under the option (``auto``, ``start``, ``skip``). The integrations consult the plan before they
build an engine, and raise :meth:`EnginePlan.not_started` where a call would need the engine that
was not built.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from stepskip.errors import EngineNotStartedError, SkipConfigError
from stepskip._policies import Engines

__all__ = ["EnginePlan", "decide", "describe_steps"]

_SHOWN_RUNS = 12  # ranges named in a message; the rest are counted


def describe_steps(steps: Iterable[int]) -> str:
    """Steps as short ranges: ``1-3, 7, 9-12``; long lists end with how many steps were left out.

    Example:
        >>> describe_steps([1, 2, 3, 7, 9, 10])
        '1-3, 7, 9-10'
    """
    ordered = sorted(set(steps))
    runs: list[tuple[int, int]] = []
    for step in ordered:
        if runs and step == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], step)
        else:
            runs.append((step, step))
    shown = [str(a) if a == b else f"{a}-{b}" for a, b in runs[:_SHOWN_RUNS]]
    if len(runs) > _SHOWN_RUNS:
        rest = sum(b - a + 1 for a, b in runs[_SHOWN_RUNS:])
        shown.append(f"... ({rest} more)")
    return ", ".join(shown)


@dataclass(frozen=True)
class EnginePlan:
    """Whether a run starts its inference engine, and why.

    Args:
        role: the role whose cache was asked (``rollout``, ``rollout_tq``, ``trl_generate`` ...).
        option: the role's ``engines`` option.
        start: True when the engine must be started.
        generate: the planned steps the cache would not serve (each would need the engine).
        validation: what generates outside the planned steps (validation) and how to turn it off;
            None when nothing does.
        reason: one sentence for the log.

    Example:
        >>> plan = decide("rollout", Engines.AUTO, planned=[1, 2, 3], generate=[])
        >>> plan.start, plan.reason
        (False, 'skip.rollout.engines = auto: all 3 planned steps (1-3) are served from the cache')
    """

    role: str
    option: Engines
    start: bool
    generate: tuple[int, ...] = ()
    validation: str | None = None
    reason: str = ""

    def not_started(self, step: int | None, what: str) -> EngineNotStartedError:
        """The error for a call that needs generation although this plan started no engine.

        Args:
            step: the step of the call (None when it has none, e.g. validation).
            what: what the call is (``"a cache miss"``, ``"validation"`` ...).

        Returns:
            An :class:`EngineNotStartedError` naming the step, the call and the option to change.
        """
        at = f"step {step}" if step is not None else "a call outside the training steps"
        return EngineNotStartedError(
            f"{at} needs generation ({what}), but no inference engine was started for this run: "
            f"{self.reason}. Set skip.{self.role}.engines=start to start the engine, or make sure the cache "
            f"serves {'that step' if step is not None else 'every call'} (record it first with action: cache)"
        )


def decide(role: str, option: Engines, *, planned: Sequence[int] | None, generate: Sequence[int],
           enabled: bool = True, validation: str | None = None) -> EnginePlan:
    """The plan under ``option``, from what the role's cache would serve.

    Args:
        role: the role's name.
        option: its ``engines`` option.
        planned: the steps the run will take, or None when the trainer cannot tell them in advance.
        generate: the planned steps the cache would not serve.
        enabled: whether the role is on at all (off: every step generates).
        validation: what generates outside the planned steps and how to turn it off, or None.

    Returns:
        The plan.

    Raises:
        SkipConfigError: ``option`` is ``skip`` and the run would need the engine (the message names
            the steps, or the validation, and how to change that).
    """
    key = f"skip.{role}.engines = {option.value}"
    generate = tuple(sorted(set(generate)))
    if option is Engines.START:
        return EnginePlan(role, option, True, generate, validation, f"{key}: the engine always starts")
    needs = []
    if not enabled:
        needs.append(f"skip.{role} is off, so every step generates")
    elif planned is None:
        needs.append("the run's steps are not known before it starts")
    elif not planned:
        needs.append("the run plans no training step")
    elif generate:
        needs.append(f"{len(generate)} of the {len(planned)} planned steps are not served from the cache: "
                     f"{describe_steps(generate)}")
    if validation is not None:
        needs.append(validation)
    if not needs:
        assert planned is not None
        return EnginePlan(role, option, False, (), None,
                          f"{key}: all {len(planned)} planned steps ({describe_steps(planned)}) are served "
                          "from the cache")
    if option is Engines.SKIP:
        fixes = []
        if enabled and generate:
            fixes.append(f"record those steps first (action: cache, skip.{role}.engines=start)")
        if validation is not None:
            fixes.append("turn validation off as said")
        fixes.append(f"set skip.{role}.engines=auto to start the engine when the run needs it")
        raise SkipConfigError(f"{key} starts no inference engine, but this run would need one: "
                              f"{'; '.join(needs)}. To run it: {', or '.join(fixes)}")
    return EnginePlan(role, option, True, generate, validation,
                      f"{key}: the engine starts because {'; '.join(needs)}")
