"""Hostile input for the custom ops: property tests (hypothesis) against numpy references.

Every case either equals the reference or raises InvalidArgumentError naming the argument;
never a crash, a hang or a silent truncation. Random keys mix dense duplicates, int32/int64
extremes and negative IDs; segments may be empty; rows carry NaN and +-inf. Each op runs
eagerly and in a tf.function with unknown shapes (the kernels' own checks, not Python's).
"""
import numpy as np
import pytest
import tensorflow as tf

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import np_reference  # noqa: E402
from tf_fusedemb import ops  # noqa: E402
from tf_fusedemb.ops import hashing  # noqa: E402

EXAMPLES = settings(max_examples=60)
FEW = settings(max_examples=25)
MAX_RANKS = 1 << 20  # RankwiseSort's bound on num_ranks (custom_ops/rankwise_sort_kernels.cc)
ERRORS = (tf.errors.InvalidArgumentError, ValueError)
CATEGORIES = ["C1", "C2", "user_id", "a/b"]


# ----------------------------------------------------------------------------- strategies
def key_values(dtype):
    info = np.iinfo(dtype)
    return st.one_of(st.integers(-3, 3),  # dense duplicates, negatives, zero
                     st.sampled_from([int(info.min), int(info.min) + 1, int(info.max),
                                      int(info.max) - 1, -1, 0]),
                     st.integers(int(info.min), int(info.max)))


@st.composite
def segmented_keys(draw, max_segments=6, max_len=30):
    """(keys[n] int32|int64, splits int64[M+1]): M >= 0 segments, some empty, some all
    duplicates of one key."""
    dtype = draw(st.sampled_from([np.int32, np.int64]))
    segments = draw(st.lists(st.lists(key_values(dtype), max_size=max_len),
                             max_size=max_segments))
    segments = [[s[0]] * len(s) if s and draw(st.booleans()) else s for s in segments]
    keys = np.array([k for s in segments for k in s], dtype)
    splits = np.cumsum([0] + [len(s) for s in segments]).astype(np.int64)
    return keys, splits


def arbitrary_ints(max_size=8):
    """Any int64 values, for arguments that must be rejected unless they happen to be valid."""
    return st.lists(st.one_of(st.integers(-3, 40), st.integers(-2 ** 63, 2 ** 63 - 1),
                              st.sampled_from([2 ** 31, 2 ** 32, -2 ** 31 - 1, 2 ** 32 + 1])),
                    max_size=max_size)


@st.composite
def corrupted(draw, values, limit):
    """``values`` (int64) with up to two elements replaced by hostile ones: v +- 2^32 (which
    an unchecked int32 cast would turn back into the valid v), -1, ``limit``, int32/int64
    extremes; sometimes an element dropped or added. Often still valid."""
    values = [int(v) for v in values]
    for _ in range(draw(st.integers(0, 2))):
        kind = draw(st.integers(0, 2))
        if kind == 0 and values:
            i = draw(st.integers(0, len(values) - 1))
            v = values[i]
            values[i] = draw(st.sampled_from([v + 2 ** 32, v - 2 ** 32, v + 2 ** 33, -1, limit,
                                              2 ** 31, -2 ** 31 - 1, 2 ** 63 - 1, -2 ** 63]))
        elif kind == 1 and values:
            del values[draw(st.integers(0, len(values) - 1))]
        else:
            values.insert(draw(st.integers(0, len(values))), draw(st.integers(-2, limit + 1)))
    return np.array(values, np.int64)


def row_values():
    return st.one_of(st.floats(-100, 100, width=32),
                     st.sampled_from([np.nan, np.inf, -np.inf, 0.0, -0.0]))


@st.composite
def rows_matrix(draw, m, d):
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    values = draw(st.lists(row_values(), min_size=m * d, max_size=m * d))
    return np.array(values, dtype).reshape(m, d)


def graph(fn, *specs):
    return tf.function(fn, input_signature=list(specs), reduce_retracing=True)


_GRAPHS = {}


def cached_graph(key, make_fn, *specs):
    """One traced tf.function per ``key`` (tracing per example would dominate the time)."""
    if key not in _GRAPHS:
        _GRAPHS[key] = graph(make_fn(), *specs)
    return _GRAPHS[key]


def expect_error(call, *names):
    """``call`` must raise an error naming one of ``names``."""
    with pytest.raises(ERRORS) as info:
        call()
    assert any(n in str(info.value) for n in names), (names, str(info.value)[:500])


# ---------------------------------------------------------------------------- SegmentUnique
SU_GRAPH = {dt: graph(ops.segment_unique, tf.TensorSpec([None], dt),
                      tf.TensorSpec([None], tf.int64)) for dt in (tf.int32, tf.int64)}


@EXAMPLES
@given(segmented_keys(), st.booleans())
def test_segment_unique_matches_reference(case, in_graph):
    keys, splits = case
    fn = SU_GRAPH[tf.as_dtype(keys.dtype)] if in_graph else ops.segment_unique
    got = fn(tf.constant(keys), tf.constant(splits))
    want = np_reference.segment_unique(keys, splits)
    for g, w, name in zip(got, want, got._fields):
        np.testing.assert_array_equal(g.numpy(), w, err_msg=name)
    assert got.unique_keys.dtype == keys.dtype  # no narrowing or widening


@EXAMPLES
@given(segmented_keys(), st.data(), st.booleans())
def test_segment_unique_arbitrary_splits_are_reference_or_named_error(case, data, in_graph):
    keys, splits = case
    splits = data.draw(st.one_of(corrupted(splits, len(keys)),
                                 arbitrary_ints().map(lambda v: np.array(v, np.int64))))
    fn = SU_GRAPH[tf.as_dtype(keys.dtype)] if in_graph else ops.segment_unique
    valid = (len(splits) >= 1 and splits[0] == 0 and np.all(np.diff(splits) >= 0)
             and splits[-1] == len(keys))
    if not valid:
        expect_error(lambda: fn(tf.constant(keys), tf.constant(splits)), "segment_splits")
        return
    got = fn(tf.constant(keys), tf.constant(splits))
    for g, w in zip(got, np_reference.segment_unique(keys, splits)):
        np.testing.assert_array_equal(g.numpy(), w)


# ------------------------------------------------------------------ RankwiseSort, OwnerRank
RS_GRAPH = {dt: graph(ops.rankwise_sort, tf.TensorSpec([None], dt), tf.TensorSpec([None], tf.int64),
                      tf.TensorSpec([], tf.int32)) for dt in (tf.int32, tf.int64)}


def rankwise_reference(keys, splits, num_ranks):
    owners = hashing.owner_rank(keys, num_ranks)
    order = np.argsort(owners, kind="stable")
    indices = np.empty(len(keys), np.int32)
    indices[order] = np.arange(len(keys), dtype=np.int32)
    segs = np.repeat(np.arange(len(splits) - 1, dtype=np.int32), np.diff(splits))
    return keys[order], segs[order], np.bincount(owners, minlength=num_ranks), indices


num_ranks_values = st.one_of(st.integers(1, 9), st.sampled_from([1000, MAX_RANKS]))


@EXAMPLES
@given(segmented_keys(), num_ranks_values, st.booleans())
def test_rankwise_sort_and_owner_rank_match_reference(case, num_ranks, in_graph):
    keys, splits = case
    fn = RS_GRAPH[tf.as_dtype(keys.dtype)] if in_graph else ops.rankwise_sort
    got = fn(tf.constant(keys), tf.constant(splits), tf.constant(num_ranks, tf.int32))
    for g, w, name in zip(got, rankwise_reference(keys, splits, num_ranks), got._fields):
        np.testing.assert_array_equal(g.numpy(), w, err_msg=name)
    np.testing.assert_array_equal(ops.owner_rank(keys, num_ranks).numpy(),
                                  hashing.owner_rank(keys, num_ranks))


@FEW
@given(segmented_keys(max_segments=2, max_len=5),
       st.one_of(st.integers(-2 ** 40, 2 ** 40), st.sampled_from(
           [0, -1, MAX_RANKS + 1, 2 ** 31 - 1, 2 ** 31, 2 ** 32 + 2, -2 ** 31])),
       st.booleans())
def test_num_ranks_is_reference_or_named_error(case, num_ranks, in_graph):
    """Regressions: 2^31-1 ranks made RankwiseSort allocate ~24 GB (the process was
    killed); an int64 2^32+2 was silently truncated to 2 ranks."""
    keys, splits = case
    ranks = tf.constant(num_ranks, tf.int64)
    if in_graph:
        sort = cached_graph(("rs64", keys.dtype), lambda: ops.rankwise_sort,
                            tf.TensorSpec([None], keys.dtype), tf.TensorSpec([None], tf.int64),
                            tf.TensorSpec([], tf.int64))
    else:
        sort = ops.rankwise_sort
    if not 1 <= num_ranks <= MAX_RANKS:
        expect_error(lambda: sort(tf.constant(keys), tf.constant(splits), ranks), "num_ranks")
        if num_ranks > 2 ** 31 - 1 or num_ranks <= 0:
            expect_error(lambda: ops.owner_rank(keys, ranks), "num_ranks")
        return
    got = sort(tf.constant(keys), tf.constant(splits), ranks)
    np.testing.assert_array_equal(got.rank_splits.numpy(),
                                  rankwise_reference(keys, splits, num_ranks)[2])


# ----------------------------------------------------------------------------- CategoryHash
def category_hash_reference(ids, segs, categories, mode, id_bits=None):
    """Dict unique of the unified keys, and the colliding (category, id) pairs."""
    names = np.array(categories, object)[segs] if len(segs) else []
    if mode == "hashed":
        keys = hashing.hashed_unified_keys(ids, list(names))
    else:
        keys = hashing.packed_unified_keys(ids, segs, len(categories), id_bits)
    pos, first, out = {}, [], ([], [], [], [], [])
    colliders = set()
    for k, i, s in zip(keys.tolist(), np.asarray(ids).tolist(), np.asarray(segs).tolist()):
        if k not in pos:
            pos[k] = len(out[0])
            first.append((s, i))
            for part, v in zip(out[:3] + (out[4],), (k, i, s, 0)):
                part.append(v)
        elif first[pos[k]] != (s, i):
            colliders.add((s, i))
        out[4][pos[k]] += 1
        out[3].append(pos[k])
    return out, len(colliders)


@st.composite
def category_case(draw, packed=False):
    m = draw(st.integers(1, len(CATEGORIES)))
    categories = CATEGORIES[:m]
    dtype = draw(st.sampled_from([np.int32, np.int64]))
    if packed:
        category_bits = int(m - 1).bit_length()
        id_bits = draw(st.one_of(st.none(), st.integers(1, 63 - category_bits)))
        bits = 63 - category_bits if id_bits is None else id_bits
        top = min((1 << bits) - 1, int(np.iinfo(dtype).max))
        values = st.one_of(st.integers(0, 3), st.just(top), st.integers(0, top))
    else:
        id_bits, values = None, key_values(dtype)
    pairs = draw(st.lists(st.tuples(st.integers(0, m - 1), values), max_size=40))
    if not packed and m > 1 and dtype == np.int64:
        # Crafted collisions: the partner of (a, x) in category b has the same hashed key.
        for s, x in draw(st.lists(st.sampled_from(pairs), max_size=6)) if pairs else []:
            other = (s + 1) % m
            pairs.append((other, ops.collision_partner(x, categories[s], categories[other])))
        pairs = draw(st.permutations(pairs))
    ids = np.array([x for _, x in pairs], dtype)
    segs = np.array([s for s, _ in pairs], np.int32)
    return ids, segs, categories, id_bits


def category_hash_fn(categories, mode, id_bits, in_graph, dtype, seg_dtype=tf.int32):
    def fn(i, s):
        return ops.category_hash(i, s, categories, mode=mode, id_bits=id_bits)
    if not in_graph:
        return fn
    return cached_graph(("ch", tuple(categories), mode, id_bits, dtype, seg_dtype), lambda: fn,
                        tf.TensorSpec([None], dtype), tf.TensorSpec([None], seg_dtype))


def check_category_hash(got, want):
    (keys, lids, lsegs, inverse, counts), collisions = want
    np.testing.assert_array_equal(got.lookup_keys.numpy(), np.array(keys, np.int64))
    np.testing.assert_array_equal(got.lookup_ids.numpy(), lids)
    np.testing.assert_array_equal(got.lookup_segment_ids.numpy(), lsegs)
    np.testing.assert_array_equal(got.inverse.numpy(), inverse)
    np.testing.assert_array_equal(got.counts.numpy(), counts)
    assert int(got.num_collisions) == collisions


@EXAMPLES
@given(category_case(), st.booleans())
def test_category_hash_hashed_matches_reference(case, in_graph):
    ids, segs, categories, _ = case
    fn = category_hash_fn(categories, "hashed", None, in_graph, tf.as_dtype(ids.dtype))
    got = fn(tf.constant(ids), tf.constant(segs))
    check_category_hash(got, category_hash_reference(ids, segs, categories, "hashed"))


@EXAMPLES
@given(category_case(packed=True), st.booleans())
def test_category_hash_packed_matches_reference(case, in_graph):
    ids, segs, categories, id_bits = case
    fn = category_hash_fn(categories, "packed", id_bits, in_graph, tf.as_dtype(ids.dtype))
    got = fn(tf.constant(ids), tf.constant(segs))
    check_category_hash(got, category_hash_reference(ids, segs, categories, "packed", id_bits))
    assert int(got.num_collisions) == 0  # packed keys are exact


@FEW
@given(category_case(), st.integers(1, 62), st.sampled_from([-1, -2 ** 63, 2 ** 62, 2 ** 63 - 1]),
       st.booleans())
def test_category_hash_packed_ids_that_do_not_fit_name_the_category(case, id_bits, bad, in_graph):
    _, segs, categories, _ = case
    ids = np.concatenate([np.arange(len(segs)), [bad]]).astype(np.int64)
    segs = np.concatenate([segs, [len(categories) - 1]]).astype(np.int32)
    id_bits = min(id_bits, 63 - int(len(categories) - 1).bit_length())
    if 0 <= bad < (1 << id_bits):  # fits after all
        return
    fn = category_hash_fn(categories, "packed", id_bits, in_graph, tf.int64)
    expect_error(lambda: fn(tf.constant(ids), tf.constant(segs)),
                 f"of category '{categories[-1]}' is outside [0, 2^{id_bits})")


@EXAMPLES
@given(category_case(), st.data(), st.booleans())
def test_category_hash_segment_ids_are_reference_or_named_error(case, data, in_graph):
    """Regression: int64 segment ids were silently truncated to int32 (2^32 -> 0)."""
    ids, segs, categories, _ = case
    m = len(categories)
    segs = data.draw(corrupted(segs, m))
    n = min(len(ids), len(segs))
    ids, segs = ids[:n].astype(np.int64), segs[:n]
    # In the graph, the wrapper's int64 -> int32 check of segment_ids runs as an assert.
    run = category_hash_fn(CATEGORIES[:m], "hashed", None, in_graph, tf.int64, tf.int64)
    if n and (segs.min() < 0 or segs.max() >= m):
        expect_error(lambda: run(tf.constant(ids), tf.constant(segs)), "segment_ids")
        return
    got = run(tf.constant(ids), tf.constant(segs))
    check_category_hash(got, category_hash_reference(ids, segs.astype(np.int32),
                                                     CATEGORIES[:m], "hashed"))


def test_category_hash_many_crafted_collisions_stay_linear():
    """Regression: colliding pairs were deduplicated by a linear scan per pair, so n
    crafted collisions (x of a, x ^ tag(a) ^ tag(b) of b) took O(n^2); 40k took 1.1 s,
    400k would take minutes. Now a hash set: exact count, well under a second."""
    k = 200_000
    delta = np.uint64(hashing.category_tag("a") ^ hashing.category_tag("b"))
    x = np.arange(k, dtype=np.int64)
    ids = np.concatenate([x, (x.view(np.uint64) ^ delta).view(np.int64), x])
    segs = np.repeat(np.array([0, 1, 0], np.int32), k)
    got = ops.category_hash(ids, segs, ["a", "b"])
    assert int(got.num_collisions) == k and got.lookup_keys.shape == (k,)
    np.testing.assert_array_equal(got.counts.numpy(), np.full(k, 3))


@pytest.mark.parametrize("kwargs,message", [
    ({"mode": "packed", "id_bits": 2 ** 31 - 1}, "id_bits = 2147483647 must lie in [1, 62]"),
    ({"mode": "packed", "id_bits": 0}, "id_bits = 0 must lie in [1, 62]"),
    ({"mode": "packed", "id_bits": 2 ** 40}, "id_bits"),
    ({"mode": "hashed", "id_bits": 3}, "id_bits is only meaningful"),
    ({"mode": "bits"}, "mode must be one of"),
])
def test_category_hash_bad_attributes_name_them(kwargs, message):
    """Regression: id_bits + category_bits overflowed int for id_bits near 2^31 (UB)."""
    expect_error(lambda: ops.category_hash([1], [0], ["a", "b"], **kwargs), message)


# ---------------------------------------------------------------------------- Recovery ops
@st.composite
def gather_case(draw):
    m = draw(st.integers(0, 6))
    d = draw(st.integers(0, 4))
    rows = draw(rows_matrix(m, d))
    u = draw(st.integers(0, 6)) if m else 0
    sort = np.array(draw(st.lists(st.integers(0, m - 1), min_size=u, max_size=u)) if m else [],
                    np.int32)
    n = draw(st.integers(0, 12)) if u else 0
    inverse = np.array(draw(st.lists(st.integers(0, u - 1), min_size=n, max_size=n)) if u else [],
                       np.int32)
    return rows, sort, inverse


RG_GRAPH = {dt: graph(ops.recovery_gather, tf.TensorSpec([None, None], dt),
                      tf.TensorSpec([None], tf.int32), tf.TensorSpec([None], tf.int32))
            for dt in (tf.float32, tf.float64)}


@EXAMPLES
@given(gather_case(), st.booleans())
def test_recovery_gather_and_gradient_match_reference(case, in_graph):
    rows, sort, inverse = case
    fn = RG_GRAPH[tf.as_dtype(rows.dtype)] if in_graph else ops.recovery_gather
    x = tf.constant(rows)
    upstream = np.random.default_rng(len(inverse)).standard_normal(
        (len(inverse), rows.shape[1])).astype(rows.dtype)
    with tf.GradientTape() as tape:
        tape.watch(x)
        out, rec = fn(x, tf.constant(sort), tf.constant(inverse))
        loss = tf.reduce_sum(out * upstream)
    want_rec = sort[inverse] if len(inverse) else np.zeros(0, np.int32)
    np.testing.assert_array_equal(rec.numpy(), want_rec)
    np.testing.assert_array_equal(out.numpy(), rows[want_rec])  # NaN == NaN here
    want_grad = np.zeros_like(rows)
    np.add.at(want_grad, want_rec, upstream)
    np.testing.assert_allclose(tape.gradient(loss, x).numpy(), want_grad, rtol=1e-5, atol=1e-5)


@EXAMPLES
@given(gather_case(), st.data(), st.booleans())
def test_recovery_gather_indices_are_reference_or_named_error(case, data, in_graph):
    """Regression: int64 indices were silently truncated to int32 (2^32 + i -> row i)."""
    rows, sort, inverse = case
    if data.draw(st.booleans()):  # one argument at a time, so the other stays valid
        sort = data.draw(corrupted(sort, len(rows)))
    else:
        inverse = data.draw(corrupted(inverse, len(sort)))
    sort, inverse = sort.astype(np.int64), inverse.astype(np.int64)
    fn = ops.recovery_gather
    if in_graph:
        fn = cached_graph(("rg64", rows.dtype), lambda: ops.recovery_gather,
                          tf.TensorSpec([None, None], rows.dtype),
                          tf.TensorSpec([None], tf.int64), tf.TensorSpec([None], tf.int64))
    call = lambda: fn(tf.constant(rows), tf.constant(sort), tf.constant(inverse))  # noqa: E731
    problems = []  # several bad arguments: the error names one of them
    if len(sort) and (sort.min() < 0 or sort.max() >= len(rows)):
        problems.append("sort_indices")
    if len(inverse) and (inverse.min() < 0 or inverse.max() >= len(sort)):
        problems.append("unique_inverse")
    if problems:
        expect_error(call, *problems)
    else:
        out, _ = call()
        np.testing.assert_array_equal(out.numpy(), rows[sort[inverse]])


@st.composite
def pool_case(draw):
    m = draw(st.integers(0, 6))
    d = draw(st.integers(0, 4))
    rows = draw(rows_matrix(m, d))
    num_features = draw(st.integers(1, 3))
    combiners = draw(st.lists(st.sampled_from(["sum", "mean", "sqrtn"]),
                              min_size=num_features, max_size=num_features))
    lengths = [draw(st.lists(st.integers(0, 4 if m else 0), max_size=4))
               for _ in range(num_features)]
    pool_lengths = [n for f in lengths for n in f]
    pool_splits = np.cumsum([0] + pool_lengths).astype(np.int64)
    feature_splits = np.cumsum([0] + [len(f) for f in lengths]).astype(np.int64)
    n = int(pool_splits[-1])
    rec = np.array(draw(st.lists(st.integers(0, m - 1), min_size=n, max_size=n)) if m else [],
                   np.int32)
    return rows, rec, pool_splits, feature_splits, combiners


def pool_fn(combiners, dtype, index_dtype, in_graph):
    def pool(r, i, s, f):
        return ops.recovery_pool(r, i, s, f, combiners)
    if not in_graph:
        return pool
    return cached_graph(("rp", tuple(combiners), dtype, index_dtype), lambda: pool,
                        tf.TensorSpec([None, None], dtype), tf.TensorSpec([None], index_dtype),
                        tf.TensorSpec([None], tf.int64), tf.TensorSpec([None], tf.int64))


def pool_grad_reference(upstream, rec, pool_splits, feature_splits, combiners, m):
    out = np.zeros((m, upstream.shape[1]), upstream.dtype)
    for f, comb in enumerate(combiners):
        for p in range(feature_splits[f], feature_splits[f + 1]):
            idx = rec[pool_splits[p]:pool_splits[p + 1]]
            w = {"sum": 1.0, "mean": 1.0 / max(len(idx), 1),
                 "sqrtn": 1.0 / np.sqrt(max(len(idx), 1))}[comb]
            np.add.at(out, idx, w * upstream[p])
    return out


@EXAMPLES
@given(pool_case(), st.booleans())
def test_recovery_pool_and_gradient_match_reference(case, in_graph):
    rows, rec, pool_splits, feature_splits, combiners = case
    pool = pool_fn(combiners, rows.dtype, tf.int32, in_graph)
    x = tf.constant(rows)
    upstream = np.random.default_rng(len(rec)).standard_normal(
        (len(pool_splits) - 1, rows.shape[1])).astype(rows.dtype)
    with tf.GradientTape() as tape:
        tape.watch(x)
        out = pool(x, tf.constant(rec), tf.constant(pool_splits), tf.constant(feature_splits))
        loss = tf.reduce_sum(out * upstream)
    want = np_reference.pool(rows, rec, pool_splits, feature_splits, combiners)
    tol = 1e-3 if rows.dtype == np.float32 else 1e-9
    np.testing.assert_allclose(out.numpy(), want, rtol=tol, atol=tol)  # NaN/inf where they are
    np.testing.assert_allclose(
        tape.gradient(loss, x).numpy(),
        pool_grad_reference(upstream, rec, pool_splits, feature_splits, combiners, len(rows)),
        rtol=1e-5, atol=1e-5)


@EXAMPLES
@given(pool_case(), st.data(), st.booleans())
def test_recovery_pool_arguments_are_reference_or_named_error(case, data, in_graph):
    rows, rec, splits, fsplits, combiners = case
    which = data.draw(st.integers(0, 2))  # one argument at a time, so the rest stays valid
    rec = data.draw(corrupted(rec, len(rows))) if which == 0 else rec.astype(np.int64)
    splits = data.draw(corrupted(splits, len(rec))) if which == 1 else splits
    fsplits = data.draw(corrupted(fsplits, len(splits) - 1)) if which == 2 else fsplits
    pool = pool_fn(combiners, rows.dtype, tf.int64, in_graph)
    call = lambda: pool(tf.constant(rows), tf.constant(rec), tf.constant(splits),  # noqa: E731
                        tf.constant(fsplits))

    def valid_splits(s, total):
        return len(s) >= 1 and s[0] == 0 and np.all(np.diff(s) >= 0) and s[-1] == total
    problems = []  # the kernel checks in its own order: the error names one of them
    if len(rec) and (rec.min() < 0 or rec.max() >= len(rows)):
        problems.append("recover_indices")
    if not valid_splits(splits, len(rec)):
        problems.append("pool_splits")
    elif not valid_splits(fsplits, len(splits) - 1):
        problems.append("feature_pool_splits")
    elif len(fsplits) - 1 != len(combiners):
        problems.append("combiners")
    if problems:
        expect_error(call, *problems)
    else:
        np.testing.assert_allclose(call().numpy(),
                                   np_reference.pool(rows, rec, splits, fsplits, combiners),
                                   rtol=1e-3, atol=1e-3)


@FEW
@given(pool_case())
def test_recover_features_matches_reference(case):
    """The layer's composite: per-feature pooling or one row per key (combiner None)."""
    rows, rec, pool_splits, feature_splits, combiners = case
    combiners = [None if c == "sum" else c for c in combiners]
    n_u = len(rows)
    sort = np.arange(n_u, dtype=np.int32)  # identity I_s: rec is then I_u
    row_splits = [pool_splits[feature_splits[f]:feature_splits[f + 1] + 1]
                  - pool_splits[feature_splits[f]] for f in range(len(combiners))]
    got = ops.recover_features(tf.constant(rows), sort, rec, row_splits, combiners)
    for f, (g, comb) in enumerate(zip(got, combiners)):
        lo, hi = pool_splits[feature_splits[f]], pool_splits[feature_splits[f + 1]]
        if comb is None:
            want = rows[rec[lo:hi]]
        else:
            want = np_reference.pool(rows, rec, row_splits[f] + lo,
                                     np.array([0, len(row_splits[f]) - 1]), [comb])
        np.testing.assert_allclose(g.numpy(), want.reshape(g.shape), rtol=1e-3, atol=1e-3)


# ------------------------------------------------------- wrong dtypes and ranks, every op
def all_op_calls():
    """(label, call, argument name) for bad dtypes and ranks of every op argument."""
    k, s = tf.constant([1, 2], tf.int64), tf.constant([0, 2], tf.int64)
    r = tf.ones([3, 2])
    i = tf.constant([0, 1], tf.int32)
    cases = []
    for bad, what in [(tf.constant([1.0, 2.0]), "float"), (tf.constant(["a", "b"]), "string"),
                      (tf.constant([True, False]), "bool")]:
        cases += [
            (f"segment_unique keys {what}", lambda b=bad: ops.segment_unique(b, s), "keys"),
            (f"segment_unique splits {what}", lambda b=bad: ops.segment_unique(k, b),
             "segment_splits"),
            (f"rankwise_sort keys {what}", lambda b=bad: ops.rankwise_sort(b, s, 2), "keys"),
            (f"owner_rank keys {what}", lambda b=bad: ops.owner_rank(b, 2), "keys"),
            (f"category_hash ids {what}", lambda b=bad: ops.category_hash(b, i, ["a"]), "ids"),
            (f"category_hash segs {what}", lambda b=bad: ops.category_hash(k, b, ["a"]),
             "segment_ids"),
            (f"gather sort {what}", lambda b=bad: ops.recovery_gather(r, b, i), "sort_indices"),
            (f"gather inverse {what}", lambda b=bad: ops.recovery_gather(r, i, b),
             "unique_inverse"),
            (f"pool rec {what}", lambda b=bad: ops.recovery_pool(r, b, s, [0, 1], ["sum"]),
             "recover_indices"),
        ]
    cases += [
        ("rankwise_sort num_ranks float", lambda: ops.rankwise_sort(k, s, 2.0), "num_ranks"),
        ("gather rows int", lambda: ops.recovery_gather(tf.ones([3, 2], tf.int32), i, i), "rows"),
        ("gather rows float16", lambda: ops.recovery_gather(tf.ones([3, 2], tf.float16), i, i),
         "rows"),
        ("pool rows string", lambda: ops.recovery_pool(tf.constant([["a"]]), i, s, [0, 1],
                                                       ["sum"]), "rows"),
        ("keys uint64", lambda: ops.segment_unique(tf.constant([1, 2], tf.uint64), s), "keys"),
        ("splits uint64 2^63", lambda: ops.segment_unique(k, tf.constant([0, 2 ** 63], tf.uint64)),
         "segment_splits"),
        # ranks
        ("segment_unique keys 2-D", lambda: ops.segment_unique(tf.reshape(k, [1, 2]), s), "keys"),
        ("segment_unique splits 0-D", lambda: ops.segment_unique(k, tf.constant(0, tf.int64)),
         "segment_splits"),
        ("segment_unique splits empty", lambda: ops.segment_unique(k, tf.zeros([0], tf.int64)),
         "segment_splits"),
        ("rankwise_sort num_ranks 1-D", lambda: ops.rankwise_sort(k, s, [2]), "num_ranks"),
        ("category_hash lengths", lambda: ops.category_hash(k, [0], ["a"]), "segment_ids"),
        ("category_hash ids 2-D", lambda: ops.category_hash(tf.reshape(k, [2, 1]), [0, 0], ["a"]),
         "ids"),
        ("gather rows 1-D", lambda: ops.recovery_gather(tf.ones([3]), i, i), "rows"),
        ("gather rows 3-D", lambda: ops.recovery_gather(tf.ones([3, 1, 1]), i, i), "rows"),
        ("pool splits 2-D", lambda: ops.recovery_pool(r, i, [[0, 2]], [0, 1], ["sum"]),
         "pool_splits"),
        ("pool combiner", lambda: ops.recovery_pool(r, i, s, [0, 1], ["max"]), "combiners"),
        ("pool combiners count", lambda: ops.recovery_pool(r, i, s, [0, 1], ["sum", "mean"]),
         "combiners"),
    ]
    return cases


OP_CALLS = all_op_calls()


@pytest.mark.parametrize("label,call,arg", OP_CALLS, ids=[c[0] for c in OP_CALLS])
@pytest.mark.parametrize("in_graph", [False, True])
def test_wrong_dtype_or_rank_names_the_argument(label, call, arg, in_graph):
    del label
    expect_error(tf.function(call) if in_graph else call, arg)


def test_recovery_pool_grad_checks_its_inputs():
    grad = tf.ones([1, 2])
    pool_grad = ops._loader.raw_op("RecoveryPoolGrad")  # pylint: disable=protected-access
    rec, splits, fsplits = tf.constant([0]), tf.constant([0, 1], tf.int64), tf.constant([0, 1],
                                                                                         tf.int64)
    expect_error(lambda: pool_grad(grad, rec, splits, fsplits, -1, combiners=["sum"]), "num_rows")
    expect_error(lambda: pool_grad(grad, rec, splits, fsplits, 0, combiners=["sum"]),
                 "recover_indices")
    expect_error(lambda: pool_grad(tf.ones([2, 2]), rec, splits, fsplits, 1, combiners=["sum"]),
                 "grad has 2 rows")
    expect_error(lambda: pool_grad(tf.ones([2]), rec, splits, fsplits, 1, combiners=["sum"]),
                 "grad")
    np.testing.assert_array_equal(pool_grad(grad, rec, splits, fsplits, 3,
                                            combiners=["mean"]).numpy(),
                                  [[1, 1], [0, 0], [0, 0]])


def int64_truncation_calls():
    """Calls whose int32 argument is given as int64 v + 2^32: an unchecked cast reads v."""
    rows, s2 = tf.ones([3, 2]), tf.constant([0, 1], tf.int64)
    big = tf.constant([2 ** 32], tf.int64)
    k = tf.constant([5], tf.int64)
    return [
        ("num_ranks", lambda b: ops.rankwise_sort(k, [0, 1], b[0] + 2)),
        ("num_ranks", lambda b: ops.owner_rank(k, b[0] + 2)),
        ("segment_ids", lambda b: ops.category_hash(k, b, ["a"])),
        ("sort_indices", lambda b: ops.recovery_gather(rows, b, [0])),
        ("unique_inverse", lambda b: ops.recovery_gather(rows, [0], b)),
        ("recover_indices", lambda b: ops.recovery_pool(rows, b, s2, s2, ["sum"])),
    ], big


@pytest.mark.parametrize("index", range(6))
@pytest.mark.parametrize("in_graph", [False, True])
def test_int64_beyond_int32_is_an_error_not_a_truncation(index, in_graph):
    """Regression: the wrappers cast int64 to int32 unchecked, so 2^32 + v silently meant v
    (rows of the wrong key, 2^32 + 2 ranks meaning 2)."""
    calls, big = int64_truncation_calls()
    arg, call = calls[index]
    fn = tf.function(call, input_signature=[tf.TensorSpec([None], tf.int64)]) if in_graph else call
    expect_error(lambda: fn(big), arg)
