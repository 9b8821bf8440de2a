"""SavedModel export: loads in a fresh process and through saved_model_cli, predictions
equal the trained model's (unseen IDs included), and it carries no custom op."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tf_fusedemb.inference import export_saved_model
from tf_fusedemb.inference.export import serving_context
from tf_fusedemb.layers import FusedEmbedding
from tf_fusedemb.layers.model_embeddings import use_context
from tf_fusedemb.models import FusedModel
from tf_fusedemb.specs import FeatureSpec, InitializerSpec, OptimizerSpec, TableSpec
from tf_fusedemb.training.checkpoint import CheckpointManager

KINDS = {"u": "scalar", "v": "list", "st": "scalar", "seq": "list"}


def training_data(seed=0, n=256):
    rng = np.random.default_rng(seed)
    data = {"u": rng.integers(0, 40, n), "st": rng.integers(0, 30, n),
            "v": tf.ragged.constant([list(rng.integers(0, 9, rng.integers(0, 4))) for _ in range(n)],
                                    tf.int64),
            "seq": tf.ragged.constant([list(rng.integers(0, 9, rng.integers(0, 4)))
                                       for _ in range(n)], tf.int64),
            "dense": rng.random(n).astype(np.float32)}
    return data, (data["u"] % 3 == 0).astype(np.float32)[:, None]


def build_and_train():
    opt = OptimizerSpec.adagrad(0.3)
    layer = FusedEmbedding([
        FeatureSpec("u", TableSpec("u", 4, opt)),
        FeatureSpec("v", TableSpec("v", 4, opt, InitializerSpec.normal(0, 0.1)), "mean"),
        FeatureSpec("st", TableSpec("st", 4, opt, vocabulary_size=30), "sum"),
        FeatureSpec("seq", TableSpec("seq", 2, OptimizerSpec.adam(0.05)), None, max_len=3)])
    inputs = {"u": tf_keras.Input([], dtype=tf.int64, name="u"),
              "v": tf_keras.Input([None], dtype=tf.int64, ragged=True, name="v"),
              "st": tf_keras.Input([], dtype=tf.int64, name="st"),
              "seq": tf_keras.Input([None], dtype=tf.int64, ragged=True, name="seq"),
              "dense": tf_keras.Input([], dtype=tf.float32, name="dense_in")}
    emb = layer({k: v for k, v in inputs.items() if k != "dense"})
    x = tf_keras.layers.Concatenate()([emb["u"], emb["v"], emb["st"],
                                       tf.reduce_sum(emb["seq"], axis=1), inputs["dense"][:, None]])
    model = FusedModel(inputs, tf_keras.layers.Dense(1)(tf_keras.layers.Dense(8, "relu")(x)))
    model.compile(optimizer=tf_keras.optimizers.Adam(0.01),
                  loss=tf_keras.losses.BinaryCrossentropy(from_logits=True))
    data, labels = training_data()
    model.fit(data, labels, batch_size=64, epochs=2, verbose=0)
    return model


def serving_inputs():
    """Raw serving inputs, with IDs never seen in training (u >= 40, v/seq >= 9)."""
    return {"u": np.array([1, 5, 77, 3], np.int64), "st": np.array([0, 29, 4, 4], np.int64),
            "v": np.array([[1, 2, 0], [0, 0, 0], [12, 3, 0], [4, 4, 4]], np.int64),
            "v_length": np.array([2, 0, 2, 3], np.int64),
            "seq": np.array([[5, 0, 0], [1, 2, 3], [0, 0, 0], [50, 1, 0]], np.int64),
            "seq_length": np.array([1, 3, 0, 2], np.int64),
            "dense": np.array([0.1, 0.5, 0.9, 0.0], np.float32)}


def model_inputs(raw):
    return {"u": raw["u"], "st": raw["st"], "dense": raw["dense"],
            "v": tf.RaggedTensor.from_tensor(raw["v"], lengths=raw["v_length"]),
            "seq": tf.RaggedTensor.from_tensor(raw["seq"], lengths=raw["seq_length"])}


@pytest.mark.timeout(600)
def test_export_loads_fresh_and_in_saved_model_cli_with_equal_predictions(tmp_path):
    model = build_and_train()
    raw = serving_inputs()
    trained = model(model_inputs(raw), training=False).numpy()
    export_dir = str(tmp_path / "export")
    export_saved_model(model, export_dir, KINDS, dense_features=["dense"])
    # The serving path of the converted model agrees too.
    np.testing.assert_allclose(model(model_inputs(raw)).numpy(), trained, rtol=1e-6, atol=1e-6)

    np.savez(tmp_path / "inputs.npz", **raw)
    # A process that never imports tf_fusedemb (nor finds it: run from elsewhere, no path).
    code = (
        "import json, sys, numpy as np, tensorflow as tf\n"
        f"m = tf.saved_model.load({export_dir!r})\n"
        f"raw = dict(np.load({str(tmp_path / 'inputs.npz')!r}))\n"
        "out = m.signatures['serving_default'](**{k: tf.constant(v) for k, v in raw.items()})\n"
        "assert not any(n.startswith('tf_fusedemb') for n in sys.modules)\n"
        "print('OUT', json.dumps(out['logits'].numpy().tolist()))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=str(tmp_path), env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    fresh = np.array(json.loads(out.stdout.split("OUT ", 1)[1]))
    np.testing.assert_allclose(fresh, trained, rtol=1e-6, atol=1e-6)

    # saved_model_cli: core TF only, no op library loaded.
    npz = str(tmp_path / "inputs.npz")
    cli_inputs = ";".join(f"{k}={npz}[{k}]" for k in raw)
    cli = os.path.join(os.path.dirname(sys.executable), "saved_model_cli")
    out = subprocess.run([cli, "run", "--dir", export_dir, "--tag_set", "serve",
                          "--signature_def", "serving_default", "--inputs", cli_inputs],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "probability" in out.stdout and "logits" in out.stdout
    graph_ops = subprocess.run(
        [sys.executable, "-c", f"import tensorflow as tf; m = tf.saved_model.load({export_dir!r}); "
         "f = m.signatures['serving_default']; "
         "print(sorted({o.type for o in f.graph.get_operations()}))"],
        capture_output=True, text=True, timeout=300)
    assert "FusedEmb" not in graph_ops.stdout and "TFRA" not in graph_ops.stdout


def test_unknown_feature_kind_is_rejected(tmp_path):
    model = tf_keras.Sequential()
    with pytest.raises(ValueError, match="feature 'u': kind 'vector'"):
        export_saved_model(model, str(tmp_path), {"u": "vector"})


@pytest.mark.timeout(600)
def test_export_leaves_the_model_unchanged(tmp_path):
    """After an export the model trains and predicts exactly as it does from the same
    state without an export (the export looks up through serving copies, never by
    changing the layer): one epoch after the export equals one epoch after restoring
    the state saved just before it."""
    model = build_and_train()
    layer = next(l for l in model.layers if isinstance(l, FusedEmbedding))
    manager = CheckpointManager(str(tmp_path / "ckpt"), model, model.optimizer)
    manager.save(1)
    raw = serving_inputs()
    before = model(model_inputs(raw), training=False).numpy()
    groups = list(layer.groups)
    export_saved_model(model, str(tmp_path / "export"), KINDS, dense_features=["dense"])
    assert list(layer.groups) == groups
    np.testing.assert_array_equal(model(model_inputs(raw), training=False).numpy(), before)
    data, labels = training_data(seed=1)
    model.fit(data, labels, batch_size=64, epochs=1, shuffle=False, verbose=0)
    exported_then_trained = model(model_inputs(raw), training=False).numpy()
    assert not np.allclose(exported_then_trained, before)  # it trained on
    manager.restore()
    np.testing.assert_array_equal(model(model_inputs(raw), training=False).numpy(), before)
    model.fit(data, labels, batch_size=64, epochs=1, shuffle=False, verbose=0)
    np.testing.assert_allclose(model(model_inputs(raw), training=False).numpy(),
                               exported_then_trained, rtol=1e-6, atol=1e-6)


def _head_model(head):
    """A plain tf_keras model (no library base class) with a given head, trained a little."""
    opt = OptimizerSpec.sgd(0.1)
    layer = FusedEmbedding([FeatureSpec("u", TableSpec("u", 4, opt)),
                            FeatureSpec("i", TableSpec("i", 4, opt))])
    inputs = {n: tf_keras.Input([], dtype=tf.int64, name=n) for n in ("u", "i")}
    h = tf_keras.layers.Concatenate()(list(layer(inputs).values()))
    if head == "softmax5":
        outputs = tf_keras.layers.Dense(5, activation="softmax", name="rating")(h)
        loss = "sparse_categorical_crossentropy"
    elif head == "two":
        outputs = {"click": tf_keras.layers.Dense(1, name="click")(h),
                   "rating": tf_keras.layers.Dense(1, name="rating")(h)}
        loss = {"click": tf_keras.losses.BinaryCrossentropy(from_logits=True), "rating": "mse"}
    else:
        outputs = tf_keras.layers.Dense(1, name="logit")(h)
        loss = tf_keras.losses.BinaryCrossentropy(from_logits=True)
    model = tf_keras.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss=loss)
    rng = np.random.default_rng(0)
    x = {n: rng.integers(0, 20, 64) for n in ("u", "i")}
    y = x["u"] % 5
    labels = {"click": (y > 2).astype(np.float32), "rating": y.astype(np.float32)} \
        if head == "two" else y if head == "softmax5" else (y > 2).astype(np.float32)
    model.fit(x, labels, batch_size=16, verbose=0)
    return model, x


@pytest.mark.parametrize("head,names", [("softmax5", {"rating"}), ("two", {"click", "rating"}),
                                        ("logit", {"logit", "logits", "probability"})])
def test_export_serves_the_models_own_head(tmp_path, head, names):
    """The signature returns the model's outputs as they are; logits/probability only for
    a single-logit head (a softmax's probabilities are not put through a sigmoid)."""
    model, x = _head_model(head)
    want = model.predict(x, verbose=0)
    served = tf.saved_model.load(export_saved_model(
        model, str(tmp_path / "m"), {"u": "scalar", "i": "scalar"})).signatures[
            "serving_default"](**{n: tf.constant(v) for n, v in x.items()})
    assert set(served) == names
    want = want if isinstance(want, dict) else {sorted(names - {"logits", "probability"})[0]: want}
    for name, values in want.items():
        np.testing.assert_allclose(served[name].numpy(), values, rtol=1e-5, atol=1e-6)
    if "probability" in names:
        np.testing.assert_allclose(served["probability"].numpy(),
                                   tf.sigmoid(want["logit"]).numpy(), rtol=1e-5, atol=1e-6)


class _TwoTables(tf_keras.Model):
    """A subclassed model with two FusedEmbedding layers whose table groups share a name
    (each has a table "u"): the serving copies must tell them apart by their layer."""

    def __init__(self, first: str, second: str):
        super().__init__()
        opt = OptimizerSpec.sgd(0.5)
        self.first = FusedEmbedding([FeatureSpec("u", TableSpec("u", 4, opt))], name=first)
        self.second = FusedEmbedding([FeatureSpec("u", TableSpec("u", 4, opt))], name=second)
        self.head = tf_keras.layers.Dense(1)

    def call(self, x):
        return self.head(tf.concat([self.first({"u": x["u"]})["u"],
                                    self.second({"u": x["i"]})["u"]], axis=1))


def test_serving_copies_are_found_by_layer_and_group_name():
    model = _TwoTables("users", "items")
    model.compile(optimizer="sgd", loss=tf_keras.losses.BinaryCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = {"u": rng.integers(0, 20, 64), "i": rng.integers(0, 20, 64)}
    model.fit(x, (x["u"] > x["i"]).astype(np.float32), batch_size=16, verbose=0)
    trained = model(x, training=False).numpy()
    with use_context(model, serving_context(model)) as context:
        served = model(x, training=False).numpy()
    names = sorted(context.substitutes)
    assert [n.layer for n in names] == ["items", "users"] and names[0].group == names[1].group
    np.testing.assert_allclose(served, trained, rtol=1e-6, atol=1e-6)


def test_two_layers_of_one_name_are_refused_for_serving():
    model = _TwoTables("emb", "emb")
    with pytest.raises(ValueError, match="two FusedEmbedding layers named 'emb' both have a "
                                         "table group"):
        serving_context(model)
