"""FusedEmbedding in one process: input forms, outputs against a direct computation,
errors that name the feature, config round trip, the Keras converter, statistics."""
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tf_fusedemb.layers import FusedEmbedding, from_keras_embeddings
from tf_fusedemb.ops import hashing
from tf_fusedemb.specs import FeatureSpec, InitializerSpec, OptimizerSpec, TableSpec
from tf_fusedemb.storage.initializers import init_rows_np

OPT = OptimizerSpec.adagrad(0.1)
INIT = InitializerSpec.uniform(-0.1, 0.1)


def spec(name, combiner="sum", dim=4, vocab=None, max_len=None):
    return FeatureSpec(name, TableSpec(name, dim, OPT, INIT, vocabulary_size=vocab), combiner,
                       max_len=max_len)


def initial_rows(name, ids, dim=4):
    return init_rows_np(hashing.hashed_unified_keys(np.asarray(ids), [name] * len(ids)), dim, INIT)


def test_input_forms_and_outputs_match_the_initial_rows():
    layer = FusedEmbedding([spec("one"), spec("fixed", "sqrtn"), spec("rag", "mean"),
                            spec("sp", "sum"), spec("seq", None, max_len=3),
                            spec("dseq", None, max_len=2)])
    sparse = tf.sparse.from_dense(tf.constant([[3, 0], [0, 0], [5, 6]], tf.int64))
    out = layer({
        "one": tf.constant([7, 7, -2], tf.int32),
        "fixed": tf.constant([[1, 2], [2, 2], [9, 1]], tf.int64),
        "rag": tf.ragged.constant([[1, 2, 3], [], [4]], tf.int64),
        "sp": sparse,
        "seq": tf.ragged.constant([[1], [2, 3], []], tf.int64),
        "dseq": tf.constant([[4, 5], [5, 4], [0, 0]], tf.int64),
    })
    np.testing.assert_allclose(out["one"], initial_rows("one", [7, 7, -2]), rtol=1e-6)
    fixed = initial_rows("fixed", [1, 2, 2, 2, 9, 1]).reshape(3, 2, 4).sum(1) / np.sqrt(2)
    np.testing.assert_allclose(out["fixed"], fixed, rtol=1e-6)
    rag = np.stack([initial_rows("rag", [1, 2, 3]).mean(0), np.zeros(4),
                    initial_rows("rag", [4])[0]])
    np.testing.assert_allclose(out["rag"], rag, rtol=1e-6, atol=1e-7)
    sp = np.stack([initial_rows("sp", [3])[0], np.zeros(4), initial_rows("sp", [5, 6]).sum(0)])
    np.testing.assert_allclose(out["sp"], sp, rtol=1e-6, atol=1e-7)
    assert out["seq"].shape == (3, 3, 4) and out["dseq"].shape == (3, 2, 4)
    np.testing.assert_allclose(out["seq"][1, :2], initial_rows("seq", [2, 3]), rtol=1e-6)
    np.testing.assert_array_equal(out["seq"][2], np.zeros((3, 4)))
    np.testing.assert_allclose(out["dseq"][1], initial_rows("dseq", [5, 4]), rtol=1e-6)


def test_works_inside_tf_function_with_unknown_shapes():
    layer = FusedEmbedding([spec("a"), spec("r", "mean")])
    fn = tf.function(layer, input_signature=[{
        "a": tf.TensorSpec([None], tf.int64),
        "r": tf.RaggedTensorSpec([None, None], tf.int64, ragged_rank=1)}])
    out = fn({"a": tf.constant([1, 2], tf.int64), "r": tf.ragged.constant([[1], []], tf.int64)})
    assert out["a"].shape == (2, 4) and out["r"].shape == (2, 4)
    empty = fn({"a": tf.zeros([0], tf.int64),
                "r": tf.RaggedTensor.from_row_splits(tf.zeros([0], tf.int64), [0])})
    assert empty["a"].shape == (0, 4)


@pytest.mark.parametrize("inputs,message", [
    ({"a": tf.constant([1.0])}, "feature 'a': IDs must be int32 or int64, got float32"),
    ({"a": tf.zeros([2, 2, 2], tf.int64)}, r"feature 'a': expected a \[B\] or \[B, L\]"),
    ({}, r"missing features \['a'\]"),
    ({"a": tf.constant([1], tf.int64), "zz": tf.constant([1], tf.int64)},
     r"unexpected features \['zz'\]"),
])
def test_bad_input_names_the_feature(inputs, message):
    with pytest.raises(ValueError, match=message):
        FusedEmbedding([spec("a")])(inputs)


def test_static_vocabulary_out_of_range_names_the_feature_and_the_id():
    """The bad ID itself, not the first IDs of the batch (eager and traced)."""
    layer = FusedEmbedding([spec("st", vocab=10), spec("other", vocab=10)])
    traced = tf.function(layer)
    ok = {"other": tf.constant([1, 2, 3, 4, 5], tf.int64)}
    for call in (layer, traced):
        for ids, bad in (([3, 4, 5, 10, 2], 10), ([0, 1, 2, -1, 9], -1)):
            with pytest.raises(tf.errors.InvalidArgumentError) as info:
                call(dict(ok, st=tf.constant(ids, tf.int64)))
            text = str(info.value).replace("\\'", "'")
            assert (f"feature 'st': ID {bad} is out of range [0, 10) of its static table (in "
                    "the input of rank 0 of 1; group 'g0_d4_adagrad')") in text, text


def test_sequence_longer_than_max_len_is_an_error_not_a_truncation():
    layer = FusedEmbedding([spec("seq", None, max_len=2)])
    with pytest.raises(tf.errors.InvalidArgumentError, match="longer than max_len=2"):
        layer({"seq": tf.ragged.constant([[1, 2, 3]], tf.int64)})


def test_config_round_trip_keeps_features_and_plan():
    layer = FusedEmbedding([spec("a"), spec("b", "mean"), spec("c", dim=8)], name="emb")
    clone = FusedEmbedding.from_config(layer.get_config())
    assert clone.plan.fingerprint() == layer.plan.fingerprint()
    assert clone.features == layer.features and clone.name == "emb"


def test_keras_embeddings_convert_to_one_fused_group():
    embs = {"user": tf_keras.layers.Embedding(100, 8),
            "item": tf_keras.layers.Embedding(50, 8, embeddings_initializer="zeros"),
            "hist": {"input_dim": 50, "output_dim": 8, "embeddings_initializer": {
                "class_name": "RandomNormal", "config": {"mean": 0.0, "stddev": 0.01}}}}
    layer = from_keras_embeddings(embs, OptimizerSpec.sgd(0.1), combiners={"hist": None},
                                  max_lens={"hist": 4})
    specs = {f.name: f for f in layer.features}
    assert specs["user"].table.vocabulary_size == 100 and specs["user"].dim == 8
    assert specs["item"].table.initializer == InitializerSpec.zeros()
    assert specs["hist"].is_sequence and specs["hist"].table.initializer.name == "normal"
    out = layer({"user": tf.constant([1, 99], tf.int64), "item": tf.constant([3, 4], tf.int64),
                 "hist": tf.ragged.constant([[1, 2], []], tf.int64)})
    np.testing.assert_array_equal(out["item"], np.zeros((2, 8)))  # zeros initializer
    assert out["hist"].shape == (2, 4, 8)
    with pytest.raises(ValueError, match="feature 'x': mask_zero=True is not supported"):
        from_keras_embeddings({"x": tf_keras.layers.Embedding(5, 2, mask_zero=True)},
                              OptimizerSpec.sgd(0.1))


def test_statistics_are_lossless_and_name_feature_and_id():
    layer = FusedEmbedding([spec("a"), spec("b")])
    layer({"a": tf.constant([5, 5, 5, 7], tf.int64), "b": tf.constant([5, 9, 9, 9], tf.int64)})
    stats = layer.statistics()
    # Counts are accesses in the batch (senders ship their local counts with the keys).
    assert stats.category_totals() == {"a": 4, "b": 4}
    assert stats.top_k("a", 5) == [("a/5", 3), ("a/7", 1)]
    assert stats.top_k("b", 5) == [("b/9", 3), ("b/5", 1)]
    metrics = stats.metrics()
    assert metrics["unique_keys_last_step"] == 4 and metrics["access/a"] == 4
    with pytest.raises(ValueError, match="unknown category 'zz'"):
        stats.top_k("zz")
