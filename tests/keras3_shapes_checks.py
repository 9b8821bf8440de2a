"""The model shapes of tests/keras_shapes.py in Keras 3 (keras.Model, Keras 3's own fit,
``tf_fusedemb.keras3.fuse_model``) against Keras 3 with ordinary layers, on 1 and 2 ranks;
and a layer of one Keras called in a model of the other, refused in one line naming the
class to use. Run by tests/test_keras_shapes.py in a process of its own (no TFRA
imported, no TF_USE_LEGACY_KERAS), as a Keras 3 program runs."""
import numpy as np
import pytest
import tf_keras

import keras_shapes as ks
from test_keras_shapes import assert_exact, assert_rows_moved
from tf_fusedemb.testing import DistributedTestCase

keras = pytest.importorskip("keras", minversion="3")


@pytest.mark.parametrize("name", ks.KERAS3_SHAPES)
def test_shape_trains_like_plain_keras3(name):
    if name in ks.PACKAGES:
        pytest.importorskip(ks.PACKAGES[name])
    initial, losses, trained = ks.reference(keras, name, ks.BATCH)
    assert_rows_moved(keras, name, initial, trained)
    assert_exact(ks.max_diffs([ks.converted_run(keras, name, initial)], losses, trained), name)


def test_keras3_converted_model_shares_nothing_and_keeps_vocabularies():
    original = ks.built(keras, "nested_blocks")
    converted = ks.fuse(keras, original)
    assert not {id(v) for v in original.weights} & {id(v) for v in converted.weights}
    new = {l.name: l for l in ks.leaves(converted)}
    for layer in ks.leaves(original):
        if isinstance(layer, keras.layers.Embedding):
            continue  # in the FusedEmbedding
        assert new[layer.name] is not layer
        if isinstance(layer, keras.layers.StringLookup):
            assert layer.get_vocabulary() == new[layer.name].get_vocabulary()


def _layers():
    from tf_fusedemb import keras3, layers
    from tf_fusedemb.specs import FeatureSpec, OptimizerSpec, TableSpec
    feature = FeatureSpec("a", TableSpec("a", 2, OptimizerSpec.sgd(0.1), vocabulary_size=9))
    return {"tf_keras": (layers.FusedEmbedding([feature]), layers.ShardedEmbedding(feature)),
            "Keras 3": (keras3.FusedEmbedding([feature]), keras3.ShardedEmbedding(feature))}


@pytest.mark.parametrize("layer_keras,model_keras", [("tf_keras", "Keras 3"),
                                                     ("Keras 3", "tf_keras")])
def test_a_layer_in_a_model_of_the_other_keras_names_the_class_to_use(layer_keras, model_keras):
    """FusedEmbedding and ShardedEmbedding of one Keras called on the Input of the other:
    one line naming the twin class."""
    k = keras if model_keras == "Keras 3" else tf_keras
    package = "keras3" if model_keras == "Keras 3" else "layers"
    ids = k.Input((), dtype="int64", name="a")
    fused, sharded = _layers()[layer_keras]
    for layer, call in ((fused, {"a": ids}), (sharded, ids)):
        with pytest.raises(TypeError) as error:
            layer(call)
        message = str(error.value)
        assert "\n" not in message
        assert f"in a {model_keras} model use tf_fusedemb.{package}.{type(layer).__name__}" \
            in message, message


class TwoRankKeras3ShapesTest(DistributedTestCase):
    """Every Keras 3 shape on 2 ranks (DistributedOptimizer, each rank half of every
    global batch), in one 2-rank job, equals Keras 3 on the global batches here."""
    timeout = 600

    @pytest.mark.timeout(700)
    def test_keras3_shapes_on_two_ranks(self):
        names = ks.installed(ks.KERAS3_SHAPES)
        for name, diffs in ks.two_rank_diffs(self.run_ranks, keras, names).items():
            assert_exact(diffs, name)
