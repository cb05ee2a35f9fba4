"""Read back what a run sent to its experiment trackers, from the files the real backends wrote.

TensorBoard: its own ``EventAccumulator`` over the event files. W&B offline: the run's transaction log
(``run-*.wandb``: blocks of length-prefixed records, each a ``wandb_internal_pb2.Record``, read here
because wandb no longer ships a Python reader) and its table files. MLflow: ``MlflowClient`` on the
file store. Each function returns plain data: ``{tag: [(step, value), ...]}`` and row dicts.

A test module that imports this one is skipped, naming the fix, where a backend is not installed
(``make test`` installs them in both environments: the ``trackers`` extra and verl's).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest

for _backend in ("tensorboard", "wandb", "mlflow"):
    pytest.importorskip(_backend, reason=f"{_backend} is not installed: pip install -e '.[trackers]' (make test does)")

# ---------------------------------------------------------------------- TensorBoard


def _accumulator(logdir: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def tensorboard_scalars(logdir: Path, prefix: str = "") -> dict[str, list[tuple[int, float]]]:
    """Every scalar series under ``logdir`` whose tag starts with ``prefix``."""
    acc = _accumulator(logdir)
    out: dict[str, list[tuple[int, float]]] = {}
    for tag in acc.Tags().get("scalars", []):
        if tag.startswith(prefix):
            out[tag] = [(event.step, event.value) for event in acc.Scalars(tag)]
    return out


def tensorboard_texts(logdir: Path) -> dict[str, list[tuple[int, str]]]:
    """Every text summary under ``logdir``: ``{tag: [(step, text), ...]}`` (tags without ``/text_summary``)."""
    acc = _accumulator(logdir)
    out: dict[str, list[tuple[int, str]]] = {}
    for tag in acc.Tags().get("tensors", []):
        if tag.endswith("/text_summary"):
            out[tag[:-len("/text_summary")]] = [
                (event.step, b"".join(event.tensor_proto.string_val).decode()) for event in acc.Tensors(tag)]
    return out


# ---------------------------------------------------------------------- W&B offline

_HEADER = 7  # ":W&B", a 2-byte magic, a 1-byte version
_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _wandb_payloads(path: Path) -> list[bytes]:
    """The records of a W&B transaction log: 32 KiB blocks of chunks, each a 7-byte header (checksum,
    little-endian length, type) and its bytes; a record split over blocks comes in first/middle/last chunks."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    out: list[bytes] = []
    parts: list[bytes] = []
    pos = _HEADER
    while pos + 7 <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < 7:  # the block's tail is padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        if kind == _FULL:
            out.append(chunk)
        elif kind == _FIRST:
            parts = [chunk]
        elif kind == _MIDDLE:
            parts.append(chunk)
        elif kind == _LAST:
            out.append(b"".join(parts + [chunk]))
            parts = []
    return out


def wandb_run_dir(wandb_dir: Path) -> Path:
    """The one offline run under ``wandb_dir`` (``WANDB_DIR``)."""
    runs = sorted((wandb_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, f"expected one offline W&B run under {wandb_dir}, found {runs}"
    return runs[0]


def wandb_history(run_dir: Path) -> list[dict[str, Any]]:
    """The run's history rows, in order: ``{key: value}`` with ``_step``."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("run-*.wandb")
    rows = []
    for payload in _wandb_payloads(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            row: dict[str, Any] = {}
            for item in record.history.item:
                keys = [item.key] if item.key else list(item.nested_key)  # a table's fields come one by one
                node = row
                for key in keys[:-1]:
                    node = node.setdefault(key, {})
                node[keys[-1]] = json.loads(item.value_json)
            rows.append(row)
    return rows


def wandb_table(run_dir: Path, reference: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of a table logged to the run (``reference``: the history value that points at it)."""
    assert reference.get("_type") == "table-file", reference
    content = json.loads((run_dir / "files" / reference["path"]).read_text())
    return [dict(zip(content["columns"], row)) for row in content["data"]]


# ---------------------------------------------------------------------- MLflow


def mlflow_run(uri: str, experiment: str) -> tuple[Any, str]:
    """``(client, run id)`` of the one run of ``experiment`` in the store at ``uri``."""
    from mlflow.tracking import MlflowClient

    # MLflow 3 refuses file stores unless asked: the runs under test wrote one, and so reading it is asked for
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no MLflow experiment {experiment!r} at {uri}"
    runs = client.search_runs([found.experiment_id])
    assert len(runs) == 1, f"expected one MLflow run, found {len(runs)}"
    return client, runs[0].info.run_id


def mlflow_metric(client: Any, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def mlflow_tables(client: Any, run_id: str, folder: str, into: Path) -> dict[str, list[dict[str, Any]]]:
    """Every table artifact under ``folder`` of the run: ``{file name: rows}``."""
    out = {}
    for artifact in client.list_artifacts(run_id, folder):
        local = Path(client.download_artifacts(run_id, artifact.path, str(into)))
        content = json.loads(local.read_text())
        out[Path(artifact.path).name] = [dict(zip(content["columns"], row)) for row in content["data"]]
    return out
