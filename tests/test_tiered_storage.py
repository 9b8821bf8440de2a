"""Tables larger than memory (issue 26): the storage engine under a DRAM budget spills
blocks to an SSD tier (a file of block slots) and reads them back, invisibly to results.

The reference of every check is the same work without a budget (every block in DRAM),
compared bit for bit with numpy: rows, optimizer slots, statistics and losses. Budgets
are a small share of the table (a sixteenth at the engine, under a third in training),
above the blocks a step pins at once, so most blocks of a step come back from the SSD
tier; admission and eviction policies are on; training crosses a checkpoint restore and
runs on 1 and 2 ranks. A budget below the blocks a step pins fails in one line.
"""
import gc
import os
import re
import subprocess
import tempfile

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tf_fusedemb.benchmarks.tiered_fit import disk_read_bytes
from tf_fusedemb.ops import hashing
from tf_fusedemb.ops.embedding_engine import EmbeddingEngine
from tf_fusedemb.specs import (AdmissionPolicy, EvictionPolicy, FeatureSpec, FusionPlan,
                               InitializerSpec, OptimizerSpec, TableSpec, plan_fusion)
from tf_fusedemb.storage import initializers
from tf_fusedemb.storage.spill_dir import make_spill_path
from tf_fusedemb.testing import DistributedTestCase
from tf_fusedemb.testing.distributed import BatchLosses, rank_bounds, rank_dataset

DIM, INIT = 4, InitializerSpec.uniform(-0.1, 0.1)
OPTIMIZER = OptimizerSpec.adagrad(0.3)
NAMES = ("u", "v", "w")
POLICIES = {"u": dict(admission=AdmissionPolicy(2), eviction=EvictionPolicy(ttl_steps=4)),
            "v": {},
            "w": dict(eviction=EvictionPolicy(max_rows=150, every_steps=2))}
VOCAB, STEPS, HALF, GLOBAL_BATCH = 500, 16, 8, 64
BLOCK = 28 + 2 * 4 * DIM  # bytes of a block: header, row, accumulator
# Per table and rank; the group's engine gets the sum, 21,000 bytes: over the 18,840 bytes
# of blocks of the keys of three consecutive batches (a step's, the next one's, which the
# pipelined fit prefetches, and the previous one's, whose delayed updates it runs), the
# most a step pins at once. The table holds >= 3x the sum: asserted below.
TABLE_BUDGET = 7000
# The engine tests' budget: over the blocks of one update (at most 500 keys of 60 bytes).
ENGINE_BUDGET = 30_000


@pytest.fixture(autouse=True)
def spill_dirs_in_tmp_path(tmp_path, monkeypatch):
    """Tables without a spill_dir put their SSD tier in the system temp dir and remove it
    when destroyed or at interpreter exit, which a pytest-xdist worker skips: here the
    temp dir is the test's own, so nothing is left in the system's."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


# ---------------------------------------------------------------- the engine alone
def engines(budget):
    """(untiered engine, tiered engine with ``budget`` bytes) of one Adagrad table."""
    params = initializers._params(INIT)  # pylint: disable=protected-access
    return (EmbeddingEngine("plain", DIM, INIT, params, OPTIMIZER),
            EmbeddingEngine("tiered", DIM, INIT, params, OPTIMIZER, memory_budget_bytes=budget,
                            spill_path=make_spill_path("g", ["tiered"], None)))


def assert_same_export(a, b):
    """Every block of both tiers: keys, fields, rows and slots bit-equal."""
    for stored_only in (False, True):
        ea, eb = a.export(stored_only, True), b.export(stored_only, True)
        for name, x, y in zip(ea._fields, ea, eb):
            for u, v in (zip(x, y) if isinstance(x, tuple) else [(x, y)]):
                np.testing.assert_array_equal(u.numpy(), v.numpy(), err_msg=name)


def test_every_engine_call_answers_as_without_a_budget():
    """Random lookups, updates, statistics, row writes and removals on 10,000 keys with a
    budget of a sixteenth of the table: every output and the final state equal the
    untiered engine's; the DRAM tier stays near the budget and the SSD tier holds the rest."""
    plain, tiered = engines(budget=ENGINE_BUDGET)
    rng = np.random.default_rng(5)
    for step in range(1, 41):
        keys = np.unique(rng.integers(0, 10_000, 400))
        grads = rng.standard_normal((len(keys), DIM)).astype(np.float32)
        counts = rng.integers(1, 3, len(keys))
        probe = rng.integers(0, 5000, 300)
        outs = []
        for e in (plain, tiered):
            e.record(keys, keys % 3, keys, counts, step, True)
            out = [e.apply_gradients(keys, keys, grads, step, [3, 1, 2]), e.lookup(probe, probe),
                   *e.find(probe)]
            if step % 5 == 0:  # rows leave (statistics stay), statistics leave, rows arrive
                e.remove_rows(keys[::7])
                e.forget(keys[1::9])
                e.write_rows(keys[2::11] + 10_000, grads[2::11], grads[2::11, None, :])
            outs.append([t.numpy() for t in out])
        for x, y in zip(*outs):
            np.testing.assert_array_equal(x, y, err_msg=f"step {step}")
    assert_same_export(plain, tiered)
    size_a, size_b = plain.size(), tiered.size()
    assert [int(size_a.stored), int(size_a.tracked)] == [int(size_b.stored), int(size_b.tracked)]
    assert int(size_a.ssd_bytes) == 0
    # the rest is on SSD
    assert int(size_b.ssd_bytes) >= int(size_b.stored) * BLOCK - ENGINE_BUDGET
    assert int(size_a.bytes_held) >= 10 * ENGINE_BUDGET  # the table 10x the budget
    # DRAM: the budget plus one call's pinned blocks (400 keys of ~60 bytes, per shard).
    assert int(size_b.bytes_held) <= ENGINE_BUDGET + 2 * 400 * 92


def test_pinned_blocks_stay_in_dram_until_unpinned():
    plain, tiered = engines(budget=0)  # everything unpinned is spilled after each call
    keys = np.arange(100, dtype=np.int64)
    for e in (plain, tiered):
        e.apply_gradients(keys, keys, np.ones((100, DIM), np.float32), 1)
    assert int(tiered.size().ssd_bytes) == 100 * (28 + 2 * 4 * DIM)
    tiered.pin(keys[:10])
    tiered.pin(keys[:5])  # pins count: the first unpin keeps keys 0..4
    assert int(tiered.size().ssd_bytes) == 90 * (28 + 2 * 4 * DIM)
    tiered.unpin(keys[:10])
    assert int(tiered.size().ssd_bytes) == 95 * (28 + 2 * 4 * DIM)
    tiered.unpin(keys[:5])
    assert int(tiered.size().ssd_bytes) == 100 * (28 + 2 * 4 * DIM)
    assert_same_export(plain, tiered)


def test_a_block_read_back_then_erased_does_not_come_back_from_the_store():
    """A block read back from the store leaves a stale copy there (the DRAM block is
    authoritative): an export while it is pinned holds it once, with its new row; once it
    is erased in DRAM (a row without statistics removed) a later lookup does not find the
    stale copy."""
    plain, tiered = engines(budget=0)  # everything unpinned is spilled after each call
    keys = np.arange(50, dtype=np.int64)
    block = 28 + 2 * 4 * DIM
    for e in (plain, tiered):
        e.apply_gradients(keys, keys, np.ones((50, DIM), np.float32), 1)
    tiered.pin(keys[:20])  # read back into DRAM; the store keeps its copies
    for e in (plain, tiered):
        e.apply_gradients(keys[:20], keys[:20], np.full((20, DIM), 2.0, np.float32), 2)
    assert_same_export(plain, tiered)  # each block once, the DRAM one
    for e in (plain, tiered):
        e.remove_rows(keys[:10])  # untracked: the blocks are erased
    tiered.unpin(keys[:20])
    assert int(tiered.size().ssd_bytes) == 40 * block
    assert_same_export(plain, tiered)
    np.testing.assert_array_equal(plain.lookup(keys, keys).numpy(),
                                  tiered.lookup(keys, keys).numpy())


def trained_engines(budget):
    """engines(budget) after the same statistics and updates of 3,000 keys, with
    admission leaving some keys tracked without a row (header-only blocks)."""
    plain, tiered = engines(budget)
    rng = np.random.default_rng(9)
    for step in range(1, 11):
        keys = np.unique(rng.integers(0, 3000, 500))
        grads = rng.standard_normal((len(keys), DIM)).astype(np.float32)
        for e in (plain, tiered):
            e.record(keys, keys % 3, keys * 7 + 1, np.ones(len(keys), np.int64), step, True)
            e.apply_gradients(keys, keys, grads, step, [3, 1, 1])
    return plain, tiered


def exported(engine):
    """{key: (stored, table, id, count, last step, row, slots)} of every block."""
    out = engine.export(False, True)
    fields = [f.numpy() for f in out.fields]
    return {int(k): (*(f[i] for f in fields), tuple(out.values.numpy()[i]),
                     tuple(out.slots.numpy()[i].ravel()))
            for i, k in enumerate(out.keys.numpy())}


@pytest.mark.parametrize("writer", ["tiered", "untiered"])
def test_a_checkpoint_restores_every_block_onto_any_engine_and_world_size(tmp_path, writer):
    """write_checkpoint of a tiered engine (most blocks on SSD) holds every block of both
    tiers, moves none, and read_checkpoint puts them into a fresh engine, tiered or not,
    equal to the engine that never left DRAM; read by 2 ranks, each gets the blocks it
    owns (mix64(ID) mod 2), and together all of them. The untiered engine's checkpoint
    (its blocks written anew) reads back the same."""
    plain, tiered = trained_engines(budget=ENGINE_BUDGET)
    assert int(tiered.size().ssd_bytes) > int(plain.size().bytes_held) / 2
    assert int(plain.size().tracked) > int(plain.size().stored)  # header-only blocks too
    ckpt = str(tmp_path / "ckpt")
    (tiered if writer == "tiered" else plain).write_checkpoint(ckpt)
    assert_same_export(plain, tiered)  # the checkpoint moved no block
    blocks = int(plain.size().tracked)
    for budget in (None, ENGINE_BUDGET):
        fresh = engines(ENGINE_BUDGET)[budget is not None]
        assert int(fresh.read_checkpoint([ckpt], 0, 1)) == blocks
        assert_same_export(plain, fresh)
    want, got = exported(plain), {}
    for rank in (0, 1):
        part = engines(ENGINE_BUDGET)[0]
        part.read_checkpoint([ckpt], rank, 2)
        mine = exported(part)
        ids = np.array([v[2] for v in mine.values()], np.int64)
        assert len(mine) and (hashing.owner_rank(ids, 2) == rank).all()
        got.update(mine)
    assert got == want


def test_a_large_untiered_checkpoint_is_written_in_parallel_and_reads_back(tmp_path):
    """200,000 blocks: the checkpoint writer splits them into key ranges, one SST file per
    thread (from 65,536 blocks each), and the database ingests them all."""
    plain = engines(None)[0]
    keys = np.arange(200_000, dtype=np.int64) * 7919
    plain.record(keys, keys % 3, keys, np.ones(len(keys), np.int64), 1, True)
    grads = np.random.default_rng(4).standard_normal((len(keys), DIM)).astype(np.float32)
    plain.apply_gradients(keys, keys, grads, 1, [1, 1, 1])
    ckpt = str(tmp_path / "ckpt")
    plain.write_checkpoint(ckpt)
    fresh = engines(None)[0]
    assert int(fresh.read_checkpoint([ckpt], 0, 1)) == len(keys)
    assert_same_export(plain, fresh)


def test_a_tiered_checkpoint_larger_than_one_part_reads_back(tmp_path):
    """400,000 blocks, over 262,144 of them on SSD: the SSD tier writes its checkpoint in
    parts of its file (262,144 slots each), each its own SST file, with the DRAM tier's
    blocks as one more; the parts' key ranges overlap and the database merges them. Read
    back into an untiered engine, every block equals the engine that never left DRAM, as
    do the tiered engine's own export and stored keys, walked over its file in the same
    parts."""
    plain, tiered = engines(2_000_000)
    keys = np.random.default_rng(5).permutation(400_000).astype(np.int64) * 7919
    grads = np.random.default_rng(6).standard_normal((len(keys), DIM)).astype(np.float32)
    for lo in range(0, len(keys), 20_000):
        k, g = keys[lo:lo + 20_000], grads[lo:lo + 20_000]
        for e in (plain, tiered):
            e.record(k, k % 3, k, np.ones(len(k), np.int64), 1, True)
            e.apply_gradients(k, k, g, 1, [1, 1, 1])
    block_bytes = int(plain.size().bytes_held) // len(keys)  # every block holds a row
    on_ssd = int(tiered.size().ssd_bytes) // (block_bytes + 4)  # a slot: length, block
    assert on_ssd > 262_144, on_ssd
    ckpt = str(tmp_path / "ckpt")
    tiered.write_checkpoint(ckpt)
    assert len([f for f in os.listdir(ckpt) if f.endswith(".sst")]) >= 3  # DRAM + 2 parts
    fresh = engines(None)[0]
    assert int(fresh.read_checkpoint([ckpt], 0, 1)) == len(keys)
    assert_same_export(plain, fresh)
    assert_same_export(plain, tiered)  # an export walks the file in the same parts
    np.testing.assert_array_equal(tiered.stored_keys().numpy(), np.sort(keys))


def test_tiered_checkpoint_errors_name_what_is_wrong(tmp_path):
    plain, tiered = trained_engines(budget=ENGINE_BUDGET)
    ckpt = str(tmp_path / "ckpt")
    plain.write_checkpoint(str(tmp_path / "plain"))
    with pytest.raises(tf.errors.InternalError, match=f"cannot write the checkpoint at "
                       f"{tmp_path / 'plain'}"):
        plain.write_checkpoint(str(tmp_path / "plain"))  # exists already
    tiered.write_checkpoint(ckpt)
    with pytest.raises(tf.errors.InternalError, match=f"cannot write the checkpoint at {ckpt}"):
        tiered.write_checkpoint(ckpt)  # exists already
    params = initializers._params(INIT)  # pylint: disable=protected-access
    wider = EmbeddingEngine("wider", DIM + 1, INIT, params, OPTIMIZER)
    with pytest.raises(tf.errors.InvalidArgumentError, match="has 60 bytes; this engine's "
                       "blocks have 68"):
        wider.read_checkpoint([ckpt], 0, 1)
    missing = str(tmp_path / "missing")
    with pytest.raises(tf.errors.NotFoundError, match=f"checkpoint at {missing}"):
        plain.read_checkpoint([missing], 0, 1)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"rank 2 is not in \[0, 2\)"):
        plain.read_checkpoint([ckpt], 2, 2)


def test_the_spill_directory_is_private_and_removed_with_its_engine(tmp_path):
    params = initializers._params(INIT)  # pylint: disable=protected-access
    a, b = (EmbeddingEngine("t", DIM, INIT, params, OPTIMIZER, memory_budget_bytes=0,
                            spill_path=make_spill_path("g", ["t"], str(tmp_path)))
            for _ in range(2))
    assert a.spill_path != b.spill_path and os.path.dirname(a.spill_path) == str(tmp_path)
    a.apply_gradients([1, 2], [1, 2], np.ones((2, DIM), np.float32), 1)
    assert os.listdir(a.spill_path)  # the slot file
    path = a.spill_path
    del a
    gc.collect()
    assert not os.path.exists(path)


def test_an_unusable_spill_dir_fails_at_construction_naming_table_and_path(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    bad = str(blocker / "spill")
    spec = TableSpec("items", DIM, OPTIMIZER, memory_budget_bytes=1000, spill_dir=bad)
    with pytest.raises(ValueError) as err:
        build_layer_with([spec])
    message = str(err.value)
    assert "\n" not in message and "items" in message and bad in message


def test_an_unusable_spill_path_fails_when_the_engine_is_made_naming_engine_and_path(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    bad = str(blocker / "spill")
    params = initializers._params(INIT)  # pylint: disable=protected-access
    with pytest.raises(tf.errors.FailedPreconditionError) as err:
        EmbeddingEngine("unusable", DIM, INIT, params, OPTIMIZER, memory_budget_bytes=0,
                        spill_path=bad).size()
    message = err.value.message
    assert "\n" not in message and "unusable' at" in message and bad in message


@pytest.fixture
def small_disk(tmp_path):
    """A 1.5 MiB tmpfs (root only), unmounted afterwards."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1536k", "tmpfs",
                                            str(disk)], check=False).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_full_disk_fails_in_one_line_naming_engine_and_path_and_loses_no_checkpoint(
        tmp_path, small_disk):
    """The SSD tier's file grows until the disk is full: the spill that needs more space
    fails with one line naming the engine and the file (no SIGBUS from the mapping), the
    blocks stay in DRAM, and the checkpoint written before restores every block."""
    params = initializers._params(INIT)  # pylint: disable=protected-access
    plain = EmbeddingEngine("plain", DIM, INIT, params, OPTIMIZER)
    full = EmbeddingEngine("full", DIM, INIT, params, OPTIMIZER, memory_budget_bytes=0,
                           spill_path=str(small_disk / "store"))  # under the free-space check
    keys = np.arange(500, dtype=np.int64)
    grads = np.random.default_rng(3).standard_normal((len(keys), DIM)).astype(np.float32)
    for e in (plain, full):
        e.record(keys, keys % 3, keys, np.ones(len(keys), np.int64), 1, True)
        e.apply_gradients(keys, keys, grads, 1)
    ckpt = str(tmp_path / "ckpt")
    full.write_checkpoint(ckpt)
    many = np.arange(500, 40_500, dtype=np.int64)  # 40,000 blocks of 64 bytes: 2.5 MB
    with pytest.raises(tf.errors.OpError) as err:
        full.apply_gradients(many, many, np.ones((len(many), DIM), np.float32), 2)
    message = err.value.message
    assert "\n" not in message and "full' at" in message and str(small_disk) in message
    assert "No space left on device" in message
    assert int(full.size().stored) == 500 + len(many)  # nothing lost: still in DRAM
    fresh = EmbeddingEngine("fresh", DIM, INIT, params, OPTIMIZER)
    assert int(fresh.read_checkpoint([ckpt], 0, 1)) == len(keys)
    assert_same_export(plain, fresh)
    del full
    gc.collect()  # the store's file unmapped and removed before the unmount


@pytest.mark.parametrize("budget", [None, 0], ids=["untiered", "tiered"])
def test_a_checkpoint_onto_a_full_disk_fails_naming_its_path_and_leaves_no_directory(
        tmp_path, small_disk, budget):
    """A checkpoint larger than the disk fails in one line naming its directory, removes
    the directory it created (no half-written checkpoint is left to be restored), and the
    engine writes a whole one elsewhere afterwards."""
    params = initializers._params(INIT)  # pylint: disable=protected-access
    tier = {} if budget is None else dict(memory_budget_bytes=budget,
                                          spill_path=str(tmp_path / "store"))
    engine = EmbeddingEngine("e", DIM, INIT, params, OPTIMIZER, **tier)
    keys = np.arange(40_000, dtype=np.int64)  # 40,000 blocks of 60 bytes: 2.4 MB
    for at in range(0, len(keys), 400):  # calls within the tiered engine's budget of 0
        part = keys[at:at + 400]
        engine.record(part, part % 3, part, np.ones(len(part), np.int64), 1, True)
        engine.apply_gradients(part, part, np.ones((len(part), DIM), np.float32), 1)
    ckpt = small_disk / "ckpt"
    with pytest.raises(tf.errors.OpError) as err:
        engine.write_checkpoint(str(ckpt))
    message = err.value.message
    assert "\n" not in message and str(ckpt) in message and "No space left" in message
    assert not ckpt.exists()
    whole = str(tmp_path / "whole")
    engine.write_checkpoint(whole)
    fresh = EmbeddingEngine("fresh", DIM, INIT, params, OPTIMIZER)
    assert int(fresh.read_checkpoint([whole], 0, 1)) == len(keys)
    assert_same_export(engine, fresh)


def test_a_budget_below_one_batch_fails_in_one_line_naming_engine_and_sizes():
    """An update whose blocks exceed the budget fails (pinned, they could never be
    spilled: every step would read its blocks back at every call), in one line naming the
    engine, its tables, the budget and the bytes pinned; so does a prefetch that leaves
    more pinned. Nothing is lost, and smaller calls still run."""
    params = initializers._params(INIT)  # pylint: disable=protected-access
    plain = EmbeddingEngine("plain", DIM, INIT, params, OPTIMIZER)
    tiered = EmbeddingEngine("tiered", DIM, INIT, params, OPTIMIZER, memory_budget_bytes=1000,
                             spill_path=make_spill_path("g", ["a", "b"], None),
                             tables=["a", "b"])
    keys = np.arange(2000, dtype=np.int64)
    grads = np.ones((len(keys), DIM), np.float32)
    plain.apply_gradients(keys, keys, grads, 1)
    with pytest.raises(tf.errors.InvalidArgumentError) as err:
        tiered.apply_gradients(keys, keys, grads, 1)
    message = err.value.message
    assert "\n" not in message and "tiered' (tables a, b): a memory budget" in message
    assert f"budget of 1000 bytes is smaller than the {2000 * BLOCK} bytes" in message
    assert "raise memory_budget_bytes" in message and "lower the batch size" in message
    assert_same_export(plain, tiered)  # the update ran once; every block kept
    for at in range(0, len(keys), 16):  # 960 bytes a call: within the budget
        for e in (plain, tiered):
            e.apply_gradients(keys[at:at + 16], keys[at:at + 16], grads[at:at + 16], 2)
    assert_same_export(plain, tiered)
    tiered.prefetch(keys[:10])  # 600 bytes pinned
    with pytest.raises(tf.errors.InvalidArgumentError, match=f"smaller than the {20 * BLOCK} "):
        tiered.prefetch(keys[10:20])  # the next batch beside it: 1,200 bytes
    assert_same_export(plain, tiered)


def spilled_engine(name):
    """(untiered engine, tiered engine with a budget of 0, the tiered one's slot file) after
    the same statistics and updates of 100 keys: every block in the slot file."""
    params = initializers._params(INIT)  # pylint: disable=protected-access
    plain = EmbeddingEngine("plain", DIM, INIT, params, OPTIMIZER)
    tiered = EmbeddingEngine(name, DIM, INIT, params, OPTIMIZER, memory_budget_bytes=0,
                             spill_path=make_spill_path("g", [name], None))
    keys = np.arange(100, dtype=np.int64)
    for e in (plain, tiered):  # tracked: a checkpoint's reader assigns keys by (table, ID)
        e.record(keys, keys % 3, keys, np.ones(len(keys), np.int64), 1, True)
        e.apply_gradients(keys, keys, np.ones((100, DIM), np.float32), 1)
    assert int(tiered.size().ssd_bytes) == 100 * (28 + 2 * 4 * DIM)
    return plain, tiered, os.path.join(tiered.spill_path, "blocks.slots")


def drop_from_page_cache(file):
    """Writes ``file``'s pages to disk and drops them from the page cache, so the next read
    of the store comes from the disk (the read path of pages the cache lacks)."""
    fd = os.open(file, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_blocks_read_back_from_pages_the_page_cache_lacks_equal_the_untiered_rows():
    """A lookup whose blocks' pages are not in the page cache reads them from the disk
    (with a read call per block, not through the mapping) and returns the same rows."""
    plain, tiered, file = spilled_engine("uncached")
    keys = np.arange(100, dtype=np.int64)[::-1].copy()
    drop_from_page_cache(file)
    read = disk_read_bytes()
    got = tiered.lookup(keys, keys)
    if disk_read_bytes() == read:
        pytest.skip(f"the file system of {file} keeps its pages (tmpfs?): no read from disk")
    np.testing.assert_array_equal(got, plain.lookup(keys, keys))
    assert_same_export(plain, tiered)


@pytest.mark.parametrize("damage", ["truncated", "corrupt", "corrupt on disk"])
def test_a_damaged_slot_file_fails_in_one_line_naming_engine_and_path(damage):
    """A store file cut short or overwritten under the engine fails each call that reads it
    (a lookup reading blocks back, an export, the stored keys, a checkpoint) in one line
    naming the engine and the file: no SIGBUS from the mapping, no block of another key
    adopted, none dropped from a walk over the file. A checkpoint written before still
    holds every block."""
    plain, tiered, file = spilled_engine("damaged")
    ckpt = os.path.join(tempfile.gettempdir(), "ckpt")
    tiered.write_checkpoint(ckpt)
    if damage == "truncated":
        os.truncate(file, 0)
    else:
        with open(file, "r+b") as f:
            f.write(b"\x07" * os.path.getsize(file))
        if damage == "corrupt on disk":  # the lookup reads it with pread, not the mapping
            drop_from_page_cache(file)
    calls = {"lookup": lambda: tiered.lookup(np.arange(10, dtype=np.int64),
                                            np.arange(10, dtype=np.int64)),
             "export": lambda: tiered.export(False, True),
             "stored_keys": tiered.stored_keys,
             "checkpoint": lambda: tiered.write_checkpoint(ckpt + "2")}
    for call, run in calls.items():
        with pytest.raises(tf.errors.OpError) as err:
            run()
        message = err.value.message
        assert "\n" not in message and "damaged' at" in message and file in message, call
        assert ("is truncated" if damage == "truncated" else "is corrupt") in message, call
    assert not os.path.exists(ckpt + "2")  # the failed checkpoint left no directory
    fresh = EmbeddingEngine("fresh", DIM, INIT, initializers._params(INIT),  # pylint: disable=protected-access
                            OPTIMIZER)
    assert int(fresh.read_checkpoint([ckpt], 0, 1)) == 100
    assert_same_export(plain, fresh)


def test_specs_validate_and_round_trip_the_tier():
    with pytest.raises(ValueError, match="memory_budget_bytes needs storage 'engine'"):
        TableSpec("t", 4, OPTIMIZER, storage="tfra", memory_budget_bytes=10)
    with pytest.raises(ValueError, match="memory_budget_bytes must be None or an int >= 0"):
        TableSpec("t", 4, OPTIMIZER, memory_budget_bytes=-1)
    with pytest.raises(ValueError, match="spill_dir needs a memory_budget_bytes"):
        TableSpec("t", 4, OPTIMIZER, spill_dir="/tmp")
    tiered = plan_fusion([FeatureSpec(t.name, t) for t in table_specs(budget=TABLE_BUDGET)])
    plain = plan_fusion([FeatureSpec(t.name, t) for t in table_specs(budget=None)])
    assert FusionPlan.from_dict(tiered.to_dict()) == tiered
    assert len(tiered.groups) == 1 and tiered.groups[0].memory_budget_bytes == 3 * TABLE_BUDGET
    assert "memory_budget_bytes" not in str(plain.to_dict())  # old plans keep their fingerprint
    # A checkpoint's layout ignores the tier: tiered and untiered restore onto each other.
    assert tiered.fingerprint(policies=False) == plain.fingerprint(policies=False)
    mixed = [FeatureSpec("a", TableSpec("a", 4, OPTIMIZER, memory_budget_bytes=10)),
             FeatureSpec("b", TableSpec("b", 4, OPTIMIZER))]
    assert len(plan_fusion(mixed).groups) == 2  # tiered tables fuse only with tiered ones


# ---------------------------------------------------------------- training
def table_specs(budget, policies=True):
    return [TableSpec(n, DIM, OPTIMIZER, INIT, memory_budget_bytes=budget,
                      **(POLICIES[n] if policies else {}))
            for n in NAMES]


def build_layer_with(specs, pipeline=None, exchange=None):
    from tf_fusedemb.layers import FusedEmbedding  # pylint: disable=import-outside-toplevel
    from tf_fusedemb.models import FusedModel  # pylint: disable=import-outside-toplevel
    layer = FusedEmbedding([FeatureSpec(t.name, t) for t in specs], exchange=exchange)
    inputs = {t.name: tf_keras.Input([], dtype=tf.int64, name=t.name) for t in specs}
    emb = layer(inputs)
    logits = tf_keras.layers.Dense(1, use_bias=False, kernel_initializer="ones", trainable=False)(
        tf_keras.layers.Concatenate()([emb[t.name] for t in specs]))
    model = FusedModel(inputs, logits)
    model.compile(optimizer=tf_keras.optimizers.SGD(0.1), pipeline=pipeline,
                  loss=tf_keras.losses.BinaryCrossentropy(from_logits=True))
    return model, layer


def build_model(budget, pipeline=None, exchange=None):
    """(compiled FusedModel, its FusedEmbedding) of three tables, tiered or not; with a
    ``pipeline`` (which admits no policies) without policies."""
    return build_layer_with(table_specs(budget, policies=pipeline is None), pipeline, exchange)


def data(steps=STEPS):
    """Zipf-popular IDs over VOCAB per table (many keys per step, a long tail)."""
    rng = np.random.default_rng(11)
    n = steps * GLOBAL_BATCH
    x = {name: np.minimum(rng.zipf(1.3, n), VOCAB).astype(np.int64) + rng.integers(0, VOCAB, n) % 3
         for name in NAMES}
    x["v"] = rng.integers(0, 10 * VOCAB, n).astype(np.int64)  # uniform: most steps miss DRAM
    return x, (rng.random((n, 1)) < 0.5).astype(np.float32)


def fit_rank(model_and_layer, x, y, first, last, num_ranks=1, rank=0):
    """Fits global batches [first, last) on this rank's share; returns per-batch losses,
    the group's stored rows (with slots) and statistics, and memory()."""
    model, layer = model_and_layer
    lo, hi = first * GLOBAL_BATCH, last * GLOBAL_BATCH
    xs, ys = {k: v[lo:hi] for k, v in x.items()}, y[lo:hi]
    losses = BatchLosses()
    shares = [GLOBAL_BATCH // num_ranks] * num_ranks
    model.fit(rank_dataset((xs, ys), rank_bounds(len(ys), shares, rank)), epochs=1, verbose=0,
              callbacks=[losses])
    group = layer.groups[0]
    return {"losses": np.asarray(losses.losses), "rows": group.store.stored_rows().arrays(),
            "stats": group.store.statistics.export(), "memory": layer.memory()[group.group.name],
            "group": group.group.name}


def assert_bit_identical(got, want, what):
    np.testing.assert_array_equal(got["losses"], want["losses"], err_msg=f"{what}: losses")
    for part in ("rows", "stats"):
        assert sorted(got[part]) == sorted(want[part])
        for k, v in want[part].items():
            np.testing.assert_array_equal(got[part][k], v, err_msg=f"{what}: {part} {k}")


def restored(budget, ckpt):
    """A fresh model (tiered with ``budget`` or not) restored from ``ckpt``."""
    from tf_fusedemb.training import CheckpointManager  # pylint: disable=import-outside-toplevel
    model, layer = build_model(budget)
    model({n: tf.zeros([0], tf.int64) for n in NAMES})
    CheckpointManager(ckpt, model, model.optimizer).restore()
    return model, layer


def fit_in_halves(budget, x, y, ckpt=None, num_ranks=1, rank=0):
    """Fits steps [0, HALF) then [HALF, STEPS) (two epochs: Keras's logged loss is a
    running mean per epoch), saving a checkpoint to ``ckpt`` in between if given; returns
    (first half's results, second half's results)."""
    from tf_fusedemb.training import CheckpointManager  # pylint: disable=import-outside-toplevel
    model, layer = build_model(budget)
    first = fit_rank((model, layer), x, y, 0, HALF, num_ranks, rank)
    if ckpt is not None:
        CheckpointManager(ckpt, model, model.optimizer).save(HALF)
    return first, fit_rank((model, layer), x, y, HALF, STEPS, num_ranks, rank)


def test_training_with_a_budget_is_bit_identical_through_a_restore(tmp_path):
    x, y = data()
    want_first, want = fit_in_halves(None, x, y)
    assert want["memory"]["bytes"] >= 3 * 3 * TABLE_BUDGET  # the table is 3x the budget
    assert want["memory"]["ssd_bytes"] == 0
    ckpt = str(tmp_path / "ckpt")
    got_first, got = fit_in_halves(TABLE_BUDGET, x, y, ckpt)
    assert_bit_identical(got_first, want_first, "tiered, first half")
    assert_bit_identical(got, want, "tiered")
    # Most blocks are on SSD (DRAM holds the budget and the last step's pinned blocks).
    assert got["memory"]["ssd_bytes"] > want["memory"]["bytes"] / 2
    # The checkpoint holds the blocks in the SSD tier's own RocksDB checkpoint, not in
    # the shard's arrays.
    saved = os.path.join(ckpt, f"ckpt-{HALF}")
    assert os.listdir(os.path.join(saved, "blocks")) == [
        f"l0-{got['group']}-shard-0-of-1"]
    with np.load(os.path.join(saved, "shard-0-of-1.npz")) as shard:
        assert sorted(k.rsplit("/", 1)[1] for k in shard.files) == ["ssd_checkpoint", "step"]
    # Restored onto a tiered and onto an untiered model, training goes on identically.
    for budget in (TABLE_BUDGET, None):
        assert_bit_identical(fit_rank(restored(budget, ckpt), x, y, HALF, STEPS), want,
                             f"restored (budget {budget})")


def test_pipelined_fit_with_prefetch_is_bit_identical():
    """fit's pipelined mode (DBP: batch t+1's rows retrieved, and pinned in DRAM, during
    step t) with a budget just over the blocks it pins at once equals the same pipeline
    without one."""
    x, y = data()
    want = fit_rank(build_model(None, pipeline="dbp"), x, y, 0, STEPS)
    got = fit_rank(build_model(TABLE_BUDGET, pipeline="dbp"), x, y, 0, STEPS)
    assert_bit_identical(got, want, "dbp")
    assert got["memory"]["ssd_bytes"] > 0


def test_a_budget_below_a_batch_fails_training_in_one_line_and_loses_no_checkpoint(tmp_path):
    """Restored onto a model whose budget (300 bytes for the group) is below the blocks
    one batch pins, training fails at its first update in one line naming the tables,
    the budget, the bytes pinned and what to do; the checkpoint written before still
    holds every row as the untiered run trained it."""
    from tf_fusedemb.training import CheckpointManager  # pylint: disable=import-outside-toplevel
    x, y = data()
    want = fit_rank(build_model(None), x, y, 0, HALF)
    model, layer = build_model(TABLE_BUDGET)
    fit_rank((model, layer), x, y, 0, HALF)
    ckpt = str(tmp_path / "ckpt")
    CheckpointManager(ckpt, model, model.optimizer).save(HALF)
    with pytest.raises(tf.errors.InvalidArgumentError) as err:
        fit_rank(restored(100, ckpt), x, y, HALF, STEPS)
    lines = [line for line in str(err.value).splitlines() if "SSD tier" in line]
    assert len(lines) == 1, str(err.value)
    line = lines[0]
    assert "(tables u, v, w): a memory budget of 300 bytes is smaller than the" in line, line
    assert "raise memory_budget_bytes" in line and "lower the batch size" in line, line
    pinned = int(re.search(r"smaller than the (\d+) bytes", line).group(1))
    assert pinned % BLOCK == 0 and 300 < pinned <= 3 * GLOBAL_BATCH * BLOCK, line
    # Nothing checkpointed is lost: restored without a budget, every row as trained.
    _, plain = restored(None, ckpt)
    rows = plain.groups[0].store.stored_rows().arrays()
    assert sorted(rows) == sorted(want["rows"])
    for name, values in want["rows"].items():
        np.testing.assert_array_equal(rows[name], values, err_msg=name)


# ---------------------------------------------------------------- two ranks
def _two_rank_job(x, y, ckpt_one, ckpt_two):
    """On each of 2 ranks: fit untiered and tiered, the untiered run checkpointing at
    HALF; then fit on from the one-process tiered checkpoint (another world size) onto
    a tiered and an untiered model, and from the two-rank untiered one onto a tiered."""
    from tf_fusedemb.comm import get_communicator  # pylint: disable=import-outside-toplevel
    comm = get_communicator()
    on_rank = dict(num_ranks=comm.size, rank=comm.rank)
    plain = fit_in_halves(None, x, y, ckpt_two, **on_rank)
    tiered = fit_in_halves(TABLE_BUDGET, x, y, **on_rank)
    return {"plain": plain, "tiered": tiered,
            "from_two": fit_rank(restored(TABLE_BUDGET, ckpt_two), x, y, HALF, STEPS, **on_rank),
            "resharded": fit_rank(restored(TABLE_BUDGET, ckpt_one), x, y, HALF, STEPS, **on_rank),
            "resharded_plain": fit_rank(restored(None, ckpt_one), x, y, HALF, STEPS, **on_rank)}


class TwoRankTieredTest(DistributedTestCase):
    timeout = 600

    def test_two_ranks_with_a_budget_equal_two_ranks_without(self):
        x, y = data()
        work = self.get_temp_dir()
        fit_in_halves(TABLE_BUDGET, x, y, os.path.join(work, "one"))
        ranks = self.run_ranks(_two_rank_job, 2, (x, y, os.path.join(work, "one"),
                                                 os.path.join(work, "two")))
        for rank, r in enumerate(ranks):
            for half in (0, 1):
                assert_bit_identical(r["tiered"][half], r["plain"][half], f"rank {rank}")
            assert r["tiered"][1]["memory"]["ssd_bytes"] > 0
            assert_bit_identical(r["from_two"], r["plain"][1], f"rank {rank} restored")
            assert_bit_identical(r["resharded"], r["resharded_plain"], f"rank {rank} resharded")


def _hierarchical_job(x, y):
    """On each of 4 ranks (2 nodes x 2): fit untiered and tiered with the hierarchical
    exchange."""
    from tf_fusedemb.comm import get_communicator  # pylint: disable=import-outside-toplevel
    comm = get_communicator()
    return [fit_rank(build_model(budget, exchange="hierarchical"), x, y, 0, STEPS, comm.size,
                     comm.rank) for budget in (None, TABLE_BUDGET)]


class HierarchicalTieredTest(DistributedTestCase):
    timeout = 800

    def test_hierarchical_exchange_with_a_budget_equals_without(self):
        """4 local ranks seen as 2 nodes x 2 (TF_FUSEDEMB_TOPOLOGY, as in
        test_hierarchical_exchange): the two-stage exchange with a budget."""
        x, y = data()
        ranks = self.run_ranks(_hierarchical_job, 4, (x, y),
                               env={"TF_FUSEDEMB_TOPOLOGY": "2x2", "TF_NUM_INTRAOP_THREADS": "1"})
        for rank, (plain, tiered) in enumerate(ranks):
            assert_bit_identical(tiered, plain, f"rank {rank}")
