"""The CLI on every store: the storage suite's backends (a local directory, ``memory://``, a real moto S3
server) with a cache on each, written by stepskip itself on that store plus runs uploaded from a local cache."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
UNIT_CLI = HERE.parents[1] / "unit" / "cli"
if str(UNIT_CLI) not in sys.path:  # the CLI tests' cache builders and in-process runner
    sys.path.insert(0, str(UNIT_CLI))


def _storage_fixtures() -> Any:
    spec = importlib.util.spec_from_file_location("storage_backends", HERE.parent / "storage" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


_storage = _storage_fixtures()
s3_server = _storage.s3_server  # the storage suite's fixtures, as they are: one moto server per session
backend = _storage.backend

from cli_caches import FIXTURE_RUN, V1_RUN, Loop, base_config, build_cache, prompts_for  # noqa: E402
from store_runs import RECORDED_STEPS  # noqa: E402

from stepskip import SkipManager  # noqa: E402


@dataclass
class StoreCache:
    """A cache on one backend.

    Args:
        name: ``local``, ``local-url`` (``local://...``), ``memory`` or ``s3``.
        dump_dir: its dump dir (a path or a URL).
        storage_options: its fsspec options.
        options: the same as ``--storage-option`` arguments.
    """

    name: str
    dump_dir: str
    storage_options: dict[str, Any]
    options: list[str]

    def fs(self) -> Any:
        import fsspec

        return fsspec.core.url_to_fs(self.dump_dir, **self.storage_options)[0]

    def path(self, rel: str) -> str:
        return f"{self.dump_dir}/{rel}"

    def local(self, rel: str) -> Path:
        return Path(self.dump_dir.removeprefix("local://")) / rel

    def rel(self, path: str) -> str:
        """``path`` (as a command prints it) below the dump dir."""
        root = self.dump_dir.removeprefix("local://")
        return path[len(root) + 1:] if path.startswith(root + "/") else path

    @property
    def is_local(self) -> bool:
        return self.name in ("local", "local-url")

    def put(self, rel: str, data: bytes) -> None:
        if self.is_local:
            target = self.local(rel)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        else:
            self.fs().pipe_file(self.path(rel), data)

    def get(self, rel: str) -> bytes:
        if self.is_local:
            return self.local(rel).read_bytes()
        return self.fs().cat_file(self.path(rel))

    def exists(self, rel: str) -> bool:
        if self.is_local:
            return self.local(rel).exists()
        return bool(self.fs().exists(self.path(rel)))

    def names(self, rel: str) -> list[str]:
        if self.is_local:
            return sorted(p.name for p in self.local(rel).iterdir())
        fs = self.fs()
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(self.path(rel), detail=False))

    def upload(self, local: Path, rel: str) -> None:
        files = {f"{rel}/{path.relative_to(local)}": path.read_bytes()
                 for path in sorted(local.rglob("*")) if path.is_file()}
        if self.is_local:
            for name, data in files.items():
                self.put(name, data)
            return
        # one filesystem (one S3 client) for the whole upload, where put() builds a fresh one per file
        # (about a third of a second each on moto); the same objects, written by the same fsspec call
        self.fs().pipe({self.path(name): data for name, data in files.items()})


@pytest.fixture(scope="session")
def local_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The CLI tests' pristine cache (V1 run, verl's own fixture ...), built once, uploaded per backend."""
    return build_cache(tmp_path_factory.mktemp("cli-stores") / "dump")


def record_on(dump_dir: str, storage_options: dict[str, Any]) -> None:
    """Record rollout steps 1-4 and the stage role reward at steps 1-2 through SkipManager on the store itself."""
    config = base_config(Path("."), "exp", "proj")
    common = {"enable": True, "dump_dir": dump_dir, "storage_options": storage_options, "async_dump": False}
    config["skip"]["rollout"] = {**common, "steps": RECORDED_STEPS}
    config["skip"]["reward"] = {**common, "kind": "stage", "steps": [1, 2]}
    SkipManager.init(config)
    loop = Loop()
    for step in RECORDED_STEPS:
        SkipManager.set_step(step)
        loop.compute_reward(loop.generate_sequences(prompts_for(step)))
    SkipManager.close()
    SkipManager.reset()


@pytest.fixture
def store_cache(backend: Any, local_runs: Path) -> StoreCache:
    """A cache on the backend: rollout + reward recorded there, the V1 run and verl's fixture uploaded."""
    options = [f"{key}={value}" for key, value in _flat(backend.storage_options)]
    cache = StoreCache(backend.name, backend.dump_dir, dict(backend.storage_options), options)
    record_on(backend.dump_dir, backend.storage_options)
    for run in (V1_RUN, FIXTURE_RUN):
        if cache.is_local:
            shutil.copytree(local_runs / run, cache.local(run))
        else:
            cache.upload(local_runs / run, run)
    return cache


def _flat(options: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    import json

    out: list[tuple[str, Any]] = []
    for key, value in options.items():
        if isinstance(value, dict):
            out += _flat(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value if isinstance(value, str) else json.dumps(value)))
    return out
