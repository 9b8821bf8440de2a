"""FusedModel.fit/evaluate/predict against plain tf_keras Model.fit of the same model with
Embedding layers, from identical initial weights: per-epoch history, per-batch losses
seen by callbacks, evaluate results and predictions equal to 1e-5 relative.

The reference is Keras itself (one process, the global batch), so a bug shared by our
step and our own reference helpers cannot hide here. Lazy Adam, which by design moves
only touched rows (Keras's Adam moves every row of an Embedding), is checked against
Keras's Adam formula applied to the touched rows only."""
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import keras_parity as kp
from tf_fusedemb.pipeline import PipelineOptions
from tf_fusedemb.testing import DistributedTestCase

RTOL = 1e-5


def assert_same(got, want, what=""):
    assert set(got) == set(want), (what, sorted(got), sorted(want))
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=RTOL, atol=1e-6, err_msg=f"{what} {k}")


def compare(got, want):
    assert_same(got["history"], want["history"], "history")
    np.testing.assert_allclose(got["batch_losses"], want["batch_losses"], rtol=RTOL, atol=1e-6)
    if "evaluate" in want:
        assert_same(got["evaluate"], want["evaluate"], "evaluate")
        np.testing.assert_allclose(got["predictions"], want["predictions"], rtol=RTOL, atol=1e-6)


def run_pair(optimizer, loss, label_rank=1, output_rank=2, weights=False, class_weight=None,
             dynamic=False):
    x, y, sw = kp.data(96, 0)
    xt, yt, _ = kp.data(40, 1)
    if label_rank == 2:
        y, yt = y[:, None], yt[:, None]
    kwargs = dict(sample_weight=sw if weights else None, class_weight=class_weight,
                  validation=(xt, yt), test=(xt, yt))
    plain = kp.plain_model(output_rank)
    fused = kp.fused_twin(plain, optimizer, output_rank, dynamic=dynamic)
    want = kp.train(plain, kp.keras_optimizer(optimizer), kp.LOSSES[loss](), x, y, 32, **kwargs)
    got = kp.train(fused, kp.keras_optimizer(optimizer), kp.LOSSES[loss](), x, y, 32, **kwargs)
    return got, want


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "ftrl"])
def test_fit_equals_keras_one_process(optimizer):
    """The reported case: labels [B], logits [B, 1], a BinaryCrossentropy object."""
    got, want = run_pair(optimizer, "bce_object", weights=True)
    compare(got, want)
    assert want["history"]["loss"][1] < want["history"]["loss"][0]  # it trains


@pytest.mark.parametrize("loss,label_rank,output_rank", [
    ("bce_object", 2, 2), ("bce_object", 1, 1), ("bce_sum", 1, 2), ("bce_none", 1, 2),
    ("mse_string", 2, 2), ("mse_string", 1, 1), ("function", 1, 2)])
def test_every_loss_form_equals_keras(loss, label_rank, output_rank):
    # Keras itself rejects [B] sample weights against a loss of [B] outputs (the
    # loss reduces the batch axis then), so those forms run without them.
    got, want = run_pair("adagrad", loss, label_rank, output_rank, weights=output_rank == 2)
    compare(got, want)


def test_class_weight_and_dynamic_tables_equal_keras():
    got, want = run_pair("sgd", "bce_object", class_weight={0: 0.3, 1: 2.0}, dynamic=True)
    compare(got, want)


@pytest.mark.parametrize("pipeline", ["dbp", "dbp,fwp=2", "fwp=3", "dbp,novertical"])
def test_pipelined_fit_equals_keras(pipeline):
    """compile(pipeline=...) changes when work happens, never what fit computes."""
    x, y, sw = kp.data(96, 0)
    xt, yt, _ = kp.data(40, 1)
    plain = kp.plain_model()
    fused = kp.fused_twin(plain, "adagrad")
    kwargs = dict(sample_weight=sw, validation=(xt, yt), test=(xt, yt))
    want = kp.train(plain, kp.keras_optimizer("adagrad"), kp.LOSSES["bce_object"](), x, y, 32,
                    **kwargs)
    got = kp.train(fused, kp.keras_optimizer("adagrad"), kp.LOSSES["bce_object"](), x, y, 32,
                   pipeline=pipeline, **kwargs)
    compare(got, want)


def test_compile_without_loss_fails_clearly():
    model = kp.fused_twin(kp.plain_model(), "sgd")
    model.compile(optimizer="sgd")
    x, y, _ = kp.data(8, 0)
    with pytest.raises(ValueError, match="needs a loss"):
        model.fit(x, y, verbose=0)


def _lazy_adam_reference(x, y, steps, batch):
    """Plain Keras model; dense part with Keras's Adam, each Embedding with Keras's Adam
    formula applied to the rows its IndexedSlices gradient touches (numpy)."""
    model = kp.plain_model()
    lr, b1, b2, eps = kp.LR["adam"], 0.9, 0.999, 1e-7
    dense_opt = tf_keras.optimizers.Adam(lr)
    loss_fn = tf_keras.losses.BinaryCrossentropy(from_logits=True)
    embs = [model.get_layer(f"emb_{f}").embeddings for f in kp.FEATURES]
    moments = {id(v): (np.zeros(v.shape, np.float32), np.zeros(v.shape, np.float32)) for v in embs}
    losses = []
    for t in range(1, steps + 1):
        rows = slice((t - 1) * batch, t * batch)
        with tf.GradientTape() as tape:
            loss = loss_fn(y[rows, None], model({f: v[rows] for f, v in x.items()}))
        dense = [v for v in model.trainable_variables if all(v is not e for e in embs)]
        grads = tape.gradient(loss, dense + embs)
        dense_opt.apply_gradients(zip(grads[:len(dense)], dense))
        for var, g in zip(embs, grads[len(dense):]):
            idx, inv = np.unique(g.indices.numpy(), return_inverse=True)
            gsum = np.zeros((len(idx), var.shape[1]), np.float32)
            np.add.at(gsum, inv, g.values.numpy())
            m, v = moments[id(var)]
            m[idx] = b1 * m[idx] + (1 - b1) * gsum
            v[idx] = b2 * v[idx] + (1 - b2) * gsum ** 2
            lr_t = lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t)
            w = var.numpy()
            w[idx] -= lr_t * m[idx] / (np.sqrt(v[idx]) + eps)
            var.assign(w)
        losses.append(float(loss))
    return model, losses


def test_lazy_adam_equals_keras_adam_on_touched_rows():
    x, y, _ = kp.data(96, 0)
    ref, ref_losses = _lazy_adam_reference(x, y, 3, 32)
    fused = kp.fused_twin(kp.plain_model(), "adam")
    got = kp.train(fused, kp.keras_optimizer("adam"), kp.LOSSES["bce_object"](), x, y, 32,
                   epochs=1, metrics=False)
    np.testing.assert_allclose(got["batch_losses"], np.cumsum(ref_losses) / np.arange(1, 4),
                               rtol=1e-5)
    xt, _, _ = kp.data(40, 1)
    np.testing.assert_allclose(fused.predict(xt, verbose=0), ref.predict(xt, verbose=0),
                               rtol=1e-4, atol=1e-5)


# The 2-rank configurations (optimizers, rows per rank per step, rows, pipeline), run one
# after another in one 2-rank job (a job's start-up costs more than a configuration):
# even slices; different batch sizes per rank with an uneven last batch and an empty
# batch on rank 1; pipelined fit.
TWO_RANK_CONFIGS = ((("sgd", "adagrad", "ftrl"), (16, 16), 96, None),
                    (("adagrad",), (20, 12), 100, None),
                    (("adagrad",), (16, 16), 96, "dbp,fwp=4"))


def _configs_on_rank():
    """One rank: kp.fit_on_ranks for each of TWO_RANK_CONFIGS."""
    return [kp.fit_on_ranks(list(opts), shares, rows, pipeline)
            for opts, shares, rows, pipeline in TWO_RANK_CONFIGS]


class TwoRankParityTest(DistributedTestCase):
    """FusedModel fit/evaluate/predict on 2 ranks (``run_ranks``) = plain Keras on the
    global batch in one process."""
    timeout = 800

    @pytest.mark.timeout(900)
    def test_even_and_uneven_slices_and_pipelined_fit(self):
        ranks = self.run_ranks(_configs_on_rank, 2)
        for config, results in zip(TWO_RANK_CONFIGS, ranks[0]):
            optimizers, shares, rows, _ = config
            self.assertEqual([r["optimizer"] for r in results], list(optimizers))
            for result in results:
                compare(result, kp.keras_global(result["optimizer"], rows, sum(shares)))


def test_auto_micro_batches_choose_by_measurement_and_equal_keras():
    """micro_batches="auto" trains its measuring steps exactly too, then keeps one N."""
    x, y, sw = kp.data(32 * 51, 0)  # 48 measuring steps (4 candidates x 4 blocks of 3), 3 more
    plain = kp.plain_model()
    fused = kp.fused_twin(plain, "adagrad")
    want = kp.train(plain, kp.keras_optimizer("adagrad"), kp.LOSSES["bce_object"](), x, y, 32,
                    epochs=1, sample_weight=sw)
    got = kp.train(fused, kp.keras_optimizer("adagrad"), kp.LOSSES["bce_object"](), x, y, 32,
                   epochs=1, sample_weight=sw, pipeline="dbp,fwp=auto")
    compare(got, want)
    pipeline = fused.training_pipeline
    labels = ["sync", "dbp", "dbp,fwp=2", "dbp,fwp=4"]  # the synchronous step first
    assert list(pipeline.timings) == labels
    # the simplest schedule within 3% of the fastest (noise must not buy pipelining)
    fastest = min(pipeline.timings.values())
    assert pipeline.chosen == next(l for l in labels if pipeline.timings[l] <= fastest * 1.03)
    assert pipeline.chosen_options == PipelineOptions.parse(pipeline.chosen)
