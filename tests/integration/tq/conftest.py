"""A real TransferQueue (``transferqueue`` 0.1.11 on a local Ray cluster) for the tests in this folder.

Ray + TransferQueue take ~10 s and ~1.5 GiB to start, so they start once for this folder's modules
(shut down after the last test here that uses them, so nothing keeps running while the rest of the
suite does) and every test starts and ends with an empty queue (``real_tq``).

Facts this relies on (measured on this machine):
- ``tq.init()`` waits forever on a 2-CPU Ray cluster with its default two storage units (controller
  and each unit reserve one CPU): we start exactly one storage unit, which fits ``num_cpus=2``.
- Ray 2.60 turns token auth on by default and writes ``~/.ray/auth_token``: ``RAY_AUTH_MODE=disabled``,
  and ``RAY_TMPDIR`` points at a temporary directory (short, under /tmp: Ray's socket paths must
  stay under ~107 characters) that is removed afterwards.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest

TQ_INIT_TIMEOUT_S = 300.0



def _import_error() -> str | None:
    """Why ``ray`` / ``transfer_queue`` cannot be imported here, or None when both can."""
    try:
        import ray  # noqa: F401
        import transfer_queue  # noqa: F401
    except ImportError as err:
        return f"{type(err).__name__}: {err}"
    return None


def _clear_everything(tq) -> None:
    for partition, listing in tq.kv_list().items():
        if listing:
            tq.kv_clear(keys=list(listing), partition_id=partition)


class _Cluster:
    """The one Ray + TransferQueue of this folder while it runs; ``stop`` is idempotent."""

    def __init__(self) -> None:
        self.tq: Any = None
        self.ray_tmp: str | None = None
        self.env: pytest.MonkeyPatch | None = None

    def start(self) -> Any:
        if self.tq is not None:
            return self.tq
        ray_tmp = tempfile.mkdtemp(prefix="ssray", dir="/tmp" if os.path.isdir("/tmp") else None)
        env = pytest.MonkeyPatch()
        env.setenv("RAY_AUTH_MODE", "disabled")
        env.setenv("RAY_TMPDIR", ray_tmp)
        env.delenv("RAY_ADDRESS", raising=False)  # never attach to a cluster outside this test run
        import ray
        import transfer_queue as tq
        from omegaconf import OmegaConf

        if ray.is_initialized():
            env.undo()
            shutil.rmtree(ray_tmp, ignore_errors=True)
            pytest.skip("a Ray cluster is already initialised in this process; these tests start their own")
        self.ray_tmp, self.env = ray_tmp, env
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 logging_level="WARNING")
        try:
            # tq.init blocks forever when Ray lacks the CPUs its actors reserve: bound the wait.
            errors: list[BaseException] = []

            def _init() -> None:
                try:
                    tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
                except BaseException as err:  # handed to the main thread
                    errors.append(err)

            thread = threading.Thread(target=_init, name="tq-init", daemon=True)
            thread.start()
            thread.join(TQ_INIT_TIMEOUT_S)
            if thread.is_alive():
                raise RuntimeError(
                    f"transfer_queue.init() did not return within {TQ_INIT_TIMEOUT_S:.0f}s on a Ray cluster with "
                    f"{ray.cluster_resources().get('CPU')} CPUs (its controller and storage unit reserve one CPU "
                    f"each); available now: {ray.available_resources()}")
            if errors:
                raise errors[0]
        except BaseException:
            self.tq = tq  # so that stop() closes what did start
            self.stop()
            raise
        self.tq = tq
        return tq

    def stop(self) -> None:
        if self.tq is None:
            return
        import ray

        tq, self.tq = self.tq, None
        try:
            tq.close()
        finally:
            ray.shutdown()
            if self.env is not None:
                self.env.undo()
            shutil.rmtree(self.ray_tmp or "", ignore_errors=True)
            self.env = self.ray_tmp = None


_CLUSTER = _Cluster()
_HERE = Path(__file__).resolve().parent


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """After this folder's last test (the next one is elsewhere, or none), stop the folder's cluster."""
    try:
        return (yield)
    finally:
        if nextitem is None or Path(nextitem.path).resolve().parent != _HERE:
            _CLUSTER.stop()


@pytest.fixture(scope="session")
def _tq_cluster():
    """The folder's cluster; stopped at the end of the session at the latest (an interrupted run)."""
    try:
        yield _CLUSTER
    finally:
        _CLUSTER.stop()


@pytest.fixture(scope="module")
def tq_module(_tq_cluster):
    """Ray (2 CPUs, no dashboard, no auth) and TransferQueue with one storage unit; yields ``transfer_queue``.

    Started by the first module of this folder that needs it and kept until this folder's last test is
    done (the modules here run one after the other; ``pytest_runtest_teardown`` stops it): the next
    module reuses it, every test still starts and ends with an empty queue (``real_tq``), and nothing
    keeps running while the rest of the suite does.
    """
    error = _import_error()
    if error is not None:
        pytest.skip(f"transfer_queue (or ray) is not importable ({error}): install `transferqueue` and "
                    "`ray[default]` to run the real-TransferQueue integration tests")
    return _tq_cluster.start()


@pytest.fixture
def real_tq(tq_module):
    """The ``transfer_queue`` module, every partition empty before and after the test."""
    _clear_everything(tq_module)
    yield tq_module
    _clear_everything(tq_module)
