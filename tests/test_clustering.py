"""Key-centric sample clustering (tf_fusedemb.pipeline.clustering): counts, permutations, gains
and the tf.data transform.

Reduction thresholds (of the summed per-micro-batch unique keys) sit below the measured values
with margin. Measured at N=2/4/8 (2026-11, diffusion bisection + swap refinement): synthetic
Criteo-like (seeds 11, 12) 4096 rows 7.2-7.3 / 11.1-11.2 / 12.3-12.5%, 1024 rows at N=4
8.3-8.4%; first 4096 rows of the real Kaggle sample 11.4 / 21.8 / 28.3% (the previous,
bisection-only version: 5.7-5.9 / 8.4-8.5 / 9.2-9.3%, 6.3-6.5%, 9.8 / 17.3 / 22.3%). The
synthetic features are independent of each other, so there is little to gain; the real rows
are correlated, hence the larger gains (issue 10 asks for >= 20% on them at N=4).
"""
import os
from pathlib import Path

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from tf_fusedemb.data.synthetic import generate_criteo_like  # noqa: E402
from tf_fusedemb.pipeline import clustering  # noqa: E402
from tf_fusedemb.pipeline.clustered_dataset import cluster_dataset  # noqa: E402
from tf_fusedemb.pipeline.clustering import (cluster_permutation,  # noqa: E402
                                             micro_batch_bounds, unique_keys_per_micro_batch)

CATEGORICAL = [f"C{i}" for i in range(1, 27)]
CRITEO_TRAIN = (Path(__file__).resolve().parents[1].parent / "shared" / "data"
                / "criteo-kaggle-sample" / "train.txt")


@pytest.fixture(scope="module")
def criteo_like():
    """{"C1".."C26": int64[4096]} for two seeds."""
    return {seed: generate_criteo_like(4096, seed=seed, batch_ids_only=True) for seed in (11, 12)}


def _reference_counts(features, n):
    """Brute force: a Python set of (feature, id) per micro-batch."""
    b = len(next(iter(features.values())))
    out = []
    for i in range(n):
        keys = set()
        for row in range(i * b // n, (i + 1) * b // n):
            for name, values in features.items():
                ids = values[row]
                for v in np.atleast_1d(np.asarray(ids)).tolist():
                    keys.add((name, v))
        out.append(len(keys))
    return out


def _permuted(values, perm):
    return [values[i] for i in perm] if isinstance(values, list) else np.asarray(values)[perm]


def _reduction(features, n):
    """1 - (summed unique keys of the clustered batch) / (summed unique keys of the batch)."""
    perm = cluster_permutation(features, n)
    before = unique_keys_per_micro_batch(features, n).sum()
    after = unique_keys_per_micro_batch({k: _permuted(v, perm) for k, v in features.items()},
                                        n).sum()
    return 1.0 - after / before


def _assert_permutation(perm, b):
    assert perm.dtype == np.int64 and perm.shape == (b,)
    np.testing.assert_array_equal(np.sort(perm), np.arange(b))


def test_micro_batch_bounds():
    assert micro_batch_bounds(10, 4) == [(0, 2), (2, 5), (5, 7), (7, 10)]
    assert micro_batch_bounds(4096, 1) == [(0, 4096)]
    assert micro_batch_bounds(2, 4) == [(0, 0), (0, 1), (1, 1), (1, 2)]  # empty ones allowed
    with pytest.raises(ValueError):
        micro_batch_bounds(8, 0)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 40])
def test_unique_keys_match_brute_force(n):
    rng = np.random.default_rng(n)
    b = 37
    features = {
        "dense": rng.integers(0, 6, b),                       # int[B], many repeats
        "wide": rng.integers(0, 2 ** 62, b) // 2 ** 40 * 2 ** 40,  # large ids, some equal
        "pair": rng.integers(0, 4, (b, 2)),                   # int[B, 2]
        # multi-hot: empty lists and an id repeated inside one sample
        "multi": [list(rng.integers(0, 5, rng.integers(0, 4))) for _ in range(b)],
    }
    features["multi"][3] = [2, 2, 2]
    got = unique_keys_per_micro_batch(features, n)
    assert got.dtype == np.int64 and got.shape == (n,)
    np.testing.assert_array_equal(got, _reference_counts(features, n))


def test_unique_keys_rejects_mismatched_batches():
    with pytest.raises(ValueError, match="batch sizes"):
        unique_keys_per_micro_batch({"a": np.arange(4), "b": np.arange(5)}, 2)
    with pytest.raises(ValueError, match="integers"):
        unique_keys_per_micro_batch({"a": np.ones(4, np.float32)}, 2)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_permutation_is_a_deterministic_permutation(criteo_like, n):
    features = {k: v[:1000] for k, v in criteo_like[11].items()}
    perm = cluster_permutation(features, n)
    _assert_permutation(perm, 1000)
    np.testing.assert_array_equal(perm, cluster_permutation(features, n))
    assert not np.array_equal(perm, np.arange(1000))


def test_identity_cases(criteo_like):
    features = criteo_like[11]
    np.testing.assert_array_equal(cluster_permutation(features, 1), np.arange(4096))
    np.testing.assert_array_equal(cluster_permutation({"a": np.array([7])}, 4), [0])
    np.testing.assert_array_equal(cluster_permutation({"a": np.zeros(0, np.int64)}, 4),
                                  np.zeros(0, np.int64))
    # No id shared by two samples: nothing to gain, order kept.
    np.testing.assert_array_equal(cluster_permutation({"a": np.arange(50)}, 4), np.arange(50))
    with pytest.raises(ValueError):
        cluster_permutation(features, 0)


def test_multi_hot_without_ids():
    np.testing.assert_array_equal(cluster_permutation({"a": [[], [], []]}, 2), [0, 1, 2])
    np.testing.assert_array_equal(unique_keys_per_micro_batch({"a": [[], [], []]}, 2), [0, 0])


def test_more_micro_batches_than_samples():
    features = {"a": np.array([1, 2, 1, 2, 3]), "b": [[1], [], [1, 1], [4], [2]]}
    _assert_permutation(cluster_permutation(features, 8), 5)


def test_multi_hot_lists():
    # 4 groups of 8 samples; the samples of a group share a hot id in a multi-hot feature only,
    # interleaved so that the unclustered micro-batches each hold every group.
    b, groups = 32, 4
    group = np.arange(b) % groups
    features = {"tags": [[100 + g, 1000 + r] for r, g in enumerate(group)],
                "empty_sometimes": [[] if r % 3 else [r % 2] for r in range(b)]}
    perm = cluster_permutation(features, groups)
    _assert_permutation(perm, b)
    clustered = group[perm].reshape(groups, b // groups)
    assert all(len(set(mb)) == 1 for mb in clustered)  # each micro-batch is one group
    assert _reduction(features, groups) > 0.2


def test_reduction_on_criteo_like_4096(criteo_like):
    for seed, data in criteo_like.items():
        features = {k: data[k] for k in CATEGORICAL}
        assert _reduction(features, 4) >= 0.095, seed  # measured 11.1-11.2%
        assert _reduction(features, 8) >= 0.105, seed  # 12.3-12.5%
        assert _reduction(features, 2) >= 0.06, seed  # 7.2-7.3%


def test_reduction_on_criteo_like_1024(criteo_like):
    for seed, data in criteo_like.items():
        features = {k: data[k][:1024] for k in CATEGORICAL}
        assert _reduction(features, 4) >= 0.07, seed  # measured 8.3-8.4%


@pytest.fixture(scope="module")
def real_ids():
    """int64[4096, 26]: C1..C26 of the first 4096 lines of the real Kaggle sample (hex ids;
    an empty field is id 0)."""
    if not CRITEO_TRAIN.is_file():
        pytest.skip(f"real Criteo sample not found at {CRITEO_TRAIN}")
    rows = []
    with open(CRITEO_TRAIN) as f:
        for line, _ in zip(f, range(4096)):
            fields = line.rstrip("\n").split("\t")
            rows.append([int(x, 16) if x else 0 for x in fields[14:40]])
    return np.array(rows, np.int64)


def _numpy_unique_keys(ids, n):
    """Summed per-micro-batch unique keys of a batch int[B, F] split into the contiguous
    micro-batches [i*B//N, (i+1)*B//N), counted column by column with np.unique (independent
    of unique_keys_per_micro_batch)."""
    b = len(ids)
    return sum(len(np.unique(ids[i * b // n:(i + 1) * b // n, j]))
               for i in range(n) for j in range(ids.shape[1]))


@pytest.mark.parametrize("n,bound", [(2, 0.10), (4, 0.20), (8, 0.25)])
def test_reduction_on_real_criteo_sample(real_ids, n, bound):
    # Measured 11.4 / 21.8 / 28.3% at N = 2 / 4 / 8 (previous version 9.8 / 17.3 / 22.3%).
    features = {name: real_ids[:, j] for j, name in enumerate(CATEGORICAL)}
    perm = cluster_permutation(features, n)
    _assert_permutation(perm, len(real_ids))
    # Micro-batch i of the clustered batch is rows [i*B//N, (i+1)*B//N) of ids[perm]: here
    # N blocks of exactly B/N samples, each sample in exactly one of them.
    blocks = [perm[lo:hi] for lo, hi in micro_batch_bounds(len(perm), n)]
    assert [len(x) for x in blocks] == [len(real_ids) // n] * n
    before = _numpy_unique_keys(real_ids, n)
    after = _numpy_unique_keys(real_ids[perm], n)
    assert after == unique_keys_per_micro_batch(
        {k: v[perm] for k, v in features.items()}, n).sum()
    assert 1.0 - after / before >= bound


def _objective(rows, kid, num_keys, part, n):
    """Sum over shared keys of the number of micro-batches holding the key."""
    return np.count_nonzero(np.bincount(kid * n + part[rows], minlength=num_keys * n))


@pytest.mark.parametrize("n", [3, 4])
def test_refinement_keeps_sizes_and_lowers_the_objective(real_ids, n):
    # 4001 rows: micro-batch sizes differ by one at N = 3 and 4; start from the batch order.
    ids = real_ids[:4001]
    feats, b = clustering._as_flat_features(
        {name: ids[:, j] for j, name in enumerate(CATEGORICAL)})
    rows, kid, key_count = clustering._shared_key_pins(feats, b, b)
    part = np.repeat(np.arange(n), [hi - lo for lo, hi in micro_batch_bounds(b, n)])
    refined = clustering._refine_swaps(rows, kid, len(key_count), part.copy(), n)
    np.testing.assert_array_equal(np.bincount(refined, minlength=n),
                                  np.bincount(part, minlength=n))
    before = _objective(rows, kid, len(key_count), part, n)
    after = _objective(rows, kid, len(key_count), refined, n)
    assert after < 0.95 * before  # the unordered real rows have much to gain
    # Its objective is exactly the drop of the summed per-micro-batch unique keys.
    perm = np.argsort(refined, kind="stable")
    clustered = unique_keys_per_micro_batch(
        {name: ids[perm, j] for j, name in enumerate(CATEGORICAL)}, n).sum()
    plain = unique_keys_per_micro_batch(
        {name: ids[:, j] for j, name in enumerate(CATEGORICAL)}, n).sum()
    assert plain - clustered == before - after


def test_never_worse_than_unclustered_or_unrefined(monkeypatch):
    """Random small batches (little structure, N up to B): the clustered order never has more
    keys than the batch order, and the refinement never adds keys to the bisection's order."""
    rng = np.random.default_rng(2)
    for trial in range(40):
        b, n = int(rng.integers(2, 200)), int(rng.integers(2, 10))
        features = {"one": rng.integers(0, int(rng.integers(2, 60)), b),
                    "pair": rng.integers(0, int(rng.integers(2, 60)), (b, 2)),
                    "multi": [list(rng.integers(0, 15, rng.integers(0, 4))) for _ in range(b)]}
        perm = cluster_permutation(features, n)
        _assert_permutation(perm, b)
        with monkeypatch.context() as m:
            m.setattr(clustering, "_REFINE_ROUNDS", 0)
            unrefined = cluster_permutation(features, n)
        plain = unique_keys_per_micro_batch(features, n).sum()
        clustered = unique_keys_per_micro_batch(
            {k: _permuted(v, perm) for k, v in features.items()}, n).sum()
        bisected = unique_keys_per_micro_batch(
            {k: _permuted(v, unrefined) for k, v in features.items()}, n).sum()
        assert clustered <= plain, trial
        assert clustered <= bisected, trial


def _batches(num_batches=3, b=512, last=100):
    """(x, y, w) batches of b samples, then one of `last`; x["row"] is a unique sample id, y and w
    are functions of it."""
    out = []
    for i in range(num_batches):
        size = last if i == num_batches - 1 else b
        data = generate_criteo_like(size, seed=100 + i)
        row = np.arange(10000 * i, 10000 * i + size, dtype=np.int64)
        x = {"C1": data["C1"], "C7": data["C7"], "C11": data["C11"].reshape(size, 1),
             "I1": data["I1"], "row": row}
        out.append((x, (row % 7).astype(np.float32).reshape(size, 1),
                    (row * 0.5).astype(np.float32)))
    return out


def _dataset(batches):
    x0, y0, w0 = batches[0]
    spec = ({k: tf.TensorSpec((None,) + v.shape[1:], tf.as_dtype(v.dtype)) for k, v in x0.items()},
            tf.TensorSpec((None, 1), tf.float32), tf.TensorSpec((None,), tf.float32))
    return tf.data.Dataset.from_generator(lambda: iter(batches), output_signature=spec)


def test_cluster_dataset_keeps_samples_and_alignment():
    batches = _batches()
    ds = _dataset(batches)
    out = cluster_dataset(ds, ["C1", "C7", "C11"], 4)
    assert out.element_spec == ds.element_spec
    results = list(out.as_numpy_iterator())
    assert len(results) == len(batches)
    for (x, y, w), (x2, y2, w2) in zip(batches, results):
        # Same samples (a permutation of the rows), each still with its own label and weight.
        perm = cluster_permutation({k: x[k] for k in ("C1", "C7", "C11")}, 4)
        np.testing.assert_array_equal(x2["row"], x["row"][perm])
        for k in x:
            np.testing.assert_array_equal(x2[k], x[k][perm])
        np.testing.assert_array_equal(y2, y[perm])
        np.testing.assert_array_equal(w2, w[perm])
        np.testing.assert_array_equal(np.sort(x2["row"]), x["row"])
        np.testing.assert_array_equal(y2[:, 0], (x2["row"] % 7).astype(np.float32))
        np.testing.assert_array_equal(w2, (x2["row"] * 0.5).astype(np.float32))
        names = ("C1", "C7", "C11")
        assert (unique_keys_per_micro_batch({k: x2[k] for k in names}, 4).sum()
                < unique_keys_per_micro_batch({k: x[k] for k in names}, 4).sum())


def test_cluster_dataset_ragged_feature_and_pairs():
    b = 64
    rng = np.random.default_rng(5)
    tags = [list(rng.integers(0, 12, rng.integers(0, 4))) for _ in range(b)]
    dense = rng.integers(0, 9, b)
    x = {"tags": tf.ragged.constant(tags, dtype=tf.int64, row_splits_dtype=tf.int64),
         "dense": tf.constant(dense, tf.int32), "row": tf.range(b, dtype=tf.int64)}
    y = tf.range(b, dtype=tf.float32)
    ds = tf.data.Dataset.from_tensors((x, y))
    (x2, y2), = list(cluster_dataset(ds, ["tags", "dense"], 4))
    perm = cluster_permutation({"tags": tags, "dense": dense}, 4)
    np.testing.assert_array_equal(x2["row"].numpy(), perm)
    np.testing.assert_array_equal(y2.numpy(), perm.astype(np.float32))
    assert x2["tags"].to_list() == [[int(v) for v in tags[r]] for r in perm]
    np.testing.assert_array_equal(x2["dense"].numpy(), dense[perm])


def test_cluster_dataset_dict_elements_and_one_micro_batch():
    data = generate_criteo_like(256, seed=3, batch_ids_only=True)
    ds = tf.data.Dataset.from_tensors({k: tf.constant(v) for k, v in data.items()})
    (out,) = list(cluster_dataset(ds, CATEGORICAL, 2).as_numpy_iterator())
    perm = cluster_permutation({k: data[k] for k in CATEGORICAL}, 2)
    np.testing.assert_array_equal(out["C3"], data["C3"][perm])
    (same,) = list(cluster_dataset(ds, CATEGORICAL, 1).as_numpy_iterator())
    np.testing.assert_array_equal(same["C3"], data["C3"])


def test_cluster_dataset_string_feature():
    words = np.array([b"a", b"b", b"a", b"c", b"b", b"a", b"c", b"d"])
    ds = tf.data.Dataset.from_tensors(({"w": tf.constant(words)}, tf.range(8)))
    ((x2, y2),) = list(cluster_dataset(ds, ["w"], 2).as_numpy_iterator())
    np.testing.assert_array_equal(x2["w"], words[y2])
    _assert_permutation(y2.astype(np.int64), 8)


def test_cluster_dataset_missing_feature_raises():
    ds = _dataset(_batches(1, 16))
    with pytest.raises(ValueError, match="'C99'"):
        cluster_dataset(ds, ["C1", "C99"], 4)
    with pytest.raises(ValueError):
        cluster_dataset(ds, [], 4)
    with pytest.raises(ValueError):
        cluster_dataset(ds, ["C1"], 0)
    with pytest.raises(TypeError, match="I1"):
        cluster_dataset(ds, ["I1"], 4)  # float feature
