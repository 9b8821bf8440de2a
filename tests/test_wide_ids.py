"""The main job's feature of many distinct IDs (``job.with_wide_ids``, ``train.py
--wide-ids``): its IDs against numpy's count of the job's samples, and its errors."""
import numpy as np
import pytest
import tensorflow as tf

from tf_fusedemb import job


def _batches(sizes):
    """(features, label) batches of the given sizes, a feature "a" holding a running
    count (to check that the rest of the batch passes through unchanged)."""
    start = np.cumsum([0] + list(sizes))
    return [({"a": np.arange(s, s + n, dtype=np.int64)}, np.zeros((n, 1), np.float32))
            for s, n in zip(start, sizes)]


@pytest.mark.parametrize("rank,size,distinct", [(0, 1, 10), (1, 2, 10), (2, 3, 7), (0, 2, 1000)])
def test_ids_are_the_global_sample_index_modulo_the_distinct_ids(rank, size, distinct):
    batch = 4
    raw = _batches([batch] * 6)
    data = tf.data.Dataset.from_generator(
        lambda: iter(raw), output_signature=({"a": tf.TensorSpec([None], tf.int64)},
                                             tf.TensorSpec([None, 1], tf.float32)))
    got = list(job.with_wide_ids(data, distinct, rank, size).as_numpy_iterator())
    assert len(got) == len(raw)
    for t, ((x, y), (raw_x, raw_y)) in enumerate(zip(got, raw)):
        first = (t * size + rank) * batch  # the job's sample index of this batch's first row
        np.testing.assert_array_equal(x[job.WIDE_FEATURE], (first + np.arange(batch)) % distinct)
        np.testing.assert_array_equal(x["a"], raw_x["a"])
        np.testing.assert_array_equal(y, raw_y)


def test_the_ranks_together_meet_every_id_once_before_any_repeats():
    distinct, size, batch, steps = 48, 3, 4, 4  # 3 ranks x 4 steps x 4 = 48 samples
    seen = []
    for rank in range(size):
        data = tf.data.Dataset.from_tensor_slices(
            ({"a": tf.zeros([batch * steps], tf.int64)}, tf.zeros([batch * steps, 1]))).batch(batch)
        seen += [x[job.WIDE_FEATURE] for x, _ in job.with_wide_ids(data, distinct, rank, size)]
    ids = np.concatenate(seen)
    assert sorted(ids.tolist()) == list(range(distinct))


def test_bad_arguments_fail_naming_them():
    data = tf.data.Dataset.from_tensor_slices(({"a": tf.zeros([4], tf.int64)}, tf.zeros([4, 1])))
    with pytest.raises(ValueError, match="wide_ids must be a positive"):
        job.with_wide_ids(data.batch(2), 0, 0, 1)
    with pytest.raises(ValueError, match="wide_ids needs the synthetic data, got --data criteo"):
        job.make_data("criteo", "/nonexistent", 8, 0, 1, wide_ids=100)
