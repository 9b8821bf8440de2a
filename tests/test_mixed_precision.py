"""Keras's ``mixed_bfloat16`` policy with FusedEmbedding: bf16 matmuls, float32 master
weights, a float32 logit and loss; rows and the engine's optimizer in float32. Each path
is compared with the same model written with ordinary tf_keras ``Embedding`` layers under
the same policy and trained the ordinary way: plain ``fit``, ``FusedModel`` (through
``fuse_model``), 2 ranks against one process, and the SavedModel export."""
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import keras_paths as kpth
from test_keras_paths import TOL, assert_same_training
from tf_fusedemb.inference import export_saved_model
from tf_fusedemb.models import fuse_model
from tf_fusedemb.specs import OptimizerSpec
from tf_fusedemb.testing import DistributedTestCase

BF16 = "mixed_bfloat16"
# N ranks against one process: each rank's kernel gradient is a bf16 matmul whose output
# (the rank's partial sum over its half of the batch) is rounded to bf16 before the
# ranks' average; one process rounds the whole batch's sum once. So they agree to bf16's
# rounding (8-bit mantissa: 2^-8 relative), not bit for bit as float32 steps do.
BF16_TOL = dict(rtol=1e-2, atol=2e-3)
# The model's predictions after N ranks' training differ from one process's by that
# rounding at the scale of the values they are computed from, not of each prediction: a
# prediction near 0 is a difference of terms near the largest. 4 bf16 units (2^-6) of the
# largest prediction. Measured: 0.15-0.37% of it over five models, 0.66% in one that failed
# a fixed atol of 2e-3 at a prediction of 0.06; training moves them by about 100% of it.
BF16_PREDICTION_UNITS = 2.0 ** -6
# The rows likewise: a row's gradient is a bf16 product at the scale of its table's
# gradients, so a row near 0 carries the rounding of the largest. 16 bf16 units (2^-4) of
# the table's largest move in training, beside the per-value BF16_TOL. Measured over six
# draws: up to 0.7% of the largest move (up to 5.9e-4), and 0.0055 once in CI; a wrong
# update is about 100% of it.
BF16_ROW_UNITS = 2.0 ** -4


def _pair(optimizer):
    ref, embeds = kpth.functional(tf_keras, False, policy=BF16)
    fused, layer = kpth.functional(tf_keras, True, optimizer, policy=BF16)
    initial = kpth.initial_weights(ref, embeds)
    kpth.load_weights(fused, layer, initial)
    return ref, embeds, fused, layer, initial


def test_the_dense_layers_compute_in_bf16_on_float32_weights():
    _, _, fused, _, _ = _pair("sgd")
    hidden = fused.get_layer("hidden")
    assert hidden.compute_dtype == "bfloat16" and hidden.kernel.dtype == tf.float32
    assert fused.output.dtype == tf.float32


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_plain_fit_equals_keras_in_bf16(optimizer):
    x, y = kpth.data()
    ref, embeds, fused, layer, initial = _pair(optimizer)
    want = kpth.fit(tf_keras, ref, kpth.keras_optimizer(tf_keras, optimizer), x, y, kpth.BATCH)
    got = kpth.fit(tf_keras, fused, kpth.keras_optimizer(tf_keras, optimizer), x, y, kpth.BATCH)
    assert_same_training(got, want, layer, embeds, initial)


def test_fused_model_equals_keras_in_bf16():
    x, y = kpth.data()
    ref, embeds = kpth.functional(tf_keras, False, policy=BF16)
    initial = kpth.initial_weights(ref, embeds)
    fused = fuse_model(ref, OptimizerSpec.sgd(kpth.LR["sgd"]))
    assert fused.get_layer("hidden").compute_dtype == "bfloat16"
    got = kpth.fit(tf_keras, fused, kpth.keras_optimizer(tf_keras, "sgd"), x, y, kpth.BATCH)
    want = kpth.fit(tf_keras, ref, kpth.keras_optimizer(tf_keras, "sgd"), x, y, kpth.BATCH)
    np.testing.assert_allclose(got["losses"], want["losses"], **TOL)
    np.testing.assert_allclose(got["predictions"], want["predictions"], **TOL)
    tables, _ = kpth.fused_tables(fused.get_layer("fused_embedding"), prefix="emb_")
    for f, emb in embeds.items():
        assert np.abs(emb.get_weights()[0] - initial["tables"][f]).max() > 1e-4
        np.testing.assert_allclose(tables[f], emb.get_weights()[0], **TOL, err_msg=f)


def test_bf16_export_serves_the_same_predictions(tmp_path):
    x, y = kpth.data()
    _, _, fused, _, _ = _pair("sgd")
    kpth.fit(tf_keras, fused, kpth.keras_optimizer(tf_keras, "sgd"), x, y, kpth.BATCH, epochs=1)
    want = fused.predict(x, verbose=0)
    served = tf.saved_model.load(export_saved_model(
        fused, str(tmp_path / "bf16"), {f: "scalar" for f in kpth.FEATURES})).signatures[
            "serving_default"](**{f: tf.constant(v) for f, v in x.items()})
    assert served["logits"].dtype == tf.float32
    np.testing.assert_allclose(served["logits"].numpy(), want, **TOL)


def test_rows_in_bf16_on_the_wire_are_the_rows_rounded_to_bf16():
    """wire_dtype="bfloat16": the layer's outputs are the float32 layer's (the same
    key-seeded rows) rounded to bf16; the tables stay float32."""
    from tf_fusedemb.layers import FusedEmbedding
    x, _ = kpth.data()
    inputs = {f: tf.constant(v) for f, v in x.items()}
    exact = FusedEmbedding(kpth.specs("sgd"))(inputs)
    layer = FusedEmbedding(kpth.specs("sgd"), wire_dtype="bfloat16")
    out = layer(inputs)
    for f in kpth.FEATURES:
        assert out[f].dtype == tf.float32
        rounded = tf.cast(tf.cast(exact[f], tf.bfloat16), tf.float32).numpy()
        np.testing.assert_array_equal(out[f].numpy(), rounded)
        assert np.abs(out[f].numpy() - exact[f].numpy()).max() > 0  # really rounded
    with pytest.raises(ValueError, match="wire_dtype must be one of"):
        FusedEmbedding(kpth.specs("sgd"), wire_dtype="float16")


class TwoRankBf16Test(DistributedTestCase):
    """bf16 fit on 2 ranks (each half of every global batch, DistributedOptimizer) equals
    tf_keras bf16 fit of the ordinary model on the global batch in one process, to bf16
    rounding at the values' scale (``BF16_PREDICTION_UNITS``, ``BF16_ROW_UNITS``)."""
    timeout = 500

    @pytest.mark.timeout(700)
    def test_two_ranks_equal_one_process_in_bf16(self):
        x, y = kpth.data()
        ref, embeds = kpth.functional(tf_keras, False, policy=BF16)
        initial = kpth.initial_weights(ref, embeds)
        want = kpth.fit(tf_keras, ref, kpth.keras_optimizer(tf_keras, "adagrad"), x, y,
                        2 * kpth.BATCH)
        ranks = self.run_ranks(kpth.plain_on_ranks, 2, (initial, "fit", "adagrad", True, BF16))
        for r in ranks:
            self.assertNotIn("error", r)
            scale = np.abs(want["predictions"]).max()
            np.testing.assert_allclose(r["predictions"], want["predictions"], rtol=0,
                                       atol=BF16_PREDICTION_UNITS * scale)
        for f, emb in embeds.items():
            rows, want_rows = sum(r["tables"][f] for r in ranks), emb.get_weights()[0]
            moved = np.abs(want_rows - initial["tables"][f]).max()
            assert moved > 1e-2
            np.testing.assert_allclose(rows, want_rows, rtol=BF16_TOL["rtol"],
                                       atol=max(BF16_TOL["atol"], BF16_ROW_UNITS * moved),
                                       err_msg=f)
