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


def _pair_from_zero_tables(k, optimizer):
    """pair_functional with kpth.zero_tables."""
    ref, embeds, fused, layer, initial = pair_functional(k, optimizer)
    kpth.zero_tables(ref, embeds)
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
    x, y = kpth.data_unique_per_batch()
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


@pytest.mark.parametrize("incremental", [False, True])
def test_keras3_sharded_checkpoint_resumes_as_keras_backup_and_restore(tmp_path, incremental):
    """Keras 3 fit saved every 4 steps, interrupted at step 7 of epoch 1 and resumed on a
    freshly built model: tf_fusedemb.keras3.ShardedCheckpoint(every_steps=4) resumes where
    Keras 3's BackupAndRestore(save_freq=4) resumes the same model with ordinary Embedding
    layers (epoch 1 again, from the state after its step 4), and the two end equal; with
    ``incremental=True`` the saves after the first are deltas, restored as a chain."""
    from tf_fusedemb.keras3 import ShardedCheckpoint
    kpth.resume_like_backup_and_restore(
        keras, "sgd", lambda d: ShardedCheckpoint(d, every_steps=4, incremental=incremental),
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


def _ranking_class():
    """The TensorFlow Recommenders ranking tutorial's model in Keras 3, as users copy it:
    Sequential([StringLookup, Embedding]) blocks, an Embedding in a list attribute and one
    of sequences, a subclassed keras.Model."""
    users = [f"user {i}" for i in range(30)]

    class RankingModel(keras.Model):
        def __init__(self):
            super().__init__()
            self.user_embeddings = keras.Sequential([
                keras.layers.StringLookup(vocabulary=users, mask_token=None),
                keras.layers.Embedding(len(users) + 1, 4)])
            self.movie_embeddings = [keras.layers.Embedding(20, 4)]
            self.watched = keras.layers.Embedding(20, 4)
            self.ratings = keras.Sequential([keras.layers.Dense(8, activation="relu"),
                                             keras.layers.Dense(1)])

        def call(self, inputs):
            user, movie, history = inputs
            return self.ratings(keras.ops.concatenate([
                self.user_embeddings(user), self.movie_embeddings[0](movie),
                keras.ops.sum(self.watched(history), axis=1)], axis=1))
    return RankingModel, users


def _ranking_data(rows=slice(None)):
    """(x, y) of 128 samples for _ranking_class's model, or of their ``rows``: (user names
    as a string tensor, movies, histories of 3 movies) and a rating; IDs repeat within
    batches."""
    _, users = _ranking_class()
    rng = np.random.default_rng(0)
    names = np.array([users[i] for i in rng.integers(0, 30, 128)])
    movies, histories = rng.integers(0, 20, 128), rng.integers(0, 20, (128, 3))
    y = ((movies % 5) + (histories[:, 0] % 3) * 0.5).astype(np.float32)
    return (tf.constant(names[rows]), movies[rows], histories[rows]), y[rows]


def _built_ranking_model(weights=None):
    """A called _ranking_class model (with ``weights``, when given)."""
    cls, _ = _ranking_class()
    x, _ = _ranking_data()
    model = cls()
    model(tuple(v[:2] for v in x))
    if weights is not None:
        model.set_weights(weights)
    return model


def _watched_rows(model):
    """float32[20, 4] of the converted model's sequence table, as this rank stores it
    (zeros where another rank owns the row)."""
    feature = model.watched.feature  # a table of the model's one shared FusedEmbedding
    group = next(g for g in model.watched.fused.groups if feature in g.group.features)
    stored = group.store.stored_rows()
    mine = stored.tables == group.table_names.index(feature.table.name)
    rows = np.zeros((20, 4), np.float32)
    rows[stored.ids[mine]] = stored.values[mine]
    return rows


def test_keras3_fuse_model_of_a_subclassed_model():
    """A subclassed Keras 3 model is converted in place: every Embedding becomes a
    ShardedEmbedding of one shared FusedEmbedding (their weights leave the model), and
    Keras 3 fit of it equals Keras 3 fit of the unconverted model to 1e-5."""
    from tf_fusedemb.keras3 import ShardedEmbedding, fuse_model
    from tf_fusedemb.specs import OptimizerSpec
    x, y = _ranking_data()
    ref = _built_ranking_model()
    converted = _built_ranking_model(ref.get_weights())
    n_weights = len(converted.weights)
    assert fuse_model(converted, OptimizerSpec.sgd(0.1)) is converted
    assert not any(isinstance(l, keras.layers.Embedding) for l in converted._flatten_layers())
    assert sum(isinstance(l, ShardedEmbedding) for l in converted._flatten_layers()) == 3
    # 3 tables out, the row-update marker of their one shared FusedEmbedding in
    assert len(converted.weights) == n_weights - 2
    np.testing.assert_allclose(converted.predict(x, verbose=0), ref.predict(x, verbose=0), **TOL)
    out = []
    for model in (ref, converted):
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")  # IDs repeat: SGD
        history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        out.append((history.history["loss"], model.predict(x, batch_size=32, verbose=0)))
    (want_loss, want_pred), (got_loss, got_pred) = out
    assert want_loss[1] < want_loss[0]
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_pred, want_pred, rtol=1e-5, atol=1e-5)
    assert np.abs(_watched_rows(converted) - ref.watched.get_weights()[0]).max() < TOL["atol"]


def _subclassed_on_rank(weights):
    """One rank: _ranking_class's model from ``weights``, converted by fuse_model, fit with
    DistributedOptimizer(SGD) on this rank's half of every global batch of 64; global
    predictions and this rank's rows of the sequence table."""
    from tf_fusedemb.comm import get_communicator
    from tf_fusedemb.keras3 import DistributedOptimizer, fuse_model
    from tf_fusedemb.specs import OptimizerSpec
    comm = get_communicator()
    x, _ = _ranking_data()
    xr, yr = _ranking_data(np.arange(128).reshape(-1, comm.size, 32)[:, comm.rank].reshape(-1))
    model = fuse_model(_built_ranking_model(weights), OptimizerSpec.sgd(0.1))
    model.compile(optimizer=DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    model.fit(xr, yr, batch_size=32, epochs=2, shuffle=False, verbose=0)
    return {"predictions": model.predict(x, batch_size=32, verbose=0),
            "watched": _watched_rows(model)}


def test_keras3_fuse_model_refuses_what_it_cannot_rewire():
    from tf_fusedemb.keras3 import fuse_model
    from tf_fusedemb.specs import OptimizerSpec
    with pytest.raises(ValueError, match="has no Input"):
        fuse_model(keras.Sequential([keras.layers.Embedding(9, 2)]), OptimizerSpec.sgd(0.1))
    cls, users = _ranking_class()
    with pytest.raises(ValueError, match="was never called"):
        fuse_model(cls(), OptimizerSpec.sgd(0.1))
    model = cls()
    model((tf.constant(users[:2]), np.arange(2), np.zeros((2, 3), np.int64)))
    with pytest.raises(ValueError, match=r"\['plan'\] configure one fused layer"):
        fuse_model(model, OptimizerSpec.sgd(0.1), plan=None)
    import tf_keras
    inp = tf_keras.Input((), dtype="int64")
    tfk = tf_keras.Model(inp, tf_keras.layers.Embedding(9, 2)(inp))
    with pytest.raises(ValueError, match="tf_fusedemb.models.fuse_model"):
        fuse_model(tfk, OptimizerSpec.sgd(0.1))


# The 2-rank fit cases, run one after another in one 2-rank job (a job's start-up costs
# more than a case): (optimizer, global batches whose IDs do not repeat, start from zero
# tables). Adagrad and FTRL on unique IDs: see test_keras3_fit_with_adagrad_and_ftrl.
FIT_CASES = (("sgd", False, False), ("adagrad", True, False), ("ftrl", True, True))


def _fit_cases_on_rank(initials):
    """One rank: keras3_on_ranks for each of FIT_CASES from its initial weights, then once
    with the bare optimizer (last: it fails the step on every rank)."""
    got = [kpth.keras3_on_ranks(w, True, opt, unique)
           for w, (opt, unique, _) in zip(initials, FIT_CASES)]
    return got + [kpth.keras3_on_ranks(initials[0], False)]


class TwoRankKeras3Test(DistributedTestCase):
    """Keras 3 fit on 2 ranks (each half of every global batch) equals Keras 3 on the global
    batch in one process; a bare optimizer fails the first step on every rank."""
    timeout = 400

    @pytest.mark.timeout(700)
    def test_keras3_fit_with_sgd_adagrad_ftrl_and_a_bare_optimizer(self):
        refs = [self._reference(*case) for case in FIT_CASES]
        ranks = self.run_ranks(_fit_cases_on_rank, 2, ([initial for _, _, initial in refs],))
        for i, (want, embeds, initial) in enumerate(refs):
            got = [r[i] for r in ranks]
            for r in got:
                np.testing.assert_allclose(r["predictions"], want["predictions"], **TOL,
                                           err_msg=FIT_CASES[i][0])
            for f, emb in embeds.items():
                rows = sum(r["tables"][f] for r in got)
                assert np.abs(emb.get_weights()[0] - initial["tables"][f]).max() > 1e-4
                np.testing.assert_allclose(rows, emb.get_weights()[0], **TOL,
                                           err_msg=f"{FIT_CASES[i][0]}: {f}")
        for r in ranks:
            assert "DistributedOptimizer" in r[-1].get("error", ""), r[-1].keys()
            assert r[-1]["steps_done"] == 0  # refused inside the first step

    @staticmethod
    def _reference(optimizer, unique, from_zero):
        """Keras 3 fit on the global batches in this process: (result, embeddings, the
        initial weights)."""
        x, y = kpth.data_unique_per_batch(2 * kpth.BATCH) if unique else kpth.data()
        ref, embeds = kpth.functional(keras, False, optimizer)
        if from_zero:
            kpth.zero_tables(ref, embeds)
        initial = kpth.initial_weights(ref, embeds)
        want = kpth.fit(keras, ref, kpth.keras_optimizer(keras, optimizer), x, y,
                        2 * kpth.BATCH)
        return want, embeds, initial

    @pytest.mark.timeout(700)
    def test_keras3_fuse_model_of_a_subclassed_model(self):
        """The subclassed ranking model converted by fuse_model on 2 ranks equals Keras 3 fit
        of the unconverted model on the global batches in one process."""
        ref = _built_ranking_model()
        initial, initial_watched = ref.get_weights(), ref.watched.get_weights()[0]
        x, y = _ranking_data()
        ref.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        ref.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
        want = ref.predict(x, batch_size=32, verbose=0)
        ranks = self.run_ranks(_subclassed_on_rank, 2, (initial,))
        for r in ranks:
            np.testing.assert_allclose(r["predictions"], want, **TOL)
        rows = sum(r["watched"] for r in ranks)
        assert np.abs(ref.watched.get_weights()[0] - initial_watched).max() > 1e-3
        np.testing.assert_allclose(rows, ref.watched.get_weights()[0], **TOL)
