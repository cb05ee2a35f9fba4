"""The names verl's own skip roles have beside the role protocol, which verl's tests and trainer call.

A mixin of :class:`~stepskip.roles.cached.CachedRole`: each name answers from the role's layout, reader
and listing, so code written against verl's role objects works on stepskip's unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from stepskip._layout import Layout, is_url
from stepskip._policies import SkipAction
from stepskip._reading.classify import EntryStatus
from stepskip._resolve import load_candidates

if TYPE_CHECKING:
    from stepskip._reading.reader import EntryReader
    from stepskip._reading.steps import StepEntries

__all__ = ["VerlNames"]


class VerlNames:
    """verl's path helpers, step look-ups and run-shape attributes, over a role's own (mixed into
    :class:`~stepskip.roles.cached.CachedRole`, whose ``layout``, ``reader``, ``entries`` and
    ``listed_steps`` they use)."""

    if TYPE_CHECKING:  # what the role provides
        reader: EntryReader
        entries: StepEntries

        @property
        def layout(self) -> Layout: ...

        @property
        def project_dump_dir(self) -> str: ...

        def step_dump_dir(self, step: int) -> str: ...

        def available_steps(self) -> list[int]: ...

        def listed_steps(self) -> list[int]: ...

    def _path(self, path: str) -> Any:
        return path if is_url(path) else Path(path)

    def _get_project_dump_dir(self) -> Any:
        return self._path(self.project_dump_dir)

    def _get_step_dump_dir(self, step: int) -> Any:
        return self._path(self.step_dump_dir(step))

    def _check_valid_step_path(self, path: Any) -> bool:
        return self.reader.probe(str(path)).state is EntryStatus.PRESENT

    def _get_available_steps(self) -> list[int]:
        return self.available_steps()

    def _find_latest_step(self, step: int) -> int:
        for candidate in load_candidates(SkipAction.REPEAT, step, self.listed_steps()):
            if self.entries.present(candidate):
                return candidate
        return -1

    @property
    def exp_name(self) -> str:
        return self.layout.experiment_name

    @property
    def project_name(self) -> str:
        return self.layout.project_name

    @property
    def gbs(self) -> int:
        return self.layout.gbs

    @property
    def n(self) -> int:
        return self.layout.n

    @property
    def prompt_len(self) -> int:
        return self.layout.prompt_len

    @property
    def response_len(self) -> int:
        return self.layout.response_len

    prompt_length = prompt_len
    response_length = response_len
