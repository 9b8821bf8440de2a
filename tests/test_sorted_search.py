"""ops.sorted_search against numpy's searchsorted: both sides, repeated and absent values,
empty inputs, int32 and int64 results, and the one kernel it traces."""
import numpy as np
import pytest
import tensorflow as tf

from tf_fusedemb.ops.sorted_search import search_sorted


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("n,k", [(0, 5), (5, 0), (1, 3), (50, 200)])
def test_search_sorted_equals_numpy(side, n, k):
    rng = np.random.default_rng(n * 1000 + k)
    sorted_values = np.sort(rng.integers(-20, 20, n))
    values = rng.integers(-25, 25, k)
    for out_type in (tf.int32, tf.int64):
        got = search_sorted(tf.constant(sorted_values, tf.int64), tf.constant(values, tf.int64),
                            side, out_type)
        assert got.dtype == out_type
        np.testing.assert_array_equal(got.numpy(), np.searchsorted(sorted_values, values, side))


def test_one_kernel_and_a_clear_error():
    spec = tf.TensorSpec([None], tf.int64)
    graph = tf.function(lambda s, v: search_sorted(s, v, "right")).get_concrete_function(
        spec, spec).graph
    ops = [op.type for op in graph.get_operations()]
    assert ops.count("UpperBound") == 1 and len(ops) <= 10, ops  # 2 inputs, 3 reshapes, 1 out
    with pytest.raises(ValueError, match="side must be 'left' or 'right', got 'middle'"):
        search_sorted(tf.constant([1]), tf.constant([1]), "middle")
