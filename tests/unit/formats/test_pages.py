"""The page pool behind big decoded tensors: reuse only once nothing views a mapping, bounded idle memory."""

import gc
import os

import numpy as np
import pytest
import torch

from stepskip._formats import get_format
from stepskip._formats.pages import POOL, PagePool

MB = 1 << 20


def test_a_mapping_is_reused_only_after_every_view_of_it_is_gone():
    pool = PagePool(keep=64 * MB, min_bytes=MB)
    first = pool.empty((512, 1024), torch.int64)  # 4 MiB
    first.fill_(7)
    view, array = first[10:20], first[5].numpy()
    del first
    gc.collect()
    assert pool.idle_bytes == 0  # a view and a numpy view still use it
    second = pool.empty((512, 1024), torch.int64)
    assert pool.mapped == 2 and pool.reused == 0
    assert int(view.sum()) == 7 * 10 * 1024 and int(array.sum()) == 7 * 1024  # untouched by the new one
    del view, array
    gc.collect()
    assert pool.idle_bytes == 4 * MB
    third = pool.empty((512, 1024), torch.int64)
    assert pool.reused == 1 and pool.idle_bytes == 0
    assert third.data_ptr() != second.data_ptr()


def test_small_arrays_and_a_pool_that_keeps_nothing_use_the_ordinary_allocator():
    small = PagePool(keep=64 * MB, min_bytes=MB).empty((4, 4), torch.float32)
    off = PagePool(keep=0, min_bytes=MB)
    big = off.empty((1024, 1024), torch.float32)
    assert small.untyped_storage().resizable() and big.untyped_storage().resizable()
    del big
    gc.collect()
    assert off.idle_bytes == 0 and off.mapped == 0


def test_idle_memory_stays_under_keep_the_longest_idle_going_first():
    pool = PagePool(keep=10 * MB, min_bytes=MB)
    a, b, c = (pool.empty((n * MB,), torch.uint8) for n in (4, 4, 4))
    a_ptr = a.data_ptr()
    del a
    gc.collect()
    del b
    gc.collect()
    assert pool.idle_bytes == 8 * MB
    del c  # 12 MiB would be idle: a's mapping, idle longest, goes
    gc.collect()
    assert pool.idle_bytes == 8 * MB
    reused = [pool.empty((4 * MB,), torch.uint8) for _ in range(2)]
    assert a_ptr not in {t.data_ptr() for t in reused}


def test_a_mapping_is_taken_only_when_it_fits_without_wasting_much():
    pool = PagePool(keep=256 * MB, min_bytes=MB)
    big = pool.empty((64 * MB,), torch.uint8)
    del big
    gc.collect()
    held = pool.empty((8 * MB,), torch.uint8)  # 64 MiB for 8 would waste most of it: a new mapping
    assert pool.reused == 0 and pool.idle_bytes == 64 * MB
    also = pool.empty((63 * MB,), torch.uint8)
    assert pool.reused == 1 and held.numel() + also.numel() == 71 * MB


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int32, torch.int64, torch.float16,
                                   torch.bfloat16, torch.float32, torch.float64, torch.uint16])
def test_every_dtype_the_decoders_produce(dtype):
    out = PagePool(keep=64 * MB, min_bytes=1024).empty((64, 64), dtype)
    assert out.dtype == dtype and out.shape == (64, 64) and out.is_contiguous()
    out.zero_()
    assert not out.any()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_writes_its_own_copy():
    pool = PagePool(keep=64 * MB, min_bytes=MB)
    out = pool.empty((MB,), torch.uint8)
    out.fill_(1)
    child = os.fork()
    if child == 0:  # pragma: no cover - the child (numpy: torch's thread pool is not fork-safe)
        out.numpy()[:] = 2
        os._exit(0)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert int(out.max()) == 1  # MAP_PRIVATE: never shared with the child


def rollout(rows=256, width=8192, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width, (rows,), generator=gen)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    tokens = torch.randint(0, 150_000, (rows, width), generator=gen) * mask
    prompts = torch.randint(0, 150_000, (rows, 1024), generator=gen)
    return {"responses": tokens, "attention_mask": mask, "prompts": prompts,
            "input_ids": torch.cat([prompts, tokens], dim=1), "logp": torch.randn(rows, width) * mask}


def test_decoded_tensors_recycle_and_every_byte_is_rewritten():
    """Two decodes into the same recycled pages: the second entry's values, never the first's."""
    fmt = get_format("safe")
    first, second = rollout(seed=1), rollout(seed=2)
    files = [fmt.encode(fmt.freeze(value, copy=False)) for value in (first, second)]
    POOL.resume()  # a closed SkipManager (an earlier test) released it
    POOL.clear()  # no idle pages left by another test
    mapped, reused = POOL.mapped, POOL.reused
    decoded = fmt.decode(dict(files[0]))
    assert all(torch.equal(decoded[k], first[k]) for k in first)
    fresh = POOL.mapped - mapped
    assert fresh >= 3  # the trimmed responses and mask, the concatenated input_ids
    del decoded
    gc.collect()
    again = fmt.decode(dict(files[1]))
    assert POOL.reused - reused == fresh and POOL.mapped - mapped == fresh  # same shapes: the same pages
    for key, tensor in second.items():
        assert torch.equal(again[key], tensor), key
    assert np.array_equal(again["attention_mask"].numpy(), second["attention_mask"].numpy())


def test_the_manager_gives_idle_pages_back_when_it_closes(tmp_path):
    from skip_configs import training_config

    from stepskip import Batch, SkipManager

    class Loop:
        result = Batch.from_dict({"responses": torch.arange(8 * MB // 8).reshape(1024, -1)},
                                 non_tensors={"uid": [str(i // 2) for i in range(1024)]})

        @SkipManager.annotate(role="rollout")
        def generate_sequences(self, prompts):
            return self.result

    prompts = Batch.from_dict(non_tensors={"uid": [str(i // 2) for i in range(1024)]})
    SkipManager.init(training_config(tmp_path, compress="none"))
    SkipManager.set_step(1)
    Loop().generate_sequences(prompts)
    POOL.clear()
    out = Loop().generate_sequences(prompts)  # a hit of 8 MiB: its tensor file and its output in pages
    assert torch.equal(out.batch["responses"], Loop.result.batch["responses"])
    del out
    gc.collect()
    assert POOL.idle_bytes >= 8 * MB
    held = Loop().generate_sequences(prompts)
    SkipManager.close()
    assert POOL.idle_bytes == 0
    del held  # a batch still held at close: its pages are unmapped when it goes, not kept
    gc.collect()
    assert POOL.idle_bytes == 0
    SkipManager.reset()
    SkipManager.init(training_config(tmp_path, compress="none"))  # pages are kept for reuse again
    SkipManager.set_step(1)
    again = Loop().generate_sequences(prompts)
    del again
    gc.collect()
    assert POOL.idle_bytes >= 8 * MB
    SkipManager.reset()


def test_pooled_tensors_pickle_and_move_to_shared_memory_like_any_other():
    import pickle

    pool = PagePool(keep=64 * MB, min_bytes=MB)
    out = pool.empty((MB // 8,), torch.int64)
    out.copy_(torch.arange(MB // 8))
    assert torch.equal(pickle.loads(pickle.dumps(out)), torch.arange(MB // 8))
    out.share_memory_()  # copied into shared memory: the mapping is no longer used and goes back
    gc.collect()
    assert out.is_shared() and torch.equal(out, torch.arange(MB // 8)) and pool.idle_bytes == 2 * MB
    with pytest.raises(RuntimeError):
        pool.empty((MB // 8,), torch.int64).resize_(MB)


def test_an_array_freed_while_its_thread_holds_the_lock_is_filed_later_not_deadlocked():
    """The cyclic GC may free a pooled array anywhere, also inside the pool's own locked code."""
    pool = PagePool(keep=64 * MB, min_bytes=MB)
    out = pool.array((2 * MB,), np.uint8)
    with pool._lock:  # as if a GC pass ran inside _take: the finalizer must not wait for the lock
        del out
        gc.collect()
    assert pool.idle_bytes == 2 * MB  # filed by the next call that takes the lock
    pool.array((2 * MB,), np.uint8)
    assert pool.reused == 1


def test_numpy_views_of_an_array_keep_its_pages():
    pool = PagePool(keep=64 * MB, min_bytes=MB)
    out = pool.array((4, MB), np.uint8)
    out[:] = 7
    view = out[1:]
    del out
    gc.collect()
    assert pool.idle_bytes == 0
    pool.array((4, MB), np.uint8)[:] = 9  # a new mapping: the view's pages are still in use
    assert int(view.max()) == 7 and pool.reused == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_while_the_lock_is_held_gets_a_pool_of_its_own():
    pool = PagePool(keep=64 * MB, min_bytes=MB)
    with pool._lock:  # another thread of the parent inside the pool at the fork
        child = os.fork()
        if child == 0:  # pragma: no cover - the child
            pool.array((2 * MB,), np.uint8)[:] = 1
            os._exit(0 if pool.idle_bytes == 2 * MB else 1)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_released_pool_unmaps_what_comes_back_until_resumed():
    pool = PagePool(keep=64 * MB, min_bytes=MB)
    held = pool.array((2 * MB,), np.uint8)
    pool.release()
    del held
    gc.collect()
    assert pool.idle_bytes == 0
    plain = pool.empty((2 * MB,), torch.uint8)
    assert plain.untyped_storage().resizable()  # the ordinary allocator while released
    pool.resume()
    again = pool.empty((2 * MB,), torch.uint8)
    del again
    gc.collect()
    assert pool.idle_bytes == 2 * MB


def test_a_bad_keep_bytes_setting_is_named(monkeypatch, caplog):
    from stepskip._formats import pages

    monkeypatch.setenv("STEPSKIP_KEEP_BYTES", "4G")
    with caplog.at_level("WARNING", logger="stepskip._formats.pages"):
        assert pages._keep_bytes() == 4 << 30
    assert "STEPSKIP_KEEP_BYTES='4G' is not a number of bytes" in caplog.text
    monkeypatch.setenv("STEPSKIP_KEEP_BYTES", "0")
    assert pages._keep_bytes() == 0
