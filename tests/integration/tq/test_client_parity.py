"""``stepskip.tq.InProcessTQClient`` against the real ``transfer_queue`` (0.1.11) KV interface.

Each test runs one sequence of ``kv_batch_put`` / ``kv_batch_get`` / ``kv_list`` / ``kv_clear``
calls against both clients and compares what came back, normalised: tensors by layout, dtype and
per-row values (a jagged tensor by its ``unbind()`` rows), non-tensor fields by their row values,
``KVBatchMeta`` by keys, tags, partition and fields, an exception as "raised" (types may differ).
The in-process client is meant to behave like the real one: every sequence here must match.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase

from stepskip.tq import InProcessTQClient

pytestmark = pytest.mark.heavy


# ---------------------------------------------------------------------------------- helpers

class Raised:
    """An exception, compared as "some exception was raised" (the two clients' types may differ)."""

    def __init__(self, err: BaseException) -> None:
        self.type, self.message = type(err).__name__, str(err)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Raised)

    def __repr__(self) -> str:
        return f"Raised({self.type}: {self.message[:160]})"


def norm_value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            rows = value.unbind()
            kind = "jagged" if value.layout == torch.jagged else "nested-strided"
            return (kind, str(value.dtype), [tuple(r.shape) for r in rows], [r.tolist() for r in rows])
        return ("dense", str(value.dtype), tuple(value.shape), value.tolist())
    if isinstance(value, NonTensorStack):
        return ("rows", value.tolist())
    if isinstance(value, NonTensorData):
        return ("batch-wide", value.data)
    return ("other", type(value).__name__, repr(value))


def norm(result: Any) -> Any:
    """A comparable form of whatever a KV call returned."""
    if isinstance(result, Raised) or result is None:
        return result
    if isinstance(result, TensorDictBase):
        return {"batch_size": list(result.batch_size),
                "fields": {k: norm_value(result.get(k)) for k in sorted(result.keys())}}
    if all(hasattr(result, a) for a in ("keys", "tags", "partition_id", "fields")):  # a KVBatchMeta
        return {"keys": list(result.keys), "tags": [dict(t) for t in result.tags],
                "partition_id": result.partition_id,
                "fields": None if result.fields is None else sorted(result.fields)}
    return result


class Calls:
    """Runs calls against one client, recording each result (or exception) under a label."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.raw: dict[str, Any] = {}
        self.results: dict[str, Any] = {}

    def __call__(self, label: str, method: str, **kwargs: Any) -> Any:
        assert label not in self.results, f"duplicate label {label}"
        try:
            out = getattr(self.client, method)(**kwargs)
        except Exception as err:  # noqa: BLE001 - recorded, compared across clients
            out = Raised(err)
        self.raw[label] = out
        self.results[label] = norm(out)
        return out


Scenario = Callable[[Calls, str], None]


def run_both(real_tq: Any, scenario: Scenario) -> tuple[Calls, Calls]:
    """The scenario against the real queue and a fresh in-process client, in partitions named ``ns*``."""
    ns = f"par{uuid.uuid4().hex[:8]}"
    real, fake = Calls(real_tq), Calls(InProcessTQClient())
    scenario(real, ns)
    scenario(fake, ns)
    return real, fake


def assert_same(real: Calls, fake: Calls) -> None:
    assert list(real.results) == list(fake.results)
    differences = {label: {"real": real.results[label], "in_process": fake.results[label]}
                   for label in real.results if real.results[label] != fake.results[label]}
    assert not differences, f"InProcessTQClient differs from transfer_queue: {differences}"


def rows_of(value: torch.Tensor) -> list[torch.Tensor]:
    return list(value.unbind())


def stack(rows: list[Any]) -> NonTensorStack:
    return NonTensorStack(*(NonTensorData(data=r, batch_size=[]) for r in rows), batch_size=[len(rows)])


def jagged(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


# ---------------------------------------------------------------------------------- matching behaviour

def test_dense_per_row_tensors_come_back_as_jagged_rows(real_tq):
    gen = torch.Generator().manual_seed(0)
    ids = torch.arange(6).reshape(3, 2)
    feats = torch.randn(3, 2, 3, generator=gen)
    mask = torch.ones(3, 4, dtype=torch.int32)

    def scenario(c: Calls, ns: str) -> None:
        c("put", "kv_batch_put", keys=["k0", "k1", "k2"], partition_id=ns,
          fields=TensorDict({"ids": ids, "feats": feats, "mask": mask}, batch_size=[3]),
          tags=[{"i": 0}, {"i": 1}, {"i": 2}])
        c("get reordered", "kv_batch_get", keys=["k2", "k0"], partition_id=ns)
        c("get one key as str", "kv_batch_get", keys="k1", partition_id=ns)

    real, fake = run_both(real_tq, scenario)
    assert_same(real, fake)
    got = real.raw["get reordered"]
    for name, dense in (("ids", ids), ("feats", feats), ("mask", mask)):
        value = got[name]
        assert value.is_nested and value.layout == torch.jagged, name  # the real queue stores per row
        assert value.dtype == dense.dtype
        for row, index in zip(rows_of(value), (2, 0)):
            assert torch.equal(row, dense[index])
        assert torch.equal(torch.stack(rows_of(value)), dense[[2, 0]])  # densify when rows are equal
    assert real.raw["get one key as str"].batch_size == torch.Size([1])


def test_per_row_scalars_come_back_dense(real_tq):
    fields = TensorDict({
        "reward": torch.tensor([0.5, -1.0, 2.0]),
        "done": torch.tensor([True, False, True]),
        "half": torch.tensor([1.5, 2.5, 3.5], dtype=torch.bfloat16),
        "count": torch.tensor([3, 1, 2]),
    }, batch_size=[3])

    def scenario(c: Calls, ns: str) -> None:
        c("put", "kv_batch_put", keys=["a", "b", "c"], partition_id=ns, fields=fields, tags=[{}, {}, {}])
        c("get", "kv_batch_get", keys=["c", "a", "b"], partition_id=ns)

    real, fake = run_both(real_tq, scenario)
    assert_same(real, fake)
    got = real.raw["get"]
    for name in fields.keys():
        assert not got[name].is_nested, name
        assert torch.equal(got[name], fields[name][[2, 0, 1]]), name


def test_jagged_input_round_trips(real_tq):
    tokens = [torch.arange(2), torch.arange(5) + 10, torch.arange(1) + 20]
    ragged2d = [torch.zeros(2, 3), torch.ones(4, 3), torch.full((1, 3), 7.0)]

    def scenario(c: Calls, ns: str) -> None:
        c("put", "kv_batch_put", keys=["x", "y", "z"], partition_id=ns,
          fields=TensorDict({"tokens": jagged(tokens), "ragged2d": jagged(ragged2d)}, batch_size=[3]),
          tags=[{}, {}, {}])
        c("get", "kv_batch_get", keys=["z", "x", "y"], partition_id=ns)

    real, fake = run_both(real_tq, scenario)
    assert_same(real, fake)
    got = real.raw["get"]
    for name, rows in (("tokens", tokens), ("ragged2d", ragged2d)):
        assert got[name].layout == torch.jagged
        assert all(torch.equal(a, b) for a, b in zip(rows_of(got[name]), [rows[2], rows[0], rows[1]])), name


def test_non_tensor_fields_round_trip_per_row(real_tq):
    messages = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": None}] for i in range(3)]
    names = ["alpha", "b", ""]

    def scenario(c: Calls, ns: str) -> None:
        fields = TensorDict({"reward": torch.tensor([1.0, 2.0, 3.0])}, batch_size=[3])
        fields.set("messages", stack(messages))
        fields.set("name", stack(names))
        c("put", "kv_batch_put", keys=["m0", "m1", "m2"], partition_id=ns, fields=fields, tags=[{}, {}, {}])
        c("get", "kv_batch_get", keys=["m1", "m2", "m0"], partition_id=ns)

    real, fake = run_both(real_tq, scenario)
    assert_same(real, fake)
    got = real.raw["get"]
    assert isinstance(got.get("messages"), NonTensorStack)
    assert got.get("messages").tolist() == [messages[1], messages[2], messages[0]]
    assert got.get("name").tolist() == ["b", "", "alpha"]


def test_tags_merge_across_puts(real_tq):
    def scenario(c: Calls, ns: str) -> None:
        c("put", "kv_batch_put", keys=["a", "b"], partition_id=ns,
          fields=TensorDict({"x": torch.tensor([1, 2])}, batch_size=[2]),
          tags=[{"status": "running", "global_steps": 1}, {"status": "running", "meta": [1, {"n": None}]}])
        c("tags update", "kv_batch_put", keys=["b", "a"], partition_id=ns,
          tags=[{"status": "finished"}, {"score": 0.5}])
        c("empty tag dicts", "kv_batch_put", keys=["a"], partition_id=ns, tags=[{}])
        c("fields without tags keep tags", "kv_batch_put", keys=["a", "b"], partition_id=ns,
          fields=TensorDict({"x": torch.tensor([3, 4])}, batch_size=[2]))
        c("list", "kv_list", partition_id=ns)
        c("get", "kv_batch_get", keys=["a", "b"], partition_id=ns)

    real, fake = run_both(real_tq, scenario)
    assert_same(real, fake)
    assert real.results["list"] == {real_ns(real): {
        "a": {"status": "running", "global_steps": 1, "score": 0.5},
        "b": {"status": "finished", "meta": [1, {"n": None}]},
    }}
    assert real.results["tags update"]["tags"] == [{"status": "finished", "meta": [1, {"n": None}]},
                                                   {"status": "running", "global_steps": 1, "score": 0.5}]
    assert real.raw["get"]["x"].tolist() == [3, 4]


def real_ns(calls: Calls) -> str:
    """The partition a scenario used (every KVBatchMeta records it)."""
    for value in calls.results.values():
        if isinstance(value, dict) and "partition_id" in value:
            return value["partition_id"]
    raise AssertionError("no put in this scenario")


def test_column_wise_put_adds_a_field_to_existing_keys(real_tq):
    def scenario(c: Calls, ns: str) -> None:
        c("put rows", "kv_batch_put", keys=["r0", "r1", "r2"], partition_id=ns,
          fields=TensorDict({"prompts": jagged([torch.arange(2), torch.arange(3), torch.arange(1)])}, batch_size=[3]),
          tags=[{"s": 0}, {"s": 1}, {"s": 2}])
        c("add column", "kv_batch_put", keys=["r2", "r0", "r1"], partition_id=ns,
          fields=TensorDict({"reward": torch.tensor([2.0, 0.0, 1.0]),
                             "responses": jagged([torch.arange(4), torch.arange(1), torch.arange(2)])}, batch_size=[3]))
        c("get all", "kv_batch_get", keys=["r0", "r1", "r2"], partition_id=ns)
        c("list", "kv_list", partition_id=ns)

    real, fake = run_both(real_tq, scenario)
    assert_same(real, fake)
    assert real.results["add column"]["fields"] == ["prompts", "responses", "reward"]
    got = real.raw["get all"]
    assert got["reward"].tolist() == [0.0, 1.0, 2.0]
    assert [r.numel() for r in got["responses"].unbind()] == [1, 2, 4]
    assert [r.numel() for r in got["prompts"].unbind()] == [2, 3, 1]


def test_tags_only_put_creates_keys_without_fields(real_tq):
    def scenario(c: Calls, ns: str) -> None:
        c("tags only", "kv_batch_put", keys=["uid1", "uid2"], partition_id=ns,
          tags=[{"is_prompt": True, "status": "finished", "global_steps": 3}, {"is_prompt": True}])
        c("list", "kv_list", partition_id=ns)
        c("then fields", "kv_batch_put", keys=["uid1"], partition_id=ns,
          fields=TensorDict({"x": torch.tensor([[1, 2]])}, batch_size=[1]))
        c("get", "kv_batch_get", keys=["uid1"], partition_id=ns)

    real, fake = run_both(real_tq, scenario)
    assert_same(real, fake)
    assert real.results["tags only"]["fields"] == []
    assert real.results["then fields"]["tags"] == [{"is_prompt": True, "status": "finished", "global_steps": 3}]


def test_select_fields(real_tq):
    def scenario(c: Calls, ns: str) -> None:
        fields = TensorDict({"a": torch.tensor([1, 2]), "b": torch.tensor([[1, 2], [3, 4]]),
                             "c": jagged([torch.arange(1), torch.arange(2)])}, batch_size=[2])
        fields.set("d", stack(["u", "v"]))
        c("put", "kv_batch_put", keys=["k0", "k1"], partition_id=ns, fields=fields, tags=[{}, {}])
        c("select list", "kv_batch_get", keys=["k1", "k0"], partition_id=ns, select_fields=["c", "a", "d"])
        c("select str", "kv_batch_get", keys=["k0"], partition_id=ns, select_fields="b")

    real, fake = run_both(real_tq, scenario)
    assert_same(real, fake)
    assert sorted(real.raw["select list"].keys()) == ["a", "c", "d"]
    assert list(real.raw["select str"].keys()) == ["b"]


def test_kv_list_per_partition(real_tq):
    def scenario(c: Calls, ns: str) -> None:
        c("put train", "kv_batch_put", keys=["t0", "t1"], partition_id=f"{ns}-train",
          fields=TensorDict({"x": torch.tensor([0, 1])}, batch_size=[2]), tags=[{"p": "train"}, {}])
        c("put val", "kv_batch_put", keys=["t0", "v1"], partition_id=f"{ns}-val",
          fields=TensorDict({"y": torch.tensor([5, 6])}, batch_size=[2]), tags=[{"p": "val"}, {}])
        c("list train", "kv_list", partition_id=f"{ns}-train")
        c("list val", "kv_list", partition_id=f"{ns}-val")
        all_partitions = c.client.kv_list()
        c.results["list all (ours)"] = {p: v for p, v in all_partitions.items() if p.startswith(ns)}
        c("get val t0", "kv_batch_get", keys=["t0"], partition_id=f"{ns}-val")

    real, fake = run_both(real_tq, scenario)
    assert_same(real, fake)
    ns = real_ns(real).rsplit("-", 1)[0]
    assert real.results["list train"] == {f"{ns}-train": {"t0": {"p": "train"}, "t1": {}}}
    assert list(real.results["list all (ours)"]) == [f"{ns}-train", f"{ns}-val"]
    assert real.raw["get val t0"]["y"].tolist() == [5]  # same key, other partition: separate record


def test_kv_clear(real_tq):
    def scenario(c: Calls, ns: str) -> None:
        c("put", "kv_batch_put", keys=["a", "b", "c", "d"], partition_id=ns,
          fields=TensorDict({"x": torch.arange(4)}, batch_size=[4]), tags=[{"t": i} for i in range(4)])
        c("clear some + unknown", "kv_clear", keys=["a", "nope"], partition_id=ns)
        c("clear str", "kv_clear", keys="b", partition_id=ns)
        c("clear unknown partition", "kv_clear", keys=["c"], partition_id=f"{ns}-none")
        c("list", "kv_list", partition_id=ns)
        c("get rest", "kv_batch_get", keys=["d", "c"], partition_id=ns)
        c("get cleared", "kv_batch_get", keys=["a"], partition_id=ns)
        c("re-put cleared key", "kv_batch_put", keys=["a"], partition_id=ns, tags=[{"fresh": True}])
        c("clear all", "kv_clear", keys=["a", "c", "d"], partition_id=ns)
        c("list after clear all", "kv_list", partition_id=ns)

    real, fake = run_both(real_tq, scenario)
    assert_same(real, fake)
    assert real.results["list"] == {real_ns(real): {"c": {"t": 2}, "d": {"t": 3}}}
    assert real.results["re-put cleared key"]["tags"] == [{"fresh": True}]  # no tags left over
    assert isinstance(real.results["get cleared"], Raised)
    assert real.results["list after clear all"] == {real_ns(real): {}}


def test_get_of_a_missing_key_or_partition_raises_value_error(real_tq):
    def scenario(c: Calls, ns: str) -> None:
        c("put", "kv_batch_put", keys=["a"], partition_id=ns,
          fields=TensorDict({"x": torch.tensor([1])}, batch_size=[1]), tags=[{}])
        c("missing key", "kv_batch_get", keys=["zz"], partition_id=ns)
        c("missing partition", "kv_batch_get", keys=["a"], partition_id=f"{ns}-none")

    real, fake = run_both(real_tq, scenario)
    assert_same(real, fake)
    for label in ("missing key", "missing partition"):
        # transfer_queue 0.1.11: ValueError("keys or partition were not found!") for both
        assert real.raw[label].type == "ValueError", real.raw[label]
        assert fake.raw[label].type == "ValueError", fake.raw[label]


def test_kv_batch_put_argument_errors_raise_in_both(real_tq):
    def scenario(c: Calls, ns: str) -> None:
        c("neither fields nor tags", "kv_batch_put", keys=["a"], partition_id=ns)
        c("rows != keys", "kv_batch_put", keys=["a", "b"], partition_id=ns,
          fields=TensorDict({"x": torch.zeros(3)}, batch_size=[3]), tags=[{}, {}])
        c("tags != keys", "kv_batch_put", keys=["a", "b"], partition_id=ns, tags=[{}])

    real, fake = run_both(real_tq, scenario)
    assert_same(real, fake)


# ---------------------------------------------------------------------------------- known differences

def test_get_without_select_returns_the_fields_common_to_all_keys(real_tq):
    def scenario(c: Calls, ns: str) -> None:
        c("put", "kv_batch_put", keys=["a", "b"], partition_id=ns,
          fields=TensorDict({"x": torch.tensor([1, 2])}, batch_size=[2]), tags=[{}, {}])
        c("add y to a", "kv_batch_put", keys=["a"], partition_id=ns,
          fields=TensorDict({"y": torch.tensor([9])}, batch_size=[1]))
        c("get both", "kv_batch_get", keys=["a", "b"], partition_id=ns)

    real, fake = run_both(real_tq, scenario)
    assert list(real.raw["get both"].keys()) == ["x"]
    assert_same(real, fake)


def test_get_with_some_keys_missing_returns_only_the_found_rows(real_tq):
    def scenario(c: Calls, ns: str) -> None:
        c("put", "kv_batch_put", keys=["a"], partition_id=ns,
          fields=TensorDict({"x": torch.tensor([1])}, batch_size=[1]), tags=[{}])
        c("get a + missing", "kv_batch_get", keys=["a", "missing"], partition_id=ns)

    real, fake = run_both(real_tq, scenario)
    assert real.raw["get a + missing"].batch_size == torch.Size([1])
    assert_same(real, fake)


def test_get_of_a_tags_only_key_raises(real_tq):
    def scenario(c: Calls, ns: str) -> None:
        c("tags only", "kv_batch_put", keys=["uid"], partition_id=ns, tags=[{"is_prompt": True}])
        c("get", "kv_batch_get", keys=["uid"], partition_id=ns)

    real, fake = run_both(real_tq, scenario)
    assert isinstance(real.results["get"], Raised)
    assert_same(real, fake)


def test_kv_list_of_an_unknown_partition_is_empty(real_tq):
    def scenario(c: Calls, ns: str) -> None:
        c("list unknown", "kv_list", partition_id=f"{ns}-never-used")

    real, fake = run_both(real_tq, scenario)
    assert real.results["list unknown"] == {}
    assert_same(real, fake)


def test_put_with_duplicate_keys_raises(real_tq):
    def scenario(c: Calls, ns: str) -> None:
        c("duplicate keys", "kv_batch_put", keys=["d", "d"], partition_id=ns,
          fields=TensorDict({"x": torch.tensor([1, 2])}, batch_size=[2]), tags=[{}, {}])

    real, fake = run_both(real_tq, scenario)
    assert isinstance(real.results["duplicate keys"], Raised)
    assert_same(real, fake)


def test_put_with_a_plain_dict_as_fields_raises(real_tq):
    def scenario(c: Calls, ns: str) -> None:
        c("dict fields", "kv_batch_put", keys=["e"], partition_id=ns, fields={"x": torch.tensor([[1]])}, tags=[{}])

    real, fake = run_both(real_tq, scenario)
    assert isinstance(real.results["dict fields"], Raised)
    assert_same(real, fake)


def test_put_of_a_batch_wide_non_tensor_field_raises(real_tq):
    def scenario(c: Calls, ns: str) -> None:
        fields = TensorDict({"x": torch.tensor([1, 2])}, batch_size=[2])
        fields.set_non_tensor("const", "same for every row")
        c("batch-wide non-tensor", "kv_batch_put", keys=["c1", "c2"], partition_id=ns, fields=fields, tags=[{}, {}])

    real, fake = run_both(real_tq, scenario)
    assert isinstance(real.results["batch-wide non-tensor"], Raised)
    assert_same(real, fake)


def test_select_of_an_unknown_field_returns_an_empty_tensordict(real_tq):
    def scenario(c: Calls, ns: str) -> None:
        c("put", "kv_batch_put", keys=["a"], partition_id=ns,
          fields=TensorDict({"x": torch.tensor([1])}, batch_size=[1]), tags=[{}])
        c("select unknown", "kv_batch_get", keys=["a"], partition_id=ns, select_fields=["nofield"])

    real, fake = run_both(real_tq, scenario)
    assert real.raw["select unknown"].batch_size == torch.Size([0])
    assert_same(real, fake)


def test_meta_fields_of_a_put_are_the_fields_common_to_all_keys(real_tq):
    def scenario(c: Calls, ns: str) -> None:
        c("put", "kv_batch_put", keys=["a", "b"], partition_id=ns,
          fields=TensorDict({"x": torch.tensor([1, 2])}, batch_size=[2]), tags=[{}, {}])
        c("add y to a", "kv_batch_put", keys=["a"], partition_id=ns,
          fields=TensorDict({"y": torch.tensor([9])}, batch_size=[1]))
        c("tags a+b", "kv_batch_put", keys=["a", "b"], partition_id=ns, tags=[{}, {}])
        c("tags a+new", "kv_batch_put", keys=["a", "new"], partition_id=ns, tags=[{}, {}])

    real, fake = run_both(real_tq, scenario)
    assert real.results["tags a+b"]["fields"] == ["x"]
    assert real.results["tags a+new"]["fields"] == []
    assert_same(real, fake)


def test_an_empty_key_list_raises(real_tq):
    def scenario(c: Calls, ns: str) -> None:
        c("put", "kv_batch_put", keys=["a"], partition_id=ns,
          fields=TensorDict({"x": torch.tensor([1])}, batch_size=[1]), tags=[{}])
        c("get []", "kv_batch_get", keys=[], partition_id=ns)
        c("clear []", "kv_clear", keys=[], partition_id=ns)

    real, fake = run_both(real_tq, scenario)
    assert isinstance(real.results["get []"], Raised) and isinstance(real.results["clear []"], Raised)
    assert_same(real, fake)


def test_keys_as_a_tuple_raise(real_tq):
    def scenario(c: Calls, ns: str) -> None:
        c("tuple keys", "kv_batch_put", keys=("a", "b"), partition_id=ns, tags=[{}, {}])

    real, fake = run_both(real_tq, scenario)
    assert isinstance(real.results["tuple keys"], Raised)
    assert_same(real, fake)
