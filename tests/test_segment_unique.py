"""segment_unique against a dict-based numpy reference, eager and in tf.function."""
import numpy as np
import pytest
import tensorflow as tf

import np_reference
from tf_fusedemb.ops import segment_unique

I64 = np.iinfo(np.int64)


def run(keys, splits, mode):
    keys = tf.constant(keys)
    splits = tf.constant(splits, tf.int64)
    if mode == "eager":
        return segment_unique(keys, splits)
    fn = tf.function(segment_unique, input_signature=[
        tf.TensorSpec([None], keys.dtype), tf.TensorSpec([None], tf.int64)])
    return fn(keys, splits)


def check(keys, splits, mode="eager"):
    got = run(keys, splits, mode)
    want = np_reference.segment_unique(keys, splits)
    for g, w, name in zip(got, want, got._fields):
        np.testing.assert_array_equal(g.numpy(), w, err_msg=name)
    assert got.unique_keys.dtype == tf.as_dtype(np.asarray(keys).dtype)
    np.testing.assert_array_equal(got.unique_keys.numpy()[got.inverse.numpy()], keys)
    return got


def random_case(rng, n, m, vocab, dtype=np.int64):
    splits = np.concatenate([[0], np.sort(rng.integers(0, n + 1, m - 1)), [n]]).astype(np.int64)
    return rng.integers(-vocab, vocab, n).astype(dtype), splits


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("seed", range(4))
def test_random(mode, dtype, seed):
    rng = np.random.default_rng(seed)
    keys, splits = random_case(rng, n=int(rng.integers(1, 3000)), m=int(rng.integers(1, 30)),
                               vocab=int(rng.integers(1, 500)), dtype=dtype)
    check(keys, splits, mode)


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("keys,splits", [
    (np.array([], np.int64), [0]),                                   # no segments, no keys
    (np.array([], np.int64), [0, 0, 0, 0]),                          # empty segments only
    (np.array([3, 3, 3, 3], np.int64), [0, 4]),                      # one segment, all dups
    (np.array([7] * 6, np.int64), [0, 0, 2, 2, 6, 6]),               # dups + empty segments
    (np.array([0, 0, 1, 0, 0, 1], np.int64), [0, 3, 6]),             # a0 and b0 both kept
    (np.array([I64.min, I64.max, -1, 0, I64.min, -1, I64.max], np.int64), [0, 4, 7]),
    (np.array([2 ** 31 - 1, -2 ** 31, -2 ** 31], np.int32), [0, 1, 3]),
])
def test_adversarial(mode, keys, splits):
    check(keys, np.array(splits, np.int64), mode)


def test_equal_ids_in_different_segments_are_kept():
    got = check(np.array([0, 1, 0, 1, 0], np.int64), np.array([0, 2, 5], np.int64))
    np.testing.assert_array_equal(got.unique_segment_splits, [0, 2, 4])


def test_one_million_keys_against_np_unique():
    # n = 1e6 over 26 skewed segments; reference per segment with np.unique (vectorised).
    rng = np.random.default_rng(7)
    n, m = 1_000_000, 26
    splits = np.linspace(0, n, m + 1).astype(np.int64)
    keys = (rng.zipf(1.2, n) % 100_000).astype(np.int64) * 1_000_003 - 5
    got = segment_unique(keys, splits)
    inv = got.inverse.numpy()
    out_splits = got.unique_segment_splits.numpy()
    for s in range(m):
        seg = keys[splits[s]:splits[s + 1]]
        uniq, first, counts = np.unique(seg, return_index=True, return_counts=True)
        order = np.argsort(first)  # first-occurrence order
        lo, hi = out_splits[s], out_splits[s + 1]
        np.testing.assert_array_equal(got.unique_keys.numpy()[lo:hi], uniq[order])
        np.testing.assert_array_equal(got.counts.numpy()[lo:hi], counts[order])
        assert inv[splits[s]:splits[s + 1]].min() >= lo and inv[splits[s]:splits[s + 1]].max() < hi
    np.testing.assert_array_equal(got.unique_keys.numpy()[inv], keys)


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("splits,message", [
    ([1, 3], r"segment_splits\[0\] must be 0"),
    ([0, 2, 1, 3], "segment_splits must be non-decreasing"),
    ([0, 2], r"segment_splits\[-1\] = 2 must equal the number of keys 3"),
    ([], "segment_splits must be a vector of at least one element"),
])
def test_invalid_splits(mode, splits, message):
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        run(np.array([1, 2, 3], np.int64), np.array(splits, np.int64), mode)


def test_invalid_dtypes_name_the_argument():
    with pytest.raises(tf.errors.InvalidArgumentError, match="keys must be int32 or int64"):
        segment_unique(tf.constant([1.0]), [0, 1])
    with pytest.raises(tf.errors.InvalidArgumentError, match="segment_splits must be an integer"):
        segment_unique(tf.constant([1], tf.int64), [0.0, 1.0])


def test_int32_splits_are_accepted():
    got = segment_unique(tf.constant([4, 4, 5], tf.int64), tf.constant([0, 2, 3], tf.int32))
    np.testing.assert_array_equal(got.unique_keys, [4, 5])

