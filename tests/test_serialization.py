"""FusedEmbedding and the models are Keras-serializable: a model's JSON config, read back by
``tf_keras.models.model_from_json`` with no custom_objects, rebuilds the same class, the
same config and (rows seeded by key, dense layers seeded) the same predictions."""
import json

import numpy as np
import tensorflow as tf
import tf_keras

import keras_parity as kp
from test_models import _small_models
from tf_fusedemb.layers import FusedEmbedding, from_keras_embeddings
from tf_fusedemb.models import fuse_model
from tf_fusedemb.models import FusedModel
from tf_fusedemb.specs import OptimizerSpec


def _round_trip(model):
    again = tf_keras.models.model_from_json(model.to_json())
    assert type(again) is type(model)
    assert json.loads(again.to_json())["config"] == json.loads(model.to_json())["config"]
    return again


def test_fused_embedding_layer_deserializes_by_registered_name():
    layer = [l for l in fuse_model(kp.plain_model(), OptimizerSpec.sgd(0.1)).layers
             if isinstance(l, FusedEmbedding)][0]
    config = tf_keras.layers.serialize(layer)
    assert config["registered_name"] == "tf_fusedemb>FusedEmbedding"
    clone = tf_keras.layers.deserialize(json.loads(json.dumps(config)))
    assert isinstance(clone, FusedEmbedding) and clone.features == layer.features
    assert clone.plan == layer.plan


def test_functional_fused_model_survives_model_from_json():
    # Rows seeded by key, a seeded Dense: the rebuilt model starts from the same weights.
    layer = from_keras_embeddings({f: tf_keras.layers.Embedding(kp.VOCAB, kp.DIM)
                                   for f in kp.FEATURES}, OptimizerSpec.adagrad(0.1))
    inputs = {f: tf_keras.Input([], dtype=tf.int64, name=f) for f in kp.FEATURES}
    h = tf_keras.layers.Concatenate()(list(layer(inputs).values()))
    model = FusedModel(inputs, tf_keras.layers.Dense(
        1, kernel_initializer=tf_keras.initializers.GlorotUniform(3))(h))
    x, _, _ = kp.data(16, 0)
    again = _round_trip(model)
    assert isinstance(again, tf_keras.Model) and again.get_layer(layer.name)
    np.testing.assert_allclose(again.predict(x, verbose=0), model.predict(x, verbose=0),
                               rtol=1e-6, atol=1e-7)


def test_hand_built_fused_model_and_the_models_survive_model_from_json():
    for model, x in _small_models():
        x = {k: (v if isinstance(v, tf.RaggedTensor) else
                 np.array(v, np.float32 if k.startswith("d") else np.int64)) for k, v in x.items()}
        again = _round_trip(model)
        np.testing.assert_allclose(again(x).numpy(), model(x).numpy(), rtol=1e-6, atol=1e-7)
    assert FusedModel.__name__ in tf_keras.saving.get_registered_name(FusedModel)


def test_load_model_rebuilds_the_structure(tmp_path):
    """A saved .keras model loads back as the same class and config without custom_objects
    (its table rows travel with tf_fusedemb.training.CheckpointManager, not the .keras file)."""
    model = fuse_model(kp.plain_model(), OptimizerSpec.sgd(0.1))
    path = str(tmp_path / "model.keras")
    model.save(path)
    again = tf_keras.models.load_model(path)
    assert type(again) is type(model)
    assert json.loads(again.to_json())["config"] == json.loads(model.to_json())["config"]
