"""Content fingerprints: each digest turns a change of what shapes generation into a named mismatch,
and what cannot be read is recorded as such, never a crash."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from unprivileged import as_unprivileged, owned_tmp_dir

from stepskip import _content as content
from stepskip._content import FULL_HASH_BYTES, SAMPLE_BYTES, ContentSources, code_revision, content_digests, file_digest
from stepskip.errors import SkipConfigError
from stepskip._identity import RunIdentity, fingerprint_diff

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def write_json(path: Path, value: dict, **dump) -> None:
    path.write_text(json.dumps(value, **dump))


@pytest.fixture
def model_dir(tmp_path) -> Path:
    """A model directory as ``save_pretrained`` leaves it: tokenizer files, configs and a weight file."""
    path = tmp_path / "model"
    path.mkdir()
    write_json(path / "tokenizer.json", {"model": {"vocab": {"<pad>": 0, "a": 1, "b": 2}}})
    write_json(path / "tokenizer_config.json", {"pad_token": "<pad>", "chat_template": TEMPLATE,
                                                 "model_max_length": 64})
    write_json(path / "special_tokens_map.json", {"pad_token": "<pad>"})
    write_json(path / "config.json", {"hidden_size": 32, "rope_theta": 10000.0, "transformers_version": "4.57.0"})
    write_json(path / "generation_config.json", {"temperature": 1.0})
    (path / "model.safetensors").write_bytes(os.urandom(256 << 10))
    return path


def digests(sources: ContentSources, **kwargs) -> dict:
    return content_digests(sources, **kwargs)


def diff_after(sources: ContentSources, change, **kwargs) -> list[str]:
    before = digests(sources, **kwargs)
    change()
    return fingerprint_diff(before, digests(sources, **kwargs))


# --------------------------------------------------------------------------- tokenizer and template


def test_a_changed_tokenizer_file_is_named(model_dir):
    sources = ContentSources(tokenizer=str(model_dir), code=False)
    changed = diff_after(sources, lambda: write_json(model_dir / "tokenizer.json",
                                                     {"model": {"vocab": {"<pad>": 0, "a": 1, "c": 2}}}))
    assert changed == ["tokenizer file tokenizer.json changed"]


def test_a_changed_chat_template_is_named_as_such_and_nothing_else(model_dir):
    sources = ContentSources(tokenizer=str(model_dir), code=False)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())

    def edit() -> None:
        write_json(model_dir / "tokenizer_config.json", {**config, "chat_template": TEMPLATE + "{{ eos }}"})

    assert diff_after(sources, edit) == ["tokenizer chat template changed"]


def test_a_chat_template_file_and_verls_custom_template_count(model_dir):
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"pad_token": "<pad>"}))
    (model_dir / "chat_template.jinja").write_text(TEMPLATE)
    sources = ContentSources(tokenizer=str(model_dir), code=False)
    assert diff_after(sources, lambda: (model_dir / "chat_template.jinja").write_text(TEMPLATE + " ")) == [
        "tokenizer chat template changed"]
    custom = digests(ContentSources(tokenizer=str(model_dir), chat_template="{{ custom }}", code=False))
    assert fingerprint_diff(digests(sources), custom) == ["tokenizer chat template changed"]


def test_a_template_appearing_is_named(model_dir):
    write_json(model_dir / "tokenizer_config.json", {"pad_token": "<pad>"})
    sources = ContentSources(tokenizer=str(model_dir), code=False)
    assert digests(sources)["content.chat_template"] == "none"
    changed = diff_after(sources, lambda: (model_dir / "chat_template.jinja").write_text(TEMPLATE))
    assert changed == ["tokenizer chat template changed (none -> set)"]


def test_a_tokenizer_config_saved_again_with_the_same_content_is_no_change(model_dir):
    sources = ContentSources(tokenizer=str(model_dir), model=str(model_dir), code=False)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())

    def resave() -> None:
        write_json(model_dir / "tokenizer_config.json", dict(reversed(config.items())), indent=2)
        write_json(model_dir / "config.json", {"rope_theta": 10000.0, "hidden_size": 32,
                                                "transformers_version": "4.99.0"})

    assert diff_after(sources, resave) == []


def test_a_tokenizer_object_gives_its_template_and_its_directorys_files(model_dir):
    class Tokenizer:
        name_or_path = str(model_dir)
        chat_template = TEMPLATE

    tokenizer = Tokenizer()
    sources = ContentSources(tokenizer=tokenizer, code=False)
    before = digests(sources)
    assert set(before["content.tokenizer"]["files"]) == {"tokenizer.json", "tokenizer_config.json",
                                                        "special_tokens_map.json"}
    tokenizer.chat_template = "{{ other }}"  # set in code: the files did not change, the template in use did
    assert fingerprint_diff(before, digests(sources)) == ["tokenizer chat template changed"]


# --------------------------------------------------------------------------- model


def test_a_re_saved_model_config_with_another_value_is_named(model_dir):
    sources = ContentSources(model=str(model_dir), code=False)
    changed = diff_after(sources, lambda: write_json(model_dir / "config.json", {
        "hidden_size": 32, "rope_theta": 1000000.0, "transformers_version": "4.57.0"}))
    assert changed == ["model config config.json changed"]
    assert diff_after(sources, lambda: (model_dir / "generation_config.json").unlink()) == [
        "model config generation_config.json is gone"]


def test_verls_hf_config_path_is_where_the_config_is_read(model_dir, tmp_path):
    other = tmp_path / "config-only"
    other.mkdir()
    write_json(other / "config.json", {"hidden_size": 64})
    sources = ContentSources(model=str(model_dir), model_config=str(other), code=False)
    assert diff_after(sources, lambda: write_json(other / "config.json", {"hidden_size": 65})) == [
        "model config config.json changed"]


def test_weights_are_digested_only_with_fingerprint_weights(model_dir):
    sources = ContentSources(model=str(model_dir), code=False)
    assert "content.model_weights" not in digests(sources)
    weights = digests(sources, weights=True)["content.model_weights"]
    assert set(weights) == {"model.safetensors"} and weights["model.safetensors"]["size"] == 256 << 10

    def resave() -> None:
        (model_dir / "model.safetensors").write_bytes(os.urandom(256 << 10))

    assert diff_after(sources, resave, weights=True) == [
        "model weight file model.safetensors changed (same size, other content)"]


def test_big_weight_files_are_sampled_not_read_whole(tmp_path):
    big = tmp_path / "model-00001-of-00002.safetensors"
    with open(big, "wb") as f:
        f.truncate(FULL_HASH_BYTES * 4)
    record = file_digest(big)
    assert record["sampled"] is True and record["size"] == FULL_HASH_BYTES * 4


def test_a_live_model_gives_the_config_it_runs_with(model_dir):
    class Config:
        def __init__(self, **values) -> None:
            self.values = values

        def to_dict(self) -> dict:
            return dict(self.values)

    class Model:
        name_or_path = str(model_dir)
        config = Config(hidden_size=32, _name_or_path="somewhere", transformers_version="1")
        generation_config = Config(temperature=1.0)

    model = Model()
    sources = ContentSources(model=model, code=False)
    before = digests(sources, weights=True)
    assert set(before["content.model_config"]) == {"config.json", "generation_config.json"}
    assert "model.safetensors" in before["content.model_weights"]
    model.config = Config(hidden_size=32, _name_or_path="elsewhere", transformers_version="2")
    assert fingerprint_diff(before, digests(sources, weights=True)) == []
    model.generation_config = Config(temperature=0.7)
    assert fingerprint_diff(before, digests(sources, weights=True)) == [
        "model config generation_config.json changed"]


def test_hub_ids_are_recorded_as_ids_without_any_reading(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sources = ContentSources(tokenizer="Qwen/Qwen2.5-0.5B-Instruct", model="Qwen/Qwen2.5-0.5B-Instruct",
                             data_files=["hdfs://cluster/data/train.parquet"], code=False)
    assert digests(sources, weights=True) == {
        "content.tokenizer": {"id": "Qwen/Qwen2.5-0.5B-Instruct"},
        "content.model_config": {"id": "Qwen/Qwen2.5-0.5B-Instruct"},
        "content.model_weights": {"id": "Qwen/Qwen2.5-0.5B-Instruct"},
        "content.data": {"hdfs://cluster/data/train.parquet": {"id": "hdfs://cluster/data/train.parquet"}},
    }
    other = digests(ContentSources(tokenizer="Qwen/Qwen3-0.6B", code=False))
    assert fingerprint_diff({"content.tokenizer": {"id": "Qwen/Qwen2.5-0.5B-Instruct"}}, other) == [
        "tokenizer changed (id 'Qwen/Qwen2.5-0.5B-Instruct' -> id 'Qwen/Qwen3-0.6B')"]


# --------------------------------------------------------------------------- data files


def test_a_data_file_rewritten_in_place_with_the_same_size_is_named(tmp_path):
    data = tmp_path / "train.parquet"
    data.write_bytes(b"a" * 1234)
    sources = ContentSources(data_files=[str(data)], code=False)
    assert diff_after(sources, lambda: data.write_bytes(b"b" * 1234)) == [
        f"data file {data} changed (same size, other content)"]
    assert diff_after(sources, lambda: data.write_bytes(b"b" * 1300)) == [f"data file {data} changed (size 1234 -> 1300)"]


def test_a_big_data_file_is_sampled_and_its_rewrite_seen_by_bytes_or_by_time(tmp_path, monkeypatch):
    data = tmp_path / "train.parquet"
    size = FULL_HASH_BYTES * 3
    data.write_bytes(bytes(size))
    os.utime(data, (1_700_000_000, 1_700_000_000))
    sources = ContentSources(data_files=["train.parquet"], code=False)
    monkeypatch.chdir(tmp_path)  # a relative path, as a config names it
    before = digests(sources)
    assert before["content.data"]["train.parquet"]["sampled"] is True

    def patch(offset: int, stamp: int) -> None:
        with open(data, "r+b") as f:
            f.seek(offset)
            f.write(b"\x01")
        os.utime(data, (stamp, stamp))

    patch(size - 1, 1_700_000_000)  # in the last window: the bytes show it even at the same time
    assert fingerprint_diff(before, digests(sources)) == ["data file train.parquet changed (same size, other content)"]
    before = digests(sources)
    patch(SAMPLE_BYTES * 4, 1_700_000_100)  # between the windows: only the time shows it
    (line,) = fingerprint_diff(before, digests(sources))
    assert line.startswith("data file train.parquet changed (same size and sampled bytes, modified ")


def test_a_small_file_touched_but_unchanged_is_no_change(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "hi"}\n')
    sources = ContentSources(data_files=[str(data)], code=False)
    assert diff_after(sources, lambda: os.utime(data, (1, 1))) == []


def test_a_missing_data_file_is_recorded_as_missing_and_its_arrival_named(tmp_path):
    data = tmp_path / "train.parquet"
    sources = ContentSources(data_files=[str(data)], code=False)
    assert digests(sources) == {"content.data": {str(data): {"missing": True}}}
    assert diff_after(sources, lambda: data.write_bytes(b"x" * 10)) == [f"data file {data} changed (missing -> size 10)"]


def test_a_data_directory_is_digested_as_a_whole(tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    for i in range(3):
        (folder / f"part-{i}.parquet").write_bytes(bytes([i]) * 100)
    sources = ContentSources(data_files=[str(folder)], code=False)
    assert digests(sources)["content.data"][str(folder)]["files"] == 3
    assert diff_after(sources, lambda: (folder / "part-1.parquet").write_bytes(b"z" * 100)) == [
        f"data file {folder} changed (same size, other content)"]
    assert diff_after(sources, lambda: (folder / "part-3.parquet").write_bytes(b"z")) == [
        f"data file {folder} changed (3 files -> 4)"]


def test_an_unreadable_file_is_recorded_as_unreadable(tmp_path):
    with owned_tmp_dir() as owned:
        secret = owned / "train.parquet"
        secret.write_bytes(b"x" * 100)
        secret.chmod(0o000)
        record = as_unprivileged(lambda: file_digest(secret))
        assert record == {"unreadable": True, "size": 100}
        assert content.describe_change("content.data", {"f": record}, {"f": record}) == []
        assert file_digest(owned / "nothing") == {"missing": True}


def test_a_fifo_is_never_opened(tmp_path):
    fifo = tmp_path / "train.parquet"
    os.mkfifo(fifo)
    assert file_digest(fifo) == {"special": True}  # opening it would wait for a writer


# --------------------------------------------------------------------------- code revision


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env=env).stdout.strip()


@pytest.fixture
def repo(tmp_path) -> Path:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    path = tmp_path / "repo"
    path.mkdir()
    git(path, "init", "-q", "-b", "main")
    (path / "train.py").write_text("print('v1')\n")
    git(path, "add", "train.py")
    git(path, "commit", "-q", "-m", "v1")
    (path / "pkg").mkdir()
    return path


def test_a_commit_and_uncommitted_changes_are_named(repo):
    sources = ContentSources(code=str(repo / "pkg"))  # any directory inside the work tree
    first = digests(sources)
    assert first == {"content.code": {"commit": git(repo, "rev-parse", "HEAD"), "dirty": False}}
    (repo / "train.py").write_text("print('v2')\n")
    dirty = digests(sources)
    short = first["content.code"]["commit"][:12]
    assert fingerprint_diff(first, dirty) == [f"code revision changed ({short} clean -> with uncommitted changes)"]
    git(repo, "commit", "-q", "-am", "v2")
    second = digests(sources)
    assert fingerprint_diff(first, second) == [
        f"code revision changed ({short} -> {second['content.code']['commit'][:12]})"]
    (repo / "untracked.txt").write_text("scratch")  # untracked files are not the code's state
    assert fingerprint_diff(second, digests(sources)) == []


def test_without_git_the_commit_is_read_from_the_git_files(repo, monkeypatch):
    head = git(repo, "rev-parse", "HEAD")
    git(repo, "pack-refs", "--all")  # the branch now lives in packed-refs only
    monkeypatch.setenv("PATH", "")
    content._CODE_CACHE.clear()
    assert code_revision(repo) == {"commit": head, "dirty": None}
    # unknown dirtiness is not a difference
    assert fingerprint_diff({"content.code": {"commit": head, "dirty": False}},
                            {"content.code": {"commit": head, "dirty": None}}) == []


def test_a_linked_worktree_is_found_through_its_git_file(repo, tmp_path):
    linked = tmp_path / "linked"
    git(repo, "worktree", "add", "-q", "-b", "side", str(linked))
    assert code_revision(linked)["commit"] == git(repo, "rev-parse", "HEAD")


def test_outside_a_work_tree_there_is_no_code_revision(tmp_path):
    assert code_revision(tmp_path) is None
    assert digests(ContentSources(code=str(tmp_path))) == {}


def test_a_git_that_fails_leaves_the_commit_from_the_files(repo, monkeypatch):
    head = git(repo, "rev-parse", "HEAD")
    fake = repo.parent / "bin"
    fake.mkdir()
    (fake / "git").write_text("#!/bin/sh\necho broken >&2\nexit 3\n")
    (fake / "git").chmod(0o755)
    monkeypatch.setenv("PATH", str(fake))
    content._CODE_CACHE.clear()
    assert code_revision(repo) == {"commit": head, "dirty": None}


# --------------------------------------------------------------------------- the rule for old entries


def test_entries_without_content_digests_are_not_mismatches():
    now = {"data.seed": 1, "content.code": {"commit": "a" * 40, "dirty": False}, "content.chat_template": "ab"}
    assert fingerprint_diff({"data.seed": 1}, now) == []
    assert fingerprint_diff(now, {"data.seed": 1}) == []  # e.g. recorded with weights, replayed without
    assert fingerprint_diff({"data.seed": 1}, {**now, "data.seed": 2}) == ["data.seed: recorded 1, now 2"]


@pytest.mark.parametrize("garbage", [None, 3, "x", [1, 2], {"files": 3}, {"a.parquet": "zz"}, {"a": {"size": []}}])
def test_a_recorded_content_value_of_any_shape_is_compared_without_crashing(garbage):
    for key in ("content.tokenizer", "content.chat_template", "content.model_config", "content.model_weights",
                "content.data", "content.code"):
        lines = fingerprint_diff({key: garbage}, {key: {"a.parquet": {"size": 1, "mtime": 1, "xxh3": "b"}}})
        assert all(isinstance(line, str) for line in lines)
        if key in ("content.data", "content.model_weights"):
            assert lines  # the digests differ


# --------------------------------------------------------------------------- sources


def test_verls_keys_name_the_sources():
    from omegaconf import OmegaConf

    config = OmegaConf.create({
        "actor_rollout_ref": {"model": {"path": "~/models/qwen", "tokenizer_path": None, "hf_config_path": None,
                                        "custom_chat_template": "{{ x }}"}},
        "data": {"train_files": ["~/data/a.parquet", "~/data/b.parquet"]},
    })
    sources = RunIdentity.from_config(config).content
    assert sources == ContentSources(tokenizer="~/models/qwen", model="~/models/qwen",
                                     data_files=("~/data/a.parquet", "~/data/b.parquet"), chat_template="{{ x }}")
    config.actor_rollout_ref.model.tokenizer_path = "/tok"
    config.actor_rollout_ref.model.hf_config_path = "/cfg"
    config.data.train_files = "~/data/a.parquet"
    sources = ContentSources.from_verl_config(config)
    assert (sources.tokenizer, sources.model, sources.model_config, sources.data_files) == (
        "/tok", "~/models/qwen", "/cfg", ("~/data/a.parquet",))


def test_sources_are_settable_through_an_identity_as_a_mapping(tmp_path):
    identity = RunIdentity("e", "p", content={"data_files": str(tmp_path / "t.jsonl"), "code": False})
    assert identity.content == ContentSources(data_files=(str(tmp_path / "t.jsonl"),), code=False)
    assert identity == RunIdentity("e", "p")  # content is what is digested, not who the run is
    with pytest.raises(SkipConfigError, match="identity.content has unknown key"):
        RunIdentity(content={"tokeniser": "x"})
    with pytest.raises(SkipConfigError, match="identity.content = 3"):
        RunIdentity(content=3)
    with pytest.raises(SkipConfigError, match="data_files"):
        ContentSources(data_files=[3])
    with pytest.raises(SkipConfigError, match="content.code"):
        ContentSources(code=3)


def test_one_run_reads_its_sources_once(tmp_path):
    data = tmp_path / "t.bin"
    data.write_bytes(b"1")
    sources = ContentSources(data_files=[str(data)], code=False)
    first = sources.digests(run="run-1")
    data.write_bytes(b"22")
    assert sources.digests(run="run-1") == first  # the second role of the same run
    assert sources.digests(run="run-2") != first  # the next run reads again


def test_many_files_are_recorded_as_one_record(tmp_path):
    shards = [tmp_path / f"part-{i:03d}.parquet" for i in range(40)]
    for shard in shards:
        shard.write_bytes(b"s" * 100)
    sources = ContentSources(data_files=[str(s) for s in shards], code=False)
    record = digests(sources)["content.data"]
    assert list(record) == ["(all files)"] and record["(all files)"]["files"] == 40
    assert diff_after(sources, lambda: shards[7].write_bytes(b"t" * 100)) == [
        "data files changed (same size, other content)"]
    assert diff_after(sources, lambda: shards[7].write_bytes(b"t" * 101)) == ["data files changed (size 4000 -> 4001)"]
    assert diff_after(sources, lambda: os.utime(shards[3], (5, 5))) == []  # small files: their bytes count, not times
    fewer = digests(ContentSources(data_files=[str(s) for s in shards[:3]], code=False))
    assert fingerprint_diff(digests(sources), fewer) == ["data files changed (40 files -> 3)"]
