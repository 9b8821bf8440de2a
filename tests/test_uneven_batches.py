"""Ranks with different numbers of batches (sharded input files of unequal length):
``fit`` trains every rank on the steps all ranks have and reports the rest; ``evaluate``
and ``predict`` cover every sample of every rank. Exact against one process on the
batches that were used; 2 and 3 ranks; synchronous and nested-pipeline fit; known and
unknown dataset lengths. Before, rank 1 finished and rank 0 died in Horovod's shutdown.
"""
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tf_fusedemb.testing import DistributedTestCase

FEATURES = ("a", "b", "c")
SHARE, DIM = 8, 4


def _data(n, seed=0):
    rng = np.random.default_rng(seed)
    x = {f: rng.integers(0, 30, n).astype(np.int64) for f in FEATURES}
    y = (x["a"] % 2).astype(np.float32)
    return x, y


def _model():
    from tf_fusedemb.layers import FusedEmbedding
    from tf_fusedemb.models import FusedModel
    from tf_fusedemb.specs import FeatureSpec, OptimizerSpec, TableSpec
    specs = [FeatureSpec(f, TableSpec(f, DIM, OptimizerSpec.adagrad(0.2))) for f in FEATURES]
    inputs = {f: tf_keras.Input([], dtype=tf.int64, name=f) for f in FEATURES}
    h = tf_keras.layers.Concatenate()(list(FusedEmbedding(specs)(inputs).values()))
    out = tf_keras.layers.Dense(1, kernel_initializer=tf_keras.initializers.GlorotUniform(3))(h)
    model = FusedModel(inputs, out)
    return model


def _compile(model, pipeline=None):
    model.compile(optimizer=tf_keras.optimizers.SGD(0.1),
                  loss=tf_keras.losses.BinaryCrossentropy(from_logits=True),
                  metrics=[tf_keras.metrics.BinaryAccuracy()], pipeline=pipeline)
    return model


def _rank_rows(rank, size, batches):
    """Rows of rank ``rank``: its SHARE-row slice of each of its ``batches`` global
    batches (global batch t = rows [t*size*SHARE, (t+1)*size*SHARE), ranks in order)."""
    return np.concatenate([np.arange(t * size * SHARE + rank * SHARE,
                                     t * size * SHARE + (rank + 1) * SHARE)
                           for t in range(batches)])


def _dataset(x, y, rows, unknown_length):
    ds = tf.data.Dataset.from_tensor_slices(({f: v[rows] for f, v in x.items()}, y[rows]))
    ds = ds.batch(SHARE)
    return ds.filter(lambda *_: True) if unknown_length else ds


def _uneven_rank(batches, pipeline, unknown_length):
    from tf_fusedemb.comm import get_communicator
    comm = get_communicator()
    x, y = _data(len(batches) * max(batches) * SHARE)
    rows = _rank_rows(comm.rank, comm.size, batches[comm.rank])
    model = _compile(_model(), pipeline)
    history = model.fit(_dataset(x, y, rows, unknown_length), epochs=2, verbose=0)
    evaluation = model.evaluate(_dataset(x, y, rows, unknown_length), verbose=0,
                                return_dict=True)
    predictions = model.predict({f: v[rows] for f, v in x.items()}, batch_size=SHARE,
                                verbose=0)
    return {"history": history.history, "evaluate": evaluation, "rows": rows,
            "predictions": predictions, "unused": getattr(model, "unused_batches", None)}


def _one_process(batches):
    """Fit on the global batches every rank has, then evaluate/predict all rows."""
    size = len(batches)
    x, y = _data(size * max(batches) * SHARE)
    used = min(batches) * size * SHARE
    model = _compile(_model())
    history = model.fit({f: v[:used] for f, v in x.items()}, y[:used], batch_size=size * SHARE,
                        epochs=2, verbose=0, shuffle=False)
    rows = np.concatenate([_rank_rows(r, size, b) for r, b in enumerate(batches)])
    evaluation = model.evaluate({f: v[rows] for f, v in x.items()}, y[rows], verbose=0,
                                return_dict=True)
    return {"history": history.history, "evaluate": evaluation, "x": x, "model": model}


class UnevenBatchesTest(DistributedTestCase):
    timeout = 600

    def _check(self, batches, pipeline=None, unknown_length=False):
        ranks = self.run_ranks(_uneven_rank, len(batches), (batches, pipeline, unknown_length))
        want = _one_process(batches)
        for rank, got in enumerate(ranks):
            msg = f"rank {rank} of {batches}"
            for key in ("loss", "binary_accuracy"):
                self.assertAllClose(got["history"][key], want["history"][key], rtol=1e-5,
                                    msg=f"{msg}: fit {key}")
            for key in ("loss", "binary_accuracy"):
                self.assertAllClose(got["evaluate"][key], want["evaluate"][key], rtol=1e-5,
                                    msg=f"{msg}: evaluate {key} over every rank's samples")
            expected = want["model"].predict({f: v[got["rows"]] for f, v in want["x"].items()},
                                             verbose=0)
            self.assertEqual(len(got["predictions"]), len(got["rows"]), msg)
            self.assertAllClose(got["predictions"], expected, rtol=1e-5, atol=1e-6, msg=msg)
        if not unknown_length:  # known lengths: the unused batches per epoch, exactly
            longest = max(batches)
            self.assertEqual(ranks[0]["unused"],
                             {r: b - min(batches) for r, b in enumerate(batches)
                              if b > min(batches)})
            del longest

    def test_two_ranks_fit_evaluate_predict(self):
        self._check([5, 4])

    def test_three_ranks_unknown_lengths(self):
        self._check([4, 5, 3], unknown_length=True)

    def test_nested_pipeline(self):
        self._check([5, 3], pipeline="dbp,fwp=2")


@pytest.mark.parametrize("until", ["first", None])
def test_until_is_checked(until):
    from tf_fusedemb.comm import LocalCommunicator
    from tf_fusedemb.training.rank_batches import RankBatches
    with pytest.raises(ValueError, match="until"):
        RankBatches(LocalCommunicator(), until, "fit")


def test_empty_batch_has_the_structure_and_no_rows():
    from tf_fusedemb.training.rank_batches import empty_batch
    spec = ({"d": tf.TensorSpec([None, 3], tf.float32),
             "r": tf.RaggedTensorSpec([None, None], tf.int64, 1),
             "s": tf.SparseTensorSpec([None, 5], tf.int64)}, tf.TensorSpec([None], tf.float32))
    x, y = empty_batch(spec)
    assert x["d"].shape == (0, 3) and y.shape == (0,)
    assert x["r"].shape[0] == 0 and x["r"].dtype == tf.int64
    assert x["s"].dense_shape.numpy().tolist() == [0, 5]
    for value, s in zip(tf.nest.flatten((x, y), expand_composites=False),
                        tf.nest.flatten(spec)):
        assert s.is_compatible_with(value), (s, value)
