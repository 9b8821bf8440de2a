"""Same-spec tables of a subclassed model share one exchange: ``fuse_model`` gives the
TensorFlow Recommenders ranking model's two tables one FusedEmbedding and one group, and
a model written by hand with ShardedEmbeddings in separate blocks sharing one
FusedEmbedding (``tables=``) trains exactly like the same model with ordinary Embeddings
in plain tf_keras. A table whose IDs come from another table's output keeps its own
exchange, and the model says so once, naming it. (The AlltoAll rounds per step on 2 ranks
are counted by tests/test_keras_shapes.py's 2-rank job.)"""
import logging

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import keras_shapes as ks
from test_keras_shapes import assert_exact
from tf_fusedemb.layers import FusedEmbedding, ShardedEmbedding, fused_embedding_layers
from tf_fusedemb.models import FusedModel, WrappedModel
from tf_fusedemb.specs import FeatureSpec, OptimizerSpec, TableSpec


def test_fuse_model_gives_a_subclassed_model_one_group():
    original = ks.built(tf_keras, "tfrs_ranking")
    converted = ks.fuse(tf_keras, original)
    assert isinstance(converted, WrappedModel) and converted.wrapped is original
    (layer,) = fused_embedding_layers(converted)
    assert len(layer.features) == 2 and len(layer.plan.groups) == 1
    inner = original._flatten_layers()  # pylint: disable=protected-access
    views = [l for l in inner if isinstance(l, ShardedEmbedding)]
    assert len(views) == 2 and all(v.fused is layer for v in views)
    assert not any(isinstance(l, tf_keras.layers.Embedding) for l in inner)


def test_a_table_fed_by_another_tables_output_is_named_once(caplog):
    initial, losses, trained = ks.reference(tf_keras, "dependent_ids", ks.BATCH)
    with caplog.at_level(logging.WARNING, logger="tf_fusedemb"):
        run = ks.converted_run(tf_keras, "dependent_ids", initial)
    assert_exact(ks.max_diffs([run], losses, trained), "dependent_ids")
    said = [r.getMessage() for r in caplog.records if "own exchange" in r.getMessage()]
    assert len(said) == 1 and "table 'bucket'" in said[0], said


def _hand_written(base, embedding):
    """The ranking model on ``base`` with its two lookup blocks' Embeddings from
    ``embedding(name, rows)`` (a plain Embedding, or a ShardedEmbedding sharing one
    FusedEmbedding)."""
    class Ranking(base):
        def __init__(self):
            super().__init__()
            self.user_block = tf_keras.Sequential([
                tf_keras.layers.StringLookup(vocabulary=ks.USERS, mask_token=None),
                embedding("user", len(ks.USERS) + 1)], name="user_block")
            self.movie_block = tf_keras.Sequential([
                tf_keras.layers.StringLookup(vocabulary=ks.MOVIES, mask_token=None),
                embedding("movie", len(ks.MOVIES) + 1)], name="movie_block")
            self.top = tf_keras.layers.Dense(1)

        def call(self, features):
            return self.top(tf.concat([self.user_block(features["user_id"]),
                                       self.movie_block(features["movie_title"])], axis=1))
    return Ranking()


def test_hand_written_shared_tables_train_like_keras():
    x, y = ks.shape_data("tfrs_ranking")
    plain = _hand_written(tf_keras.Model,
                          lambda name, rows: tf_keras.layers.Embedding(rows, ks.DIM, name=name))
    plain(x)
    features = [FeatureSpec(name, TableSpec(name, ks.DIM, OptimizerSpec.sgd(ks.LR),
                                          vocabulary_size=rows),
                            combiner="sum")
                for name, rows in (("user", len(ks.USERS) + 1), ("movie", len(ks.MOVIES) + 1))]
    tables = FusedEmbedding(features, name="tables")
    by_name = {f.name: f for f in features}
    ours = _hand_written(FusedModel, lambda name, rows: ShardedEmbedding(
        by_name[name], tables=tables, name=name))
    ours(x)
    tables.set_embedding_weights({n: plain.get_layer(f"{n}_block").layers[1].get_weights()[0]
                                  for n in by_name})
    ours.top.set_weights(plain.top.get_weights())
    assert len(tables.plan.groups) == 1
    results = []
    for model in (plain, ours):
        model.compile(optimizer=tf_keras.optimizers.SGD(ks.LR), loss="mse")
        history = model.fit(x, y, batch_size=ks.BATCH, epochs=2, shuffle=False, verbose=0)
        results.append((history.history["loss"], model.top.get_weights()))
    (want_loss, want_top), (got_loss, got_top) = results
    np.testing.assert_allclose(got_loss, want_loss, atol=1e-5)
    for got, want in zip(got_top, want_top):
        np.testing.assert_allclose(got, want, atol=1e-5)
    rows = ks.fused_rows(ours)
    for n in by_name:
        np.testing.assert_allclose(rows[n], plain.get_layer(f"{n}_block").layers[1]
                                   .get_weights()[0], atol=1e-5)


def test_adam_tables_keep_one_group_each_and_shared_ones_refuse_a_lookup_per_feature():
    """Adam's row update counts the group's steps: fuse_model gives each table its own
    FusedEmbedding (so each steps once per training step), and tables shared by hand
    that a plain tf_keras fit looks up one feature at a time are refused in one line,
    naming the fix, instead of stepping once per feature."""
    from tf_fusedemb.models import fuse_model
    converted = fuse_model(ks.built(tf_keras, "tfrs_ranking"), OptimizerSpec.adam(0.01))
    layers = fused_embedding_layers(converted)
    assert len(layers) == 2 and all(len(l.features) == 1 for l in layers)
    x, y = ks.shape_data("tfrs_ranking")
    features = [FeatureSpec(name, TableSpec(name, ks.DIM, OptimizerSpec.adam(0.01),
                                          vocabulary_size=rows), combiner="sum")
                for name, rows in (("user", len(ks.USERS) + 1), ("movie", len(ks.MOVIES) + 1))]
    tables = FusedEmbedding(features, name="adam_tables")
    by_name = {f.name: f for f in features}
    plain = _hand_written(tf_keras.Model, lambda name, rows: ShardedEmbedding(
        by_name[name], tables=tables, name=name))
    plain.compile(optimizer=tf_keras.optimizers.SGD(ks.LR), loss="mse")
    with pytest.raises(ValueError, match="counts steps.*its own FusedEmbedding"):
        plain.fit(x, y, batch_size=ks.BATCH, epochs=1, verbose=0)
