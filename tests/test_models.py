"""DLRM, DCN-v2 and the DIN-style sequence model: numerics against numpy, masking,
training through FusedModel.fit, validation and configs (single process)."""
import json

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tf_fusedemb.models import (CRITEO_CATEGORICAL, CRITEO_DENSE, DCNv2, DLRM, CrossLayer,
                                DotInteraction, FusedModel, LocalActivationUnit, SequenceModel,
                                criteo_feature_specs, movielens_feature_specs)
from tf_fusedemb.specs import FeatureSpec, InitializerSpec, OptimizerSpec, TableSpec

BCE = tf_keras.losses.BinaryCrossentropy(from_logits=True)


def _relu(x):
    return np.maximum(x, 0.0)


def _np_mlp(mlp, x, activate_last=True):
    layers = mlp.dense_layers
    for i, layer in enumerate(layers):
        w, b = (v.numpy() for v in layer.weights)
        x = x @ w + b
        if i < len(layers) - 1 or activate_last:
            x = _relu(x)
    return x


def _np_dense(layer, x):
    w, b = (v.numpy() for v in layer.weights)
    return x @ w + b


def _criteo_batch(n, seed=0, c1_values=10):
    """Criteo-shaped features; the label is learnable only through the C1 embedding."""
    rng = np.random.default_rng(seed)
    x = {c: rng.integers(0, 1000, n).astype(np.int64) for c in CRITEO_CATEGORICAL}
    x["C1"] = rng.integers(0, c1_values, n).astype(np.int64)
    x.update({d: rng.normal(size=n).astype(np.float32) for d in CRITEO_DENSE})
    y = (x["C1"] % 2).astype(np.float32)[:, None]
    return x, y


def _movielens_batch(n, history_len, seed=0, movies=20):
    """MovieLens-shaped features: user, movie int64[B]; genres, history ragged int64."""
    rng = np.random.default_rng(seed)
    movie = rng.integers(0, movies, n).astype(np.int64)
    x = {"user": rng.integers(0, 30, n).astype(np.int64), "movie": movie,
         "genres": tf.ragged.constant([list(rng.integers(0, 18, rng.integers(1, 4)))
                                       for _ in range(n)], tf.int64),
         # lengths 0..history_len: empty histories included
         "history": tf.ragged.constant(
             [list(rng.integers(0, movies, rng.integers(0, history_len + 1))) for _ in range(n)],
             tf.int64, ragged_rank=1)}
    y = (movie % 2).astype(np.float32)[:, None]
    return x, y


def _fit(model, x, y, epochs, lr=0.01, batch_size=64):
    model.compile(optimizer=tf_keras.optimizers.Adam(lr), loss=BCE)
    return model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=0,
                     shuffle=False).history["loss"]


# ---------------------------------------------------------------------------- numerics

def test_dot_interaction_matches_numpy():
    rng = np.random.default_rng(1)
    xs = [rng.normal(size=(5, 3)).astype(np.float32) for _ in range(4)]
    got = DotInteraction()([tf.constant(x) for x in xs]).numpy()
    pairs = [np.sum(xs[i] * xs[j], axis=1) for i in range(4) for j in range(i)]
    want = np.concatenate([xs[0], np.stack(pairs, axis=1)], axis=1)
    assert got.shape == (5, 3 + 6)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_dlrm_forward_matches_numpy():
    """Bottom MLP, dot interaction over (bottom, embeddings in feature order), top MLP."""
    specs = criteo_feature_specs(4, names=("a", "b", "c"))
    model = DLRM(specs, ("d1", "d2"), bottom_mlp=(8, 4), top_mlp=(6,))
    rng = np.random.default_rng(2)
    x = {n: rng.integers(0, 50, 7).astype(np.int64) for n in ("a", "b", "c")}
    x.update(d1=rng.normal(size=7).astype(np.float32), d2=rng.normal(size=7).astype(np.float32))
    logits = model(x).numpy()
    assert logits.shape == (7, 1) and logits.dtype == np.float32
    assert model.interaction_width == 4 + 4 * 3 // 2

    embs = {n: v.numpy() for n, v in model.embedding({n: x[n] for n in "abc"}).items()}
    bottom = _np_mlp(model.bottom_mlp, np.stack([x["d1"], x["d2"]], 1))
    vecs = [bottom] + [embs[n] for n in "abc"]
    dots = [np.sum(vecs[i] * vecs[j], 1) for i in range(4) for j in range(i)]
    z = np.concatenate([bottom, np.stack(dots, 1)], 1)
    want = _np_dense(model.logit, _np_mlp(model.top_mlp, z))
    np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("low_rank", [None, 2])
def test_cross_layer_matches_numpy(low_rank):
    rng = np.random.default_rng(3)
    d = 5
    x0, xl = (rng.normal(size=(4, d)).astype(np.float32) for _ in range(2))
    layer = CrossLayer(low_rank)
    layer([tf.constant(x0), tf.constant(xl)])
    b = rng.normal(size=d).astype(np.float32)
    if low_rank is None:
        w = rng.normal(size=(d, d)).astype(np.float32)      # W, column-vector convention
        layer.set_weights([w.T, b])
    else:
        u, v = (rng.normal(size=(d, low_rank)).astype(np.float32) for _ in range(2))
        w = u @ v.T                                          # W = U V^T
        layer.set_weights([v, u.T, b])
    got = layer([tf.constant(x0), tf.constant(xl)]).numpy()
    want = np.stack([x0[i] * (w @ xl[i] + b) + xl[i] for i in range(4)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("structure", ["stacked", "parallel"])
def test_dcn_forward_matches_numpy(structure):
    specs = [FeatureSpec("a", TableSpec("a", 3, OptimizerSpec.adagrad(0.1))),
             FeatureSpec("b", TableSpec("b", 2, OptimizerSpec.sgd(0.1)), "mean")]
    model = DCNv2(specs, ("d",), num_cross_layers=2, deep=(4,), low_rank=2, structure=structure)
    x = {"a": np.array([1, 2, 3], np.int64), "b": tf.ragged.constant([[1, 2], [], [5]], tf.int64),
         "d": np.array([0.5, -1.0, 2.0], np.float32)}
    logits = model(x).numpy()
    embs = model.embedding({"a": x["a"], "b": x["b"]})
    x0 = np.concatenate([embs["a"].numpy(), embs["b"].numpy(), x["d"][:, None]], 1)
    assert x0.shape[1] == model.input_width == 6
    xl = x0
    for layer in model.cross_layers:
        v, ut, b = (w.numpy() for w in layer.weights)
        xl = x0 * ((xl @ v) @ ut + b) + xl
    if structure == "stacked":
        h = _np_mlp(model.deep, xl)
    else:
        h = np.concatenate([xl, _np_mlp(model.deep, x0)], 1)
    np.testing.assert_allclose(logits, _np_dense(model.logit, h), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("weighting", ["softmax", "sigmoid", "linear"])
def test_local_activation_unit_ignores_padding(weighting):
    rng = np.random.default_rng(4)
    unit = LocalActivationUnit((8,), weighting=weighting)
    h = rng.normal(size=(3, 6, 4)).astype(np.float32)
    t = rng.normal(size=(3, 4)).astype(np.float32)
    lengths = np.array([2, 6, 0])
    mask = np.arange(6)[None, :] < lengths[:, None]
    out, w = (v.numpy() for v in unit([h, t, mask]))
    noisy = np.where(mask[:, :, None], h, 1e3 * rng.normal(size=h.shape)).astype(np.float32)
    longer = np.concatenate([noisy, rng.normal(size=(3, 5, 4)).astype(np.float32)], 1)
    mask_longer = np.concatenate([mask, np.zeros((3, 5), bool)], 1)
    out2, w2 = (v.numpy() for v in unit([longer, t, mask_longer]))
    np.testing.assert_allclose(out2, out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(w2[:, :6], w, rtol=1e-5, atol=1e-7)
    assert np.all(w[~mask] == 0) and np.all(w2[:, 6:] == 0)
    np.testing.assert_array_equal(out[2], 0.0)  # empty history: no interest
    if weighting == "softmax":
        np.testing.assert_allclose(w.sum(1), [1.0, 1.0, 0.0], rtol=1e-6, atol=1e-6)
    # Weighted sum of the valid rows, by numpy.
    np.testing.assert_allclose(out, np.einsum("bl,bld->bd", w, h * mask[:, :, None]),
                               rtol=1e-5, atol=1e-6)


def test_sequence_model_masks_padding_and_shares_the_movie_table():
    """Same sample, history padded to max_len 6 or 12, or dense with junk after its length:
    the same logits. The target and the history read one table."""
    x, _ = _movielens_batch(8, history_len=6, seed=5)
    short = SequenceModel(movielens_feature_specs(8, history_len=6), attention_mlp=(8,),
                          mlp=(8,), length_key="history_length")
    long_ = SequenceModel(movielens_feature_specs(8, history_len=12), attention_mlp=(8,),
                          mlp=(8,), length_key="history_length")
    logits = short(x).numpy()
    np.testing.assert_allclose(long_(x).numpy(), logits, rtol=1e-5, atol=1e-6)

    lengths = x["history"].row_lengths().numpy()
    junk = np.random.default_rng(6).integers(100, 200, (8, 9))  # real IDs, real rows
    dense = np.where(np.arange(9)[None, :] < lengths[:, None],
                     x["history"].to_tensor(shape=[None, 9]).numpy(), junk)
    dense_x = dict(x, history=dense, history_length=lengths)
    np.testing.assert_allclose(short(dense_x).numpy(), logits, rtol=1e-5, atol=1e-6)
    # Without the lengths a dense history is all valid: the junk then matters.
    assert not np.allclose(short(dict(x, history=dense)).numpy(), logits, atol=1e-6)

    # One fused group; movie and history share the "movie" table, hence its rows.
    layer = short.embedding
    assert len(layer.groups) == 1
    assert layer.groups[0].group.shared_tables == {"movie": ("movie", "history")}
    ids = np.array([3, 7], np.int64)
    embs = layer({"user": ids, "movie": ids, "genres": tf.ragged.constant([[1], [2]], tf.int64),
                  "history": tf.ragged.constant([[7, 3], [3]], tf.int64)})
    np.testing.assert_array_equal(embs["history"][0, 0], embs["movie"][1])
    np.testing.assert_array_equal(embs["history"][0, 1], embs["movie"][0])
    np.testing.assert_array_equal(embs["history"][0, 2:], 0.0)  # FusedEmbedding's padding


# ---------------------------------------------------------------------------- training

def _assert_generalises(model, x, y):
    """Fresh samples (other IDs mostly unseen): the label's feature alone must decide."""
    accuracy = np.mean((model.predict(x, batch_size=len(y), verbose=0) > 0) == (y > 0.5))
    print("held-out accuracy", accuracy)
    assert accuracy > 0.9, accuracy


def test_dlrm_fit_learns():
    x, y = _criteo_batch(256)
    model = DLRM(criteo_feature_specs(8, OptimizerSpec.adagrad(0.2)), CRITEO_DENSE,
                 bottom_mlp=(16, 8), top_mlp=(16,))
    assert isinstance(model, FusedModel)
    losses = _fit(model, x, y, epochs=6)
    print("dlrm losses", losses)
    assert losses[-1] < 0.5 * losses[0], losses
    _assert_generalises(model, *_criteo_batch(256, seed=10))
    assert model.predict(x, batch_size=256, verbose=0).shape == (256, 1)


def test_dcn_fit_learns():
    x, y = _criteo_batch(256, seed=1)
    model = DCNv2(criteo_feature_specs(8, OptimizerSpec.adagrad(0.2)), CRITEO_DENSE,
                  num_cross_layers=2, deep=(32, 16), low_rank=8, structure="parallel")
    losses = _fit(model, x, y, epochs=6, lr=0.02)
    print("dcn losses", losses)
    assert losses[-1] < 0.5 * losses[0], losses
    _assert_generalises(model, *_criteo_batch(256, seed=11))


def test_sequence_model_fit_learns():
    x, y = _movielens_batch(256, history_len=8, seed=2)
    model = SequenceModel(movielens_feature_specs(8, history_len=8,
                                                  optimizer=OptimizerSpec.adagrad(0.2)),
                          attention_mlp=(16,), mlp=(32,))
    losses = _fit(model, x, y, epochs=6)
    print("sequence losses", losses)
    assert losses[-1] < 0.5 * losses[0], losses
    _assert_generalises(model, *_movielens_batch(256, history_len=8, seed=12))
    # One row per distinct user, genre and movie: target and history IDs share the rows.
    movies = set(x["movie"].tolist()) | set(x["history"].flat_values.numpy().tolist())
    expected = (len(set(x["user"].tolist())) + len(movies)
                + len(set(x["genres"].flat_values.numpy().tolist())))
    assert model.embedding.groups[0].store.table.size().numpy() == expected


# ---------------------------------------------------------------------------- validation

_T16 = TableSpec("t16", 16, OptimizerSpec.sgd(0.1))
_T8 = TableSpec("t8", 8, OptimizerSpec.sgd(0.1))
_SEQ = FeatureSpec("s", _T16, combiner=None, max_len=4)


@pytest.mark.parametrize("build, match", [
    (lambda: DLRM([FeatureSpec("a", _T16), FeatureSpec("b", _T8)], ["d"], bottom_mlp=(16,)),
     r"share one embedding dim.*'a': 16, 'b': 8"),
    (lambda: DLRM([FeatureSpec("a", _T16)], ["d"], bottom_mlp=(32, 8)),
     r"bottom_mlp\[-1\]=8 must equal the embedding dim 16"),
    (lambda: DLRM([FeatureSpec("a", _T16)], [], bottom_mlp=(16,)), r"dense_features"),
    (lambda: DLRM([FeatureSpec("a", _T16)], "d", bottom_mlp=(16,)), r"dense_features"),
    (lambda: DLRM([FeatureSpec("a", _T16)], ["a"], bottom_mlp=(16,)),
     r"\['a'\] are both dense and categorical"),
    (lambda: DLRM([_SEQ], ["d"], bottom_mlp=(16,)), r"feature 's' is a sequence feature"),
    (lambda: DLRM([], ["d"]), r"categorical must have at least one FeatureSpec"),
    (lambda: DLRM([FeatureSpec("a", _T16)], ["d"], bottom_mlp=(16,), top_mlp=(8, 0)),
     r"top_mlp must be a sequence of ints > 0"),
    (lambda: DCNv2([FeatureSpec("a", _T16)], structure="diagonal"),
     r"structure must be one of \('stacked', 'parallel'\)"),
    (lambda: DCNv2([FeatureSpec("a", _T16)], low_rank=0), r"low_rank must be None"),
    (lambda: DCNv2([FeatureSpec("a", _T16)], num_cross_layers=-1), r"num_cross_layers"),
    (lambda: DCNv2([FeatureSpec("a", _T16)], num_cross_layers=0, deep=()),
     r"neither a cross nor a deep"),
    (lambda: DCNv2([FeatureSpec("a", _T16), FeatureSpec("a", _T8)]),
     r"feature 'a' appears twice"),
    (lambda: SequenceModel(movielens_feature_specs(), target="item"),
     r"target feature 'item' is not among the features"),
    (lambda: SequenceModel(movielens_feature_specs(), sequence="genres"),
     r"sequence feature 'genres' must be a sequence feature"),
    (lambda: SequenceModel([FeatureSpec("movie", _T8), _SEQ], sequence="s"),
     r"target 'movie' \(dim 8\) and sequence 's' \(dim 16\) must have the same dim"),
    (lambda: SequenceModel(movielens_feature_specs(), attention_weights="max"),
     r"attention_weights must be one of"),
    (lambda: SequenceModel(movielens_feature_specs() + [FeatureSpec("s2", _T16, None, 3)]),
     r"\['s2'\] are sequence features too"),
])
def test_invalid_configs_raise_value_error_naming_the_problem(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_missing_input_feature_is_named():
    model = DLRM(criteo_feature_specs(4, names=("a", "b")), ("d",), bottom_mlp=(4,))
    with pytest.raises(ValueError, match=r"missing input features \['d'\]"):
        model({"a": np.array([1]), "b": np.array([2])})


# ---------------------------------------------------------------------------- configs

def _small_models():
    crit = criteo_feature_specs(4, names=("a", "b", "c"))
    return [
        (DLRM(crit, ("d1", "d2"), bottom_mlp=(8, 4), top_mlp=(8,), seed=7),
         {"a": [1, 2], "b": [3, 4], "c": [5, 6], "d1": [0.1, 0.2], "d2": [1.0, -1.0]}),
        (DCNv2(crit, ("d1",), num_cross_layers=1, deep=(8,), low_rank=2, structure="parallel"),
         {"a": [1, 2], "b": [3, 4], "c": [5, 6], "d1": [0.1, 0.2]}),
        (SequenceModel(movielens_feature_specs(4, history_len=3), attention_mlp=(4,), mlp=(4,),
                       attention_weights="sigmoid"),
         {"user": [1, 2], "movie": [3, 4], "genres": tf.ragged.constant([[1, 2], [3]], tf.int64),
          "history": tf.ragged.constant([[3, 5], []], tf.int64)}),
    ]


def test_get_config_round_trip():
    for model, x in _small_models():
        x = {k: (v if isinstance(v, tf.RaggedTensor) else
                 np.array(v, np.float32 if k.startswith("d") else np.int64)) for k, v in x.items()}
        config = model.get_config()
        json.dumps(config)  # plain JSON
        clone = type(model).from_config(config)
        assert clone.get_config() == config
        # Seeded dense weights and key-seeded rows: the clone starts where the model did.
        np.testing.assert_allclose(clone(x).numpy(), model(x).numpy(), rtol=1e-6, atol=1e-7)
        again = tf_keras.saving.deserialize_keras_object(
            tf_keras.saving.serialize_keras_object(model))
        assert type(again) is type(model) and again.get_config() == config


def test_feature_spec_factories():
    crit = criteo_feature_specs()
    assert [f.name for f in crit] == [f"C{i}" for i in range(1, 27)]
    assert CRITEO_DENSE == tuple(f"I{i}" for i in range(1, 14))
    assert all(f.dim == 16 and not f.table.is_static and f.combiner == "sum" for f in crit)
    assert all(f.table.optimizer == OptimizerSpec.adagrad(0.05) for f in crit)
    ml = {f.name: f for f in movielens_feature_specs(dim=8, history_len=5,
                                                     initializer=InitializerSpec.zeros())}
    assert list(ml) == ["user", "movie", "genres", "history"]
    assert ml["genres"].combiner == "mean" and ml["history"].max_len == 5
    assert ml["history"].is_sequence and ml["history"].table == ml["movie"].table
