"""Content fingerprints: digests of the files and objects that shape what a rollout generates.

A run's config values say *which* tokenizer, model and data a run uses, not *what* they hold: a
dataset rewritten in place, a checkpoint or tokenizer re-saved at the same path, a changed chat
template, another commit of the training code all leave the values equal. Beside the values, a
run's fingerprint therefore records digests of

* the tokenizer: its files in a local directory (``tokenizer.json``, ``vocab``/``merges``, the
  tokenizer config without its chat template ...) and, apart, its chat template;
* the model's config (``config.json`` / ``generation_config.json``) and, with the role option
  ``fingerprint_weights: true``, its weight files (sampled, see :data:`SAMPLE_BYTES`);
* the training data files: size, modification time and a hash (the whole file up to
  :data:`FULL_HASH_BYTES`, else its first, middle and last :data:`SAMPLE_BYTES`);
* the code revision of the git work tree the run starts in: HEAD's commit and whether tracked files
  have uncommitted changes.

What :class:`ContentSources` names is read once per run when a role that serves calls is bound;
nothing is downloaded (a hub id is recorded as the id). A path that does not exist is recorded as
missing, an unreadable file as unreadable; neither stops a run. The digests are fingerprint values
under keys starting with :data:`CONTENT_PREFIX`; an entry compares them only where it recorded
them too (entries written before stepskip recorded content are not mismatches), and
:func:`describe_change` says what changed in words.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
import subprocess
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from stepskip.config import select
from stepskip.errors import SkipConfigError

__all__ = [
    "CONTENT_PREFIX", "FULL_HASH_BYTES", "SAMPLE_BYTES", "ContentSources", "content_digests", "describe_change",
    "file_digest", "code_revision",
]

logger = logging.getLogger(__name__)

#: Fingerprint keys holding content digests start with this; they are compared only when both the
#: entry and the run have them.
CONTENT_PREFIX = "content."
TOKENIZER = "content.tokenizer"
CHAT_TEMPLATE = "content.chat_template"
MODEL_CONFIG = "content.model_config"
MODEL_WEIGHTS = "content.model_weights"
DATA = "content.data"
CODE = "content.code"

#: Files up to this size are hashed whole; bigger ones are sampled (first, middle and last
#: :data:`SAMPLE_BYTES`) and their modification time counts as well.
FULL_HASH_BYTES = 4 << 20
#: The size of each window a sampled file is hashed on.
SAMPLE_BYTES = 64 << 10
#: Tokenizer and model-config files up to this size are hashed whole (a tokenizer.json is ~10 MiB).
TOKENIZER_FULL_BYTES = 64 << 20
#: JSON files parsed to leave out what a re-save changes without changing the content.
_JSON_PARSE_BYTES = 64 << 20
#: More data or weight files than this are recorded as one (:func:`_collapse`) under this name.
_MAX_LISTED_FILES = 16
ALL_FILES = "(all files)"
#: The most files of a data directory taken into its digest.
_DIR_MAX_FILES = 10_000
#: How long ``git status`` may take before the revision is read from ``.git`` alone (no dirty flag).
GIT_TIMEOUT = 10.0

_TOKENIZER_NAME = re.compile(r"^(tokenizer.*|vocab.*|merges.*|special_tokens_map\.json|added_tokens\.json"
                             r"|spiece\.model|.*\.tiktoken|sentencepiece.*\.model|preprocessor_config\.json"
                             r"|processor_config\.json)$")
_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
_MODEL_CONFIG_FILES = ("config.json", "generation_config.json")
_WEIGHT_NAME = re.compile(r".*\.(safetensors|bin|pt|pth|gguf|h5|msgpack|ckpt)$|.*\.safetensors\.index\.json$"
                          r"|.*\.bin\.index\.json$")
#: Keys a re-save rewrites although the model is the same (the library version, where it was saved from).
_VOLATILE_CONFIG_KEYS = frozenset({"transformers_version", "_name_or_path", "_commit_hash",
                                   "_attn_implementation_autoset", "_attn_implementation_internal"})
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_URL = re.compile(r"^[A-Za-z][\w+.-]*://")


# --------------------------------------------------------------------------- what to digest


@dataclass(frozen=True)
class ContentSources:
    """What shapes a run's generation beyond its config values, to be digested when the run starts.

    Args:
        tokenizer: a local tokenizer directory, a hub id (recorded as the id), or a tokenizer /
            processor object (TRL's ``processing_class``: its ``chat_template`` and the files of its
            ``name_or_path`` directory).
        model: a local model directory, a hub id, or a model object (its ``config`` and
            ``generation_config``; weights from its ``name_or_path`` directory).
        data_files: training data files or directories (local paths; URLs are recorded as given).
        chat_template: the template the run applies when it is not the tokenizer's own (verl's
            ``actor_rollout_ref.model.custom_chat_template``).
        model_config: a directory holding the model's ``config.json`` when it is not ``model``'s
            (verl's ``actor_rollout_ref.model.hf_config_path``).
        code: record the git revision of the work tree holding the current directory (True), of
            the one holding this directory (a path), or none (False).

    Example:
        >>> sources = ContentSources(tokenizer="Qwen/Qwen2.5-0.5B-Instruct", data_files=["/no/such.parquet"], code=False)
        >>> content_digests(sources)["content.tokenizer"]
        {'id': 'Qwen/Qwen2.5-0.5B-Instruct'}
    """

    tokenizer: Any = None
    model: Any = None
    data_files: tuple[str, ...] = ()
    chat_template: Any = None
    model_config: str | None = None
    code: bool | str = True
    #: The digests read for one run: ``{"run": run id, (weights, code): digests ...}``.
    _memo: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        files: Any = self.data_files
        if files is None:
            files = ()
        elif isinstance(files, (str, os.PathLike)):
            files = (files,)
        if not isinstance(files, Iterable) or not all(isinstance(f, (str, os.PathLike)) for f in files):
            raise SkipConfigError(f"identity.content.data_files = {self.data_files!r} is not valid; expected a "
                                  "path or a list of paths of the training data")
        object.__setattr__(self, "data_files", tuple(os.fspath(f) for f in files))
        if not isinstance(self.code, (bool, str, os.PathLike)):
            raise SkipConfigError(f"identity.content.code = {self.code!r} is not valid; expected true (the "
                                  "current directory's git work tree), a directory, or false")
        if self.model_config is not None and not isinstance(self.model_config, (str, os.PathLike)):
            raise SkipConfigError(f"identity.content.model_config = {self.model_config!r} is not valid; "
                                  "expected a directory holding config.json")

    @classmethod
    def coerce(cls, value: Any) -> ContentSources | None:
        """``value`` as sources: itself, a mapping of the fields, or None.

        Raises:
            SkipConfigError: anything else, or a mapping with unknown or bad fields.
        """
        if value is None or isinstance(value, ContentSources):
            return value
        if isinstance(value, Mapping):
            known = ("tokenizer", "model", "data_files", "chat_template", "model_config", "code")
            unknown = sorted(set(map(str, value)) - set(known))
            if unknown:
                raise SkipConfigError(f"identity.content has unknown key(s) {', '.join(unknown)}; known keys: "
                                      f"{', '.join(known)}")
            return cls(**{str(k): v for k, v in value.items()})
        raise SkipConfigError(f"identity.content = {value!r} is not valid; expected a "
                              "stepskip._content.ContentSources or a mapping of its fields")

    @classmethod
    def from_verl_config(cls, config: Any) -> ContentSources:
        """verl's keys: ``actor_rollout_ref.model.{path, tokenizer_path, hf_config_path,
        custom_chat_template}`` and ``data.train_files``; the code of the current directory."""
        model = _as_path(select(config, "actor_rollout_ref.model.path"))
        files = select(config, "data.train_files")
        if files is not None and not isinstance(files, (str, os.PathLike)):
            try:
                files = [os.fspath(f) for f in files]
            except TypeError:
                files = None  # not paths: the config value itself stays in the fingerprint
        template = select(config, "actor_rollout_ref.model.custom_chat_template")
        return cls(tokenizer=_as_path(select(config, "actor_rollout_ref.model.tokenizer_path")) or model,
                   model=model, data_files=files or (), chat_template=template if isinstance(template, str) else None,
                   model_config=_as_path(select(config, "actor_rollout_ref.model.hf_config_path")))

    def digests(self, weights: bool = False, code: bool = True, run: Any = None) -> dict[str, Any]:
        """The content fingerprint values (see :func:`content_digests`); computed once per ``run``
        (a run id), so the roles of one run share one reading."""
        key = (weights, code)
        with self._lock:
            if run is None or self._memo.get("run") != run:
                self._memo.clear()
                self._memo["run"] = run
            cached = self._memo.get(key)
            if cached is None:
                cached = self._memo[key] = content_digests(self, weights=weights, code=code)
            return dict(cached)


def _as_path(value: Any) -> str | None:
    return os.fspath(value) if isinstance(value, (str, os.PathLike)) and os.fspath(value) else None


# --------------------------------------------------------------------------- digesting


def content_digests(sources: ContentSources, weights: bool = False, code: bool = True) -> dict[str, Any]:
    """The fingerprint values of ``sources``: one key per kind of content (``content.tokenizer``,
    ``content.chat_template``, ``content.model_config``, ``content.model_weights`` when ``weights``,
    ``content.data``, ``content.code`` when ``code`` and inside a git work tree).

    Never raises for what it reads: a missing path is ``{"missing": true}``, an unreadable file
    ``{"unreadable": true}``; a tokenizer or model object that fails to describe itself is left
    out (logged).

    Example:
        >>> content_digests(ContentSources(data_files=["/no/such/train.parquet"], code=False))
        {'content.data': {'/no/such/train.parquet': {'missing': True}}}
    """
    start = time.perf_counter()
    out: dict[str, Any] = {}
    if sources.tokenizer is not None:
        _guarded(out, "tokenizer", lambda: _tokenizer_digests(sources.tokenizer, sources.chat_template))
    elif sources.chat_template is not None:
        out[CHAT_TEMPLATE] = _template_digest([("explicit", sources.chat_template)])
    if sources.model is not None or sources.model_config is not None:
        _guarded(out, "model", lambda: _model_digests(sources.model, sources.model_config, weights))
    if sources.data_files:
        out[DATA] = _collapse({name: _data_digest(name) for name in sources.data_files})
    if code and sources.code is not False:
        revision = code_revision(os.getcwd() if sources.code is True else os.fspath(sources.code))
        if revision is not None:
            out[CODE] = revision
    logger.debug("content fingerprint read in %.1f ms: %s", 1000 * (time.perf_counter() - start), sorted(out))
    return out


def _guarded(out: dict[str, Any], what: str, compute: Any) -> None:
    """Add what ``compute`` gives; a user object that raises leaves its keys out (not compared)."""
    try:
        out.update(compute())
    except Exception as err:  # a tokenizer or model object of any library: its failure must not stop a run
        logger.warning("stepskip: the %s's content could not be digested (%s: %s); it is left out of the run "
                       "fingerprint", what, type(err).__name__, err)


def _local_dir(value: str) -> tuple[Path | None, dict[str, Any] | None]:
    """A local directory for ``value``, or the record of what it is instead (a hub id, a URL, missing)."""
    path = Path(os.path.expanduser(value))
    if path.is_dir():
        return path, None
    if path.exists():
        return None, {"not_a_directory": value}
    if _URL.match(value) or (_HUB_ID.match(value) and not value.startswith(".")):
        return None, {"id": value}
    return None, {"missing": value}


def _tokenizer_digests(tokenizer: Any, explicit_template: Any) -> dict[str, Any]:
    templates: list[tuple[str, Any]] = []
    if isinstance(tokenizer, (str, os.PathLike)):
        where = os.fspath(tokenizer)
    else:  # a tokenizer or processor object: the template it applies, the files it came from
        where = getattr(tokenizer, "name_or_path", None) or \
            getattr(getattr(tokenizer, "tokenizer", None), "name_or_path", None) or ""
        templates.append(("object", getattr(tokenizer, "chat_template", None)))
    directory, other = _local_dir(str(where)) if where else (None, {"id": type(tokenizer).__qualname__})
    out: dict[str, Any] = {}
    if directory is None:
        out[TOKENIZER] = other
    else:
        files: dict[str, Any] = {}
        for path in sorted(directory.iterdir()):
            name = path.name
            if not _TOKENIZER_NAME.match(name) or not path.is_file():
                continue
            if name == "tokenizer_config.json":
                files[name], template = _json_digest(path, drop=("chat_template",))
                if template is not None and not templates:
                    templates.append((name, template))
            else:
                files[name] = _hash_of(file_digest(path, TOKENIZER_FULL_BYTES))
        if not templates:
            for name in _TEMPLATE_FILES:
                if (directory / name).is_file():
                    templates.append((name, _hash_of(file_digest(directory / name, TOKENIZER_FULL_BYTES))))
        out[TOKENIZER] = {"files": files}
    if explicit_template is not None:
        templates = [("explicit", explicit_template)]
    if directory is not None or templates:
        out[CHAT_TEMPLATE] = _template_digest(templates)
    return out


def _template_digest(templates: list[tuple[str, Any]]) -> str:
    """One digest of the chat template(s) in use; ``"none"`` when there is none."""
    present = [(name, value) for name, value in templates if value is not None]
    if not present:
        return "none"
    h = xxhash.xxh3_128()
    for _name, value in present:
        h.update(_canonical_json(value).encode())
    return h.hexdigest()


def _model_digests(model: Any, config_dir: str | None, weights: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    where: str | None
    if model is None or isinstance(model, (str, os.PathLike)):
        where = os.fspath(model) if model is not None else None
        source = config_dir or where
        assert source is not None
        directory, other = _local_dir(source)
        if directory is None:
            out[MODEL_CONFIG] = other
        else:
            configs: dict[str, Any] = {}
            for name in _MODEL_CONFIG_FILES:
                if (directory / name).is_file():
                    configs[name] = _json_digest(directory / name, drop=_VOLATILE_CONFIG_KEYS)[0]
            out[MODEL_CONFIG] = configs
    else:  # a live model: the config it runs with, which may differ from the one on disk
        configs = {}
        for name, attr in (("config.json", "config"), ("generation_config.json", "generation_config")):
            value = getattr(model, attr, None)
            if value is not None and hasattr(value, "to_dict"):
                data = {k: v for k, v in value.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
                configs[name] = xxhash.xxh3_128_hexdigest(_canonical_json(data).encode())
        out[MODEL_CONFIG] = configs
        where = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    if weights:
        directory, other = _local_dir(where) if where else (None, {"id": type(model).__qualname__})
        if directory is None:
            out[MODEL_WEIGHTS] = other
        else:
            out[MODEL_WEIGHTS] = _collapse({path.name: file_digest(path, FULL_HASH_BYTES)
                                            for path in sorted(directory.iterdir())
                                            if _WEIGHT_NAME.match(path.name) and path.is_file()})
    return out


def _data_digest(name: str) -> dict[str, Any]:
    if _URL.match(name) and not name.startswith("file://"):
        return {"id": name}
    path = Path(os.path.expanduser(name.removeprefix("file://")))
    try:
        if path.is_dir():
            return _dir_digest(path)
    except OSError:
        return {"unreadable": True}
    return file_digest(path, FULL_HASH_BYTES)


def _collapse(records: dict[str, Any]) -> dict[str, Any]:
    """The records of many files as one (:data:`ALL_FILES`): every entry's ``meta.json`` holds them,
    and a thousand data shards must not make each one heavy. Modification times count only for
    sampled files, as they do file by file."""
    if len(records) <= _MAX_LISTED_FILES:
        return records
    h = xxhash.xxh3_128()
    total = 0
    for name, record in sorted(records.items()):
        kept = record if record.get("sampled") else {k: v for k, v in record.items() if k != "mtime"}
        h.update(_canonical_json([name, kept]).encode())
        total += int(record.get("size", 0) or 0)
    return {ALL_FILES: {"files": len(records), "size": total, "xxh3": h.hexdigest()}}


def _dir_digest(root: Path) -> dict[str, Any]:
    h = xxhash.xxh3_128()
    count = 0
    for folder, dirs, names in os.walk(root):
        dirs.sort()
        for name in sorted(names):
            if count >= _DIR_MAX_FILES:
                break
            path = Path(folder) / name
            record = file_digest(path, 0)
            h.update(_canonical_json([str(path.relative_to(root)), record]).encode())
            count += 1
    return {"dir": True, "files": count, "xxh3": h.hexdigest()}


def file_digest(path: str | os.PathLike[str], full_bytes: int = FULL_HASH_BYTES) -> dict[str, Any]:
    """Size, modification time (whole seconds) and an xxh3-128 hash of one file: of all of it up to
    ``full_bytes``, else of its first, middle and last :data:`SAMPLE_BYTES` (``sampled: true``).

    A path that does not exist is ``{"missing": true}``; one that is not a regular file (a FIFO, a
    device: opening it could block) ``{"special": true}``; one that cannot be read
    ``{"unreadable": true, "size": ...}``.

    Example:
        >>> file_digest("/no/such/file")
        {'missing': True}
    """
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return {"missing": True}
    except OSError:
        return {"unreadable": True}
    if not stat.S_ISREG(info.st_mode):
        return {"special": True}
    size = info.st_size
    out: dict[str, Any] = {"size": size, "mtime": int(info.st_mtime)}
    h = xxhash.xxh3_128()
    try:
        with open(path, "rb") as f:
            if size <= full_bytes:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
            else:
                h.update(size.to_bytes(8, "little"))
                for offset in (0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)):
                    f.seek(offset)
                    h.update(f.read(SAMPLE_BYTES))
                out["sampled"] = True
    except OSError:
        return {"unreadable": True, "size": size}
    out["xxh3"] = h.hexdigest()
    return out


def _hash_of(record: dict[str, Any]) -> Any:
    """A tokenizer file's digest: its hash, or its record when it has none (unreadable, special)."""
    return record.get("xxh3", record)


def _canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=repr, ensure_ascii=True)


def _json_digest(path: Path, drop: Iterable[str]) -> tuple[Any, Any]:
    """The digest of a JSON file's content without the ``drop`` keys, and the value of its
    ``chat_template`` (None when absent); a file that is not a JSON object is hashed as bytes."""
    record = file_digest(path, TOKENIZER_FULL_BYTES)
    if "xxh3" not in record or record.get("size", 0) > _JSON_PARSE_BYTES:
        return _hash_of(record), None
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return record["xxh3"], None
    if not isinstance(data, dict):
        return record["xxh3"], None
    dropped = set(drop)
    kept = {k: v for k, v in data.items() if k not in dropped}
    return xxhash.xxh3_128_hexdigest(_canonical_json(kept).encode()), data.get("chat_template")


# --------------------------------------------------------------------------- code revision


@dataclass
class _Revision:
    """A work tree's revision as last read, and what says it still holds: the stamps of HEAD, its
    branch and the index, and of every tracked file (taken before ``git status`` ran)."""

    git_stamp: tuple[Any, ...]
    tracked: list[str] | None  # None: too many files to stat, or git absent: ``git status`` runs each time
    file_stamp: tuple[Any, ...]
    revision: dict[str, Any]


_CODE_CACHE: dict[str, _Revision] = {}
_CODE_LOCK = threading.Lock()
#: Work trees with more tracked files than this are asked ``git status`` at every run start.
_STAT_MAX_FILES = 5_000


def _git_dirs(start: Path) -> tuple[Path, Path, Path] | None:
    """(work tree, git dir, common git dir) of the work tree holding ``start``, else None."""
    for folder in (start, *start.parents):
        dot = folder / ".git"
        try:
            if dot.is_dir():
                git_dir = dot
            elif dot.is_file():
                text = dot.read_text(errors="replace")[:4096].strip()
                if not text.startswith("gitdir:"):
                    return None
                git_dir = (folder / text.removeprefix("gitdir:").strip()).resolve()
            else:
                continue
            common = git_dir
            if (git_dir / "commondir").is_file():
                common = (git_dir / (git_dir / "commondir").read_text(errors="replace")[:4096].strip()).resolve()
            return folder, git_dir, common
        except OSError:
            return None
    return None


def _read_head(git_dir: Path, common: Path) -> tuple[str | None, Path | None]:
    """HEAD's commit read from the git files (loose refs, then packed-refs), and the ref file it names."""
    try:
        head = (git_dir / "HEAD").read_text(errors="replace")[:4096].strip()
    except OSError:
        return None, None
    if not head.startswith("ref:"):
        return (head if re.fullmatch(r"[0-9a-f]{40}([0-9a-f]{24})?", head) else None), None
    ref = head.removeprefix("ref:").strip()
    for base in (git_dir, common):
        try:
            value = (base / ref).read_text(errors="replace")[:128].strip()
        except OSError:
            continue
        return value or None, base / ref
    try:
        with open(common / "packed-refs", errors="replace") as f:
            for line in f:
                parts = line.split()
                if len(parts) == 2 and parts[1] == ref:
                    return parts[0], common / "packed-refs"
    except OSError:
        pass
    return None, None  # a branch with no commit yet


def _stamp(paths: Iterable[str | Path | None]) -> tuple[Any, ...]:
    out: list[Any] = []
    for path in paths:
        try:
            info = os.stat(path) if path is not None else None
            out.append((info.st_mtime_ns, info.st_size, info.st_ino) if info is not None else None)
        except OSError:
            out.append(None)
    return tuple(out)


def code_revision(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """``{"commit": ..., "dirty": ...}`` of the git work tree holding ``directory``, else None.

    ``dirty`` is whether tracked files differ from HEAD (``git status``, with a timeout); it is
    None when git is not installed, fails or takes longer than :data:`GIT_TIMEOUT` (the commit is
    then read from the ``.git`` files). The answer is kept while HEAD, its branch, the index and the
    tracked files (up to 5,000 of them) keep their modification times and sizes.

    Example:
        >>> code_revision("/") is None  # not inside a work tree
        True
    """
    try:
        start = Path(directory).resolve()
    except OSError:
        return None
    found = _git_dirs(start)
    if found is None:
        return None
    top, git_dir, common = found
    commit, ref_file = _read_head(git_dir, common)
    git_stamp = _stamp([git_dir / "HEAD", ref_file, git_dir / "index", common / "packed-refs"])
    with _CODE_LOCK:
        cached = _CODE_CACHE.get(str(top))
    tracked = cached.tracked if cached is not None and cached.git_stamp == git_stamp else None
    if tracked is None and shutil.which("git") is not None:
        tracked = _tracked_files(top)
    root = str(top)
    file_stamp = _stamp(os.path.join(root, name) for name in tracked) if tracked is not None else ()
    if cached is not None and tracked is not None and cached.git_stamp == git_stamp \
            and cached.file_stamp == file_stamp:
        return dict(cached.revision)
    dirty: bool | None = None
    status = _git_status(top)
    if status is not None:
        head, dirty = status
        commit = head or commit
    revision = {"commit": commit, "dirty": dirty}
    with _CODE_LOCK:
        _CODE_CACHE[str(top)] = _Revision(git_stamp, tracked if status is not None else None, file_stamp, revision)
    return dict(revision)


def _git(top: Path, *args: str) -> bytes | None:
    """``git -C top args`` 's output; None when git is absent, fails or takes too long."""
    git = shutil.which("git")
    if git is None:
        return None
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0", "LC_ALL": "C"}  # never rewrites the index
    try:
        proc = subprocess.run([git, "-C", str(top), *args], capture_output=True, timeout=GIT_TIMEOUT, env=env,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as err:
        logger.debug("git %s in %s failed: %s", args[0], top, err)
        return None
    if proc.returncode != 0:
        logger.debug("git %s in %s exited %d: %s", args[0], top, proc.returncode, proc.stderr[:500])
        return None
    return proc.stdout


def _tracked_files(top: Path) -> list[str] | None:
    out = _git(top, "ls-files", "-z")
    if out is None:
        return None
    names = [name for name in out.decode(errors="surrogateescape").split("\0") if name]
    return names if len(names) <= _STAT_MAX_FILES else None


def _git_status(top: Path) -> tuple[str | None, bool] | None:
    """(HEAD commit, dirty) from ``git status``; None when git is absent, refuses or is too slow."""
    out = _git(top, "status", "--porcelain=v2", "--branch", "--untracked-files=no")
    if out is None:
        return None
    commit: str | None = None
    dirty = False
    for line in out.decode(errors="replace").splitlines():
        if line.startswith("# branch.oid "):
            oid = line.split()[-1]
            commit = oid if oid != "(initial)" else None
        elif line and not line.startswith("#"):
            dirty = True
    return commit, dirty


# --------------------------------------------------------------------------- describing a change


def describe_change(key: str, recorded: Any, current: Any) -> list[str]:
    """What changed between an entry's content digest ``recorded`` and the run's ``current``, in
    words (``tokenizer chat template changed``, ``data file train.parquet changed (size 1234 ->
    1300)``); empty when the content is the same (e.g. only the modification time of a file hashed
    whole differs).

    Example:
        >>> describe_change("content.data", {"train.parquet": {"size": 1234, "mtime": 1, "xxh3": "a"}},
        ...                 {"train.parquet": {"size": 1300, "mtime": 2, "xxh3": "b"}})
        ['data file train.parquet changed (size 1234 -> 1300)']
    """
    if recorded == current:
        return []
    if key == CHAT_TEMPLATE:
        return [f"tokenizer chat template changed{_template_detail(recorded, current)}"]
    if key == CODE and isinstance(recorded, Mapping) and isinstance(current, Mapping):
        return _code_change(recorded, current)
    labels = {TOKENIZER: ("tokenizer", "tokenizer file"), MODEL_CONFIG: ("model config", "model config"),
              MODEL_WEIGHTS: ("model weights", "model weight file"), DATA: ("data", "data file")}
    if key in labels and isinstance(recorded, Mapping) and isinstance(current, Mapping):
        whole, each = labels[key]
        old_files, new_files = _files_of(key, recorded), _files_of(key, current)
        if old_files is None or new_files is None:
            return [f"{whole} changed ({_what(recorded)} -> {_what(current)})"]
        lines = []
        for name in sorted(set(old_files) | set(new_files), key=str):
            if name == ALL_FILES and name in old_files and name in new_files:
                detail = _file_change(old_files[name], new_files[name])
                if detail is not None:
                    lines.append(f"{each}s changed{detail}")
            elif name == ALL_FILES or (ALL_FILES in old_files) != (ALL_FILES in new_files):
                lines.append(f"{each}s changed ({_count(old_files)} files -> {_count(new_files)})")
                break
            elif name not in new_files:
                lines.append(f"{each} {name} is gone")
            elif name not in old_files:
                lines.append(f"{each} {name} is new")
            else:
                detail = _file_change(old_files[name], new_files[name])
                if detail is not None:
                    lines.append(f"{each} {name} changed{detail}")
        return lines
    return [f"{key}: recorded {recorded!r}, now {current!r}"]


def _files_of(key: str, value: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The per-file digests of a content value; None when it is not local files (an id, missing ...)."""
    if key == TOKENIZER:
        files = value.get("files")
        return files if isinstance(files, Mapping) else None
    if any(k in value for k in ("id", "missing", "not_a_directory")) and len(value) == 1:
        return None
    return value


def _count(files: Mapping[str, Any]) -> Any:
    collapsed = files.get(ALL_FILES)
    return collapsed.get("files") if isinstance(collapsed, Mapping) else len(files)


def _what(value: Mapping[str, Any]) -> str:
    for kind in ("id", "missing", "not_a_directory"):
        if kind in value and len(value) == 1:
            label = {"id": "id", "missing": "missing", "not_a_directory": "not a directory"}[kind]
            return f"{label} {value[kind]!r}" if kind != "missing" else f"missing at {value[kind]!r}"
    return "local files"


def _describe_file(value: Any) -> str:
    if not isinstance(value, Mapping):
        return "a hash" if isinstance(value, str) else repr(value)
    for flag in ("missing", "unreadable", "special", "dir"):
        if value.get(flag):
            return {"missing": "missing", "unreadable": "unreadable", "special": "not a regular file",
                    "dir": "a directory"}[flag]
    if "id" in value:
        return f"id {value['id']!r}"
    return f"size {value.get('size')}" if "size" in value else "a file"


def _file_change(old: Any, new: Any) -> str | None:
    """`` (size 1234 -> 1300)`` and the like, or None when the content is the same."""
    if old == new:
        return None
    if isinstance(old, str) and isinstance(new, str):  # tokenizer files and configs: a hash of the whole
        return ""
    if not (isinstance(old, Mapping) and isinstance(new, Mapping)):
        return f" ({_describe_file(old)} -> {_describe_file(new)})"
    kinds = [tuple(flag for flag in ("missing", "unreadable", "special", "dir", "id") if v.get(flag) is not None
                   and v.get(flag) is not False) for v in (old, new)]
    if kinds[0] != kinds[1]:
        return f" ({_describe_file(old)} -> {_describe_file(new)})"
    if "unreadable" in kinds[0] or "special" in kinds[0]:
        return None  # nothing was read either time: nothing to compare
    if old.get("size") != new.get("size"):
        return f" (size {old.get('size')} -> {new.get('size')})"
    if old.get("files") != new.get("files"):
        return f" ({old.get('files')} files -> {new.get('files')})"
    if old.get("xxh3") != new.get("xxh3"):
        return " (same size, other content)"
    if (old.get("sampled") or old.get("dir")) and old.get("mtime") != new.get("mtime"):
        # sampled bytes equal, but the file was rewritten: the bytes not sampled may differ
        return (f" (same size and sampled bytes, modified {_when(old.get('mtime'))} -> {_when(new.get('mtime'))}; "
                "a copy that did not keep modification times reads so too)")
    return None


def _when(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(value))
        except (OverflowError, OSError, ValueError):
            pass
    return repr(value)


def _template_detail(old: Any, new: Any) -> str:
    if old == "none":
        return " (none -> set)"
    if new == "none":
        return " (set -> none)"
    return ""


def _code_change(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    def short(value: Any) -> str:
        return value[:12] if isinstance(value, str) else repr(value)

    if old.get("commit") != new.get("commit"):
        return [f"code revision changed ({short(old.get('commit'))} -> {short(new.get('commit'))})"]
    dirty_old, dirty_new = old.get("dirty"), new.get("dirty")
    if isinstance(dirty_old, bool) and isinstance(dirty_new, bool) and dirty_old != dirty_new:
        state = {False: "clean", True: "with uncommitted changes"}
        return [f"code revision changed ({short(old.get('commit'))} {state[dirty_old]} -> {state[dirty_new]})"]
    return []
