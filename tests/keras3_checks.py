"""Keras 3 paths with FusedEmbedding against Keras 3 with ordinary Embedding layers:
functional and subclassed ``fit``, a ``GradientTape`` loop, the SavedModel export. Run by
tests/test_keras_paths.py in a process of its own (no TFRA imported, no
TF_USE_LEGACY_KERAS), as a Keras 3 program runs."""
import numpy as np
import pytest
import tensorflow as tf

import keras_paths as kpth
from test_keras_paths import TOL, assert_same_training, pair_functional, pair_subclassed

keras = pytest.importorskip("keras", minversion="3")


@pytest.mark.parametrize("shape", ["functional", "subclassed"])
def test_keras3_fit(shape):
    x, y = kpth.data()
    pair = pair_functional if shape == "functional" else pair_subclassed
    ref, embeds, fused, layer, initial = pair(keras, "sgd")
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
