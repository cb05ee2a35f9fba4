"""``stepskip.integrations.verl`` wraps ``verl.utils.tracking.Tracking.log``: when it is patched, what it adds,
and that nothing of it can stop a training step.

verl is absent from this environment: a stand-in package on disk (``verl/utils/tracking.py`` with a
``Tracking`` that fans ``log`` out to its ``logger`` dict, as verl 0.9.1's does) and recording backends
take its place. verl's real ``Tracking`` with real TensorBoard, W&B, MLflow and file backends is
exercised in tests/integration/verl_real/test_tracking.py, in verl's env.
"""

from __future__ import annotations

import importlib
import logging
import sys
import textwrap

import pytest
import torch

from stepskip import Batch, SkipManager
from stepskip.integrations import verl as integration
from stepskip.integrations.verl import _tracking
from stepskip._tracker import take_samples

TRACKING = textwrap.dedent('''
    class Tracking:
        def __init__(self, backends):
            self.logger = backends

        def log(self, data, step, backend=None):
            for name, instance in self.logger.items():
                if backend is None or name in backend:
                    instance.log(data=data, step=step)
''')


@pytest.fixture
def verl_on_disk(tmp_path, monkeypatch):
    """The stand-in package importable as ``verl``; import state restored afterwards."""
    root = tmp_path / "site"
    (root / "verl" / "utils").mkdir(parents=True)
    (root / "verl" / "__init__.py").write_text("")
    (root / "verl" / "utils" / "__init__.py").write_text("")
    (root / "verl" / "utils" / "tracking.py").write_text(TRACKING)
    # the unit suite's tensordict-0.10 leg hides verl's own package with a finder: not this stand-in
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if type(f).__name__ != "_HideVerl"])
    monkeypatch.syspath_prepend(str(root))
    saved = {n: m for n, m in sys.modules.items() if n == "verl" or n.startswith("verl.")}
    for name in saved:
        del sys.modules[name]
    monkeypatch.setattr(_tracking, "_said", set())
    take_samples()
    yield root
    for name in [n for n in sys.modules if n == "verl" or n.startswith("verl.")]:
        del sys.modules[name]
    sys.modules.update(saved)


class Recorder:
    """A backend that keeps what ``Tracking.log`` gave it."""

    def __init__(self) -> None:
        self.lines: list[tuple[int, dict]] = []

    def log(self, data, step):
        self.lines.append((step, dict(data)))


class Writer:
    def __init__(self) -> None:
        self.texts: list[tuple[str, str, int]] = []

    def add_text(self, tag, text, step):
        self.texts.append((tag, text, step))

    def flush(self):
        pass


class Board(Recorder):
    """verl's TensorBoard adapter: scalars through ``log``, its ``writer`` a SummaryWriter."""

    def __init__(self) -> None:
        super().__init__()
        self.writer = Writer()


class Words:
    def decode(self, ids, skip_special_tokens=False):
        return " ".join(f"t{i}" for i in ids)


class Loop:
    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts: Batch) -> Batch:
        rows = len(prompts.non_tensor_batch["uid"])
        return Batch.from_dict(tensors={"prompts": torch.ones(rows, 2, dtype=torch.long),
                                        "responses": torch.full((rows, 3), 7), "attention_mask": torch.ones(rows, 5)},
                               non_tensors={"uid": prompts.non_tensor_batch["uid"]})


class Trainer:
    """What calls ``log`` in verl: a trainer method, the trainer holding the tokenizer."""

    tokenizer = Words()

    def __init__(self, tracking) -> None:
        self.tracking = tracking

    def fit_step(self, step: int, metrics: dict) -> None:
        SkipManager.set_step(step)
        Loop().generate_sequences(Batch.from_dict(non_tensors={"uid": ["a", "b"]}))
        self.tracking.log(data=metrics, step=step)


def start(tmp_path, **fields) -> None:
    section = {"enable": True, "dump_dir": str(tmp_path / "dump"), "steps": [1, 2], "action": "repeat",
               "async_dump": False, **fields}
    SkipManager.init({"trainer": {"experiment_name": "e", "project_name": "p"}, "skip": {"rollout": section}})


def test_imported_after_install_the_class_is_patched_and_the_skip_finder_stays_first(verl_on_disk):
    integration.install()
    module = importlib.import_module("verl.utils.tracking")
    assert getattr(module.Tracking.log, _tracking.MARKER, False)
    assert type(sys.meta_path[0]).__name__ == "SkipFinder"
    assert "tracking.py" in module.__file__ and module.__spec__.loader.get_source("verl.utils.tracking")


def test_imported_before_install_it_is_patched_at_once_and_only_once(verl_on_disk):
    module = importlib.import_module("verl.utils.tracking")
    original = module.Tracking.log
    integration.install()
    integration.install()
    assert module.Tracking.log is not original and module.Tracking.log.__wrapped__ is original


def test_every_backend_gets_each_steps_metrics_and_the_callers_dict_is_untouched(verl_on_disk, tmp_path):
    integration.install()
    from verl.utils.tracking import Tracking

    start(tmp_path)
    console, board = Recorder(), Board()
    trainer = Trainer(Tracking({"console": console, "tensorboard": board}))
    sent = [{"actor/loss": 0.5}, {"actor/loss": 0.4}]
    for step, metrics in zip((1, 2), sent):
        trainer.fit_step(step, metrics)
    assert sent == [{"actor/loss": 0.5}, {"actor/loss": 0.4}]
    for backend in (console, board):
        assert [(step, data["skip/rollout/misses"], data["skip/rollout/hits"]) for step, data in backend.lines] == [
            (1, 1, 0), (2, 0, 1)]
        assert all(data["actor/loss"] for _, data in backend.lines)
    trainer.tracking.log(data={"val/score": 1.0}, step=2)  # a second line of step 2: nothing new to send
    assert "skip/rollout/hits" not in console.lines[-1][1]


def test_samples_go_to_each_backend_decoded_with_the_trainers_tokenizer(verl_on_disk, tmp_path, caplog):
    integration.install()
    from verl.utils.tracking import Tracking

    start(tmp_path, log_samples=1)
    file, board, console, other = Recorder(), Board(), Recorder(), Recorder()
    tracking = Tracking({"file": file, "tensorboard": board, "console": console, "swanlab": other})
    original = Tracking.log

    def spy(self, data, step, *args, **kwargs):  # another wrapper between the trainer and stepskip's
        return original(self, data, step, *args, **kwargs)

    Tracking.log = spy
    caplog.set_level(logging.INFO, logger="stepskip")
    Trainer(tracking).fit_step(1, {})
    Trainer(tracking).fit_step(2, {})
    records = [data["skip/rollout/samples"] for _, data in file.lines if "skip/rollout/samples" in data]
    assert [(r[0]["step"], r[0]["origin"], r[0]["source_step"]) for r in records] == [
        (1, "generated", 1), (2, "replayed", 1)]
    assert records[0][0]["prompt"] == "t1 t1" and records[0][0]["response"] == "t7 t7 t7"
    assert [(tag, step) for tag, _, step in board.writer.texts] == [("skip/rollout/samples", 1),
                                                                    ("skip/rollout/samples", 2)]
    assert "skip/rollout/samples: step 2, replayed from step 1" in caplog.text  # console
    assert "not sent to verl's swanlab backend" in caplog.text
    assert caplog.text.count("not sent to verl's swanlab backend") == 1


def test_the_backend_filter_is_kept(verl_on_disk, tmp_path):
    integration.install()
    from verl.utils.tracking import Tracking

    start(tmp_path, log_samples=1)
    first, second = Recorder(), Recorder()
    SkipManager.set_step(1)
    Loop().generate_sequences(Batch.from_dict(non_tensors={"uid": ["a"]}))
    Tracking({"file": first, "console": second}).log({"x": 1.0}, 1, backend=["file"])
    assert len(first.lines) == 2 and second.lines == []  # the metrics line and the samples line


def test_nothing_of_stepskip_stops_a_training_step(verl_on_disk, tmp_path, monkeypatch, caplog):
    integration.install()
    from verl.utils.tracking import Tracking

    start(tmp_path, log_samples=1)

    class Refuses(Recorder):
        def log(self, data, step):
            if any(key.endswith("/samples") for key in data):
                raise ValueError("no tables here")
            super().log(data, step)

    def broken(self, step=None):
        raise RuntimeError("counters unavailable")

    monkeypatch.setattr(_tracking.tracker.StepMetrics, "collect", broken)
    backend = Refuses()
    Trainer(Tracking({"file": backend})).fit_step(1, {"actor/loss": 1.0})
    assert backend.lines == [(1, {"actor/loss": 1.0})]
    assert "skip metrics left out" in caplog.text and "not sent to verl's file backend" in caplog.text


def test_without_an_enabled_role_the_lines_go_through_as_they_are(verl_on_disk):
    integration.install()
    from verl.utils.tracking import Tracking

    backend = Recorder()
    Tracking({"console": backend}).log({"x": 1.0}, 3)
    assert backend.lines == [(3, {"x": 1.0})]
