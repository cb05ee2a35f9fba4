"""What one cached step of a role consists of: one flat entry, or a V1 step's inner entries.

A role asks its steps collaborator for the probes of a step and whether it is complete; it never
needs to know which kind it holds. A V1 step (``{step}/{inner}/``, or the recording its manifest
names, ``{step}/rec-{token}/{inner}/``: :mod:`stepskip._manifest`) is complete only when every inner
entry is present and one run wrote them all.
"""

from __future__ import annotations

from typing import Any, Protocol

from stepskip._reading.classify import EntryStatus, Look, root_state
from stepskip._reading.reader import EntryReader
from stepskip._storage import Tree
from stepskip._layout import Layout
from stepskip._manifest import StepRoot, may_need_clean_up, remove_stale_recordings, resolve_step

__all__ = ["FlatSteps", "StepEntries", "V1Steps", "complete"]


class StepEntries(Protocol):
    """The entries one step of a role consists of."""

    def probed(self, step: int) -> list[tuple[str, Look]]:
        """``(path, probe)`` of every entry of ``step`` (classified by the role's reader)."""
        ...

    def present(self, step: int) -> bool:
        """True when ``step`` is complete and usable-looking (no data read)."""
        ...

    def clean_up(self, tree: Tree | None) -> None:
        """Remove what interrupted writers left inside the steps, once stale (the role removed the
        leftovers beside them); ``tree``: as :meth:`CachedRole.clean_up`'s."""
        ...


class _StepOwner(Protocol):
    reader: EntryReader

    def step_dump_dir(self, step: int) -> str: ...


class FlatSteps:
    """One entry per step, at the step's directory."""

    def __init__(self, owner: _StepOwner) -> None:
        self.owner = owner

    def probed(self, step: int) -> list[tuple[str, Look]]:
        path = self.owner.step_dump_dir(step)
        return [(path, self.owner.reader.probe(path))]

    def present(self, step: int) -> bool:
        return all(p.state is EntryStatus.PRESENT for _, p in self.probed(step))

    def clean_up(self, tree: Tree | None) -> None:
        """Nothing is built inside a flat entry's directory but by the store's own write."""


class _V1Owner(_StepOwner, Protocol):
    parameter_sync_step: int

    @property
    def layout(self) -> Layout: ...

    @property
    def store(self) -> Any: ...

    @property
    def project_dump_dir(self) -> str: ...

    def listed_steps(self) -> list[int]: ...


class V1Steps:
    """``parameter_sync_step`` inner entries per step, in place or in the recording the manifest names."""

    def __init__(self, owner: _V1Owner) -> None:
        self.owner = owner

    def root(self, step: int) -> StepRoot:
        """Where ``step``'s inner entries are, its manifest read once (see :mod:`stepskip._manifest`)."""
        return resolve_step(self.owner.store, self.owner.step_dump_dir(step))

    def probed(self, step: int, where: StepRoot | None = None) -> list[tuple[str, Look]]:
        """``(path, probe)`` of every inner entry of ``step``, all below one resolved root (``where``, else
        resolved here); one damaged, unsupported or unavailable (the store did not answer) probe of the
        manifest when it cannot be used."""
        owner = self.owner
        where = self.root(step) if where is None else where
        if root_state(where) is not EntryStatus.PRESENT:
            return [(owner.layout.manifest_path(step), Look(root_state(where), reason=where.reason))]
        inner = [Layout.inner_path(where.root, i) for i in range(owner.parameter_sync_step)]
        out = [(path, owner.reader.probe(path)) for path in inner]
        manifest = where.manifest
        if manifest is not None:  # written after every inner entry it counts: one of them missing is damage
            present = [i for i, (_, p) in enumerate(out) if p.state is not EntryStatus.MISSING]
            lacking = [i for i in manifest.lacking(present) if i < len(out)]  # of the inner entries this run reads
            if lacking:
                return [(owner.layout.manifest_path(step), Look(EntryStatus.DAMAGED,
                                                                reason=manifest.lacking_reason(lacking)))]
        return out

    def present(self, step: int) -> bool:
        return complete(self.probed(step))

    def clean_up(self, tree: Tree | None) -> None:
        """Inner entries are built inside their step directory: the recordings no manifest names and the
        inner writes' temporaries go there, once stale."""
        owner, store = self.owner, self.owner.store
        if tree is None:
            steps = owner.listed_steps()
        else:  # the run directory's listing: only the steps it leaves room for a leftover in are looked at
            steps = sorted(s for s in map(Layout.parse_step, tree.dirs(owner.project_dump_dir)) if s is not None)
        for step in steps:
            step_dir = owner.step_dump_dir(step)
            if tree is not None and not may_need_clean_up(store, tree, step_dir):
                continue
            where = self.root(step)  # the manifest read once for both clean-ups
            remove_stale_recordings(store, step_dir, where=where, tree=tree)
            # an inner write's temporaries lie beside its entry: in the recording a manifest names, else in place
            store.remove_leftovers(where.root if where.manifest is not None else step_dir, tree=tree)


def complete(probed: list[tuple[str, Look]]) -> bool:
    """True when every inner entry probed is present and one run wrote them all."""
    if any(p.state is not EntryStatus.PRESENT for _, p in probed):
        return False
    runs = {(p.meta or {}).get("run_id") for _, p in probed}
    return len(runs) == 1  # a step half-written by a crashed run is never completed by another
