"""The layer's façade: one record of a model's FusedEmbedding layers (``ModelEmbeddings``),
found once per ``FusedModel`` and handed to its step, pipeline and checkpoints; a group
lookup split into its router and its store; any embedding provider served through the
one ``GroupEmbeddings`` interface.

References are independent of the code under test: the model's own layers as Keras
tracks them, and for the provider test, numpy rows pooled by hand.
"""
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tf_fusedemb.comm import LocalCommunicator
from tf_fusedemb.layers import FusedEmbedding, LookupContext, ModelEmbeddings, use_context
from tf_fusedemb.layers.group_interface import DistributedGroupLookup, StoredGroup
from tf_fusedemb.layers.lookup_context import GroupName
from tf_fusedemb.layers.model_embeddings import fused_embedding_layers
from tf_fusedemb.models import FusedModel
from tf_fusedemb.specs import FeatureSpec, OptimizerSpec, TableSpec

DIM = 4


def _features(prefix, n=2):
    opt = OptimizerSpec.adagrad(0.1)
    return [FeatureSpec(f"{prefix}{i}", TableSpec(f"{prefix}{i}", DIM, opt)) for i in range(n)]


def _two_layer_model(communicator=None, names=("user", "item")):
    """A functional FusedModel with two FusedEmbedding layers (one nested in a model)."""
    feats = {n: _features(n) for n in ("u", "i")}
    inputs = {f.name: tf_keras.Input([], dtype=tf.int64, name=f.name)
              for fs in feats.values() for f in fs}
    user = FusedEmbedding(feats["u"], name=names[0])
    inner_in = {f.name: tf_keras.Input([], dtype=tf.int64, name=f.name) for f in feats["i"]}
    item = FusedEmbedding(feats["i"], name=names[1], communicator=communicator)
    tower = tf_keras.Model(inner_in, item(inner_in), name="tower")
    out_u = user({f.name: inputs[f.name] for f in feats["u"]})
    out_i = tower({f.name: inputs[f.name] for f in feats["i"]})
    x = tf_keras.layers.Concatenate()(list(out_u.values()) + list(out_i.values()))
    return FusedModel(inputs, tf_keras.layers.Dense(1)(x)), user, item


def _data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = {f"{p}{i}": rng.integers(0, 30, n).astype(np.int64) for p in "ui" for i in range(2)}
    return x, rng.integers(0, 2, n).astype(np.float32)


def test_the_record_holds_every_layer_group_and_store_in_model_order():
    model, user, item = _two_layer_model()
    found = ModelEmbeddings.of(model)
    keras_order = [m for m in model.submodules if isinstance(m, FusedEmbedding)]
    assert list(found.layers) == keras_order and set(found.layers) == {user, item}
    expected = [(GroupName(layer.name, g.group.name), g)
                for layer in keras_order for g in layer.groups]
    assert [tuple(n) for n in found.named] == expected
    assert list(found.lookups) == [g for _, g in expected]
    assert [s for s in found.stores] == [g.store for _, g in expected]
    assert found.feature_names == {"u0", "u1", "i0", "i1"}
    assert found.communicator is user.communicator
    for lookup in found.lookups:  # the router and its store, each its own interface
        assert isinstance(lookup, DistributedGroupLookup)
        assert isinstance(lookup.store, StoredGroup)
        for gone in ("table", "stats", "policy", "key_codec", "save_state", "memory"):
            assert not hasattr(lookup, gone), gone


def test_different_communicators_and_duplicate_group_names_fail_in_one_line():
    model, _, _ = _two_layer_model(communicator=LocalCommunicator())
    with pytest.raises(ValueError, match="built with different communicators; build them "
                                         "with one"):
        ModelEmbeddings.of(model)
    clash, _, _ = _two_layer_model(names=("same", "same"))
    with pytest.raises(ValueError, match="two FusedEmbedding layers named 'same'"):
        ModelEmbeddings.of(clash)


def test_use_context_installs_on_every_layer_and_restores_after_an_error():
    model, user, item = _two_layer_model()
    context = LookupContext(suffix="/x")
    with pytest.raises(RuntimeError):
        with use_context(model, context):
            assert user.lookup_context is context and item.lookup_context is context
            raise RuntimeError("inside")
    assert user.lookup_context is not context and item.lookup_context is not context


def test_fused_model_walks_itself_once_for_fit_evaluate_and_predict(monkeypatch):
    model, _, _ = _two_layer_model()
    model.compile(optimizer="sgd", loss="mse")
    x, y = _data()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # builds and keeps the record
    walks = []
    original = ModelEmbeddings.of.__func__

    def counting(cls, *args, **kwargs):
        walks.append(args)
        return original(cls, *args, **kwargs)
    monkeypatch.setattr(ModelEmbeddings, "of", classmethod(counting))
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    model.evaluate(x, y, batch_size=16, verbose=0)
    model.predict(x, batch_size=16, verbose=0)
    assert model.communicator is model.fused_embeddings.communicator
    assert walks == []


class _ConstantRows:
    """An embedding provider of our own (not one of the library's classes): one fixed row
    per (table, ID), pooled by sum, through the GroupEmbeddings interface alone."""
    defers_range_check = False

    def __init__(self, lookup, rows):
        self.group, self.key_mode, self.table_names = (lookup.group, lookup.key_mode,
                                                       lookup.table_names)
        self.rows, self.calls = rows, []

    def __call__(self, flats, combiners, context, record_statistics, marker=None):
        self.calls.append((record_statistics, marker))
        out = []
        for spec, flat in zip(self.group.features, flats):
            rows = tf.gather(self.rows[spec.table.name], flat.ids)
            out.append(tf.math.segment_sum(rows, tf.repeat(
                tf.range(flat.batch_size), flat.row_splits[1:] - flat.row_splits[:-1])))
        return out


def test_any_provider_of_the_interface_serves_the_layer():
    features = _features("f", 2)
    layer = FusedEmbedding(features, name="emb")
    rng = np.random.default_rng(3)
    rows = {f.table.name: rng.normal(size=(20, DIM)).astype(np.float32) for f in features}
    group, = layer.groups
    provider = _ConstantRows(group, {k: tf.constant(v) for k, v in rows.items()})
    ids = {"f0": tf.constant([3, 7, 7], tf.int64),
           "f1": tf.ragged.constant([[1, 2], [], [19]], tf.int64)}
    context = LookupContext(substitutes={GroupName("emb", group.group.name): provider})
    with use_context(layer, context):
        out = layer(ids, training=False)
    np.testing.assert_allclose(out["f0"], rows["f0"][[3, 7, 7]], rtol=1e-6)
    want = np.stack([rows["f1"][1] + rows["f1"][2], np.zeros(DIM), rows["f1"][19]])
    np.testing.assert_allclose(out["f1"], want, rtol=1e-6)
    assert provider.calls == [(False, None)]
    assert fused_embedding_layers(layer) == [layer]
