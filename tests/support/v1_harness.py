"""A small V1 trainer and replay buffer over a TransferQueue client, wired like verl's."""

from __future__ import annotations

import uuid
from typing import Any

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from stepskip import SkipManager
from stepskip.tq import KVBatchMeta


#: The width padded trajectories are padded to (prompt and response alike), as a verl agent loop pads them.
PAD_WIDTH = 6


def trajectory_fields(prompt_ids: list[int], n: int, step: int, fail_sessions: set[int] = frozenset(),
                      padded: str | None = None) -> tuple:
    """Deterministic trajectories: prompt p, session s -> response of length 1 + (p + s) % 4.

    ``padded`` lays them out as verl's agent loop does: prompts left-padded and responses right-padded
    to :data:`PAD_WIDTH` with 0, plus ``attention_mask`` over both, and ``response_mask`` when
    ``padded == "response_mask"`` (``"attention_mask"``: that mask alone).
    """
    if padded is not None:
        return _padded_fields(prompt_ids, n, step, fail_sessions, with_response_mask=padded == "response_mask")
    rows, sessions = [], []
    for p in prompt_ids:
        for s in range(n):
            if s in fail_sessions:
                continue
            rows.append((p, s))
            sessions.append(s)
    responses = [torch.arange((p + s) % 4 + 1) + 100 * p + 10 * s + 1000 * step for p, s in rows]
    fields = TensorDict(
        {
            "prompts": torch.nested.as_nested_tensor([torch.full((p % 3 + 2,), p) for p, _ in rows], layout=torch.jagged),
            "responses": torch.nested.as_nested_tensor(responses, layout=torch.jagged),
            "reward": torch.tensor([float(p * 10 + s) for p, s in rows]),
        },
        batch_size=[len(rows)],
    )
    fields.set("messages", NonTensorStack(*(NonTensorData(data=[{"role": "user", "content": f"p{p}"}], batch_size=[])
                                            for p, _ in rows), batch_size=[len(rows)]))
    return rows, fields


def _padded_fields(prompt_ids: list[int], n: int, step: int, fail_sessions: set[int],
                   with_response_mask: bool) -> tuple:
    rows, fields = trajectory_fields(prompt_ids, n, step, fail_sessions)
    prompts = torch.zeros(len(rows), PAD_WIDTH, dtype=torch.int64)
    responses = torch.zeros(len(rows), PAD_WIDTH, dtype=torch.int64)
    attention = torch.zeros(len(rows), 2 * PAD_WIDTH, dtype=torch.int64)
    for i, (prompt, response) in enumerate(zip(fields["prompts"].unbind(), fields["responses"].unbind())):
        prompts[i, PAD_WIDTH - len(prompt):] = prompt
        responses[i, :len(response)] = response
        attention[i, PAD_WIDTH - len(prompt):PAD_WIDTH + len(response)] = 1
    padded = TensorDict({"prompts": prompts, "responses": responses, "attention_mask": attention,
                         "reward": fields["reward"]}, batch_size=[len(rows)])
    if with_response_mask:
        padded.set("response_mask", attention[:, PAD_WIDTH:].clone())
    padded.set("messages", fields.get("messages"))
    return rows, padded


class AgentLoop:
    """Writes each prompt's n trajectories into the queue, then marks the prompt finished."""

    def __init__(self, tq: Any, n: int, fail_sessions: set[int] = frozenset(), padded: str | None = None) -> None:
        self.tq, self.n, self.fail_sessions, self.calls = tq, n, set(fail_sessions), 0
        self.padded = padded
        self.submitted: list[list[int]] = []  # the prompt ids of each call, in order

    def generate(self, uids: list[str], prompt_ids: list[int], step: int, partition_id: str = "train") -> None:
        self.calls += 1
        self.submitted.append(list(prompt_ids))
        for uid, p in zip(uids, prompt_ids):
            rows, fields = trajectory_fields([p], self.n, step, self.fail_sessions, self.padded)
            keys = [f"{uid}_{s}_0" for _, s in rows]
            tags = [{"global_steps": step, "status": "finished", "seq_len": (p + s) % 4 + 1} for p, s in rows]
            self.tq.kv_batch_put(keys=keys, fields=fields, tags=tags, partition_id=partition_id)
            self.tq.kv_batch_put(keys=[uid], partition_id=partition_id,
                                 tags=[{"is_prompt": True, "status": "finished", "global_steps": step}])


class ReplayBuffer:
    """Samples every finished prompt's trajectories (keys in a scrambled order, as verl does not sort)."""

    def __init__(self, tq: Any) -> None:
        self.tq = tq
        self.calls = 0

    @SkipManager.annotate_tq(role="rollout_tq", phase="sample")
    def sample(self, global_steps: int, partition_id: str, batch_size: int) -> tuple[KVBatchMeta, dict]:
        self.calls += 1
        listing = self.tq.kv_list(partition_id=partition_id).get(partition_id, {})
        finished = [k for k, t in listing.items() if t.get("is_prompt") and t.get("status") == "finished"]
        chosen = sorted(finished)[:batch_size]
        self.tq.kv_clear(keys=chosen, partition_id=partition_id)
        keys = [k for k in listing if not listing[k].get("is_prompt") and k.split("_")[0] in set(chosen)]
        keys = keys[1::2] + keys[0::2]  # any order: the role must group by uid prefix
        return KVBatchMeta(keys=keys, tags=[listing[k] for k in keys], partition_id=partition_id), {"sampled": len(keys)}


class V1Trainer:
    """``_add_batch_to_generate`` split into ``_next_train_batch`` + ``_submit_batch_to_rollout``."""

    def __init__(self, config: Any, tq: Any, prompts_per_step: int = 3, n: int = 2, sync_steps: int = 1,
                 fail_sessions: set[int] = frozenset(), padded: str | None = None) -> None:
        self.config, self.tq = config, tq
        self.prompts_per_step, self.n, self.sync_steps = prompts_per_step, n, sync_steps
        self.agent_loop = AgentLoop(tq, n, fail_sessions, padded)
        self.replay_buffer = ReplayBuffer(tq)
        self.next_prompt = 0
        self.global_steps = 0
        self.seen: list[TensorDict] = []

    def _next_train_batch(self) -> TensorDict:
        ids = list(range(self.next_prompt, self.next_prompt + self.prompts_per_step))
        self.next_prompt += self.prompts_per_step
        batch = TensorDict({"prompt_id": torch.tensor(ids)}, batch_size=[len(ids)])
        batch.set("uid", NonTensorStack(*(NonTensorData(data=uuid.uuid4().hex, batch_size=[]) for _ in ids),
                                        batch_size=[len(ids)]))
        batch["global_steps"] = NonTensorData(self.global_steps)  # verl's V1 trainer stamps every batch it submits
        return batch

    def _submit_batch_to_rollout(self, batch: TensorDict) -> str:
        self.agent_loop.generate(list(batch["uid"]), batch["prompt_id"].tolist(), self.global_steps)
        return "submitted"

    @SkipManager.annotate_tq(role="rollout_tq", phase="submit")
    def _add_batch_to_generate(self) -> str:
        batch = self._next_train_batch()
        return self._submit_batch_to_rollout(batch)

    def step(self) -> list[TensorDict]:
        """One training step; returns what the trainer read from the queue per sample call."""
        self.global_steps += 1
        SkipManager.set_step(self.global_steps)
        per = self.prompts_per_step // self.sync_steps
        self._add_batch_to_generate()
        reads = []
        for _ in range(self.sync_steps):
            meta, _ = self.replay_buffer.sample(self.global_steps, "train", per)
            reads.append((meta, self.tq.kv_batch_get(keys=meta.keys, partition_id="train")))
        for meta, _ in reads:
            self.tq.kv_clear(keys=meta.keys, partition_id="train")
        return reads

    def fit(self, steps: int) -> list[list]:
        SkipManager.init(self.config, tq_client=self.tq)
        out = [self.step() for _ in range(steps)]
        SkipManager.flush()
        return out


def rewrite_inner_entry(path: str, change: Any) -> None:
    """Rewrite the V1 inner entry at ``path`` with ``change(payload)`` applied to its decoded payload,
    its meta.json fields (row_prompts, ...) kept and its checksums valid: a crafted entry."""
    from stepskip._storage import open_store
    from stepskip._formats import get_format

    store = open_store(path.rsplit("/", 1)[0])
    meta, files = store.read_entry(path)
    codec = get_format(meta["format"])
    payload = codec.decode(files)
    change(payload)
    kept = {k: v for k, v in meta.items() if k not in ("files", "retired")}
    store.write_entry(path, codec.encode(codec.freeze(payload, copy=False)), kept)
