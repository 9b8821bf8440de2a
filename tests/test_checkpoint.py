"""Checkpoints: restore onto another number of ranks continues training exactly (the
single-process reference decides), and an interrupted save never damages the last one."""
import os

import numpy as np
import pytest

import equivalence_model as em
from horovod_launch import horovodrun
from test_fused_embedding_equivalence import SCRIPT, parse_result, reference_run, \
    run_single_process

FIRST, SECOND = 5, 4


def run(num_proc, *args):
    if num_proc == 1:
        return run_single_process(*args)
    return parse_result(horovodrun([SCRIPT, *args], num_proc, timeout=800))


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("save_np,restore_np,storages", [
    # fewer ranks (down to one) and more (re-sharding between two sharded layouts);
    # tests/test_multihost.py restores 2 hosts x 2 ranks onto 3 local ranks
    (2, 1, ()), (2, 3, ()),
    # written with the TFRA backend, restored onto the engine (TableSpec.storage)
    pytest.param(2, 1, ("tfra", "engine"), marks=pytest.mark.tfra)])
def test_restore_on_another_world_size_continues_exactly(tmp_path, save_np, restore_np,
                                                          storages):
    ckpt = str(tmp_path / "ckpt")
    save, restore = [["--storage", s] for s in storages] or ([], [])
    first = run(save_np, "--steps", str(FIRST), "--save-dir", ckpt, *save)
    second = run(restore_np, "--steps", str(SECOND), "--restore-dir", ckpt, *restore)
    assert second["start"] == FIRST
    losses, dense, tables = reference_run(steps=FIRST + SECOND)
    np.testing.assert_allclose(first["losses"] + second["losses"], losses, rtol=1e-5)
    for got, want in zip(second["dense"], dense):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    for name, want in tables.items():
        np.testing.assert_allclose(second["tables"][name], want, rtol=1e-5, atol=1e-7,
                                   err_msg=f"table {name}")
    # No key lost: the tables after restore + training hold at least what was saved.
    for group, size in first["table_sizes"].items():
        assert second["table_sizes"][group] >= size, group
    assert sorted(os.listdir(ckpt)) == [f"ckpt-{FIRST}", "latest"]


def _small_model():
    import tensorflow as tf
    import tf_keras
    from tf_fusedemb.layers import FusedEmbedding
    from tf_fusedemb.models import FusedModel
    from tf_fusedemb.specs import FeatureSpec, OptimizerSpec, TableSpec
    layer = FusedEmbedding([FeatureSpec("u", TableSpec("u", 4, OptimizerSpec.adagrad(0.3)))])
    inputs = {"u": tf_keras.Input([], dtype=tf.int64, name="u")}
    model = FusedModel(inputs, tf_keras.layers.Dense(1)(layer(inputs)["u"]))
    model.compile(optimizer=tf_keras.optimizers.Adagrad(0.1), loss=em.bce)
    return model, layer


def test_interrupted_save_never_damages_the_last_checkpoint(tmp_path, monkeypatch):
    import tensorflow as tf
    from tf_fusedemb.training import CheckpointManager, checkpoint
    model, layer = _small_model()
    x, y = {"u": np.arange(8, dtype=np.int64)}, np.ones((8, 1), np.float32)
    model.fit(x, y, batch_size=8, verbose=0)
    manager = CheckpointManager(str(tmp_path), model, model.optimizer)
    good = manager.save(1, {"next_step": 1})
    saved_rows = layer.groups[0].store.table.export()["values"].numpy()
    model.fit(x, y, batch_size=8, verbose=0)

    def crash(*args, **kwargs):
        raise OSError("disk full (simulated)")
    monkeypatch.setattr(checkpoint.np, "savez", crash)
    with pytest.raises(OSError, match="simulated"):
        manager.save(2, {"next_step": 2})
    monkeypatch.undo()
    assert manager.latest() == good and os.path.exists(os.path.join(good, "meta.json"))

    fresh, fresh_layer = _small_model()
    fresh({"u": tf.zeros([0], tf.int64)})  # build variables
    meta = CheckpointManager(str(tmp_path), fresh, fresh.optimizer).restore()
    assert meta["state"] == {"next_step": 1} and meta["world_size"] == 1
    np.testing.assert_array_equal(fresh_layer.groups[0].store.table.export()["values"], saved_rows)
    assert fresh_layer.statistics().category_totals() == {"u": 8}
    # A later good save replaces the debris of the failed one.
    manager.save(2, {"next_step": 2})
    assert sorted(os.listdir(tmp_path)) == ["ckpt-1", "ckpt-2", "latest"]


def test_restore_with_another_plan_is_refused(tmp_path):
    from tf_fusedemb.layers import FusedEmbedding
    from tf_fusedemb.specs import FeatureSpec, OptimizerSpec, TableSpec
    from tf_fusedemb.training import CheckpointManager
    model, _ = _small_model()
    CheckpointManager(str(tmp_path), model, model.optimizer).save(1)
    other = FusedEmbedding([FeatureSpec("u", TableSpec("u", 8, OptimizerSpec.adagrad(0.3)))])
    with pytest.raises(ValueError, match=r"another embedding spec for FusedEmbedding layer "
                                         r"'\w+': specs differ for \['u'\] \(feature 'u': "
                                         r"table.dim 4 in the checkpoint, 8 in the model\)"):
        CheckpointManager(str(tmp_path), other).restore()
