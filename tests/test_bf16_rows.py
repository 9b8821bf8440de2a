"""Tables stored in bfloat16 (``TableSpec(row_dtype="bfloat16")``, engine storage): each row
is float32 training rounded to nearest even (``tf.cast``) after every update. References:
Keras's own optimizers on a ``tf.Variable`` (and plain tf_keras ``fit`` with an ordinary
``Embedding``) whose rows are cast to bfloat16 and back after every step: equal bit for bit."""
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tf_fusedemb.inference.export import export_saved_model
from tf_fusedemb.layers import FusedEmbedding
from tf_fusedemb.specs import FeatureSpec, InitializerSpec, OptimizerSpec, TableSpec
from tf_fusedemb.storage.engine_table import EngineGroupTable


def bf16(x):
    """float32 values rounded to bfloat16 and back, by TensorFlow's cast."""
    return tf.cast(tf.cast(tf.convert_to_tensor(x, tf.float32), tf.bfloat16), tf.float32).numpy()


def _table(spec, row_dtype, name):
    return EngineGroupTable(name, 8, InitializerSpec.normal(0.0, 0.5), spec, row_dtype=row_dtype)


@pytest.mark.parametrize("opt", ["sgd", "adagrad"])
def test_bf16_rows_are_keras_training_rounded_after_every_update(opt):
    spec = {"sgd": OptimizerSpec.sgd(0.3), "adagrad": OptimizerSpec.adagrad(0.1)}[opt]
    keras_opt = {"sgd": lambda: tf_keras.optimizers.SGD(0.3),
                 "adagrad": lambda: tf_keras.optimizers.Adagrad(0.1)}[opt]()
    rng = np.random.default_rng(3)
    universe = np.unique(rng.integers(-2**40, 2**40, 200))
    table, full = _table(spec, "bfloat16", "b"), _table(spec, "float32", "f")
    initial = table.lookup(universe).numpy()
    np.testing.assert_array_equal(initial, bf16(full.lookup(universe).numpy()))
    var = tf.Variable(initial)
    for _ in range(20):
        idx = rng.choice(len(universe), 64, replace=False)
        grads = rng.normal(0, 1, (64, 8)).astype(np.float32)
        _, got = table.apply_gradients(universe[idx], grads, return_rows=True)
        keras_opt.apply_gradients([(tf.IndexedSlices(grads, idx, var.shape), var)])
        var.assign(bf16(var))
        np.testing.assert_array_equal(got.numpy(), var.numpy()[idx])
    rows = table.lookup(universe).numpy()
    np.testing.assert_array_equal(rows, bf16(rows))  # every stored row is a bfloat16
    np.testing.assert_array_equal(rows, var.numpy())
    assert np.abs(rows - initial).max() > 0.05
    exported = table.export()
    order = np.searchsorted(universe, exported["keys"].numpy())
    np.testing.assert_array_equal(exported["values"].numpy(), rows[order])
    if opt == "adagrad":  # the accumulator stays float32: Keras's own, from the same grads
        (accumulator,) = [v for v in keras_opt.variables if "accumulator" in v.name]
        np.testing.assert_allclose(exported["accumulator"].numpy(),
                                   accumulator.numpy()[order], rtol=1e-6)


def test_bf16_rows_under_a_memory_budget_equal_bf16_rows_in_dram(tmp_path):
    """Blocks with bfloat16 rows spill to the SSD tier and come back unchanged."""
    spec, rng = OptimizerSpec.adagrad(0.1), np.random.default_rng(4)
    dram = _table(spec, "bfloat16", "d")
    tiered = EngineGroupTable("t", 8, InitializerSpec.normal(0.0, 0.5), spec,
                              row_dtype="bfloat16", memory_budget_bytes=10_000,
                              spill_path=str(tmp_path / "spill"))
    universe = np.unique(rng.integers(-2**40, 2**40, 400))
    for _ in range(10):
        keys = rng.choice(universe, 100, replace=False)
        grads = rng.normal(0, 1, (100, 8)).astype(np.float32)
        _, want = dram.apply_gradients(keys, grads, return_rows=True)
        _, got = tiered.apply_gradients(keys, grads, return_rows=True)
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    assert int(tiered.ssd_bytes().numpy()) > 0
    np.testing.assert_array_equal(tiered.lookup(universe).numpy(), dram.lookup(universe).numpy())


def test_bf16_rows_take_half_the_row_bytes():
    """dim 16, SGD: a block is the 28-byte header + the row (64 bytes float32, 32 bfloat16)."""
    keys = np.arange(20000, dtype=np.int64)
    held = {}
    for row_dtype in ("float32", "bfloat16"):
        t = EngineGroupTable(f"m_{row_dtype}", 16, InitializerSpec(), OptimizerSpec.sgd(0.1),
                             row_dtype=row_dtype)
        t.apply_gradients(keys, tf.zeros([len(keys), 16]))
        held[row_dtype] = int(t.bytes_held().numpy())
    saved = held["float32"] - held["bfloat16"]
    assert 32 * len(keys) <= saved <= 32 * len(keys) * 1.2, held


def test_row_dtype_is_checked_and_keeps_tables_apart():
    with pytest.raises(ValueError, match=r"row_dtype 'float16' is not one of"):
        TableSpec("t", 4, OptimizerSpec.sgd(0.1), row_dtype="float16")
    with pytest.raises(ValueError, match=r"row_dtype 'bfloat16' needs storage 'engine'"):
        TableSpec("t", 4, OptimizerSpec.sgd(0.1), vocabulary_size=10, row_dtype="bfloat16")
    t = TableSpec("t", 4, OptimizerSpec.sgd(0.1), row_dtype=tf.bfloat16)
    assert t.row_dtype == "bfloat16" and TableSpec.from_dict(t.to_dict()) == t
    assert t.fusion_key != TableSpec("u", 4, OptimizerSpec.sgd(0.1)).fusion_key
    assert "row_dtype" not in TableSpec("u", 4, OptimizerSpec.sgd(0.1)).to_dict()


class RoundRows(tf_keras.callbacks.Callback):
    """Rounds an Embedding's rows to bfloat16 after every training step."""

    def __init__(self, embedding):
        super().__init__()
        self.embedding = embedding

    def on_train_batch_end(self, batch, logs=None):
        self.embedding.set_weights([bf16(self.embedding.get_weights()[0])])


def test_fit_with_bf16_rows_equals_keras_fit_rounding_its_embedding():
    """Plain tf_keras fit of a model holding FusedEmbedding with a bfloat16 table equals
    plain tf_keras fit of the same model with an ordinary Embedding whose rows a callback
    rounds to bfloat16 after every step (both from the same, rounded, initial weights)."""
    vocab, rng = 50, np.random.default_rng(0)
    x = (rng.zipf(1.3, 256).clip(1, vocab) - 1).astype(np.int64)
    y = (x % 3 == 0).astype(np.float32)
    ids = tf_keras.Input((), dtype="int64", name="ids")
    emb = tf_keras.layers.Embedding(vocab, 8)
    ref = tf_keras.Model(ids, tf_keras.layers.Dense(1)(emb(ids)))
    emb.set_weights([bf16(emb.get_weights()[0])])
    table = TableSpec("t", 8, OptimizerSpec.sgd(0.5), row_dtype="bfloat16")
    layer = FusedEmbedding([FeatureSpec("ids", table, combiner="sum")])
    ids2 = tf_keras.Input((), dtype="int64", name="ids")
    model = tf_keras.Model(ids2, tf_keras.layers.Dense(1)(layer({"ids": ids2})["ids"]))
    model.layers[-1].set_weights(ref.layers[-1].get_weights())
    layer.set_embedding_weights({"t": emb.get_weights()[0]})
    losses = []
    for m, callbacks in ((ref, [RoundRows(emb)]), (model, [])):
        m.compile(tf_keras.optimizers.SGD(0.5),
                  tf_keras.losses.BinaryCrossentropy(from_logits=True))
        losses.append(m.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0,
                            callbacks=callbacks).history["loss"])
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    (group,) = layer.groups
    stored = group.store.stored_rows()
    rows = emb.get_weights()[0]
    np.testing.assert_array_equal(stored.values, rows[stored.ids])
    np.testing.assert_array_equal(stored.values, bf16(stored.values))


def test_export_serves_never_trained_keys_their_rounded_initial_rows(tmp_path):
    """The SavedModel of a model with a bfloat16 table serves what the model predicts, for
    trained keys and for keys it never saw (their initial row, rounded as stored)."""
    table = TableSpec("t", 8, OptimizerSpec.sgd(0.5), row_dtype="bfloat16")
    layer = FusedEmbedding([FeatureSpec("ids", table, combiner="sum")])
    ids = tf_keras.Input((), dtype="int64", name="ids")
    model = tf_keras.Model(ids, tf_keras.layers.Dense(1)(layer({"ids": ids})["ids"]))
    model.compile(tf_keras.optimizers.SGD(0.5),
                  tf_keras.losses.BinaryCrossentropy(from_logits=True))
    x = np.arange(64, dtype=np.int64)
    model.fit(x, (x % 2).astype(np.float32), batch_size=16, epochs=1, verbose=0)
    query = np.concatenate([x[:8], np.arange(10**9, 10**9 + 8)])  # trained, never seen
    want = model.predict(query, verbose=0).reshape(-1)
    served = tf.saved_model.load(export_saved_model(model, str(tmp_path / "m"), {"ids": "scalar"}))
    got = served.signatures["serving_default"](ids=tf.constant(query))["logits"].numpy()
    np.testing.assert_allclose(got.reshape(-1), want, rtol=1e-6, atol=1e-6)
