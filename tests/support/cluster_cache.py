"""What the actors of the many-nodes test do: record steps, replay them (also while they are being written),
and prune the cache, each through stepskip's public API in its own process on its own Ray node.

A recorded step holds a result anyone can recompute (:func:`expected`), so a reader checks every replayed
value against it: a value that is not the whole step as recorded is a partial read.
"""

from __future__ import annotations

from typing import Any

ROWS = 8
COLS = 64


def expected(step: int) -> Any:
    """The result recorded for ``step``."""
    import torch

    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(ROWS, COLS, generator=generator)


def config(dump_dir: str, storage_options: dict[str, Any], action: str, steps: int) -> dict[str, Any]:
    return {"trainer": {"experiment_name": "team", "project_name": "shared"},
            "skip": {"rollout": {"enable": True, "dump_dir": dump_dir, "steps": f"1-{steps}", "action": action,
                                 "async_dump": False, "storage_options": storage_options}}}


class _Loop:
    def __init__(self) -> None:
        from stepskip import Batch, SkipManager

        self.calls = 0
        self.batch = Batch

        @SkipManager.annotate(role="rollout")
        def generate_sequences(prompts: Any) -> Any:
            self.calls += 1
            step = int(prompts.meta_info["step"])
            return Batch.from_dict(tensors={"responses": expected(step)},
                                   non_tensors={"uid": prompts.non_tensor_batch["uid"]})

        self.generate_sequences = generate_sequences

    def call(self, step: int) -> Any:
        from stepskip import SkipManager

        SkipManager.set_step(step)
        prompts = self.batch.from_dict(non_tensors={"uid": [str(i) for i in range(ROWS)]}, meta_info={"step": step})
        return self.generate_sequences(prompts=prompts)


class _Placed:
    def node(self) -> str:
        """The Ray node this actor runs on."""
        import ray

        return str(ray.get_runtime_context().get_node_id())


class Recorder(_Placed):
    """Records each step it is given (``action: cache``: the call runs once, its result is written)."""

    def __init__(self, dump_dir: str, storage_options: dict[str, Any], steps: int) -> None:
        from stepskip import SkipManager

        SkipManager.init(config(dump_dir, storage_options, "cache", steps))
        self.loop = _Loop()

    def record(self, step: int) -> dict[str, float]:
        from stepskip import SkipManager

        self.loop.call(step)
        SkipManager.flush()
        return SkipManager.stats()


class Replayer(_Placed):
    """Replays steps (``action: replay``): a step not there yet is a miss, never a partial value."""

    def __init__(self, dump_dir: str, storage_options: dict[str, Any], steps: int) -> None:
        from stepskip import SkipManager

        SkipManager.init(config(dump_dir, storage_options, "replay", steps))
        self.loop = _Loop()

    def replay(self, steps: list[int]) -> dict[int, str]:
        """``{step: "replayed" | "missing" | what was wrong}``."""
        import torch

        from stepskip import CacheMissError
        from stepskip.errors import ReplayMissError

        out: dict[int, str] = {}
        for step in steps:
            try:
                value = self.loop.call(step)
            except ReplayMissError:
                out[step] = "missing"
                continue
            except CacheMissError as err:  # damage: what a partial step would look like
                out[step] = f"{type(err).__name__}: {err}"
                continue
            same = torch.equal(value.batch["responses"], expected(step)) and self.loop.calls == 0
            out[step] = "replayed" if same else "a value other than the recorded one"
        return out


class Pruner(_Placed):
    """Keeps the newest ``keep`` steps of the run, with the operations ``stepskip prune`` runs."""

    def __init__(self, run_dir: str, storage_options: dict[str, Any], keep: int) -> None:
        self.run_dir, self.storage_options, self.keep = run_dir, storage_options, keep

    def prune(self) -> list[str]:
        from stepskip.cache import apply_prune, open_cache, plan_prune

        index = open_cache(self.run_dir, self.storage_options)
        try:
            plan = plan_prune(index, keep_last=self.keep)
        except Exception as err:  # no run directory yet: nothing recorded
            if "no such directory" in str(err):
                return []
            raise
        return [path.rsplit("/", 1)[-1] for path in apply_prune(index, plan)]
