"""ops.row_masks against numpy's boolean indexing: every tensor cut to the mask's rows,
in order, for empty, full and mixed masks, and the one-``Where`` graph it traces."""
import numpy as np
import pytest
import tensorflow as tf

from tf_fusedemb.ops.row_masks import mask_indices, masked_rows


@pytest.mark.parametrize("n", [0, 1, 7, 64])
def test_masked_rows_equal_numpy(n):
    rng = np.random.default_rng(n)
    for mask in (np.zeros(n, bool), np.ones(n, bool), rng.random(n) < 0.4):
        keys = rng.integers(-2**62, 2**62, n)
        rows = rng.normal(size=(n, 3)).astype(np.float32)
        got_keys, got_rows = masked_rows(tf.constant(mask), tf.constant(keys), tf.constant(rows))
        np.testing.assert_array_equal(got_keys.numpy(), keys[mask])
        np.testing.assert_array_equal(got_rows.numpy(), rows[mask])
        np.testing.assert_array_equal(mask_indices(tf.constant(mask)).numpy(),
                                      np.flatnonzero(mask))


def test_one_where_serves_every_tensor():
    spec = tf.TensorSpec([None], tf.bool), tf.TensorSpec([None], tf.int64)
    graph = tf.function(lambda m, k: masked_rows(m, k, k, k)).get_concrete_function(*spec).graph
    ops = [op.type for op in graph.get_operations()]
    assert ops.count("Where") == 1 and ops.count("GatherV2") == 3, ops
