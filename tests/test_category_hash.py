"""category_hash against the numpy hash mirror and a dict unique; collision behaviour."""
import numpy as np
import pytest
import tensorflow as tf

from tf_fusedemb.ops import category_hash, category_key_strings, collision_partner, hashing

I64 = np.iinfo(np.int64)
CATS = ["C1", "C2", "user_id"]


def reference(ids, segs, categories, mode, id_bits=None):
    names = np.array(categories)[segs] if len(segs) else np.array([], str)
    if mode == "hashed":
        keys = hashing.hashed_unified_keys(ids, names)
    else:
        keys = hashing.packed_unified_keys(ids, segs, len(categories), id_bits)
    pos, lookup, lids, lsegs, counts, inverse = {}, [], [], [], [], []
    for k, i, s in zip(keys.tolist(), np.asarray(ids).tolist(), np.asarray(segs).tolist()):
        if k not in pos:
            pos[k] = len(lookup)
            lookup.append(k), lids.append(i), lsegs.append(s), counts.append(0)
        counts[pos[k]] += 1
        inverse.append(pos[k])
    return lookup, lids, lsegs, inverse, counts


def run(ids, segs, mode, fn_mode, categories=CATS, id_bits=None):
    def f(i, s):
        return category_hash(i, s, categories, mode=mode, id_bits=id_bits)
    ids, segs = tf.constant(ids), tf.constant(segs, tf.int32)
    if fn_mode == "function":
        f = tf.function(f, input_signature=[tf.TensorSpec([None], ids.dtype),
                                            tf.TensorSpec([None], tf.int32)])
    return f(ids, segs)


@pytest.mark.parametrize("fn_mode", ["eager", "function"])
@pytest.mark.parametrize("mode", ["hashed", "packed"])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_random_against_reference(fn_mode, mode, dtype):
    rng = np.random.default_rng(11)
    ids = rng.integers(0, 300, 5000).astype(dtype)
    segs = rng.integers(0, len(CATS), 5000).astype(np.int32)
    got = run(ids, segs, mode, fn_mode)
    for g, w, name in zip(got[:5], reference(ids, segs, CATS, mode), got._fields):
        np.testing.assert_array_equal(g.numpy(), np.asarray(w, g.dtype.as_numpy_dtype), err_msg=name)
    assert int(got.num_collisions) == 0


@pytest.mark.parametrize("mode", ["hashed", "packed"])
def test_empty_input(mode):
    got = run(np.array([], np.int64), np.array([], np.int32), mode, "function")
    assert got.lookup_keys.shape == (0,) and got.inverse.shape == (0,)


def test_hashed_mode_takes_int64_extremes_and_negatives():
    ids = np.array([I64.min, I64.max, -1, 0, I64.min], np.int64)
    segs = np.array([0, 1, 2, 0, 0], np.int32)
    got = run(ids, segs, "hashed", "eager")
    np.testing.assert_array_equal(got.lookup_keys, reference(ids, segs, CATS, "hashed")[0])
    np.testing.assert_array_equal(got.counts, [2, 1, 1, 1])


def test_same_id_in_different_categories_gives_different_keys():
    for mode in ("hashed", "packed"):
        got = run(np.array([0, 0, 0], np.int64), np.array([0, 1, 2], np.int32), mode, "eager")
        assert got.lookup_keys.shape == (3,), mode


def test_hashed_collision_is_shared_and_counted():
    x = 987654321
    y = collision_partner(x, "C1", "C2")
    ids = np.array([x, y, x, y, 5], np.int64)
    segs = np.array([0, 1, 0, 1, 2], np.int32)
    got = run(ids, segs, "hashed", "eager")
    # One key for (C1, x) and (C2, y); the second pair counted once, however often it occurs.
    assert got.lookup_keys.shape == (2,)
    np.testing.assert_array_equal(got.inverse, [0, 0, 0, 0, 1])
    assert int(got.num_collisions) == 1
    np.testing.assert_array_equal(got.lookup_segment_ids, [0, 2])  # the first pair is kept
    # The packed mode has no collision for the same pairs (when they fit).
    small_x, small_y = 3, 3 ^ 1
    ok = run(np.array([small_x, small_y], np.int64), np.array([0, 1], np.int32), "packed", "eager")
    assert ok.lookup_keys.shape == (2,) and int(ok.num_collisions) == 0


def test_within_one_category_hashed_keys_never_collide():
    ids = np.arange(-50_000, 50_000, dtype=np.int64) * 7919
    got = run(ids, np.zeros(ids.size, np.int32), "hashed", "eager")
    assert got.lookup_keys.shape == (ids.size,) and int(got.num_collisions) == 0


def test_packed_mode_rejects_ids_that_do_not_fit_naming_the_category():
    with pytest.raises(tf.errors.InvalidArgumentError, match="of category 'C2' is outside"):
        run(np.array([1, -5], np.int64), np.array([0, 1], np.int32), "packed", "eager")
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"outside \[0, 2\^4\)"):
        run(np.array([16], np.int64), np.array([0], np.int32), "packed", "function", id_bits=4)


def test_packed_mode_with_one_category_takes_every_non_negative_id():
    ids = np.array([0, 1, I64.max], np.int64)
    got = run(ids, np.zeros(3, np.int32), "packed", "eager", categories=["only"])
    np.testing.assert_array_equal(got.lookup_keys, ids)  # 63 ID bits, category 0
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"outside \[0, 2\^63\)"):
        run(np.array([-1], np.int64), np.zeros(1, np.int32), "packed", "eager",
            categories=["only"])


def test_packed_keys_are_exact_bit_packing():
    got = run(np.array([5, 5], np.int64), np.array([0, 2], np.int32), "packed", "eager")
    bits = 63 - 2  # 3 categories need 2 bits
    np.testing.assert_array_equal(got.lookup_keys, [5, (2 << bits) | 5])


@pytest.mark.parametrize("segs,message", [
    ([0, 3], r"segment_ids\[1\] = 3 is out of range \[0, 3\)"),
    ([-1, 0], r"segment_ids\[0\] = -1 is out of range"),
])
def test_invalid_segment_ids(segs, message):
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        run(np.array([1, 2], np.int64), np.array(segs, np.int32), "hashed", "function")


def test_invalid_arguments_are_named():
    with pytest.raises(tf.errors.InvalidArgumentError, match="mode must be one of"):
        category_hash([1], [0], CATS, mode="exact")
    with pytest.raises(tf.errors.InvalidArgumentError, match="categories must be distinct"):
        category_hash([1], [0], ["a", "a"])
    with pytest.raises(tf.errors.InvalidArgumentError, match="ids must be int32 or int64"):
        category_hash([1.5], [0], CATS)
    with pytest.raises(tf.errors.InvalidArgumentError, match="segment_ids has 1 elements"):
        category_hash(tf.constant([1, 2], tf.int64), tf.constant([0], tf.int32), CATS)


def test_key_strings_for_reports():
    s = category_key_strings(tf.constant([0, 2]), tf.constant([17, -3], tf.int64), CATS)
    assert [v.decode() for v in s.numpy()] == ["C1/17", "user_id/-3"]
