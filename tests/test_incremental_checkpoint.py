"""Incremental checkpoints: a chain (a full checkpoint and deltas) restores bit for bit
what a full checkpoint of the same step restores, onto another number of ranks and with
a memory budget too; a broken chain is refused naming the link while the last complete
checkpoint still restores; pruning keeps what a kept checkpoint builds on.

The reference of every comparison is a full (non-incremental) checkpoint of the same
state, written by another manager into another directory, restored into another fresh
model, and the state of the model that saved both."""
import json
import os

import numpy as np
import pytest

import incremental_checkpoint_model as icm
from horovod_launch import horovodrun

WORKER = "tests/incremental_checkpoint_worker.py"


def _meta(path):
    with open(os.path.join(path, "meta.json")) as f:
        return json.load(f)


def _restored(path, **build):
    """The state of a fresh model (built as the saving one) restored from ``path``."""
    from tf_fusedemb.training import CheckpointManager
    model, layer = icm.build(**build)
    meta = CheckpointManager(os.path.dirname(path), model, model.optimizer).restore(path)
    return meta, icm.state(model, layer)


def _save_chain(tmp_path, model, layer, phases=3, full_every=10, max_to_keep=3):
    """Saves a full checkpoint and ``phases - 1`` deltas, ``icm.change`` between them, and
    a full reference of the last state; returns (chain dir, reference path, state)."""
    from tf_fusedemb.training import CheckpointManager
    chain = CheckpointManager(str(tmp_path / "chain"), model, model.optimizer,
                              max_to_keep=max_to_keep, incremental=True, full_every=full_every)
    for phase in range(phases):
        icm.change(model, layer, phase)
        chain.save(phase + 1, {"phase": phase})
    reference = CheckpointManager(str(tmp_path / "full"), model, model.optimizer)
    return str(tmp_path / "chain"), reference.save(phases), icm.state(model, layer)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tiered", [False, True], ids=["dram", "tiered"])
def test_chain_restores_what_a_full_checkpoint_restores(tmp_path, tiered):
    build = dict(budget=1500, spill_dir=str(tmp_path / "spill")) if tiered else {}
    model, layer = icm.build(**build)
    chain, reference, live = _save_chain(tmp_path, model, layer)
    metas = [_meta(os.path.join(chain, f"ckpt-{s}")) for s in (1, 2, 3)]
    assert [m["kind"] for m in metas] == ["full", "delta", "delta"]
    assert [m["base"] for m in metas] == [None, "ckpt-1", "ckpt-2"]
    assert [m["base_id"] for m in metas[1:]] == [m["id"] for m in metas[:2]]
    group = icm.engine_group(layer).group.name
    delta_blocks = os.path.join(chain, "ckpt-3", "blocks")
    assert os.listdir(delta_blocks) == [f"l0-{group}-shard-0-of-1"]  # the engine group only
    if tiered:  # the budget spilled blocks: the deltas read them back from the SSD tier
        assert int(icm.engine_group(layer).store.table.ssd_bytes().numpy()) > 0

    meta, got = _restored(os.path.join(chain, "ckpt-3"), **build)
    assert meta["state"] == {"phase": 2} and meta["kind"] == "delta"
    _, want = _restored(reference, **build)
    icm.assert_same(want, live, "full checkpoint vs the saving model")
    icm.assert_same(got, want, "chain vs full checkpoint")


@pytest.mark.timeout(900)
def test_chain_restores_onto_another_world_size(tmp_path):
    """1 rank's chain restored on 2 ranks (tiered and not), and 2 ranks' chain restored on
    1, each against a full checkpoint of the same step restored the same way."""
    model, layer = icm.build()
    chain, reference, _ = _save_chain(tmp_path, model, layer)
    out = tmp_path / "two"
    horovodrun([WORKER, "--restore", os.path.join(chain, "ckpt-3"), "--reference", reference,
                "--out", str(out), "--spill-dir", str(tmp_path / "spill")], 2, timeout=800)
    # The 2-rank job restored both (it asserts they are equal on every rank), trained on
    # and saved its own chain and reference: restore both here, on 1 rank.
    assert [_meta(os.path.join(out, "chain", f"ckpt-{s}"))["kind"] for s in (1, 2, 3)] == \
        ["full", "delta", "delta"]
    assert _meta(os.path.join(out, "chain", "ckpt-3"))["world_size"] == 2
    _, got = _restored(os.path.join(out, "chain", "ckpt-3"))
    _, want = _restored(os.path.join(out, "full", "ckpt-3"))
    icm.assert_same(got, want, "2-rank chain vs 2-rank full checkpoint, restored on 1 rank")


def test_broken_chain_is_refused_and_the_last_full_checkpoint_restores(tmp_path):
    from tf_fusedemb.training import CheckpointManager
    from tf_fusedemb.training import BrokenChainError
    model, layer = icm.build()
    chain, _, _ = _save_chain(tmp_path, model, layer, phases=4)
    fresh, _ = icm.build()
    manager = CheckpointManager(chain, fresh, fresh.optimizer)

    # A half-written link: a delta's shard file cut short.
    shard = os.path.join(chain, "ckpt-3", "shard-0-of-1.npz")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    with pytest.raises(BrokenChainError) as e:
        manager.restore()
    message = str(e.value)
    assert "\n" not in message and "cannot restore ckpt-4" in message
    assert "checkpoint ckpt-3 is half-written: shard-0-of-1.npz has" in message
    assert "ckpt-2 is the newest complete checkpoint" in message

    # A missing link: a delta's base deleted.
    import shutil
    shutil.rmtree(os.path.join(chain, "ckpt-1"))
    with pytest.raises(BrokenChainError, match=r"^cannot restore ckpt-2: checkpoint ckpt-1 is "
                                               r"missing; no complete checkpoint is left"):
        manager.restore(os.path.join(chain, "ckpt-2"))

    # The last full checkpoint still restores, and equals a full save of its state.
    model, layer = icm.build()
    icm.change(model, layer, 0)
    saved = CheckpointManager(str(tmp_path / "ok"), model, model.optimizer, incremental=True)
    saved.save(1)
    icm.change(model, layer, 1)
    saved.save(2)
    shutil.rmtree(os.path.join(tmp_path, "ok", "ckpt-2", "blocks"))
    fresh, fresh_layer = icm.build()
    restorer = CheckpointManager(str(tmp_path / "ok"), fresh, fresh.optimizer)
    with pytest.raises(BrokenChainError, match=r"ckpt-2 is half-written: blocks/l0-\S+ is "
                                               r"missing; ckpt-1 is the newest complete"):
        restorer.restore()
    assert restorer.restore(os.path.join(tmp_path, "ok", "ckpt-1"))["kind"] == "full"


def test_pruning_keeps_the_links_a_kept_checkpoint_builds_on(tmp_path):
    from tf_fusedemb.training import CheckpointManager
    model, layer = icm.build()
    manager = CheckpointManager(str(tmp_path), model, model.optimizer, max_to_keep=1,
                                incremental=True, full_every=3)
    kept = []
    for step in range(1, 8):
        icm.fit(model, step, 0, 50, n=16)
        manager.save(step)
        kept.append(sorted(n for n in os.listdir(tmp_path) if n.startswith("ckpt-")))
    # Saves 1, 4, 7 are full: each delta keeps its chain back to its full checkpoint.
    assert kept == [["ckpt-1"], ["ckpt-1", "ckpt-2"], ["ckpt-1", "ckpt-2", "ckpt-3"],
                    ["ckpt-4"], ["ckpt-4", "ckpt-5"], ["ckpt-4", "ckpt-5", "ckpt-6"],
                    ["ckpt-7"]]
    live = icm.state(model, layer)
    _, got = _restored(os.path.join(tmp_path, "ckpt-7"))
    icm.assert_same(got, live, "full checkpoint after pruning")


@pytest.mark.timeout(600)
def test_sharded_checkpoint_callback_incremental_resumes_exactly(tmp_path):
    """fit with ShardedCheckpoint(incremental=True) on a subclassed model; a fresh model's
    fit resumes from the chain and holds what the trained model held."""
    from tf_fusedemb.models import ShardedCheckpoint
    model, layer = icm.build(subclassed=True)
    x, y = icm.data(5, 96, 0, 80)
    directory = str(tmp_path / "ckpt")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False,
              callbacks=[ShardedCheckpoint(directory, every_steps=4, incremental=True,
                                           full_every=4, max_to_keep=2)])
    kinds = {n: _meta(os.path.join(directory, n))["kind"]
             for n in os.listdir(directory) if n.startswith("ckpt-")}
    assert "delta" in kinds.values() and "full" in kinds.values()
    live = icm.state(model, layer)
    fresh, fresh_layer = icm.build(subclassed=True)
    # Trained to the end already: fit restores the chain and runs no step.
    fresh.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False,
              callbacks=[ShardedCheckpoint(directory, every_steps=4, incremental=True)])
    icm.assert_same(icm.state(fresh, fresh_layer), live, "resumed from the chain")


def test_incremental_arguments_are_checked(tmp_path):
    from tf_fusedemb.training import CheckpointManager
    model, _ = icm.build()
    with pytest.raises(ValueError, match=r"^CheckpointManager: full_every must be an int >= 1, "
                                         r"got 0$"):
        CheckpointManager(str(tmp_path), model, incremental=True, full_every=0)
    with pytest.raises(ValueError, match=r"^CheckpointManager: incremental must be a bool"):
        CheckpointManager(str(tmp_path), model, incremental="yes")


@pytest.mark.parametrize("budget", [None, 6000], ids=["dram", "tiered"])
def test_engine_delta_writes_changed_blocks_and_deletions(tmp_path, monkeypatch, budget):
    """The engine alone: after a tracked full write, a delta holds exactly the keys that
    changed (by update, row write, statistics, row removal, forgetting), a deletion for
    each key gone; the full write then the delta read into a fresh engine (tiered or not)
    equal the engine, block for block. A delta is refused unless the engine records
    changes for its writer."""
    import tempfile
    import tensorflow as tf
    from tf_fusedemb.ops.embedding_engine import EmbeddingEngine
    from tf_fusedemb.specs import InitializerSpec, OptimizerSpec
    from tf_fusedemb.storage import initializers
    from tf_fusedemb.storage.spill_dir import make_spill_path
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # spill stores in the test's dir
    init, optimizer = InitializerSpec(), OptimizerSpec.adagrad(0.3)
    params = initializers._params(init)  # pylint: disable=protected-access

    def engine(name, tiered):
        if not tiered:
            return EmbeddingEngine(name, 4, init, params, optimizer)
        return EmbeddingEngine(name, 4, init, params, optimizer, memory_budget_bytes=budget,
                               spill_path=make_spill_path("g", [name], None))

    e = engine("e", budget is not None)
    keys = np.arange(1000, dtype=np.int64) * 7
    rng = np.random.default_rng(3)
    e.record(keys, keys % 2, keys, np.ones(len(keys), np.int64), 1, True)
    grads = rng.standard_normal((len(keys), 4)).astype(np.float32)
    for at in range(0, len(keys), 50):  # 3,000 bytes of blocks an update: within the budget
        e.apply_gradients(keys[at:at + 50], keys[at:at + 50], grads[at:at + 50], 1)
    refused = "the engine records no changes since a checkpoint of its blocks by this writer"
    with pytest.raises(tf.errors.FailedPreconditionError, match=refused):
        e.write_delta(str(tmp_path / "untracked"), "me")
    e.write_checkpoint(str(tmp_path / "full"), changes_for="me")
    assert bool(e.records_changes_for("me")) and not bool(e.records_changes_for("other"))
    with pytest.raises(tf.errors.FailedPreconditionError, match=refused):
        e.write_delta(str(tmp_path / "other"), "other")
    updated, written, removed, forgotten = keys[:50], keys[100:110], keys[200:210], keys[205:210]
    e.apply_gradients(updated, updated, np.ones((50, 4), np.float32), 2)
    e.write_rows(written, np.full((10, 4), 0.5, np.float32), np.zeros((10, 1, 4), np.float32))
    e.remove_rows(removed)  # rows go, statistics stay (header-only blocks)
    e.forget(forgotten)  # these go entirely
    counts = e.write_delta(str(tmp_path / "delta"), "me").numpy().tolist()
    # Changed: 50 + 10 + 10 keys; of them, the 5 forgotten have no block any more.
    assert counts == [65, 5]
    assert e.write_delta(str(tmp_path / "empty"), "me").numpy().tolist() == [0, 0]
    for tiered in (False, budget is not None):
        fresh = engine(f"fresh{tiered}", tiered)
        for link in ("full", "delta", "empty"):
            fresh.read_checkpoint([str(tmp_path / link)], 0, 1)
        for stored_only in (False, True):
            want, got = e.export(stored_only, True), fresh.export(stored_only, True)
            for name in ("keys", "values", "slots"):
                np.testing.assert_array_equal(getattr(got, name), getattr(want, name), name)
            for name in want.fields._fields:
                np.testing.assert_array_equal(getattr(got.fields, name),
                                              getattr(want.fields, name), name)


def test_a_save_by_another_manager_in_between_makes_the_next_save_full(tmp_path):
    """Deltas are relative to their own manager's previous save: after another manager
    (incremental or not) saved the same model, the next save is full, not a delta that
    would miss the changes made before the other save."""
    from tf_fusedemb.training import CheckpointManager
    model, layer = icm.build()
    mine = CheckpointManager(str(tmp_path / "mine"), model, model.optimizer, incremental=True)
    others = [CheckpointManager(str(tmp_path / "other"), model, model.optimizer,
                                incremental=True),
              CheckpointManager(str(tmp_path / "plain"), model, model.optimizer)]
    icm.change(model, layer, 0)
    mine.save(1)
    for step, other in enumerate(others, start=2):
        icm.change(model, layer, step)
        other.save(step)
        icm.change(model, layer, step + 2)
        path = mine.save(step)
        assert _meta(path)["kind"] == "full", other
        icm.assert_same(_restored(path)[1], icm.state(model, layer), f"after {other}")
    icm.change(model, layer, 6)
    assert _meta(mine.save(4))["kind"] == "delta"  # nobody in between
