"""The identity of a run: what names its cache directory and what its entries are checked against.

A cache directory encodes the run's shape (``GBS{gbs}_N{n}_in{prompt_len}_out{response_len}``)
under ``{experiment}_{project}``; every entry records a fingerprint — the values that decide what
a rollout produces. verl's config keys are the default mapping (:meth:`RunIdentity.from_config`);
any other trainer passes an explicit ``RunIdentity`` to ``SkipManager.init(config, identity=...)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from stepskip.config import select, to_plain
from stepskip._content import CONTENT_PREFIX, ContentSources, describe_change
from stepskip.errors import SkipConfigError

__all__ = ["RunIdentity", "VERL_FINGERPRINT_KEYS", "fingerprint_of", "fingerprint_diff"]

#: verl's config keys that determine what a rollout produces; never a run id, time or host.
VERL_FINGERPRINT_KEYS = (
    "actor_rollout_ref.model.path",
    "actor_rollout_ref.rollout.name",
    "actor_rollout_ref.rollout.temperature",
    "actor_rollout_ref.rollout.top_p",
    "actor_rollout_ref.rollout.top_k",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.rollout.prompt_length",
    "actor_rollout_ref.rollout.response_length",
    "data.train_files",
    "data.max_prompt_length",
    "data.max_response_length",
    "data.seed",
)


def _jsonable(value: Any) -> Any:
    value = to_plain(value)
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


def fingerprint_of(config: Any, keys: Iterable[str]) -> dict[str, Any]:
    """The values of ``keys`` that are set in ``config``, as JSON-ready values.

    Example:
        >>> fingerprint_of({"data": {"seed": 1}, "trainer": {"run_id": "x"}}, ["data.seed", "data.other"])
        {'data.seed': 1}
    """
    out: dict[str, Any] = {}
    for key in keys:
        value = select(config, key)
        if value is not None:
            out[key] = _jsonable(value)
    return out


def fingerprint_diff(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """``key: recorded X, now Y`` for every key whose value differs (a key absent on one side counts),
    and what changed in words for content digests (``content.*`` keys, compared only when both sides
    hold them: entries recorded before stepskip digested content, or without ``fingerprint_weights``,
    are not mismatches for lacking them).

    Example:
        >>> fingerprint_diff({"data.seed": 1}, {"data.seed": 2})
        ['data.seed: recorded 1, now 2']
        >>> fingerprint_diff({"data.seed": 1}, {"data.seed": 1, "content.chat_template": "ab12"})
        []
    """
    lines = []
    for key in sorted(set(recorded) | set(current)):
        old, new = recorded.get(key), current.get(key)
        if old == new:
            continue
        if key.startswith(CONTENT_PREFIX):
            if key in recorded and key in current:
                lines.extend(describe_change(key, old, new))
        else:
            lines.append(f"{key}: recorded {old!r}, now {new!r}")
    return lines


def _shape_int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0  # an unset or odd value names the directory with 0, as stepskip always has


@dataclass(frozen=True)
class RunIdentity:
    """Who a run is, as far as its cache is concerned.

    Args:
        experiment_name: first half of the project directory ``{experiment}_{project}``.
        project_name: second half of it.
        gbs: generation batch size (prompts per step), in the run directory name.
        n: samples per prompt, in the run directory name.
        prompt_len: maximum prompt length, in the run directory name.
        response_len: maximum response length, in the run directory name.
        fingerprint: values that decide what a rollout produces (model, sampling, data); an entry
            recorded under other values is reported by the roles' ``on_mismatch`` policy.
        world_size: processes that each cache their own share of a call (SPMD trainers such as
            TRL's); more than one adds ``_W{world_size}`` to the run directory name, so that a cache
            recorded by 2 ranks is a miss, not another run's data, for a run of 1 (verl's runs: 1).
        content: the tokenizer, model, data files and code whose content digests join the
            fingerprint (a :class:`~stepskip._content.ContentSources` or a mapping of its fields);
            None: no content digests.

    Example:
        >>> identity = RunIdentity("exp", "proj", gbs=8, n=4, fingerprint={"model": "tiny", "temperature": 1.0})
        >>> identity.run_name
        'GBS8_N4_in0_out0'
        >>> RunIdentity("exp", "proj", gbs=8, n=4, world_size=2).run_name
        'GBS8_N4_in0_out0_W2'
    """

    experiment_name: str = "default_experiment_name"
    project_name: str = "default_project_name"
    gbs: int = 0
    n: int = 0
    prompt_len: int = 0
    response_len: int = 0
    fingerprint: Mapping[str, Any] = field(default_factory=dict)
    world_size: int = 1
    #: Not part of equality: two identities naming the same directory and values are the same run's,
    #: whatever content they will digest.
    content: ContentSources | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for key in ("experiment_name", "project_name"):
            if not isinstance(getattr(self, key), str):
                raise SkipConfigError(f"identity.{key} = {getattr(self, key)!r} is not valid; expected a str")
        for key in ("gbs", "n", "prompt_len", "response_len", "world_size"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int):
                raise SkipConfigError(f"identity.{key} = {value!r} is not valid; expected an int")
        if self.world_size < 1:
            raise SkipConfigError(f"identity.world_size = {self.world_size!r} is not valid; expected an int >= 1")
        if not isinstance(self.fingerprint, Mapping) or not all(isinstance(k, str) for k in self.fingerprint):
            raise SkipConfigError(f"identity.fingerprint = {self.fingerprint!r} is not valid; expected a mapping "
                                  "of names to JSON-like values")
        object.__setattr__(self, "fingerprint", {k: _jsonable(v) for k, v in self.fingerprint.items()})
        object.__setattr__(self, "content", ContentSources.coerce(self.content))

    @property
    def run_name(self) -> str:
        """The run directory's name, ``GBS{gbs}_N{n}_in{prompt_len}_out{response_len}`` (then
        ``_W{world_size}`` when more than one process shares the run)."""
        name = f"GBS{self.gbs}_N{self.n}_in{self.prompt_len}_out{self.response_len}"
        return name if self.world_size == 1 else f"{name}_W{self.world_size}"

    @classmethod
    def from_config(cls, config: Any) -> RunIdentity:
        """verl's mapping: ``trainer.{experiment,project}_name``, ``data.gen_batch_size``
        (else ``data.train_batch_size``), ``actor_rollout_ref.rollout.n``,
        ``data.max_{prompt,response}_length`` and the fingerprint keys of :data:`VERL_FINGERPRINT_KEYS`;
        content digests of the model, tokenizer and data files those keys name, and of the code
        (:meth:`~stepskip._content.ContentSources.from_verl_config`)."""
        gbs = select(config, "data.gen_batch_size")
        if gbs is None:
            gbs = select(config, "data.train_batch_size", 0)
        return cls(
            experiment_name=str(select(config, "trainer.experiment_name", "default_experiment_name")),
            project_name=str(select(config, "trainer.project_name", "default_project_name")),
            gbs=_shape_int(gbs),
            n=_shape_int(select(config, "actor_rollout_ref.rollout.n", 0)),
            prompt_len=_shape_int(select(config, "data.max_prompt_length", 0)),
            response_len=_shape_int(select(config, "data.max_response_length", 0)),
            fingerprint=fingerprint_of(config, VERL_FINGERPRINT_KEYS),
            content=ContentSources.from_verl_config(config),
        )

    def with_fingerprint(self, extra: Mapping[str, Any]) -> RunIdentity:
        """The same identity with ``extra`` values added to the fingerprint."""
        if not extra:
            return self
        return replace(self, fingerprint={**self.fingerprint, **extra})
