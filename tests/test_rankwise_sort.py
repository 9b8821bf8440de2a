"""rankwise_sort / owner_rank against numpy: the hash mirror and a stable sort."""
import numpy as np
import pytest
import tensorflow as tf

import np_reference
from tf_fusedemb.ops import hashing, owner_rank, rankwise_sort
from tf_fusedemb.ops import reference as tf_ref

I64 = np.iinfo(np.int64)


def run(keys, splits, num_ranks, mode):
    args = (tf.constant(keys), tf.constant(splits, tf.int64), tf.constant(num_ranks, tf.int32))
    if mode == "eager":
        return rankwise_sort(*args)
    fn = tf.function(rankwise_sort, input_signature=[
        tf.TensorSpec([None], args[0].dtype), tf.TensorSpec([None], tf.int64),
        tf.TensorSpec([], tf.int32)])
    return fn(*args)


def check(keys, splits, num_ranks, mode="eager"):
    got = run(keys, splits, num_ranks, mode)
    owners = hashing.owner_rank(keys, num_ranks)
    want = np_reference.rankwise_sort(keys, splits, owners, num_ranks)
    for g, w, name in zip(got, want, got._fields):
        np.testing.assert_array_equal(g.numpy(), w, err_msg=name)
    np.testing.assert_array_equal(got.sorted_keys.numpy()[got.indices.numpy()], keys)
    return got


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("num_ranks", [1, 2, 3, 8, 64])
def test_random(mode, dtype, num_ranks):
    rng = np.random.default_rng(num_ranks)
    n, m = int(rng.integers(1, 2000)), int(rng.integers(1, 27))
    splits = np.concatenate([[0], np.sort(rng.integers(0, n + 1, m - 1)), [n]]).astype(np.int64)
    keys = rng.integers(np.iinfo(dtype).min, np.iinfo(dtype).max, n, dtype=dtype)
    check(keys, splits, num_ranks, mode)


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("keys,splits", [
    (np.array([], np.int64), [0]),
    (np.array([], np.int64), [0, 0, 0]),
    (np.array([5], np.int64), [0, 0, 1, 1]),
    (np.array([0, 0, 0], np.int64), [0, 1, 2, 3]),                  # a0 b0 c0 -> same owner
    (np.array([I64.min, I64.max, -1, 0, 1], np.int64), [0, 5]),
])
def test_adversarial(mode, keys, splits):
    check(keys, np.array(splits, np.int64), 4, mode)


def test_large_input_crosses_parallel_chunks():
    rng = np.random.default_rng(3)
    n = 1_000_000
    keys = rng.integers(I64.min, I64.max, n, dtype=np.int64)
    splits = np.array([0, 1, 400_000, 400_000, n], np.int64)
    got = rankwise_sort(keys, splits, 7)
    owners = hashing.owner_rank(keys, 7)
    order = np.argsort(owners, kind="stable")
    np.testing.assert_array_equal(got.sorted_keys, keys[order])
    np.testing.assert_array_equal(got.rank_splits, np.bincount(owners, minlength=7))
    segs = np.repeat(np.arange(4), np.diff(splits))
    np.testing.assert_array_equal(got.sorted_segment_ids, segs[order])
    np.testing.assert_array_equal(got.sorted_keys.numpy()[got.indices.numpy()], keys)


def test_owner_rank_matches_numpy_and_pure_tf_mirrors():
    keys = np.array([I64.min, -1, 0, 1, 12345, I64.max], np.int64)
    want = hashing.owner_rank(keys, 5)
    np.testing.assert_array_equal(owner_rank(keys, 5), want)
    np.testing.assert_array_equal(tf_ref.owners_pure_tf(tf.constant(keys), 5), want)
    # Known value of fmix64 (MurmurHash3), independent of both implementations.
    assert int(hashing.mix64(np.array([1], np.uint64))[0]) == 0xB456BCFC34C2CB2C


def test_owners_are_balanced_on_sequential_ids():
    counts = np.bincount(hashing.owner_rank(np.arange(100_000), 8), minlength=8)
    assert counts.min() > 0.95 * 100_000 / 8


@pytest.mark.parametrize("num_ranks,message", [(0, "num_ranks must be positive, got 0"),
                                               (-3, "num_ranks must be positive")])
def test_invalid_num_ranks(num_ranks, message):
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        rankwise_sort(tf.constant([1], tf.int64), [0, 1], num_ranks)
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        owner_rank(tf.constant([1], tf.int64), num_ranks)


def test_invalid_splits_in_function():
    fn = tf.function(rankwise_sort, input_signature=[
        tf.TensorSpec([None], tf.int64), tf.TensorSpec([None], tf.int64), tf.TensorSpec([], tf.int32)])
    with pytest.raises(tf.errors.InvalidArgumentError, match="segment_splits"):
        fn(tf.constant([1, 2], tf.int64), tf.constant([0, 3], tf.int64), tf.constant(2))
