"""Recovery gather and pooling: numpy references, gradients, invalid input."""
import numpy as np
import pytest
import tensorflow as tf

import np_reference
from tf_fusedemb.ops import (rankwise_sort, recover_features, recovery_gather, recovery_pool,
                             segment_unique)
from tf_fusedemb.ops import reference as tf_ref
from tf_fusedemb.ops.recovery import UniformSplits, group_pool_splits


def fused_case(seed, n=600, m=5, d=8):
    """A real (I_s, I_u) pair from the ops, and rows standing for the received rows."""
    rng = np.random.default_rng(seed)
    splits = np.concatenate([[0], np.sort(rng.integers(0, n + 1, m - 1)), [n]]).astype(np.int64)
    keys = rng.integers(0, 60, n).astype(np.int64)
    u = segment_unique(keys, splits)
    s = rankwise_sort(u.unique_keys, u.unique_segment_splits, 3)
    rows = rng.standard_normal((int(u.unique_keys.shape[0]), d))
    return keys, splits, u, s, rows


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_gather_matches_numpy_and_scatter_nd(mode):
    _, _, u, s, rows = fused_case(0)
    fn = recovery_gather if mode == "eager" else tf.function(recovery_gather, input_signature=[
        tf.TensorSpec([None, None], tf.float64), tf.TensorSpec([None], tf.int32),
        tf.TensorSpec([None], tf.int32)])
    out, rec = fn(tf.constant(rows), s.indices, u.inverse)
    want_rec = s.indices.numpy()[u.inverse.numpy()]
    np.testing.assert_array_equal(rec, want_rec)
    np.testing.assert_array_equal(out, rows[want_rec])
    np.testing.assert_array_equal(out, tf_ref.scatter_nd_recovery(
        rows, tf.math.invert_permutation(s.indices), u.inverse))


def test_gather_empty():
    out, rec = recovery_gather(tf.zeros([0, 4]), tf.zeros([0], tf.int32), tf.zeros([0], tf.int32))
    assert out.shape == (0, 4) and rec.shape == (0,)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_pool_matches_numpy_and_sparse_segment_ops(combiner):
    rng = np.random.default_rng(1)
    rows = rng.standard_normal((40, 6))
    lengths = rng.integers(0, 5, 30)  # includes empty samples
    splits = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    rec = rng.integers(0, 40, splits[-1]).astype(np.int32)
    got = recovery_pool(rows, rec, splits, [0, 30], [combiner])
    np.testing.assert_allclose(got, np_reference.pool(rows, rec, splits, [0, 30], [combiner]),
                               rtol=1e-12)
    np.testing.assert_allclose(got, tf_ref.gather_pool(rows, rec, splits, combiner), rtol=1e-12)


def test_pool_mixed_combiners_per_feature():
    rng = np.random.default_rng(2)
    rows = rng.standard_normal((10, 3)).astype(np.float32)
    splits = np.array([0, 2, 2, 5, 6, 9, 10], np.int64)
    fsplits = np.array([0, 2, 2, 6], np.int64)  # middle feature has no samples
    rec = rng.integers(0, 10, 10).astype(np.int32)
    combiners = ["mean", "sum", "sqrtn"]
    got = recovery_pool(rows, rec, splits, fsplits, combiners)
    np.testing.assert_allclose(got, np_reference.pool(rows, rec, splits, fsplits, combiners),
                               rtol=1e-6)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_pool_gradient_numerically(combiner):
    rng = np.random.default_rng(3)
    rows = tf.constant(rng.standard_normal((7, 3)))
    splits = tf.constant([0, 3, 3, 7, 8], tf.int64)
    rec = tf.constant(rng.integers(0, 7, 8).astype(np.int32))
    theoretical, numerical = tf.test.compute_gradient(
        lambda r: recovery_pool(r, rec, splits, tf.constant([0, 4], tf.int64), [combiner]), [rows])
    np.testing.assert_allclose(theoretical[0], numerical[0], atol=1e-7)


def test_gather_gradient_is_unsorted_segment_sum():
    _, _, u, s, rows = fused_case(4, n=50, d=3)
    rows = tf.constant(rows)
    theoretical, numerical = tf.test.compute_gradient(
        lambda r: recovery_gather(r, s.indices, u.inverse)[0], [rows])
    np.testing.assert_allclose(theoretical[0], numerical[0], atol=1e-7)
    g = tf.random.normal([50, 3], dtype=tf.float64)
    with tf.GradientTape() as tape:
        tape.watch(rows)
        out = recovery_gather(rows, s.indices, u.inverse)[0]
    rec = s.indices.numpy()[u.inverse.numpy()]
    want = np.zeros(rows.shape)
    np.add.at(want, rec, g.numpy())
    np.testing.assert_allclose(tape.gradient(out, rows, output_gradients=g), want, rtol=1e-12)


def test_recover_features_for_a_mixed_group():
    """One-hot, multi-hot mean and a sequence feature of one group vs a direct numpy build."""
    rng = np.random.default_rng(5)
    onehot = rng.integers(0, 20, 6)
    multi = tf.ragged.constant([[1, 2, 2], [], [7], [3, 3, 3, 9], [1], [2, 8]], tf.int64)
    seq = tf.ragged.constant([[4, 5], [5], [], [6, 4, 4], [9], [1]], tf.int64)
    keys = np.concatenate([onehot, multi.flat_values.numpy(), seq.flat_values.numpy()])
    splits = np.cumsum([0, 6, multi.flat_values.shape[0], seq.flat_values.shape[0]])
    u = segment_unique(keys, splits)
    s = rankwise_sort(u.unique_keys, u.unique_segment_splits, 2)
    # Stand-in for received rows: row of unique j at sorted position I_s[j] encodes its key.
    table = rng.standard_normal((100, 4)).astype(np.float32)
    seg_of = np.repeat(np.arange(3), np.diff(u.unique_segment_splits.numpy()))
    rows = np.zeros((u.unique_keys.shape[0], 4), np.float32)
    rows[s.indices.numpy()] = table[u.unique_keys.numpy() + 30 * seg_of]
    outs = recover_features(rows, s.indices, u.inverse,
                            [tf.range(7, dtype=tf.int64), multi.row_splits, seq.row_splits],
                            [None, "mean", None])
    np.testing.assert_allclose(outs[0], table[onehot], rtol=1e-6)
    want_multi = [table[np.array(r, int) + 30].mean(0) if len(r) else np.zeros(4)
                  for r in multi.to_list()]
    np.testing.assert_allclose(outs[1], want_multi, rtol=1e-6)
    np.testing.assert_allclose(outs[2], table[seq.flat_values.numpy() + 60], rtol=1e-6)


def _pool_splits_numpy(row_splits, combiners):
    """The group's pooling segments, feature after feature, by a plain loop."""
    parts, sizes, offset = [np.zeros(1, np.int64)], [], 0
    for rs, combiner in zip(row_splits, combiners):
        rs = np.arange(rs[-1] + 1) if combiner is None else np.asarray(rs, np.int64)
        parts.append(rs[1:] + offset)
        sizes.append(len(rs) - 1)
        offset += rs[-1]
    return np.concatenate(parts), np.array(sizes, np.int64)


@pytest.mark.parametrize("seed", range(3))
def test_group_pool_splits_of_ragged_and_uniform_features(seed):
    """Features given as row splits or as L IDs per sample, empty ones among them, with and
    without a combiner: the segments a loop over the features builds."""
    rng = np.random.default_rng(seed)
    for _ in range(40):
        splits, given, combiners = [], [], []
        for _ in range(rng.integers(1, 6)):
            samples = int(rng.integers(0, 5))
            if rng.integers(0, 2):
                rs = np.concatenate([[0], np.cumsum(rng.integers(0, 4, samples))])
                given.append(tf.constant(rs, tf.int64))
            else:
                per_sample = int(rng.integers(1, 4))
                rs = np.arange(samples + 1) * per_sample
                given.append(UniformSplits(per_sample, tf.constant(rs[-1], tf.int64)))
            splits.append(rs)
            combiners.append([None, "sum", "mean"][rng.integers(0, 3)])
        got, sizes = group_pool_splits(given, combiners)
        want, want_sizes = _pool_splits_numpy(splits, combiners)
        np.testing.assert_array_equal(got, want, err_msg=f"{splits} {combiners}")
        np.testing.assert_array_equal(sizes, want_sizes)


@pytest.mark.parametrize("args,message", [
    (dict(sort=[0, 5]), r"sort_indices\[1\] = 5 is out of range \[0, 2\)"),
    (dict(inv=[0, 2]), r"unique_inverse\[1\] = 2 is out of range \[0, 2\)"),
    (dict(rows=np.zeros(2, np.float32)), "rows must be a matrix"),
])
def test_gather_invalid_input(args, message):
    rows = args.get("rows", np.zeros((2, 3), np.float32))
    fn = tf.function(recovery_gather, input_signature=[
        tf.TensorSpec(None, tf.float32), tf.TensorSpec([None], tf.int32),
        tf.TensorSpec([None], tf.int32)])
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        fn(rows, np.array(args.get("sort", [0, 1]), np.int32),
           np.array(args.get("inv", [0, 1]), np.int32))


def test_pool_invalid_input():
    rows = np.zeros((3, 2), np.float32)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"recover_indices\[0\] = 3"):
        recovery_pool(rows, [3], [0, 1], [0, 1], ["sum"])
    with pytest.raises(tf.errors.InvalidArgumentError, match="combiners has 2 entries"):
        recovery_pool(rows, [0], [0, 1], [0, 1], ["sum", "sum"])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"combiners\[0\] = 'max'"):
        recovery_pool(rows, [0], [0, 1], [0, 1], ["max"])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"pool_splits\[-1\] = 2"):
        recovery_pool(rows, [0], [0, 2], [0, 1], ["sum"])
    with pytest.raises(tf.errors.InvalidArgumentError, match="rows must be float32 or float64"):
        recovery_pool(np.zeros((3, 2), np.int32), [0], [0, 1], [0, 1], ["sum"])
