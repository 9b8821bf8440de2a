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


class TwoRankKeras3Test(DistributedTestCase):
    """Keras 3 fit on 2 ranks (each half of every global batch) equals Keras 3 on the global
    batch in one process."""
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
