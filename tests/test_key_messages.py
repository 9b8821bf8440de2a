"""The key exchange's wire format (pack_key_messages, unpack_key_messages) and the
plan-independent key (hashed_unified_keys) against plain numpy/Python references written
here, edge cases (empty input, one rank, counts at the bit limit, int64 extremes) and
clear errors for bad arguments; the bad-input report protocol still reads the messages."""
import re

import numpy as np
import pytest
import tensorflow as tf

import np_reference
from tf_fusedemb import ops
from tf_fusedemb.layers import exchange
from tf_fusedemb.ops import hashing
from tf_fusedemb.ops.key_messages import category_bits, max_count

# The documented wire format (docs/guide/ops.md), the reference the library must match.
CATEGORY_BITS = 16
MAX_COUNT = (1 << (63 - CATEGORY_BITS)) - 1
BAD_INPUT = (1 << CATEGORY_BITS) - 1

I64 = np.iinfo(np.int64)
ERRORS = (tf.errors.InvalidArgumentError, ValueError)  # kernel errors; shape functions' in graphs
TABLES = ["C1", "C2", "user_id", "a/b"]


def as_int64(values):
    """Python ints taken modulo 2^64 into int64 (two's complement), as C++ would."""
    return np.array([(v + (1 << 63)) % (1 << 64) - (1 << 63) for v in values], np.int64)


def pack_reference(unique_keys, unique_segs, counts, segment_table, indices):
    """Key messages in sorted order, from the keys in unique (pre-sort) order: message of
    key u = (ID, count * 2^16 + table), placed at indices[u]. Python ints throughout."""
    n = len(unique_keys)
    out = np.zeros([n, 2], np.int64)
    for u in range(n):
        word = int(counts[u]) * (1 << CATEGORY_BITS) + int(segment_table[unique_segs[u]])
        out[indices[u]] = as_int64([int(unique_keys[u]), word])
    return out


def unpack_reference(messages):
    """(ids, counts, tables) of messages with Python ints: floor division (arithmetic
    shift) and the remainder."""
    messages = np.asarray(messages, np.int64)
    words = [int(w) for w in messages[:, 1]]
    return (messages[:, 0], np.array([w // (1 << CATEGORY_BITS) for w in words], np.int64),
            np.array([w % (1 << CATEGORY_BITS) for w in words], np.int32))


def random_keys(rng, dtype, n, num_segments):
    info = np.iinfo(dtype)
    keys = np.concatenate([rng.integers(-5, 50, n // 2),  # duplicates
                           rng.integers(info.min, info.max, n - n // 2, endpoint=True)])
    keys[:4] = [info.min, info.max, -1, 0]
    rng.shuffle(keys)
    cuts = np.sort(rng.integers(0, n + 1, num_segments - 1))
    return keys.astype(dtype), np.concatenate([[0], cuts, [n]]).astype(np.int64)


def sorted_inputs(keys, splits, num_ranks):
    """segment_unique then rankwise_sort, as the exchange runs them (numpy results)."""
    uniq = ops.segment_unique(keys, splits)
    srt = ops.rankwise_sort(uniq.unique_keys, uniq.unique_segment_splits, num_ranks)
    unique_segs = np.repeat(np.arange(len(splits) - 1, dtype=np.int32),
                            np.diff(uniq.unique_segment_splits.numpy()))
    return uniq, srt, unique_segs


def function(fn, *specs):
    """``fn`` as a tf.function with unknown lengths (the kernels' own checks run)."""
    return tf.function(fn, input_signature=[tf.TensorSpec([None] * len(s), d) for s, d in specs])


# ----------------------------------------------------------------------------- packing
@pytest.mark.parametrize("num_ranks", [1, 3, 8])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("count_dtype", [np.int32, np.int64])
def test_pack_equals_reference(num_ranks, dtype, count_dtype):
    rng = np.random.default_rng(num_ranks)
    keys, splits = random_keys(rng, dtype, 4000, num_segments=5)
    segment_table = np.array([2, 0, 3, 0, 1], np.int64)  # features sharing a table
    uniq, srt, unique_segs = sorted_inputs(keys, splits, num_ranks)
    counts = uniq.counts.numpy().astype(count_dtype)
    if count_dtype == np.int64:  # the limit and large counts (summed across a node)
        counts[:3] = [MAX_COUNT, MAX_COUNT - 1, 1 << 40]
    got = ops.pack_key_messages(srt.sorted_keys, srt.sorted_segment_ids, srt.indices, counts,
                                segment_table)
    want = pack_reference(uniq.unique_keys.numpy(), unique_segs, counts, segment_table,
                          srt.indices.numpy())
    assert got.dtype == tf.int64 and got.shape == (len(want), 2)
    np.testing.assert_array_equal(got.numpy(), want)


def test_pack_in_a_function_with_unknown_lengths():
    rng = np.random.default_rng(5)
    keys, splits = random_keys(rng, np.int64, 500, num_segments=3)
    uniq, srt, unique_segs = sorted_inputs(keys, splits, 2)
    f = function(ops.pack_key_messages, ([0], tf.int64), ([0], tf.int32), ([0], tf.int32),
                 ([0], tf.int32), ([0], tf.int64))
    graph = f.get_concrete_function().graph
    assert graph.outputs[0].shape.as_list() == [None, 2]
    got = f(srt.sorted_keys, srt.sorted_segment_ids, srt.indices, uniq.counts, [1, 0, 2])
    np.testing.assert_array_equal(got.numpy(), pack_reference(
        uniq.unique_keys.numpy(), unique_segs, uniq.counts.numpy(), [1, 0, 2], srt.indices.numpy()))


def test_pack_static_shape():
    @tf.function
    def f():
        return ops.pack_key_messages(tf.zeros([7], tf.int64), tf.zeros([7], tf.int32),
                                     tf.range(7), tf.ones([7], tf.int32), [0])
    assert f.get_concrete_function().graph.outputs[0].shape.as_list() == [7, 2]


@pytest.mark.parametrize("num_segments", [0, 2])
def test_pack_empty(num_segments):
    empty = np.array([], np.int64)
    got = ops.pack_key_messages(empty, empty.astype(np.int32), empty.astype(np.int32),
                                empty.astype(np.int32), np.zeros([num_segments], np.int64))
    assert got.shape == (0, 2) and got.dtype == tf.int64


def test_pack_then_unpack_round_trips():
    rng = np.random.default_rng(9)
    keys, splits = random_keys(rng, np.int64, 1000, num_segments=4)
    uniq, srt, _ = sorted_inputs(keys, splits, 4)
    table = np.array([65534, 0, 7, 1], np.int64)  # the largest table a message holds
    counts = rng.integers(0, MAX_COUNT, len(uniq.counts), endpoint=True)
    got = ops.unpack_key_messages(ops.pack_key_messages(
        srt.sorted_keys, srt.sorted_segment_ids, srt.indices, counts, table))
    inv = np.argsort(srt.indices.numpy())  # sorted position -> unique index
    np.testing.assert_array_equal(got.ids.numpy(), srt.sorted_keys.numpy())
    np.testing.assert_array_equal(got.counts.numpy(), counts[inv])
    np.testing.assert_array_equal(got.tables.numpy(), table[srt.sorted_segment_ids.numpy()])
    assert (got.ids.dtype, got.counts.dtype, got.tables.dtype) == (tf.int64, tf.int64, tf.int32)


def pack_args(n=3, **changes):
    args = dict(sorted_keys=np.arange(n, dtype=np.int64),
                sorted_segment_ids=np.zeros(n, np.int32),
                indices=np.arange(n, dtype=np.int32)[::-1].copy(), counts=np.ones(n, np.int32),
                segment_table=np.array([4], np.int64))
    args.update(changes)
    return args


@pytest.mark.parametrize("changes,words", [
    (dict(counts=np.array([1, MAX_COUNT + 1, 1], np.int64)), "counts[1] = 140737488355328"),
    (dict(counts=np.array([1, 1, -1], np.int64)), "counts[2] = -1"),
    (dict(counts=np.array([1, -5, 1], np.int32)), "counts[1] = -5"),
    (dict(segment_table=np.array([BAD_INPUT], np.int64)), "segment_table[0] = 65535"),
    (dict(segment_table=np.array([-1], np.int64)), "segment_table[0] = -1"),
    (dict(sorted_segment_ids=np.array([0, 1, 0], np.int32)), "sorted_segment_ids[1] = 1"),
    (dict(sorted_segment_ids=np.array([0, 0, -2], np.int32)), "sorted_segment_ids[2] = -2"),
    (dict(indices=np.array([0, 3, 1], np.int32)), "indices[1] = 3 is out of range"),
    (dict(indices=np.array([0, -1, 1], np.int32)), "indices[1] = -1 is out of range"),
    (dict(indices=np.array([2, 0, 2], np.int32)), "indices[2] = 2 repeats"),
    (dict(counts=np.ones(2, np.int32)), "counts has 2 elements but sorted_keys has 3"),
    (dict(indices=np.arange(4, dtype=np.int32)), "indices has 4 elements"),
    (dict(sorted_segment_ids=np.zeros(1, np.int32)), "sorted_segment_ids has 1 elements"),
])
@pytest.mark.parametrize("fn_mode", ["eager", "function"])
def test_pack_rejects_bad_arguments(changes, words, fn_mode):
    args = pack_args(**changes)
    f = ops.pack_key_messages
    if fn_mode == "function":
        f = function(f, *[(v.shape, tf.as_dtype(v.dtype)) for v in args.values()])
    with pytest.raises(tf.errors.InvalidArgumentError, match=re.escape(words)):
        f(*args.values())


def test_pack_shape_function_names_mismatched_lengths():
    with pytest.raises(ERRORS, match="sorted_keys and counts must have the same length"):
        tf.function(lambda: ops.pack_key_messages(
            tf.zeros([3], tf.int64), tf.zeros([3], tf.int32), tf.range(3),
            tf.ones([2], tf.int32), [0])).get_concrete_function()


def test_pack_rejects_non_integer_arguments():
    with pytest.raises(ERRORS, match="counts"):
        ops.pack_key_messages(**pack_args(counts=np.ones(3, np.float32)))


# ----------------------------------------------------------------------------- unpacking
@pytest.mark.parametrize("fn_mode", ["eager", "function"])
def test_unpack_equals_reference(fn_mode):
    rng = np.random.default_rng(3)
    messages = rng.integers(I64.min, I64.max, [3000, 2], endpoint=True)
    messages[:6, 1] = [I64.min, I64.max, -1, 0, (MAX_COUNT << CATEGORY_BITS) | 65534,
                       (5 << 32) | (3 << CATEGORY_BITS) | BAD_INPUT]
    f = ops.unpack_key_messages
    if fn_mode == "function":
        f = function(f, ([0, 0], tf.int64))
    got = f(messages)
    for g, w, name in zip(got, unpack_reference(messages), got._fields):
        assert g.dtype.as_numpy_dtype == w.dtype, name
        np.testing.assert_array_equal(g.numpy(), w, err_msg=name)


def test_unpack_empty_and_shapes():
    got = ops.unpack_key_messages(np.zeros([0, 2], np.int64))
    assert [t.shape for t in got] == [(0,)] * 3
    f = tf.function(lambda m: ops.unpack_key_messages(m))
    out = f.get_concrete_function(tf.TensorSpec([5, 2], tf.int64)).graph.outputs
    assert [t.shape.as_list() for t in out] == [[5]] * 3


def test_unpack_rejects_other_shapes():
    with pytest.raises(ERRORS, match=r"messages must have shape \[n, 2\]"):
        ops.unpack_key_messages(np.zeros([4, 3], np.int64))
    with pytest.raises(ERRORS, match=r"messages must have shape \[n, 2\]"):
        function(ops.unpack_key_messages, ([0], tf.int64))(np.zeros([4], np.int64))
    with pytest.raises(ERRORS, match=r"messages must have shape \[n, 2\]"):
        tf.function(lambda: ops.unpack_key_messages(tf.zeros([4, 3], tf.int64))
                    ).get_concrete_function()


def test_bad_input_report_survives_packing():
    """A report sent instead of packed keys is found (received_report), decoded
    (decode_report) and unpacks with the BAD_INPUT table field."""
    rng = np.random.default_rng(1)
    keys, splits = random_keys(rng, np.int64, 200, num_segments=3)
    uniq, srt, _ = sorted_inputs(keys, splits, 4)
    table = np.array([0, 1, 2], np.int64)
    packed = ops.pack_key_messages(srt.sorted_keys, srt.sorted_segment_ids, srt.indices,
                                   uniq.counts, table)
    assert not bool(exchange.received_report(packed)[0])
    ids = tf.constant(keys)
    invalid = tf.constant(np.arange(len(keys)) == 150)
    report = exchange.input_report(ids, invalid, tf.constant(splits), rank=3)
    sent, sent_splits = exchange.with_report(packed, srt.rank_splits, report)
    np.testing.assert_array_equal(sent_splits.numpy(), [1, 1, 1, 1])
    received = tf.concat([packed[:5], sent[:1], packed[5:]], 0)
    failed, first = exchange.received_report(received)
    rank, feature, bad_id = (int(t) for t in exchange.decode_report(first))
    assert bool(failed) and (rank, bad_id) == (3, keys[150])
    assert feature == int(np.searchsorted(splits, 150, side="right") - 1)
    fields = ops.unpack_key_messages(received)
    assert int(fields.tables[5]) == BAD_INPUT
    assert (fields.tables.numpy() != BAD_INPUT).sum() == len(packed)


# ----------------------------------------------------------------------------- hashed keys
@pytest.mark.parametrize("fn_mode", ["eager", "function"])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("table_dtype", [np.int32, np.int64])
def test_hashed_keys_equal_numpy_mirror(fn_mode, dtype, table_dtype):
    rng = np.random.default_rng(7)
    info = np.iinfo(dtype)
    ids = np.concatenate([[info.min, info.max, -1, 0],
                          rng.integers(info.min, info.max, 20000, endpoint=True)]).astype(dtype)
    tables = rng.integers(0, len(TABLES), len(ids)).astype(table_dtype)
    tags = hashing.category_tags(TABLES)
    f = ops.hashed_unified_keys
    if fn_mode == "function":
        f = function(f, ([0], tf.as_dtype(dtype)), ([0], tf.as_dtype(table_dtype)),
                     ([0], tf.int64))
    got = f(ids, tables, tags).numpy()
    # The mirror takes int64 IDs: int32 IDs sign-extend first (as tf.cast does).
    want = hashing.hashed_unified_keys(ids.astype(np.int64), np.array(TABLES)[tables])
    np.testing.assert_array_equal(got, want)
    # The same key CategoryHash computes on the owner (hashed mode).
    uniq = ops.category_hash(ids[:500], tables[:500].astype(np.int32), TABLES)
    np.testing.assert_array_equal(
        ops.hashed_unified_keys(uniq.lookup_ids, uniq.lookup_segment_ids, tags).numpy(),
        uniq.lookup_keys.numpy())


def test_hashed_keys_of_a_python_int_mix64():
    """One key checked with Python integers only: fmix64(id XOR tag) by hand."""
    def fmix64(x):
        mask = (1 << 64) - 1
        x ^= x >> 33
        x = (x * 0xFF51AFD7ED558CCD) & mask
        x ^= x >> 33
        x = (x * 0xC4CEB9FE1A85EC53) & mask
        return x ^ (x >> 33)
    tag = int(hashing.category_tags(["user_id"]).view(np.uint64)[0])
    for i in [-(1 << 63), -1, 0, 1, (1 << 63) - 1, 123456789012345]:
        got = int(ops.hashed_unified_keys([i], [0], hashing.category_tags(["user_id"]))[0])
        assert got == as_int64([fmix64((i % (1 << 64)) ^ tag)])[0]


def test_hashed_keys_empty():
    got = ops.hashed_unified_keys(np.array([], np.int64), np.array([], np.int32),
                                  hashing.category_tags(TABLES))
    assert got.shape == (0,) and got.dtype == tf.int64
    got = ops.hashed_unified_keys(np.array([], np.int64), np.array([], np.int32),
                                  np.zeros([0], np.int64))  # no tables, no keys: nothing to check
    assert got.shape == (0,)


@pytest.mark.parametrize("tables,words", [
    ([0, 4, 1], "tables[1] = 4 is out of range [0, 4)"),
    ([0, 1, -1], "tables[2] = -1 is out of range"),
    ([9, 1, -1], "tables[0] = 9 is out of range"),  # the first bad one is named
])
@pytest.mark.parametrize("fn_mode", ["eager", "function"])
def test_hashed_keys_reject_a_table_out_of_range(tables, words, fn_mode):
    f = ops.hashed_unified_keys
    if fn_mode == "function":
        f = function(f, ([0], tf.int64), ([0], tf.int32), ([0], tf.int64))
    with pytest.raises(tf.errors.InvalidArgumentError, match=re.escape(words)):
        f(np.array([1, 2, 3], np.int64), np.array(tables, np.int32), hashing.category_tags(TABLES))


def test_hashed_keys_first_bad_table_in_a_large_input():
    """The parallel kernel still reports the FIRST bad index."""
    tables = np.zeros(200000, np.int32)
    tables[[123457, 150000, 199999]] = [7, -3, 99]
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"tables\[123457\] = 7 "):
        ops.hashed_unified_keys(np.arange(len(tables), dtype=np.int64), tables,
                                hashing.category_tags(TABLES))


def test_hashed_keys_reject_mismatched_lengths():
    tags = hashing.category_tags(TABLES)
    with pytest.raises(tf.errors.InvalidArgumentError, match="tables has 2 elements but ids has 3"):
        ops.hashed_unified_keys(np.arange(3), np.zeros(2, np.int32), tags)
    with pytest.raises(ERRORS, match="ids and tables must have the same length"):
        tf.function(lambda: ops.hashed_unified_keys(tf.range(3), tf.zeros([2], tf.int32), tags)
                    ).get_concrete_function()
    with pytest.raises(ERRORS, match="tags must have rank 1"):
        tf.function(lambda: ops.hashed_unified_keys(
            tf.range(3), tf.zeros([3], tf.int32), tf.zeros([2, 2], tf.int64))
        ).get_concrete_function()


def test_routes_use_one_op_each():
    """The exchange's graph holds the kernels, not the chains they replace."""
    ids = np.array([5, 7, 5, 9, 1], np.int64)

    @tf.function
    def route(keys, splits, tags):
        uniq = ops.segment_unique(keys, splits)
        srt = ops.rankwise_sort(uniq.unique_keys, uniq.unique_segment_splits, 2)
        sent = ops.pack_key_messages(srt.sorted_keys, srt.sorted_segment_ids, srt.indices,
                                     uniq.counts, tf.constant([1, 0], tf.int64))
        got = ops.unpack_key_messages(sent)
        return ops.hashed_unified_keys(got.ids, got.tables, tags)

    graph = route.get_concrete_function(tf.TensorSpec([None], tf.int64),
                                        tf.TensorSpec([None], tf.int64),
                                        tf.TensorSpec([None], tf.int64)).graph
    types = [op.type for op in graph.get_operations()]
    assert not {"InvertPermutation", "LeftShift", "RightShift", "BitwiseXor", "Pack"} & set(types)
    keys = route(ids, np.array([0, 3, 5]), hashing.category_tags(["a", "b"])).numpy()
    # Table 1 for segment 0 ("b"), table 0 for segment 1 ("a"), in rank-sorted order.
    u, splits, _, _ = np_reference.segment_unique(ids, [0, 3, 5])
    names = np.where(np.repeat([0, 1], np.diff(splits)) == 0, "b", "a")
    assert sorted(keys.tolist()) == sorted(hashing.hashed_unified_keys(u, names).tolist())


def test_the_op_library_defines_the_documented_format():
    """Python reads the layout from the op library (its one definition)."""
    assert category_bits() == CATEGORY_BITS
    assert max_count() == MAX_COUNT
    assert exchange.bad_input() == BAD_INPUT
