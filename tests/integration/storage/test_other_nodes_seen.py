"""What another node writes or deletes on a shared S3 cache is seen by this process's next look.

s3fs keeps every listing it takes for as long as the process runs and answers later ``ls`` and ``info``
calls from it; a run that listed its run directory once would never see a step recorded by another node
after that. Real S3 (moto in server mode); the other node is a second filesystem object, as another
process would hold.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from sharing_runs import Rollout, prompts, role_dir, run_flat, training_config

from stepskip import SkipManager
from stepskip._storage.fsspec import FsspecBackend

pytestmark = pytest.mark.heavy


@pytest.fixture
def shared(s3_server: str) -> tuple[str, dict[str, Any]]:
    import s3fs

    # listings cached as s3fs does by default: nothing here turns its cache off
    options = {"client_kwargs": {"endpoint_url": s3_server}, "skip_instance_cache": True}
    bucket = f"stepskip-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem(**options).mkdir(bucket)
    return f"s3://{bucket}", options


def other_node(options: dict[str, Any]) -> Any:
    import s3fs

    return s3fs.S3FileSystem(**options)


def copy_step(fs: Any, source_run: str, target_run: str, step: int) -> None:
    """Copy a recorded step as a writer publishes one: its data objects first, its ``meta.json`` last."""
    source, target = f"{source_run}/{step}", f"{target_run}/{step}"
    keys = sorted(fs.find(source), key=lambda k: k.endswith("/meta.json"))
    for key in keys:
        fs.pipe_file(target + key[len(fs._strip_protocol(source)):], fs.cat_file(key))


def test_the_backend_sees_what_another_node_wrote_and_deleted_since_its_last_listing(shared):
    base, options = shared
    import s3fs

    backend = FsspecBackend(s3fs.S3FileSystem(**options), root=f"{base}/dump")
    node = other_node(options)
    node.pipe_file(f"{base}/dump/run/1/meta.json", b"{}")
    assert backend.names(f"{base}/dump/run") == ["1"]  # listed: s3fs now holds this listing
    assert backend.is_file(f"{base}/dump/run/1/meta.json")

    node.pipe_file(f"{base}/dump/run/2/meta.json", b"{}")
    node.rm_file(f"{base}/dump/run/1/meta.json")

    assert backend.names(f"{base}/dump/run") == ["2"]
    assert backend.is_file(f"{base}/dump/run/2/meta.json")
    assert not backend.is_file(f"{base}/dump/run/1/meta.json")
    assert backend.stat(f"{base}/dump/run/1") is None
    assert backend.stat(f"{base}/dump/run/2") is not None


def test_repeat_replays_the_newest_step_another_node_recorded_after_this_run_listed(shared):
    base, options = shared
    staging, dump_dir = f"{base}/staging", f"{base}/dump"
    run_flat(training_config(staging, options=options), [1, 3])  # what the other node records
    SkipManager.reset()
    node = other_node(options)
    copy_step(node, role_dir(staging), role_dir(dump_dir), 1)

    SkipManager.init(training_config(dump_dir, options=options, action="repeat"))
    worker = Rollout()
    SkipManager.set_step(2)
    first = worker.generate_sequences(prompts(2))  # lists the run directory: step 1 is all there is
    copy_step(node, role_dir(staging), role_dir(dump_dir), 3)  # meanwhile, the other node records step 3
    SkipManager.set_step(4)
    second = worker.generate_sequences(prompts(4))
    SkipManager.reset()

    assert worker.calls == []  # both replayed
    assert int(first["responses"][0, 0]) // 10 == 1
    assert int(second["responses"][0, 0]) // 10 == 3  # the newest step below 4, not the one listed before
