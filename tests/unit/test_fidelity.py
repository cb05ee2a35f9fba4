"""Run fingerprints and prompt digests (replay fidelity)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from tensordict import NonTensorData, NonTensorStack, TensorDict

from stepskip import Batch
from stepskip._fidelity import (
    DIGEST_PREFIX,
    STEPLESS_PREFIX,
    digest_like,
    fingerprint_diff,
    prompt_digest,
    prompt_row_digests,
    run_fingerprint,
    shared_object_digests,
)


def test_fingerprint_takes_the_listed_keys_that_are_set_and_user_keys():
    config = OmegaConf.create({
        "actor_rollout_ref": {"model": {"path": "/m"}, "rollout": {"temperature": 0.7, "n": 4}},
        "data": {"train_files": ["a.parquet", "b.parquet"], "seed": 3},
        "trainer": {"experiment_name": "e", "run_id": "r1"},
        "reward": {"version": 2},
    })
    fp = run_fingerprint(config, ["reward.version", "missing.key"])
    assert fp == {
        "actor_rollout_ref.model.path": "/m", "actor_rollout_ref.rollout.temperature": 0.7,
        "actor_rollout_ref.rollout.n": 4, "data.train_files": ["a.parquet", "b.parquet"], "data.seed": 3,
        "reward.version": 2,
    }


def test_fingerprint_diff_names_each_key_with_both_values():
    lines = fingerprint_diff({"a": 1, "b": "x", "c": 3}, {"a": 1, "b": "y", "d": 4})
    assert lines == ["b: recorded 'x', now 'y'", "c: recorded 3, now None", "d: recorded None, now 4"]


def prompts(tokens, uids, raw=("hello", "world")):
    return Batch.from_dict(tensors={"input_ids": torch.tensor(tokens)},
                           non_tensors={"uid": list(uids), "raw_prompt": list(raw)})


def test_prompt_digest_covers_content_and_ignores_identifier_columns():
    base = prompt_digest(prompts([[1, 2], [3, 4]], ["u1", "u2"]), ["uid"])
    assert base == prompt_digest(prompts([[1, 2], [3, 4]], ["v1", "v2"]), ["uid"])
    assert base != prompt_digest(prompts([[1, 2], [3, 5]], ["u1", "u2"]), ["uid"])
    assert base != prompt_digest(prompts([[1, 2], [3, 4]], ["u1", "u2"], raw=("hello", "there")), ["uid"])
    assert base != prompt_digest(prompts([[1, 2], [3, 4]], ["u1", "u2"]), [])  # uid counted when not excluded


def test_prompt_digest_of_tensordicts_with_jagged_and_non_tensor_columns():
    def td(last):
        out = TensorDict({"ids": torch.nested.nested_tensor([torch.arange(2), torch.tensor([5, last])],
                                                            layout=torch.jagged)}, batch_size=[2])
        out.set("uid", NonTensorStack.from_list([str(last), "x"]))
        out.set("msg", NonTensorStack.from_list([{"role": "user"}, "s"]))
        return out

    assert prompt_digest(td(1), ["uid"]) == prompt_digest(td(1), ["uid"])
    assert prompt_digest(td(1), ["uid"]) != prompt_digest(td(2), ["uid"])
    assert prompt_digest(object()) is None


def test_prompt_digest_is_a_bulk_hash():
    big = Batch.from_dict(tensors={"input_ids": torch.randint(0, 50000, (1024, 4096))},
                          non_tensors={"uid": np.array([str(i) for i in range(1024)], dtype=object)})
    digest = prompt_digest(big, ["uid"])
    big.batch["input_ids"][1023, 4095] += 1
    assert prompt_digest(big, ["uid"]) != digest  # the last token of 4M counts


def verl_like(n=4, shared=True, **override):
    """Prompts as verl hands them to generate_sequences: n rows per prompt, objects np.repeat-ed (shared)."""
    groups = 3
    columns = {
        "raw_prompt": [[{"role": "user", "content": f"q{g}"}] for g in range(groups)],
        "reward_model": [{"ground_truth": str(g), "style": "rule"} for g in range(groups)],
        "index": list(range(groups)),
        "uid": [f"u{g}" for g in range(groups)],
    }
    columns.update(override)
    non_tensor = {}
    for key, values in columns.items():
        column = np.empty(groups, dtype=object)
        column[:] = values
        if shared:
            non_tensor[key] = np.repeat(column, n)
        else:
            rows = np.empty(groups * n, dtype=object)
            rows[:] = [copy.deepcopy(v) for v in values for _ in range(n)]
            non_tensor[key] = rows
    tensors = {"input_ids": torch.arange(groups * n * 5).reshape(groups * n, 5)}
    return Batch(batch=TensorDict(tensors, batch_size=[groups * n]), non_tensor_batch=non_tensor)


def test_prompt_digest_depends_on_content_not_on_object_sharing():
    shared, copied = verl_like(shared=True), verl_like(shared=False)
    assert shared.non_tensor_batch["raw_prompt"][0] is shared.non_tensor_batch["raw_prompt"][1]
    assert copied.non_tensor_batch["raw_prompt"][0] is not copied.non_tensor_batch["raw_prompt"][1]
    assert prompt_digest(shared, ["uid"]) == prompt_digest(copied, ["uid"])
    assert prompt_digest(shared, ["uid"]).startswith(DIGEST_PREFIX)


def test_prompt_digest_changes_with_any_non_rebind_column():
    base = prompt_digest(verl_like(), ["uid"])
    changes = {
        "raw_prompt": [[{"role": "user", "content": "q0"}], [{"role": "user", "content": "q1"}],
                       [{"role": "user", "content": "q9"}]],
        "reward_model": [{"ground_truth": "0", "style": "rule"}, {"ground_truth": "1", "style": "rule"},
                         {"ground_truth": "2", "style": "model"}],
        "index": [0, 1, 2.0],  # a type change alone
    }
    for key, values in changes.items():
        assert prompt_digest(verl_like(**{key: values}), ["uid"]) != base, key
    one_row = verl_like(shared=False)
    one_row.non_tensor_batch["raw_prompt"][5] = [{"role": "user", "content": "other"}]
    assert prompt_digest(one_row, ["uid"]) != base  # a single row of a repeated group
    swapped = verl_like(shared=False)
    rows = swapped.non_tensor_batch["reward_model"]
    rows[0], rows[11] = rows[11], rows[0]
    assert prompt_digest(swapped, ["uid"]) != base  # row order counts
    assert prompt_digest(verl_like(uid=["a", "b", "c"]), ["uid"]) == base  # rebind columns do not


def test_prompt_digest_type_distinctions_and_dict_key_order():
    def digest(value):
        column = np.empty(2, dtype=object)
        column[0], column[1] = value, "x"
        return prompt_digest(Batch(non_tensor_batch={"v": column}))

    assert digest({"a": 1, "b": [2, 3]}) == digest({"b": [2, 3], "a": 1})  # dict key order does not count
    distinct = [[1, 2], (1, 2), [1.0, 2], [True, 2], {1: "a"}, {"1": "a"}, {"__t": "tuple", "v": [1, 2]},
                {1, 2}, np.int64(1), np.arange(2), np.arange(2.0), b"ab", "ab", None]
    digests = [digest(v) for v in distinct]
    assert None not in digests
    assert len(set(digests)) == len(distinct)
    assert digest(np.arange(1000)) != digest(np.arange(1000) + (np.arange(1000) == 999))  # no repr truncation
    assert digest(object()) is None  # no content form: no digest rather than an address


def test_prompt_digest_is_the_same_in_another_process_whatever_the_hash_seed():
    script = (
        "import numpy as np, torch\n"
        "from stepskip import Batch\n"
        "from stepskip._fidelity import prompt_digest\n"
        "col = np.empty(3, dtype=object)\n"
        "col[:] = [{'s': {'a', 'b', 'c'}, 't': ('x', 1)}, [{'role': 'user', 'content': 'hi'}], 'z']\n"
        "b = Batch.from_dict(tensors={'ids': torch.arange(6).reshape(3, 2)}, non_tensors={'v': col})\n"
        "print(prompt_digest(b))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    children = [subprocess.Popen([sys.executable, "-c", script], env=dict(env, PYTHONHASHSEED=seed),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for seed in ("1", "2")]
    seen = set()
    for child in children:  # started side by side; each waited for
        out, err = child.communicate()
        assert child.returncode == 0, err
        seen.add(out.strip())
    here: dict = {}
    exec(script.replace("print(prompt_digest(b))", "here['digest'] = prompt_digest(b)"), {"here": here})
    seen.add(here["digest"])  # this process's own hash seed (pytest's random one) as a third
    assert len(seen) == 1 and next(iter(seen)).startswith(DIGEST_PREFIX)


def test_prompt_row_digests_group_equal_rows_by_content():
    shared, copied = verl_like(shared=True), verl_like(shared=False)
    rows = prompt_row_digests(shared, ["uid"])
    assert rows == prompt_row_digests(copied, ["uid"])  # sharing does not count
    assert len(rows) == 12 and all(r.startswith(DIGEST_PREFIX) for r in rows)
    assert len(set(rows)) == 12  # input_ids differ on every row
    same_ids = verl_like(shared=False)
    same_ids.batch["input_ids"] = torch.arange(3).repeat_interleave(4)[:, None].expand(12, 5).contiguous()
    groups = prompt_row_digests(same_ids, ["uid"])
    assert [len({groups[i] for i in range(g * 4, g * 4 + 4)}) for g in range(3)] == [1, 1, 1]  # a group: one digest
    assert len(set(groups)) == 3
    same_ids.non_tensor_batch["raw_prompt"][5] = [{"role": "user", "content": "other"}]
    changed = prompt_row_digests(same_ids, ["uid"])
    assert [i for i in range(12) if changed[i] != groups[i]] == [5]
    assert prompt_row_digests(verl_like(uid=["a", "b", "c"]), ["uid"]) == rows  # rebind columns do not count


def test_prompt_row_digests_of_a_tensordict_with_jagged_and_non_tensor_columns():
    td = TensorDict({"ids": torch.nested.nested_tensor([torch.arange(2), torch.arange(2), torch.arange(3)],
                                                       layout=torch.jagged)}, batch_size=[3])
    td.set("msg", NonTensorStack.from_list(["a", "a", "a"]))
    d = prompt_row_digests(td)
    assert d[0] == d[1] != d[2]
    with pytest.raises(ValueError, match="rows"):
        prompt_row_digests(Batch(batch=TensorDict({"x": torch.zeros(2)}, batch_size=[2]),
                                 non_tensor_batch={"v": np.array(["a"], dtype=object)}))


def test_prompt_digest_of_token_id_rows_covers_content_boundaries_and_types():
    """Prompts as TRL passes them, ``list[list[int]]``: hashed packed (row lengths, then the ids)."""
    rows = [[1, 2, 3], [], [4, 5]]
    digest = prompt_digest(rows)
    assert digest is not None and digest.startswith(DIGEST_PREFIX)
    assert digest == prompt_digest([list(r) for r in rows])  # content, not identity
    assert digest == prompt_digest(torch.tensor([3, 3, 0, 2, 1, 2, 3, 4, 5]))  # the packed form's digest
    others = [[[1, 2], [3], [4, 5]], [[1, 2, 3], [4, 5]], [[1, 2, 3], [], [4, 6]], [[1, 2, 3], [], [4, 5], []],
              [[1, 2, 3], [], [4, True]], [[1, 2, 3], (), [4, 5]], ([1, 2, 3], [], [4, 5]), [[1, 2, 3], [], [4, 5.0]]]
    digests = {prompt_digest(o) for o in others}
    assert None not in digests and digest not in digests and len(digests) == len(others)


def test_prompt_digest_of_other_lists_is_by_content():
    assert prompt_digest([[2**70], [1]]) == prompt_digest([[2**70], [1]]) != prompt_digest([[2**70], [2]])
    messages = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "yo"}]]
    assert prompt_digest(messages) not in (None, prompt_digest([messages[1], messages[0]]))
    assert prompt_digest(["a", "b"]) != prompt_digest(("a", "b"))
    assert prompt_digest([object()]) is None  # no content form: no digest rather than an address


def test_prompt_digest_of_many_token_id_rows():
    rows = [list(range(i, i + 2048)) for i in range(512)]
    digest = prompt_digest(rows)
    rows[511][2047] += 1
    assert prompt_digest(rows) != digest


def _verl_like_prompts(groups: int, n: int, tag: str = "") -> Batch:
    messages = np.empty(groups, dtype=object)
    messages[:] = [[{"role": "user", "content": f"question {g}{tag}"}] for g in range(groups)]
    rewards = np.empty(groups, dtype=object)
    rewards[:] = [{"ground_truth": str(g), "style": "rule"} for g in range(groups)]
    return Batch.from_dict(tensors={"input_ids": torch.arange(groups * n * 3).reshape(groups * n, 3)},
                           non_tensors={"raw_prompt": np.repeat(messages, n), "reward_model": np.repeat(rewards, n),
                                        "uid": np.repeat(np.array([f"u{g}" for g in range(groups)], dtype=object), n)})


def test_shared_object_digests_gives_the_values_computed_without_it():
    prompts = _verl_like_prompts(4, 3)
    alone = (prompt_row_digests(prompts, ["uid"]), prompt_digest(prompts, ["uid"]))
    with shared_object_digests():
        shared = (prompt_row_digests(prompts, ["uid"]), prompt_digest(prompts, ["uid"]))
        # other prompts in the same block, made after the first were hashed, get their own digests
        others = [_verl_like_prompts(4, 3, tag=f" v{i}") for i in range(5)]
        inside = [prompt_digest(p, ["uid"]) for p in others]
    assert shared == alone
    assert inside == [prompt_digest(p, ["uid"]) for p in others]
    assert len(set(inside) | {alone[1]}) == 6


def test_shared_object_digests_hashes_each_distinct_object_once_for_both_digests(monkeypatch):
    """What the block is for: a miss computes row digests and the prompt digest over the same columns."""
    from stepskip import _fidelity as fidelity

    calls = []
    value_digest = fidelity._value_digest
    monkeypatch.setattr(fidelity, "_value_digest", lambda value: calls.append(1) or value_digest(value))
    prompts = _verl_like_prompts(4, 3)

    def both() -> int:
        calls.clear()
        prompt_row_digests(prompts, ["uid"])
        prompt_digest(prompts, ["uid"])
        return len(calls)

    alone = both()
    with shared_object_digests():
        shared = both()
    assert 0 < shared < alone  # the second digest reuses the first one's object hashes
    assert shared == 8  # 4 distinct messages and 4 distinct reward dicts, each hashed once


def test_shared_object_digests_never_mistakes_a_new_object_at_a_freed_address():
    """A memo keyed by id alone would hand a freed object's digest to a new one at its address."""
    with shared_object_digests():
        digests = []
        for i in range(200):  # each batch dies before the next: CPython reuses the addresses
            digests.append(prompt_digest(_verl_like_prompts(2, 2, tag=f" {i}"), ["uid"]))
    assert digests == [prompt_digest(_verl_like_prompts(2, 2, tag=f" {i}"), ["uid"]) for i in range(200)]
    assert len(set(digests)) == 200


def test_object_columns_in_any_layout_hash_each_distinct_object_once_by_content(monkeypatch):
    """The ids of a column's items are read from its object array: a strided view and a view with a
    negative stride of the same objects give the digests of a column of equal copies, and each
    distinct object is still hashed once."""
    from stepskip import _fidelity as fidelity

    messages = [[{"role": "user", "content": f"q{i}"}] for i in range(3)]
    rows = [messages[i // 2] for i in range(6)]  # two rows share each message
    wide = np.empty(12, dtype=object)
    wide[::2] = rows
    wide[1::2] = "unused"
    backwards = np.empty(6, dtype=object)
    backwards[:] = rows[::-1]
    copies = np.empty(6, dtype=object)
    copies[:] = [copy.deepcopy(row) for row in rows]
    layouts = {"strided": wide[::2], "negative stride": backwards[::-1], "copies": copies}
    assert not layouts["strided"].flags.c_contiguous and not layouts["negative stride"].flags.c_contiguous
    calls = []
    value_digest = fidelity._value_digest
    monkeypatch.setattr(fidelity, "_value_digest", lambda value: calls.append(1) or value_digest(value))

    def digests(column):
        batch = Batch(batch=None, non_tensor_batch={"raw_prompt": column}, meta_info={})
        calls.clear()
        out = (prompt_digest(batch), tuple(prompt_row_digests(batch)))
        return out, len(calls)

    results = {name: digests(column) for name, column in layouts.items()}
    assert len({value for value, _ in results.values()}) == 1
    assert {name: hashed for name, (_, hashed) in results.items()} == {"strided": 6, "negative stride": 6,
                                                                       "copies": 12}
    assert fidelity._object_ids(rows, layouts["strided"]).tolist() == [id(row) for row in rows]
    others = [copy.deepcopy(row) for row in rows]  # not the array's objects: the ids are taken one by one
    assert fidelity._object_ids(others, layouts["strided"]).tolist() == [id(row) for row in others]
    masked = np.ma.array(copies, mask=[False, True, False, False, True, False])  # lists None where masked
    listed = masked.reshape(-1).tolist()
    assert listed[1] is None and fidelity._object_ids(listed, masked).tolist() == [id(item) for item in listed]


def _recorded_batch() -> Batch:
    """verl-like prompts with a column of every kind of value the digest reads."""
    batch = verl_like(n=3)
    mixed = np.empty(9, dtype=object)
    mixed[:] = [{}, [], {"a": {}}, [{}, []], {"s": {"a", "b"}, "t": ("x", 1)}, {"k": [1, 2.0, True, None, "x"]},
                np.arange(3), {1: "a"}, "leaf"]
    batch.non_tensor_batch["mixed"] = mixed
    batch.non_tensor_batch["source"] = np.array(["openai/gsm8k"] * 9, dtype=object)
    return batch


#: Digests of :func:`_recorded_batch` computed by the fidelity code of commit 6eea3ce (the xxh3v2 scheme stored in
#: existing caches); a faster digest must give the same values, or recorded entries stop matching.
RECORDED_DIGEST = "xxh3v2:d7eb783385a51e1b"
RECORDED_ROW_DIGESTS = [
    "xxh3v2:e2f657001aab6cd3",
    "xxh3v2:716bbbfd11f0d265",
    "xxh3v2:e45179762c319367",
    "xxh3v2:d4734163c67416ec",
    "xxh3v2:a202b63bc995ecf2",
    "xxh3v2:29db32a6203c73dc",
    "xxh3v2:55ac8d684df3c856",
    "xxh3v2:733d5113148a9575",
    "xxh3v2:ee23b0a484381ab1",
]


def test_digests_are_the_ones_recorded_caches_hold():
    batch = _recorded_batch()
    assert prompt_digest(batch, ["uid"]) == RECORDED_DIGEST
    assert prompt_row_digests(batch, ["uid"]) == RECORDED_ROW_DIGESTS
    with shared_object_digests():
        assert prompt_row_digests(batch, ["uid"]) == RECORDED_ROW_DIGESTS
        assert prompt_digest(batch, ["uid"]) == RECORDED_DIGEST


def test_shared_object_digests_gives_each_column_made_inside_the_block_its_own_digests():
    """The memo also finds a column by its object array: batches made and dropped inside one block
    (CPython reuses freed addresses) each get the digests computed without it."""
    expected = []
    for i in range(100):
        batch = _verl_like_prompts(2, 2, tag=f" {i}")
        expected.append((prompt_row_digests(batch, ["uid"]), prompt_digest(batch, ["uid"])))
    with shared_object_digests():
        seen = []
        for i in range(100):  # each batch, its arrays and objects die before the next is made
            batch = _verl_like_prompts(2, 2, tag=f" {i}")
            seen.append((prompt_row_digests(batch, ["uid"]), prompt_digest(batch, ["uid"])))
            del batch
    assert seen == expected
    assert len({whole for _, whole in seen}) == 100


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.bool, torch.bfloat16, torch.float16])
def test_prompt_digest_of_a_tensor_is_the_same_whichever_way_its_bytes_are_read(dtype: torch.dtype) -> None:
    """Plain CPU tensors are hashed through numpy's view, others (a strided copy, autograd, bfloat16)
    through torch: the same values give the same digest either way."""
    values = (torch.arange(12) % 4).to(dtype).reshape(3, 4)

    def digest(tensor: torch.Tensor) -> str | None:
        return prompt_digest(Batch.from_dict(tensors={"input_ids": tensor}), [])

    same = [values.t(), values.t().contiguous()]
    if dtype.is_floating_point:
        same.append(values.t().clone().requires_grad_())
    assert len({digest(t) for t in same}) == 1
    changed = values.t().clone()
    changed[0, 0] = 1 if dtype != torch.bool else not bool(changed[0, 0])
    assert digest(changed) != digest(values.t())


def test_prompt_digest_reads_a_plain_cpu_tensor_without_torch_calls(monkeypatch):
    """numpy's view gives a plain CPU tensor's bytes: no ``contiguous`` / ``view`` (each releases the GIL);
    a tensor numpy cannot hold (bfloat16) still goes through them."""
    calls = []
    contiguous = torch.Tensor.contiguous

    def counting(self, *args, **kwargs):
        calls.append(self.dtype)
        return contiguous(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "contiguous", counting)
    ids = torch.arange(12).reshape(3, 4)
    plain = prompt_digest(Batch.from_dict(tensors={"input_ids": ids.t()}), [])
    assert calls == []
    prompt_digest(Batch.from_dict(tensors={"input_ids": ids.to(torch.bfloat16)}), [])
    assert calls == [torch.bfloat16]
    monkeypatch.undo()
    assert prompt_digest(Batch.from_dict(tensors={"input_ids": ids.t().contiguous()}), []) == plain


def test_small_and_large_columns_find_their_distinct_objects_alike(monkeypatch):
    """Columns of few rows find their distinct objects by a dict of ids, larger ones by np.unique:
    the digest is the same either way, for shared objects, equal copies and changed ones."""
    import numpy as np

    from stepskip import Batch
    from stepskip import _fidelity

    shared = [{"role": "user", "content": f"q{g}"} for g in range(4)]
    column = np.empty(32, dtype=object)
    column[:] = [shared[i // 8] for i in range(32)]
    copies = np.empty(32, dtype=object)
    copies[:] = [dict(shared[i // 8]) for i in range(32)]
    changed = copies.copy()
    changed[31] = {"role": "user", "content": "other"}
    digests = {}
    for small in (0, 1 << 20):
        monkeypatch.setattr(_fidelity, "_SMALL_COLUMN", small)
        digests[small] = [_fidelity.prompt_digest(Batch.from_dict(non_tensors={"messages": c}))
                          for c in (column, copies, changed)]
    assert digests[0] == digests[1 << 20]
    assert digests[0][0] == digests[0][1] != digests[0][2]


def _v1_prompts(ids: list[int], step: int, messages: list[str] | None = None) -> TensorDict:
    """A batch of prompts as verl's V1 trainer submits it: tensors, object columns, fresh uids and the
    step it stamps on the whole batch (``global_steps``)."""
    batch = TensorDict({"input_ids": torch.tensor([[i, i + 1] for i in ids])}, batch_size=[len(ids)])
    texts = messages or [f"prompt {i}" for i in ids]
    batch.set("raw_prompt", NonTensorStack(*(NonTensorData(data=[{"role": "user", "content": t}], batch_size=[])
                                             for t in texts), batch_size=[len(ids)]))
    batch.set("uid", NonTensorStack(*(NonTensorData(data=f"u{step}-{i}", batch_size=[]) for i in ids),
                                    batch_size=[len(ids)]))
    batch["global_steps"] = NonTensorData(step)
    return batch


def test_stepless_digests_of_a_prompt_are_the_same_at_every_step_and_differ_for_another_prompt():
    at_3, at_9 = _v1_prompts([0, 1], 3), _v1_prompts([0, 1], 9)
    rows_3 = prompt_row_digests(at_3, ["uid"], stepless=True)
    assert rows_3 == prompt_row_digests(at_9, ["uid"], stepless=True)
    assert prompt_digest(at_3, ["uid"], stepless=True) == prompt_digest(at_9, ["uid"], stepless=True)
    assert all(d.startswith(STEPLESS_PREFIX) for d in rows_3)
    # other content, at the same step or another: another digest (tensor rows and object rows alike)
    assert prompt_row_digests(_v1_prompts([1, 0], 3), ["uid"], stepless=True) == rows_3[::-1]
    other_ids = prompt_row_digests(_v1_prompts([0, 5], 9), ["uid"], stepless=True)
    assert other_ids[0] == rows_3[0] and other_ids[1] != rows_3[1]
    other_text = _v1_prompts([0, 1], 3, messages=["prompt 0", "prompt one"])
    assert prompt_row_digests(other_text, ["uid"], stepless=True)[1] != rows_3[1]
    assert prompt_digest(other_text, ["uid"], stepless=True) != prompt_digest(at_3, ["uid"], stepless=True)


def test_the_earlier_scheme_still_digests_the_step_and_a_recorded_digest_is_compared_in_its_own_scheme():
    at_3, at_9 = _v1_prompts([0, 1], 3), _v1_prompts([0, 1], 9)
    earlier = prompt_digest(at_3, ["uid"])
    assert earlier.startswith(DIGEST_PREFIX) and earlier != prompt_digest(at_9, ["uid"])  # as entries hold it
    assert prompt_row_digests(at_3, ["uid"]) != prompt_row_digests(at_9, ["uid"])
    # an entry of the earlier scheme matches the prompts of its own step only: never a false match
    assert digest_like(earlier, at_3, ["uid"]) == earlier
    assert digest_like(earlier, at_9, ["uid"]) != earlier
    stepless = prompt_digest(at_3, ["uid"], stepless=True)
    assert digest_like(stepless, at_9, ["uid"]) == stepless
    assert digest_like(stepless, _v1_prompts([0, 2], 3), ["uid"]) != stepless
    assert digest_like("xxh3_64:0123456789abcdef", at_3, ["uid"]) is None  # a scheme not known: not compared
    assert digest_like(None, at_3, ["uid"]) is None
