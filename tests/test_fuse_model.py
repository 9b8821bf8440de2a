"""tf_fusedemb.models.fuse_model on a Criteo-shaped tf_keras model (26 Embeddings + 13 dense
inputs): the same predictions before training, and after training on 2 ranks the same
history, evaluation and predictions as plain tf_keras fit of the original on one process."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import keras_parity as kp
import tf_fusedemb.layers
from conftest import REPO_ROOT
from tf_fusedemb.layers import FusedEmbedding, from_keras_embeddings
from tf_fusedemb.models import fuse_model
from tf_fusedemb.specs import OptimizerSpec
from tf_fusedemb.testing import DistributedTestCase

OPT = OptimizerSpec.adagrad(0.3)


def test_the_old_import_path_gives_the_same_function_with_a_warning():
    with pytest.warns(DeprecationWarning, match="tf_fusedemb.models.fuse_model"):
        assert tf_fusedemb.layers.fuse_model is fuse_model
    with pytest.raises(AttributeError, match="no attribute 'fuse_modle'"):
        tf_fusedemb.layers.fuse_modle  # pylint: disable=pointless-statement


def test_predictions_equal_before_training():
    plain = kp.plain_model(**kp.CRITEO)
    fused = fuse_model(plain, OPT)
    x, _, _ = kp.data(64, 3, **kp.CRITEO)
    np.testing.assert_allclose(fused.predict(x, verbose=0), plain.predict(x, verbose=0),
                               rtol=1e-6, atol=1e-6)
    (layer,) = [l for l in fused.layers if isinstance(l, FusedEmbedding)]
    names = sorted(f"emb_{c}" for c in kp.CRITEO["features"])
    assert sorted(f.name for f in layer.features) == names
    assert len(layer.plan.groups) == 1           # 26 same-spec tables: one fused group
    assert not any(isinstance(l, tf_keras.layers.Embedding) for l in fused.layers)
    # No weight is shared: the original is untouched by training the converted model.
    before = [w.copy() for w in plain.get_weights()]
    fused.compile(optimizer=tf_keras.optimizers.SGD(0.5),
                  loss=tf_keras.losses.BinaryCrossentropy(from_logits=True))
    fused.fit(x, (x["C1"] % 2).astype(np.float32), verbose=0)
    for a, b in zip(before, plain.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_a_sequential_model_trains_like_keras():
    """A Sequential built on an Input is fused as the functional model of its layers: a
    new model, the same predictions, and fit equal to plain fit of the original's copy."""
    def sequential():
        return tf_keras.Sequential([
            tf_keras.Input([3], dtype=tf.int64), tf_keras.layers.Embedding(30, 4, name="ids"),
            tf_keras.layers.Flatten(), tf_keras.layers.Dense(1)])
    ref, original = sequential(), sequential()
    original.set_weights(ref.get_weights())
    fused = fuse_model(original, OptimizerSpec.adagrad(0.1))
    assert [l.name for l in fused.layers if isinstance(l, FusedEmbedding)] == ["fused_embedding"]
    rng = np.random.default_rng(0)
    x = rng.zipf(1.3, (64, 3)).clip(1, 30).astype(np.int64) - 1
    y = (x[:, 0] % 3 == 0).astype(np.float32)
    np.testing.assert_allclose(fused.predict(x, verbose=0), ref.predict(x, verbose=0),
                               rtol=1e-6, atol=1e-6)
    out = []
    for model in (ref, fused):
        model.compile(optimizer=tf_keras.optimizers.Adagrad(0.1),
                      loss=tf_keras.losses.BinaryCrossentropy(from_logits=True))
        out.append(model.fit(x, y, batch_size=16, epochs=2, shuffle=False,
                             verbose=0).history["loss"])
    assert out[0][1] < out[0][0]
    np.testing.assert_allclose(out[1], out[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(fused.predict(x, verbose=0), ref.predict(x, verbose=0),
                               rtol=1e-5, atol=1e-5)


def test_sequence_and_shared_embeddings_convert():
    """[B, L] inputs become sequence features; a second call of one Embedding shares its table."""
    ids = tf_keras.Input([], dtype=tf.int64, name="ids")
    hist = tf_keras.Input([5], dtype=tf.int32, name="hist")
    item = tf_keras.layers.Embedding(40, 4, name="item")
    pooled = tf_keras.layers.GlobalAveragePooling1D()(item(hist))
    h = tf_keras.layers.Concatenate()([item(ids), pooled])
    plain = tf_keras.Model({"ids": ids, "hist": hist}, tf_keras.layers.Dense(2)(h))
    fused = fuse_model(plain, OPT, dynamic=True)
    rng = np.random.default_rng(0)
    x = {"ids": rng.integers(0, 40, 9), "hist": rng.integers(0, 40, (9, 5)).astype(np.int32)}
    np.testing.assert_allclose(fused.predict(x, verbose=0), plain.predict(x, verbose=0),
                               rtol=1e-6, atol=1e-6)
    specs = {f.name: f for f in fused.get_layer("fused_embedding").features}
    assert specs["item"].table == specs["item_1"].table and specs["item"].table.name == "item"
    assert {specs["item"].max_len, specs["item_1"].max_len} == {5, None}


@pytest.mark.parametrize("build, match", [
    (lambda: tf_keras.Sequential([tf_keras.layers.Embedding(5, 2)]), "int32/int64 IDs"),
    (lambda: tf_keras.Sequential([tf_keras.layers.Dense(2)]), "has no Input"),
    (lambda: _one_embedding(tf.float32), "int32/int64 IDs"),
    (lambda: _one_embedding(tf.int64, mask_zero=True), "mask_zero"),
    (lambda: _one_embedding(tf.int64, embeddings_regularizer="l2"), "embeddings_regularizer"),
    (lambda: tf_keras.Model(*_io(tf_keras.layers.Reshape([1]))), "no top-level Embedding"),
    (lambda: _Subclassed(), "Embedding '.*' was never called"),
    (lambda: _keras3_functional(), "Keras 3 model.*tf_fusedemb.keras3.fuse_model"),
])
def test_unsupported_models_fail_clearly(build, match):
    with pytest.raises(ValueError, match=match):
        fuse_model(build(), OPT)


class _Subclassed(tf_keras.Model):
    def __init__(self):
        super().__init__()
        self.emb = tf_keras.layers.Embedding(5, 2)

    def call(self, x):
        return self.emb(x)


def _keras3_functional():
    keras = pytest.importorskip("keras", minversion="3")
    x = keras.Input((2,))  # no initializer runs: TFRA, if a test imported it, breaks them
    return keras.Model(x, keras.layers.Activation("relu")(x))


def _io(layer, dtype=tf.float32):
    x = tf_keras.Input([], dtype=dtype, name="x")
    return x, layer(x)


def _one_embedding(dtype, **kwargs):
    return tf_keras.Model(*_io(tf_keras.layers.Embedding(5, 2, **kwargs), dtype))


class FuseModelOnTwoRanksTest(DistributedTestCase):
    timeout = 500

    @pytest.mark.timeout(600)
    def test_fuse_model_on_two_ranks_equals_keras_on_one_process(self):
        """History (loss, accuracy, AUC), per-batch losses and predictions of the converted
        model fitted on 2 ranks = plain tf_keras fit of the original on one process."""
        self.assertEquivalentToSingleProcess(
            kp.criteo_fused_compiled, kp.criteo_data, num_ranks=2, batch_size=32, epochs=2,
            reference_fn=kp.criteo_plain_compiled, rtol=1e-5, atol=1e-6)


# Noise a CPU machine must not show (tf_fusedemb.quiet): CUDA factories, TFRA's import
# notices, AutoGraph failing on frozen stdlib functions, deprecation warnings.
NOISE = ("Unable to register cu", "GraphKeys has already been deprecated", "_SingleDeviceSaver",
         "AutoGraph could not transform", "DeprecationWarning", "oneDNN custom operations")


@pytest.mark.timeout(400)
def test_movielens_example_ported_from_tfra_runs_quietly(shared_data):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HOROVOD", "TF_CPP", "TF_USE_LEGACY"))}  # the package's defaults
    out = subprocess.run(
        [sys.executable, "examples/movielens_from_tfra.py", "--data",
         str(shared_data / "movielens-latest-small"), "--steps-per-epoch", "3", "--test-steps",
         "2", "--batch-size", "64", "--embedding-size", "8"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=350)
    assert out.returncode == 0, out.stderr[-3000:]
    (line,) = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    result = json.loads(line[len("RESULT "):])
    assert result["world_size"] == 1 and np.isfinite(result["train_loss"])
    assert 0.0 <= result["test_auc"] <= 1.0
    assert not [n for n in NOISE if n in out.stdout + out.stderr], out.stdout + out.stderr


@pytest.mark.parametrize("initializer,limit,std", [
    ("glorot_uniform", np.sqrt(6 / (500 + 16)), np.sqrt(2 / (500 + 16))),
    ("he_normal", 2 * np.sqrt(2 / 500) / 0.87962566103423978, np.sqrt(2 / 500)),
    (tf_keras.initializers.VarianceScaling(0.5, "fan_out", "uniform"), np.sqrt(1.5 / 16),
     np.sqrt(0.5 / 16)),
])
def test_keras_variance_scaling_initializers_carry_over(initializer, limit, std):
    """A converted table draws its never-trained rows from the Keras initializer's own
    distribution (its scale computed from the Embedding's [input_dim, output_dim])."""
    emb = tf_keras.layers.Embedding(500, 16, embeddings_initializer=initializer, name="t")
    layer = from_keras_embeddings({"t": emb}, OPT, dynamic=True)
    rows = layer({"t": tf.range(500, dtype=tf.int64)}, training=False)["t"].numpy()
    assert np.abs(rows).max() <= limit + 1e-6
    assert abs(rows.std() - std) < 0.05 * std


def test_initializer_without_a_per_key_form_is_refused_by_name():
    emb = tf_keras.layers.Embedding(10, 4, embeddings_initializer="orthogonal")
    with pytest.raises(ValueError, match="'Orthogonal' has no per-key"):
        from_keras_embeddings({"t": emb}, OPT)


def test_a_fused_model_pipelines_though_its_inputs_are_named_otherwise():
    """fuse_model names features after the Embedding layers (emb_a), the model's inputs
    keep their names (a): prefetch reads each feature from the input it comes from, and
    the pipelined fit equals plain tf_keras fit of the original model."""
    import keras_paths as kpth
    from tf_fusedemb.pipeline import PipelineOptions
    x, y = kpth.data()
    original, _ = kpth.functional(tf_keras, False)
    ref, _ = kpth.functional(tf_keras, False)
    ref.set_weights(original.get_weights())
    fused = fuse_model(original, OptimizerSpec.sgd(kpth.LR["sgd"]))
    fused.compile(optimizer=kpth.keras_optimizer(tf_keras, "sgd"),
                  loss=tf_keras.losses.BinaryCrossentropy(from_logits=True),
                  pipeline=PipelineOptions(prefetch=True))
    got = fused.fit(x, y, batch_size=kpth.BATCH, epochs=2, shuffle=False, verbose=0)
    want = kpth.fit(tf_keras, ref, kpth.keras_optimizer(tf_keras, "sgd"), x, y, kpth.BATCH)
    np.testing.assert_allclose(fused.predict(x, batch_size=kpth.BATCH, verbose=0).reshape(-1),
                               want["predictions"], rtol=1e-5, atol=1e-6)
    assert np.isfinite(got.history["loss"]).all()
