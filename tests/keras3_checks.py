"""Keras 3 paths with FusedEmbedding against Keras 3 with ordinary Embedding layers:
functional and subclassed ``fit``, a ``GradientTape`` loop, the SavedModel export, ``fit`` on 2
ranks with ``DistributedOptimizer``. Run by
tests/test_keras_paths.py in a process of its own (no TFRA imported, no
TF_USE_LEGACY_KERAS), as a Keras 3 program runs."""
import numpy as np
import pytest
import tensorflow as tf

import keras_paths as kpth
from test_keras_paths import TOL, assert_same_training, pair_functional, pair_subclassed
from tf_fusedemb.testing import DistributedTestCase

keras = pytest.importorskip("keras", minversion="3")


@pytest.mark.parametrize("shape", ["functional", "subclassed"])
def test_keras3_fit(shape):
    x, y = kpth.data()
    pair = pair_functional if shape == "functional" else pair_subclassed
    ref, embeds, fused, layer, initial = pair(keras, "sgd")
    want = kpth.fit(keras, ref, kpth.keras_optimizer(keras, "sgd"), x, y, kpth.BATCH)
    got = kpth.fit(keras, fused, kpth.keras_optimizer(keras, "sgd"), x, y, kpth.BATCH)
    assert_same_training(got, want, layer, embeds, initial)


def _ids_unique_per_batch():
    """Like kpth.data, but no ID repeats within a batch of kpth.BATCH."""
    rng = np.random.default_rng(1)
    x = {f: np.concatenate([rng.permutation(kpth.VOCAB)[:kpth.BATCH]
                            for _ in range(kpth.STEPS)]).astype(np.int64)
         for f in kpth.FEATURES}
    return x, ((x["a"] % 3 == 0) ^ (x["b"] % 4 == 1)).astype(np.float32)


def _pair_from_zero_tables(k, optimizer):
    """pair_functional with every table starting at zero, as FTRL tables usually do (and
    the hidden bias at 0.1, so that rows of zeros still get a gradient through the relu)."""
    ref, embeds, fused, layer, initial = pair_functional(k, optimizer)
    for emb in embeds.values():
        emb.set_weights([np.zeros_like(emb.get_weights()[0])])
    kernel, bias = ref.get_layer("hidden").get_weights()
    ref.get_layer("hidden").set_weights([kernel, np.full_like(bias, 0.1)])
    initial = kpth.initial_weights(ref, embeds)
    kpth.load_weights(fused, layer, initial)
    return ref, embeds, fused, layer, initial


@pytest.mark.parametrize("optimizer", ["adagrad", "ftrl"])
def test_keras3_fit_with_adagrad_and_ftrl(optimizer):
    """Keras 3's Adagrad and Ftrl, exact where their sparse update equals their dense one
    (the rows follow the dense update, as tf_keras's do): on batches whose IDs do not
    repeat (Keras 3 accumulates a sparse gradient's square per occurrence, not per row:
    see the next test), and for Ftrl from zero tables (Keras 3's Ftrl rewrites every row
    from its linear slot, so a row never looked up goes to zero)."""
    x, y = _ids_unique_per_batch()
    pair = pair_functional if optimizer == "adagrad" else _pair_from_zero_tables
    ref, embeds, fused, layer, initial = pair(keras, optimizer)
    want = kpth.fit(keras, ref, kpth.keras_optimizer(keras, optimizer), x, y, kpth.BATCH)
    got = kpth.fit(keras, fused, kpth.keras_optimizer(keras, optimizer), x, y, kpth.BATCH)
    assert_same_training(got, want, layer, embeds, initial)


def test_keras3_adagrad_with_repeated_ids_applies_the_dense_update():
    """With IDs repeated in a batch, the rows take Keras 3 Adagrad's dense update (the
    accumulator grows by the square of each row's summed gradient), which Keras 3 itself
    applies to a dense gradient; Keras 3's sparse update (a square per occurrence) ends
    elsewhere, which this test also shows."""
    x, y = kpth.data()
    ref, embeds, fused, layer, initial = pair_functional(keras, "adagrad")
    want = kpth.custom_loop(keras, ref, kpth.keras_optimizer(keras, "adagrad"), x, y,
                            kpth.BATCH, dense_gradients=True)
    got = kpth.custom_loop(keras, fused, kpth.keras_optimizer(keras, "adagrad"), x, y,
                           kpth.BATCH)
    assert_same_training(got, want, layer, embeds, initial)
    sparse, sparse_embeds = kpth.functional(keras, False)
    for name in ("hidden", "logit"):
        sparse.get_layer(name).set_weights(initial[name])
    for f, emb in sparse_embeds.items():
        emb.set_weights([initial["tables"][f]])
    kpth.custom_loop(keras, sparse, kpth.keras_optimizer(keras, "adagrad"), x, y, kpth.BATCH)
    assert max(np.abs(e.get_weights()[0] - embeds[f].get_weights()[0]).max()
               for f, e in sparse_embeds.items()) > 1e-3


def test_keras3_fit_in_mixed_bfloat16():
    """Keras 3's mixed_bfloat16 policy on every layer but the float32 logit: the fused
    model trains as the ordinary one under the same policy."""
    x, y = kpth.data()
    ref, embeds = kpth.functional(keras, False, policy="mixed_bfloat16")
    fused, layer = kpth.functional(keras, True, "sgd", policy="mixed_bfloat16")
    initial = kpth.initial_weights(ref, embeds)
    kpth.load_weights(fused, layer, initial)
    assert fused.get_layer("hidden").compute_dtype == "bfloat16"
    want = kpth.fit(keras, ref, kpth.keras_optimizer(keras, "sgd"), x, y, kpth.BATCH)
    got = kpth.fit(keras, fused, kpth.keras_optimizer(keras, "sgd"), x, y, kpth.BATCH)
    assert_same_training(got, want, layer, embeds, initial)


def test_keras3_custom_loop():
    x, y = kpth.data()
    ref, embeds, fused, layer, initial = pair_functional(keras, "sgd")
    want = kpth.custom_loop(keras, ref, kpth.keras_optimizer(keras, "sgd"), x, y, kpth.BATCH)
    got = kpth.custom_loop(keras, fused, kpth.keras_optimizer(keras, "sgd"), x, y, kpth.BATCH)
    assert_same_training(got, want, layer, embeds, initial)


def test_keras3_export_serves_the_same_predictions(tmp_path):
    from tf_fusedemb.inference import export_saved_model
    x, y = kpth.data()
    model, _ = kpth.functional(keras, True, "sgd")
    kpth.fit(keras, model, kpth.keras_optimizer(keras, "sgd"), x, y, kpth.BATCH, epochs=1)
    want = model.predict(x, verbose=0)
    served = tf.saved_model.load(export_saved_model(
        model, str(tmp_path / "k3"), {f: "scalar" for f in kpth.FEATURES})).signatures[
            "serving_default"](**{f: tf.constant(v) for f, v in x.items()})
    np.testing.assert_allclose(served["logits"].numpy(), want, **TOL)
    np.testing.assert_allclose(served["probability"].numpy(), tf.sigmoid(want).numpy(), **TOL)


def test_keras3_sharded_checkpoint_resumes_as_keras_backup_and_restore(tmp_path):
    """Keras 3 fit saved every 4 steps, interrupted at step 7 of epoch 1 and resumed on a
    freshly built model: tf_fusedemb.keras3.ShardedCheckpoint(every_steps=4) resumes where
    Keras 3's BackupAndRestore(save_freq=4) resumes the same model with ordinary Embedding
    layers (epoch 1 again, from the state after its step 4), and the two end equal."""
    from tf_fusedemb.keras3 import ShardedCheckpoint
    kpth.resume_like_backup_and_restore(
        keras, "sgd", lambda d: ShardedCheckpoint(d, every_steps=4),
        lambda d: keras.callbacks.BackupAndRestore(d, save_freq=4), tmp_path, TOL)


def test_keras3_fuse_model_trains_like_the_original():
    """fuse_model of a functional Keras 3 model: the same predictions before training, and
    Keras 3 fit of the fused model equals Keras 3 fit of the original (from a copy)."""
    from tf_fusedemb.keras3 import FusedEmbedding, fuse_model
    from tf_fusedemb.specs import OptimizerSpec
    x, y = kpth.data()
    original, _ = kpth.functional(keras, False)
    ref, embeds = kpth.functional(keras, False)
    ref.set_weights(original.get_weights())
    initial = kpth.initial_weights(ref, embeds)
    fused = fuse_model(original, OptimizerSpec.sgd(kpth.LR["sgd"]))
    assert isinstance(fused, keras.Model) and not isinstance(fused, keras.Sequential)
    (layer,) = [l for l in fused.layers if isinstance(l, FusedEmbedding)]
    np.testing.assert_allclose(fused.predict(x, verbose=0), ref.predict(x, verbose=0), **TOL)
    want = kpth.fit(keras, ref, kpth.keras_optimizer(keras, "sgd"), x, y, kpth.BATCH)
    got = kpth.fit(keras, fused, kpth.keras_optimizer(keras, "sgd"), x, y, kpth.BATCH)
    np.testing.assert_allclose(got["losses"], want["losses"], **TOL)
    np.testing.assert_allclose(got["predictions"], want["predictions"], **TOL)
    tables, _ = kpth.fused_tables(layer, prefix="emb_")
    for f, emb in embeds.items():
        assert np.abs(emb.get_weights()[0] - initial["tables"][f]).max() > 1e-4
        np.testing.assert_allclose(tables[f], emb.get_weights()[0], **TOL, err_msg=f)


def test_keras3_fuse_model_of_a_sequential_model():
    """A Sequential built on an Input: fused as the functional model of its layers."""
    from tf_fusedemb.keras3 import FusedEmbedding, fuse_model
    from tf_fusedemb.specs import OptimizerSpec
    seq = keras.Sequential([keras.Input((), dtype="int64"),
                            keras.layers.Embedding(kpth.VOCAB, 2, name="ids"),
                            keras.layers.Dense(1)])
    fused = fuse_model(seq, OptimizerSpec.sgd(0.1))
    assert any(isinstance(l, FusedEmbedding) for l in fused.layers)
    x, _ = kpth.data()
    np.testing.assert_allclose(fused.predict(x["a"], verbose=0), seq.predict(x["a"], verbose=0),
                               **TOL)


def test_keras3_fuse_model_refuses_what_it_cannot_rewire():
    from tf_fusedemb.keras3 import fuse_model
    from tf_fusedemb.specs import OptimizerSpec
    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__()
            self.emb = keras.layers.Embedding(9, 2)

        def call(self, x):
            return self.emb(x)
    model = Subclassed()
    model(np.arange(3))
    with pytest.raises(ValueError, match=r"needs a functional Keras 3 model.*Put "
                       r"tf_fusedemb.keras3.FusedEmbedding in the model in place of its "
                       rf"Embedding layers \['{model.emb.name}'\]"):
        fuse_model(model, OptimizerSpec.sgd(0.1))
    with pytest.raises(ValueError, match="has no Input"):
        fuse_model(keras.Sequential([keras.layers.Embedding(9, 2)]), OptimizerSpec.sgd(0.1))
    import tf_keras
    inp = tf_keras.Input((), dtype="int64")
    tfk = tf_keras.Model(inp, tf_keras.layers.Embedding(9, 2)(inp))
    with pytest.raises(ValueError, match="tf_fusedemb.models.fuse_model"):
        fuse_model(tfk, OptimizerSpec.sgd(0.1))


class TwoRankKeras3Test(DistributedTestCase):
    """Keras 3 fit on 2 ranks (each half of every global batch) equals Keras 3 on the global
    batch in one process; a bare optimizer fails the first step on every rank."""
    timeout = 400

    @pytest.mark.timeout(700)
    def test_keras3_fit(self):
        x, y = kpth.data()
        ref, embeds = kpth.functional(keras, False)
        initial = kpth.initial_weights(ref, embeds)
        want = kpth.fit(keras, ref, kpth.keras_optimizer(keras, "sgd"), x, y, 2 * kpth.BATCH)
        ranks = self.run_ranks(kpth.keras3_on_ranks, 2, (initial,))
        for r in ranks:
            np.testing.assert_allclose(r["predictions"], want["predictions"], **TOL)
        for f, emb in embeds.items():
            rows = sum(r["tables"][f] for r in ranks)
            assert np.abs(emb.get_weights()[0] - initial["tables"][f]).max() > 1e-4
            np.testing.assert_allclose(rows, emb.get_weights()[0], **TOL, err_msg=f)

    @pytest.mark.timeout(700)
    def test_keras3_bare_optimizer_fails_first_step(self):
        ref, embeds = kpth.functional(keras, False)
        ranks = self.run_ranks(kpth.keras3_on_ranks, 2, (kpth.initial_weights(ref, embeds),
                                                         False))
        for r in ranks:
            assert "DistributedOptimizer" in r.get("error", ""), r.keys()
            assert r["steps_done"] == 0  # refused inside the first step
