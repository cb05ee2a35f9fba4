"""``stepskip convert`` over entries whose bytes are intact but whose contents are invalid.

An entry rewritten with a jagged tensor whose offsets do not describe its values, and one with
a trim width far beyond its bytes, both with valid checksums (whoever writes a cache can compute
them): convert must report them as failures by name and convert the rest, never crash.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from cli_caches import SAFE_RUN
from tensordict import TensorDict

from stepskip import Batch
from stepskip._storage import EntryStore, LocalBackend
from stepskip.cli.convert import convert_cache
from stepskip.cache import open_cache as open_index
from stepskip._formats.safe import SafeFormat


def _rewrite(entry_dir: str, files: dict[str, bytes]) -> None:
    with open(os.path.join(entry_dir, "meta.json")) as fh:
        meta = {k: v for k, v in json.load(fh).items() if k != "files"}
    EntryStore(LocalBackend()).write_entry(entry_dir, files, meta)


def test_convert_reports_invalid_entries_and_converts_the_rest(copy_cache, tmp_path):
    dump = copy_cache("dump")
    for other in (f"{SAFE_RUN}/reward", "exp_verlfmt", "fx_verl"):
        shutil.rmtree(dump / other, ignore_errors=True)
    fmt = SafeFormat()
    bad_offsets = torch.nested.nested_tensor_from_jagged(torch.arange(5), torch.tensor([0, 4, 2, 5]))
    jagged = fmt.encode(fmt.freeze(Batch(batch=TensorDict({"responses": bad_offsets}, batch_size=[3]),
                                         non_tensor_batch={}, meta_info={}), copy=False))
    padded = torch.zeros(4, 64, dtype=torch.int64)
    padded[:, :2] = 9
    wide = fmt.encode(fmt.freeze(Batch(batch=TensorDict({"x": padded}, batch_size=[4]), non_tensor_batch={},
                                       meta_info={}), copy=False))
    tree = json.loads(wide["data.json"])
    tree["root"]["batch"]["entries"]["x"]["shape"] = [4, 10**9]
    wide["data.json"] = json.dumps(tree).encode()
    _rewrite(str(dump / SAFE_RUN / "1"), jagged)
    _rewrite(str(dump / SAFE_RUN / "2"), wide)

    report = convert_cache(open_index(str(dump)), open_index(str(tmp_path / "out")), to="verl")

    failed = {os.path.basename(f.source): f.error for f in report.failed}
    assert set(failed) == {"1", "2"}, failed
    assert "invalid jagged tensor" in failed["1"] and "responses" in failed["1"]
    assert "decode bound" in failed["2"] and "root.batch['x']" in failed["2"]
    assert report.converted  # every other entry still converted
    assert not os.path.exists(tmp_path / "out" / SAFE_RUN / "1" / "gen_batch.dp")
