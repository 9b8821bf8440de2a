"""FusedEmbedding trains exactly like ordinary Embedding layers on every Keras path: plain
tf_keras and Keras 3 models (functional and subclassed, no library base class) with
``fit``, a user's ``tf.GradientTape`` loop, a ``call`` decorated with ``tf.function``,
on one rank and on two. Each path is compared with the same model built from ordinary
``Embedding`` layers and trained the ordinary way (the reference), from the same initial
weights: per-batch losses, predictions and every table row to 1e-5. The rows must move
(a path that leaves them unchanged fails here: the negative control of the silent case)."""
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import keras_paths as kpth
from tf_fusedemb.models import FusedModel
from tf_fusedemb.testing import DistributedTestCase

TOL = dict(rtol=1e-5, atol=1e-6)


def assert_same_training(got, want, fused_layer, ref_embeds, initial):
    np.testing.assert_allclose(got["losses"], want["losses"], **TOL, err_msg="batch losses")
    np.testing.assert_allclose(got["predictions"], want["predictions"], **TOL,
                               err_msg="predictions")
    tables, _ = kpth.fused_tables(fused_layer)
    for f, emb in ref_embeds.items():
        want_rows = emb.get_weights()[0]
        assert np.abs(want_rows - initial["tables"][f]).max() > 1e-4, "reference rows moved"
        np.testing.assert_allclose(tables[f], want_rows, **TOL, err_msg=f"table {f}")


def pair_functional(k, optimizer):
    ref, embeds = kpth.functional(k, False)
    fused, layer = kpth.functional(k, True, optimizer)
    initial = kpth.initial_weights(ref, embeds)
    kpth.load_weights(fused, layer, initial)
    return ref, embeds, fused, layer, initial


def pair_subclassed(k, optimizer, base_fused=None, compiled_call=False):
    x, _ = kpth.data()
    ref = kpth.build(kpth.subclassed_class(k, compiled_call=compiled_call)(False), x)
    fused_cls = kpth.subclassed_class(k, base_fused, compiled_call)
    fused = kpth.build(fused_cls(True, optimizer), x)
    initial = kpth.initial_weights(ref, ref.embedding())
    kpth.load_weights(fused, fused.embedding(), initial)
    return ref, ref.embedding(), fused, fused.embedding(), initial


@pytest.mark.parametrize("shape,optimizer", [
    ("functional", "sgd"), ("functional", "adagrad"), ("functional", "ftrl"),
    ("subclassed", "sgd"), ("subclassed", "adagrad")])
def test_plain_tf_keras_fit(shape, optimizer):
    x, y = kpth.data()
    pair = pair_functional if shape == "functional" else pair_subclassed
    ref, embeds, fused, layer, initial = pair(tf_keras, optimizer)
    want = kpth.fit(tf_keras, ref, kpth.keras_optimizer(tf_keras, optimizer), x, y, kpth.BATCH)
    got = kpth.fit(tf_keras, fused, kpth.keras_optimizer(tf_keras, optimizer), x, y, kpth.BATCH)
    assert_same_training(got, want, layer, embeds, initial)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_custom_gradient_tape_loop(optimizer):
    x, y = kpth.data()
    ref, embeds, fused, layer, initial = pair_functional(tf_keras, optimizer)
    want = kpth.custom_loop(tf_keras, ref, kpth.keras_optimizer(tf_keras, optimizer), x, y,
                            kpth.BATCH)
    got = kpth.custom_loop(tf_keras, fused, kpth.keras_optimizer(tf_keras, optimizer), x, y,
                           kpth.BATCH)
    assert_same_training(got, want, layer, embeds, initial)


@pytest.mark.parametrize("base", [None, FusedModel], ids=["tf_keras.Model", "FusedModel"])
def test_call_decorated_with_tf_function(base):
    x, y = kpth.data()
    ref, embeds, fused, layer, initial = pair_subclassed(tf_keras, "adagrad", base, True)
    want = kpth.fit(tf_keras, ref, kpth.keras_optimizer(tf_keras, "adagrad"), x, y, kpth.BATCH)
    got = kpth.fit(tf_keras, fused, kpth.keras_optimizer(tf_keras, "adagrad"), x, y, kpth.BATCH)
    assert_same_training(got, want, layer, embeds, initial)


def test_frozen_layer_leaves_rows_unchanged():
    """trainable=False freezes the rows, as it freezes an ordinary Embedding."""
    x, y = kpth.data()
    _, _, fused, layer, initial = pair_functional(tf_keras, "sgd")
    layer.trainable = False
    kpth.fit(tf_keras, fused, kpth.keras_optimizer(tf_keras, "sgd"), x, y, kpth.BATCH)
    tables, _ = kpth.fused_tables(layer)
    for f, rows in initial["tables"].items():
        np.testing.assert_array_equal(tables[f], rows)


def test_keras3_paths_in_a_fresh_process():
    """Keras 3 fit (functional, subclassed), a Keras 3 GradientTape loop and Keras 3 export
    (tests/keras3_checks.py) run in a process of their own without TF_USE_LEGACY_KERAS, as
    a Keras 3 program runs: TFRA, which other tests import, patches Keras's initializers
    at import and breaks Keras 3 in the same process."""
    env = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(pathlib.Path(__file__).with_name("keras3_checks.py"))],
                         capture_output=True, text=True, timeout=840, env=env)  # under the 900 s test limit
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and " failed" not in out.stdout, out.stdout[-2000:]


# The 2-rank cases, run one after another in one 2-rank job (a job's start-up costs more
# than a case): (path, optimizer, wrapped in DistributedOptimizer). The bare optimizer's
# cases come last: they fail the first step on every rank.
TWO_RANK_CASES = (("fit", "adagrad", True), ("loop", "sgd", True), ("fit", "sgd", False),
                  ("loop", "sgd", False))


def _cases_on_rank(initials):
    """One rank: kpth.plain_on_ranks for each of TWO_RANK_CASES from its initial weights."""
    return [kpth.plain_on_ranks(w, path, opt, wrap)
            for w, (path, opt, wrap) in zip(initials, TWO_RANK_CASES)]


class TwoRankKerasPathsTest(DistributedTestCase):
    """Plain tf_keras fit and a custom loop on 2 ranks (each rank half of every global
    batch, DistributedOptimizer) equal plain Keras on the global batch in one process; a
    bare optimizer fails the first step on every rank with the fix named."""
    timeout = 600

    @staticmethod
    def _reference(path, optimizer):
        x, y = kpth.data()
        ref, embeds = kpth.functional(tf_keras, False)
        initial = kpth.initial_weights(ref, embeds)
        run = kpth.fit if path == "fit" else kpth.custom_loop
        want = run(tf_keras, ref, kpth.keras_optimizer(tf_keras, optimizer), x, y,
                   2 * kpth.BATCH)
        return initial, want, ref, embeds

    def _check(self, path, reference, ranks):
        _, want, ref, embeds = reference
        for r in ranks:
            self.assertNotIn("error", r)
            np.testing.assert_allclose(r["predictions"], want["predictions"], **TOL)
            for got, ref_var in zip(r["dense"][1:], ref.trainable_variables[3:]):
                np.testing.assert_allclose(got, ref_var.numpy(), **TOL, err_msg="dense")
        if path == "loop":  # each rank's mean loss: their mean is the global batch's
            np.testing.assert_allclose(np.mean([r["losses"] for r in ranks], 0),
                                       want["losses"], **TOL)
        for f, emb in embeds.items():
            rows = sum(r["tables"][f] for r in ranks)
            self.assertTrue(all(sum(r["owned"][f] for r in ranks) == 1))
            np.testing.assert_allclose(rows, emb.get_weights()[0], **TOL, err_msg=f)

    @pytest.mark.timeout(700)
    def test_fit_custom_loop_and_bare_optimizer(self):
        refs = [self._reference(path, opt) if wrap else None
                for path, opt, wrap in TWO_RANK_CASES]
        initials = [ref[0] if ref else refs[0][0] for ref in refs]
        ranks = self.run_ranks(_cases_on_rank, 2, (initials,))
        for i, (path, _, wrap) in enumerate(TWO_RANK_CASES):
            got = [r[i] for r in ranks]
            if wrap:
                self._check(path, refs[i], got)
                continue
            for r in got:
                self.assertIn("error", r, path)
                self.assertIn("DistributedOptimizer", r["error"], path)
                self.assertEqual(r["steps_done"], 0, path)  # refused inside the first step


@pytest.mark.parametrize("model_class", [None, FusedModel], ids=["tf_keras.Model", "FusedModel"])
def test_multi_output_dict_labels(model_class):
    """Two outputs, a dict of labels, per-output losses and loss weights: the history
    (total and per-output losses), predictions and rows equal Keras's."""
    x, y = kpth.data()
    ref, embeds = kpth.multi_output(False)
    fused, layer = kpth.multi_output(True, "sgd", model_class)
    initial = {"tables": {f: e.get_weights()[0] for f, e in embeds.items()}}
    for name in ("hidden", "click", "rating"):
        fused.get_layer(name).set_weights(ref.get_layer(name).get_weights())
    layer.set_embedding_weights(initial["tables"])
    want_h, want_p = kpth.fit_multi_output(ref, kpth.keras_optimizer(tf_keras, "sgd"), x, y)
    got_h, got_p = kpth.fit_multi_output(fused, kpth.keras_optimizer(tf_keras, "sgd"), x, y)
    assert set(got_h) == set(want_h) == {"loss", "click_loss", "rating_loss"}
    for key in want_h:
        np.testing.assert_allclose(got_h[key], want_h[key], **TOL, err_msg=key)
    for key in want_p:
        np.testing.assert_allclose(got_p[key], want_p[key], **TOL, err_msg=key)
    tables, _ = kpth.fused_tables(layer)
    for f, emb in embeds.items():
        np.testing.assert_allclose(tables[f], emb.get_weights()[0], **TOL, err_msg=f)


@pytest.mark.parametrize("model_class", [None, FusedModel], ids=["tf_keras.Model", "FusedModel"])
def test_sharded_checkpoint_callback_resumes_fit(tmp_path, model_class):
    """fit(epochs=3) with ShardedCheckpoint, stopped after epoch 1 and started again on a
    freshly built model, ends where an uninterrupted fit ends (rows, dense weights,
    optimizer state through the predictions, and the resumed epochs' losses)."""
    from tf_fusedemb.models import ShardedCheckpoint
    x, y = kpth.data()

    def model_from(initial):
        model, layer = kpth.functional(tf_keras, True, "adagrad")
        if model_class is not None:
            model = FusedModel(model.inputs, model.outputs)
        kpth.load_weights(model, layer, initial)
        model.compile(optimizer=kpth.keras_optimizer(tf_keras, "adagrad"),
                      loss=tf_keras.losses.BinaryCrossentropy(from_logits=True))
        return model, layer

    ref, embeds = kpth.functional(tf_keras, False)
    initial = kpth.initial_weights(ref, embeds)
    whole, whole_layer = model_from(initial)
    want = whole.fit(x, y, batch_size=kpth.BATCH, epochs=3, shuffle=False, verbose=0,
                     callbacks=[ShardedCheckpoint(str(tmp_path / "a"))]).history["loss"]
    first, _ = model_from(initial)
    first.fit(x, y, batch_size=kpth.BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[ShardedCheckpoint(str(tmp_path / "b"))])
    other, _ = kpth.functional(tf_keras, False)  # other initial weights: the restore decides
    resumed, layer = model_from(kpth.initial_weights(other, _))
    history = resumed.fit(x, y, batch_size=kpth.BATCH, epochs=3, shuffle=False, verbose=0,
                          callbacks=[ShardedCheckpoint(str(tmp_path / "b"))])
    assert history.epoch == [1, 2]
    np.testing.assert_allclose(history.history["loss"], want[1:], **TOL)
    np.testing.assert_allclose(resumed.predict(x, verbose=0), whole.predict(x, verbose=0), **TOL)
    got_tables, _ = kpth.fused_tables(layer)
    want_tables, _ = kpth.fused_tables(whole_layer)
    for f in kpth.FEATURES:
        np.testing.assert_allclose(got_tables[f], want_tables[f], **TOL, err_msg=f)


def test_sharded_checkpoint_every_steps_resumes_as_keras_backup_and_restore(tmp_path):
    """Saved every 4 steps, interrupted at step 7 of epoch 1 (of 8 steps each) and resumed
    on a freshly built model: ShardedCheckpoint(every_steps=4) resumes where Keras's own
    BackupAndRestore(save_freq=4) resumes the same model with ordinary Embedding layers
    (epoch 1, step 4; the epoch's remaining steps on its data afresh, Keras's convention),
    and the two end equal: resumed losses, predictions and every row."""
    from tf_fusedemb.models import ShardedCheckpoint
    kpth.resume_like_backup_and_restore(
        tf_keras, "adagrad", lambda d: ShardedCheckpoint(d, every_steps=4),
        lambda d: tf_keras.callbacks.BackupAndRestore(d, save_freq=4), tmp_path, TOL)


def test_eviction_outside_fused_model_is_refused():
    """Eviction runs between FusedModel's steps; a plain model would never evict: its first
    training step refuses, naming FusedModel (no silent divergence)."""
    from tf_fusedemb.layers import FusedEmbedding
    from tf_fusedemb.specs import EvictionPolicy, FeatureSpec, OptimizerSpec, TableSpec
    layer = FusedEmbedding([FeatureSpec("a", TableSpec(
        "a", kpth.DIM, OptimizerSpec.sgd(0.1), eviction=EvictionPolicy(ttl_steps=2)))])
    inputs = {"a": tf_keras.Input((), dtype="int64", name="a")}
    model = tf_keras.Model(inputs, tf_keras.layers.Dense(1)(layer(inputs)["a"]))
    model.compile(optimizer="sgd", loss="mse")
    x, y = kpth.data()
    with pytest.raises(ValueError, match="EvictionPolicy.*FusedModel"):
        model.fit({"a": x["a"]}, y, batch_size=kpth.BATCH, verbose=0)


def test_pipelining_a_tf_function_call_is_refused():
    """A call decorated with tf.function hides its lookups from the pipelined step: fit
    with compile(pipeline=...) refuses it naming both fixes, instead of training wrong."""
    x, y = kpth.data()
    model = kpth.build(kpth.subclassed_class(tf_keras, FusedModel, True)(True, "sgd"), x)
    model.compile(optimizer=kpth.keras_optimizer(tf_keras, "sgd"),
                  loss=tf_keras.losses.BinaryCrossentropy(from_logits=True),
                  pipeline="dbp,fwp=2")
    with pytest.raises(ValueError, match="remove @tf.function from call.*compile without pipeline"):
        model.fit(x, y, batch_size=kpth.BATCH, verbose=0)
