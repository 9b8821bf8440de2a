"""shard_embeddings converts the models users write (subclassed, Sequential blocks of
StringLookup/IntegerLookup + Embedding as in the TensorFlow Recommenders tutorials, bytes
or str vocabularies, a dict of Embeddings) in place; the converted model, trained by its
own plain ``fit``, equals the unconverted model trained the same way (the reference is
Keras with its ordinary Embeddings)."""
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import keras_paths as kpth
from tf_fusedemb.layers import ShardedEmbedding
from tf_fusedemb.models import fuse_model, shard_embeddings
from tf_fusedemb.specs import OptimizerSpec

USERS = [f"user {i}" for i in range(30)]
MOVIES = [f"movie {i}" for i in range(20)]


def ranking_class(vocab_type):
    """The TensorFlow Recommenders ranking tutorial's model, as users copy it."""
    users = np.array([u.encode() for u in USERS]) if vocab_type == "bytes" else USERS
    movies = np.array([m.encode() for m in MOVIES]) if vocab_type == "bytes" else MOVIES

    class RankingModel(tf_keras.Model):
        def __init__(self):
            super().__init__()
            self.user_embeddings = tf_keras.Sequential([
                tf_keras.layers.StringLookup(vocabulary=users, mask_token=None),
                tf_keras.layers.Embedding(len(users) + 1, 8)])
            self.movie_embeddings = tf_keras.Sequential([
                tf_keras.layers.StringLookup(vocabulary=movies, mask_token=None),
                tf_keras.layers.Embedding(len(movies) + 1, 8)])
            self.ratings = tf_keras.Sequential([
                tf_keras.layers.Dense(16, activation="relu"), tf_keras.layers.Dense(1)])

        def call(self, inputs):
            user_id, movie_title = inputs
            return self.ratings(tf.concat([self.user_embeddings(user_id),
                                           self.movie_embeddings(movie_title)], axis=1))
    return RankingModel


def ratings_data(n=256, seed=0):
    rng = np.random.default_rng(seed)
    users, movies = rng.integers(0, 30, n), rng.integers(0, 20, n)
    x = (np.array([USERS[i] for i in users]), np.array([MOVIES[i] for i in movies]))
    return x, ((users % 5) + (movies % 3) * 0.5).astype(np.float32)


def fit_pair(ref, converted, x, y, optimizer):
    out = []
    for model in (ref, converted):
        model.compile(optimizer=optimizer(), loss="mse")
        history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        out.append((history.history["loss"], model.predict(x, batch_size=32, verbose=0)))
    return out


@pytest.mark.parametrize("vocab_type, convert", [
    ("str", shard_embeddings), ("bytes", shard_embeddings), ("str", fuse_model)])
def test_tfrs_ranking_model_trains_like_keras(vocab_type, convert):
    """shard_embeddings (trained by plain fit), and fuse_model, which converts a subclassed
    model the same way and trains it in a FusedModel."""
    x, y = ratings_data()
    cls = ranking_class(vocab_type)
    ref, converted = cls(), cls()
    ref(tuple(v[:2] for v in x))
    converted(tuple(v[:2] for v in x))
    converted.set_weights(ref.get_weights())
    trained = convert(converted, OptimizerSpec.adagrad(0.1))
    # fuse_model returns the model converted in place inside a FusedModel
    assert (trained if convert is shard_embeddings else trained.wrapped) is converted
    sharded = [l for l in converted._flatten_layers() if isinstance(l, ShardedEmbedding)]
    assert len(sharded) == 2
    assert not any(isinstance(l, tf_keras.layers.Embedding) for l in converted._flatten_layers())
    (want_loss, want_pred), (got_loss, got_pred) = fit_pair(
        ref, trained, x, y, lambda: tf_keras.optimizers.Adagrad(0.1))
    assert want_loss[1] < want_loss[0]
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_pred, want_pred, rtol=1e-5, atol=1e-5)


def test_subclassed_model_with_a_dict_of_embeddings():
    x, y = kpth.data()
    cls = kpth.subclassed_class(tf_keras)
    ref, converted = kpth.build(cls(False), x), kpth.build(cls(False), x)
    converted.set_weights(ref.get_weights())
    shard_embeddings(converted, OptimizerSpec.sgd(kpth.LR["sgd"]))
    (want_loss, want_pred), (got_loss, got_pred) = fit_pair(
        ref, converted, x, y, lambda: kpth.keras_optimizer(tf_keras, "sgd"))
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_pred, want_pred, rtol=1e-5, atol=1e-5)


def test_fuse_model_of_a_subclassed_model_refuses_fused_layer_options():
    x, _ = ratings_data(4)
    model = ranking_class("str")()
    model(x)
    with pytest.raises(ValueError, match=r"\['key_mode'\].*shard_embeddings"):
        fuse_model(model, OptimizerSpec.sgd(0.1), key_mode="hashed")
    assert any(isinstance(l, tf_keras.layers.Embedding) for l in model._flatten_layers())


@pytest.mark.parametrize("build, match", [
    (lambda: ranking_class("str")(), "never called"),
    (lambda: tf_keras.Sequential([tf_keras.layers.Dense(1)]), "holds no Embedding"),
])
@pytest.mark.parametrize("convert", [shard_embeddings, fuse_model])
def test_unconvertible_models_fail_clearly(build, match, convert):
    if convert is fuse_model and match == "holds no Embedding":
        match = "has no Input"  # fuse_model takes a Sequential as a functional model
    with pytest.raises(ValueError, match=match):
        convert(build(), OptimizerSpec.sgd(0.1))
