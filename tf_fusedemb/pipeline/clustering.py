"""Key-centric sample clustering (NestPipe, section V-C): reorder a batch so samples that share
sparse keys land in the same micro-batch.

Frozen-window pipelining splits each rank's batch of B samples into N contiguous micro-batches
(micro-batch i = rows [i*B//N, (i+1)*B//N)) and deduplicates keys only within a micro-batch, so
the embedding All2All of a step carries sum_i |unique (feature, id) keys of micro-batch i| rows.
A key used by samples of several micro-batches is sent once per micro-batch. Clustering permutes
the samples INSIDE the batch (the batch's composition, hence the model's values and gradients,
is unchanged) so that such samples meet in one micro-batch.

Finding the best order is balanced hypergraph partitioning (samples = vertices, keys shared by
>= 2 samples = hyperedges, objective = sum over keys of the number of micro-batches holding it),
so `cluster_permutation` uses a cheap spectral heuristic; see the comment above it for the
measurements behind the choice and the achievable reductions.

Importing this module does not import TensorFlow; only `cluster_dataset` needs it.
"""
from __future__ import annotations

from typing import List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np

__all__ = ["micro_batch_bounds", "unique_keys_per_micro_batch", "cluster_permutation",
           "cluster_dataset"]

# One feature of one batch: int[B] (one id per sample), int[B, k] (k ids per sample), or a
# sequence of B per-sample id sequences (multi-hot, lengths may differ, may be empty).
FeatureValues = Union[np.ndarray, Sequence[Sequence[int]]]


class _RaggedIds(NamedTuple):
    """Multi-hot ids of B samples in CSR form (what a tf.RaggedTensor [B, None] holds): the ids
    of sample i are values[row_splits[i]:row_splits[i + 1]]. Used by cluster_dataset."""
    values: np.ndarray  # int[P]
    row_splits: np.ndarray  # int[B + 1], row_splits[0] = 0, nondecreasing


_U64 = np.uint64
# 2**64 / golden ratio (odd): Fibonacci hashing. Multiplying by an odd constant is a bijection
# of the 64-bit words and the product's top bits mix all input bits, so keeping only the bits
# left over after the row and feature fields merges two distinct ids with probability about
# 2**-hash_bits (hash_bits = 64 - log2(B) - log2(F) >= 34 for B <= 2**20, F <= 2**10).
_GOLDEN = _U64(0x9E3779B97F4A7C15)
_MIN_HASH_BITS = 16


def micro_batch_bounds(batch_size: int, num_micro_batches: int) -> List[Tuple[int, int]]:
    """Row ranges of the micro-batches of a batch: [(i*B//N, (i+1)*B//N) for i in range(N)].

    Args:
      batch_size: B >= 0.
      num_micro_batches: N >= 1 (N > B gives some empty micro-batches).
    Returns:
      list of N (lo, hi) pairs; they tile [0, B) in order and their sizes differ by at most 1.
    Raises:
      ValueError: B < 0 or N < 1.
    """
    b, n = _check_sizes(batch_size, num_micro_batches)
    return [(i * b // n, (i + 1) * b // n) for i in range(n)]


def unique_keys_per_micro_batch(features: Mapping[str, FeatureValues],
                                num_micro_batches: int) -> np.ndarray:
    """Distinct (feature, id) keys of each micro-batch: what FWP's per-micro-batch dedup sends.

    Args:
      features: {name: values} for one batch of B samples; values int[B], int[B, k] or a
        sequence of B per-sample id lists (multi-hot). Every feature must have B samples.
      num_micro_batches: N >= 1; micro-batch i is rows [i*B//N, (i+1)*B//N).
    Returns:
      int64[N]: entry i = number of distinct (feature, id) pairs among the samples of
      micro-batch i (exact, no hashing). Their sum is the batch's communicated key count.
    Raises:
      ValueError: features of different batch sizes, N < 1, non-integer ids.
    """
    feats, b = _as_flat_features(features)
    bounds = micro_batch_bounds(b, num_micro_batches)
    his = np.array([hi for _, hi in bounds], np.int64)
    out = np.zeros(len(bounds), np.int64)
    for values, rows in feats:
        rows = np.arange(b) if rows is None else rows
        mb = np.searchsorted(his, rows, side="right")  # micro-batch of each id
        # Sort the (micro-batch, id) pairs; each change of pair starts a distinct key.
        order = np.lexsort((values, mb))
        v, m = values[order], mb[order]
        first = np.ones(len(v), bool)
        first[1:] = (v[1:] != v[:-1]) | (m[1:] != m[:-1])
        out += np.bincount(m[first], minlength=len(bounds))
    return out


# Heuristic choice. Figures: reduction of the summed per-micro-batch unique keys vs the unclustered
# order on the 26 Criteo columns C1..C26, B=4096, N=4; "synthetic" = generate_criteo_like(4096,
# seed=7), "real" = the first 4096 lines of the Kaggle sample (measured 2026-11):
#   lexicographic sort, features ranked by expected dedup savings:  3.5% synthetic, 10.3% real
#   spectral ordering (1 vector) cut into N contiguous blocks:       5.2% synthetic, 14.6% real
#   recursive spectral bisection, unweighted keys:                   7.3% synthetic, 16.2% real
#   ... with keys weighted by their expected savings (this code):    8.6% synthetic, 17.3% real
#   vectorised greedy swap refinement (FM-like, 10-20 rounds after a
#   sort or a spectral order, 100-300 ms):                          8-10% synthetic, 15-18% real
#   KaHyPar km1 (state of the art partitioner, seconds per batch):  10.6% synthetic, 22.9% real
# A sort only groups the duplicates of its leading feature, while the savings are spread over
# keys shared by 2..30 samples in ALL features; the spectral vector averages every shared key at
# once. The synthetic generator draws features independently (a random hypergraph, an
# expander), so no order does much better there (KaHyPar's ~10.6% is the practical ceiling);
# real data has correlated columns and samples, hence the larger gains. At N=2 / 8 this code gives
# 6.1 / 9.1% synthetic and 9.8 / 22.3% real. Cost, numpy on one core of a shared 2-core VM:
# ~9-14 ms per 4096 x 26 batch at N=4 (one 106k-element sort, then 8 power iterations of two
# bincounts per bisection level), ~2-4 ms at 1024 rows.
_POWER_ITERATIONS = 8


def _max_key_count(b: int, n: int) -> int:
    """Keys shared by more samples than this are left out of the clustering.

    A key of more than B/N samples spans several micro-batches whatever the order. Keys of
    B/(8N)..B/N samples could still be grouped, but each saves at most N - 1 copies and their
    weight is tiny (see _savings_weight) while their incidences are ~40% of the work on Criteo
    (22k of 57k at B=4096, N=4, where the reduction is the same within 0.1 point without
    them); keys of up to min(B/N, 16) samples are always kept, so small batches, where such
    keys may be the only structure, are still clustered.
    """
    return max(2, b // (8 * n), min(b // n, 16))


def _savings_weight(count: np.ndarray, n: int) -> np.ndarray:
    """float64[K]: expected extra micro-batch copies per sample of keys shared by `count`
    samples when the batch is in random order: (N * (1 - (1 - 1/N)**c) - 1) / c.

    A key of c samples saves at most N - 1 copies however large c is, but its pull on the
    spectral vector grows with c; weighting its incidences by this keeps a few big keys from
    outvoting the many small ones (+1.2 points synthetic, +1.0 real over unit weights).
    """
    c = count.astype(np.float64)
    return (n * -np.expm1(c * np.log1p(-1.0 / n)) - 1.0) / c


def cluster_permutation(features: Mapping[str, FeatureValues], num_micro_batches: int,
                        seed: int = 0) -> np.ndarray:
    """Key-centric sample order of one batch: recursive spectral bisection of the key graph.

    Samples are vertices and every (feature, id) key shared by 2..max(B/(8N), min(B/N, 16))
    samples joins them (bigger keys span several micro-batches whatever the order, or save too
    little for their cost, see _max_key_count). At each level the rows of a segment (a range of
    micro-batches) get a smoothed random vector: a few power iterations of "key value = mean of
    its samples' values, sample value = weighted mean of its keys' values" (a lazy random walk
    on the sample-key graph restricted to the segment; key weights = expected dedup savings
    per sample, see _savings_weight), which make samples that share keys, directly or through
    chains, take close values. The segment's rows are sorted by that value and cut at the
    micro-batch boundary nearest its middle, so both halves hold whole micro-batches; the
    halves are refined the same way until each segment is one micro-batch.

    Deterministic (fixed-seed start vector, stable sorts). Ids are hashed to 64 - log2(B) -
    log2(F) bits for speed; a collision merges two keys in the heuristic only, the result is
    always a permutation.

    Args:
      features: {name: values} for one batch of B samples: int[B], int[B, k] (every id used) or
        a sequence of B per-sample id lists (multi-hot, every id used; empty lists allowed).
      num_micro_batches: N >= 1.
      seed: seed of the start vector (the default is fine; other seeds give other good orders).
    Returns:
      int64[B] permutation: clustered batch = batch[perm] (row j of the new batch is old row
      perm[j]). Identity when N == 1, B <= 1 or no key is shared.
    Raises:
      ValueError: features of different batch sizes, N < 1, non-integer ids, too many rows or
        features for the hash layout.
    """
    feats, b = _as_flat_features(features)
    _, n = _check_sizes(b, num_micro_batches)
    if n == 1 or b <= 1:
        return np.arange(b, dtype=np.int64)
    rows, kid, key_count = _shared_key_pins(feats, b, _max_key_count(b, n))
    if rows.size == 0:
        return np.arange(b, dtype=np.int64)
    weight = _savings_weight(key_count, n)[kid]
    return _recursive_spectral_bisection(rows, kid, weight, len(key_count), b, n, seed)


def _recursive_spectral_bisection(rows: np.ndarray, kid: np.ndarray, weight: np.ndarray,
                                  num_keys: int, b: int, n: int, seed: int) -> np.ndarray:
    """Pins (sample rows[p] uses key kid[p], weight[p]), int/float[P] -> int64[B] order; see
    cluster_permutation."""
    bounds = [i * b // n for i in range(n + 1)]
    inv_deg = np.bincount(rows, weights=weight, minlength=b)
    inv_deg = np.divide(1.0, inv_deg, out=np.zeros_like(inv_deg), where=inv_deg > 0)
    x0 = np.random.default_rng(seed).standard_normal(b)
    segs = [(0, n)]  # segment s holds micro-batches [p0, p1)
    lab = np.zeros(b, np.intp)  # segment of each row
    order = np.arange(b)
    while any(p1 - p0 > 1 for p0, p1 in segs):
        ns = len(segs)
        # A key seen in several segments becomes one key per segment: the halves are
        # partitioned independently, as their rows can no longer meet.
        kk = kid * ns + lab[rows] if ns > 1 else kid
        kc = np.bincount(kk, minlength=num_keys * ns).astype(np.float64)
        inv_kc = np.divide(1.0, kc, out=np.zeros_like(kc), where=kc > 0)
        seg_size = np.bincount(lab, minlength=ns).clip(1)
        x = x0 - (np.bincount(lab, weights=x0, minlength=ns) / seg_size)[lab]  # precision only
        for _ in range(_POWER_ITERATIONS):
            y = np.bincount(kk, weights=x[rows], minlength=num_keys * ns) * inv_kc
            x = np.bincount(rows, weights=y[kk] * weight, minlength=b) * inv_deg
        # No renormalisation needed: the walk is an averaging operator, so the vector only
        # shrinks towards per-segment constants, and a constant shift does not change the sort.
        # By segment, then by vector value (two stable argsorts: ties keep row order; cheaper
        # than np.lexsort).
        order = np.argsort(x, kind="stable")
        order = order[np.argsort(lab[order], kind="stable")]
        new_segs: List[Tuple[int, int]] = []
        new_lab = np.empty(b, np.intp)
        for p0, p1 in segs:
            cuts = [p0, (p0 + p1) // 2, p1] if p1 - p0 > 1 else [p0, p1]
            for q0, q1 in zip(cuts[:-1], cuts[1:]):
                new_lab[order[bounds[q0]:bounds[q1]]] = len(new_segs)
                new_segs.append((q0, q1))
        segs, lab = new_segs, new_lab
    return order.astype(np.int64)


def _shared_key_pins(feats: List[Tuple[np.ndarray, np.ndarray]], b: int,
                     max_count: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sample, key) incidences of the keys shared by 2..max_count samples.

    One sort of packed 64-bit words [feature | hash(id) | row] groups every key's samples
    (cheaper than a per-feature np.unique, or an argsort).
    Returns:
      rows intp[P], kid intp[P] (key index, 0..K-1, nondecreasing), key_count int64[K].
    """
    f = len(feats)
    rbits = max(1, (b - 1).bit_length())
    fbits = max(1, (f - 1).bit_length())
    if 64 - rbits - fbits < _MIN_HASH_BITS:
        raise ValueError(f"batch of {b} rows with {f} features leaves fewer than "
                         f"{_MIN_HASH_BITS} hash bits per id")
    sizes = [len(values) for values, _ in feats]
    s = np.empty(sum(sizes), np.uint64)
    one_per_row = np.arange(b, dtype=np.uint64)
    pos = 0
    with np.errstate(over="ignore"):  # wrap-around multiplication is the hash
        for i, (values, rows) in enumerate(feats):
            w = s[pos:pos + len(values)]
            np.multiply(values.view(np.uint64), _GOLDEN, out=w)
            w >>= _U64(rbits + fbits)
            w <<= _U64(rbits)
            w |= _U64(i) << _U64(64 - fbits)
            w |= one_per_row if rows is None else rows.view(np.uint64)
            pos += len(values)
    s.sort()
    if len(s) > 1 and any(rows is not None for _, rows in feats):
        # The same id twice in one multi-hot sample is one key of that sample.
        s = s[np.concatenate(([True], s[1:] != s[:-1]))]
    key = s >> _U64(rbits)
    new = np.empty(len(s), bool)
    new[:1] = True
    np.not_equal(key[1:], key[:-1], out=new[1:])
    count = np.diff(np.append(np.flatnonzero(new), len(s)))
    kept = (count >= 2) & (count <= max_count)
    key_count = count[kept]
    kid = np.repeat(np.arange(len(key_count), dtype=np.intp), key_count)
    rows = (s[np.repeat(kept, count)] & _U64((1 << rbits) - 1)).astype(np.intp)
    return rows, kid, key_count


def _check_sizes(batch_size, num_micro_batches) -> Tuple[int, int]:
    b, n = int(batch_size), int(num_micro_batches)
    if b < 0:
        raise ValueError(f"batch_size must be >= 0, got {batch_size}")
    if n < 1:
        raise ValueError(f"num_micro_batches must be >= 1, got {num_micro_batches}")
    return b, n


def _as_flat_features(features: Mapping[str, FeatureValues]
                      ) -> Tuple[List[Tuple[np.ndarray, np.ndarray]], int]:
    """{name: values} -> ([(ids int64[P_f], row of each id int64[P_f]) per feature], B).

    The rows array is None for int[B] features (id i belongs to row i), which saves building
    and hashing B row indices per feature in the common one-hot case.

    B is returned separately because a multi-hot feature may hold no id at all.
    """
    if not features:
        raise ValueError("features is empty: need at least one feature to cluster on")
    out = []
    sizes = {}
    for name, v in features.items():
        if isinstance(v, _RaggedIds):
            splits = np.asarray(v.row_splits, np.int64)
            values = np.asarray(v.values)
            _check_int(name, values)
            b = len(splits) - 1
            values = np.ascontiguousarray(values, dtype=np.int64)
            rows = np.repeat(np.arange(b, dtype=np.int64), np.diff(splits))
        elif hasattr(v, "shape") and hasattr(v, "dtype"):  # numpy array (or array-like tensor)
            a = np.asarray(v)
            if a.ndim not in (1, 2):
                raise ValueError(f"feature {name!r}: expected ids of shape [B] or [B, k], got "
                                 f"shape {a.shape}")
            _check_int(name, a)
            b = a.shape[0]
            values = np.ascontiguousarray(a.reshape(-1), dtype=np.int64)
            rows = None if a.ndim == 1 else np.repeat(np.arange(b, dtype=np.int64), a.shape[1])
        else:  # a sequence of per-sample id lists (multi-hot); a bare id counts as a 1-list
            lists = [np.asarray(x).reshape(-1) for x in v]
            for x in lists:
                _check_int(name, x)
            b = len(lists)
            lens = np.array([len(x) for x in lists], np.int64)
            values = (np.concatenate(lists).astype(np.int64) if lens.sum() else
                      np.zeros(0, np.int64))
            rows = np.repeat(np.arange(b, dtype=np.int64), lens)
        sizes[name] = b
        out.append((values, rows))
    if len(set(sizes.values())) != 1:
        raise ValueError(f"features have different batch sizes: {sizes}")
    return out, next(iter(sizes.values()))


def _check_int(name: str, a: np.ndarray) -> None:
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"feature {name!r}: ids must be integers, got dtype {a.dtype}")


def cluster_dataset(dataset, feature_names: Sequence[str], num_micro_batches: int,
                    num_parallel_calls: Optional[int] = None, seed: int = 0):
    """tf.data transform: reorders the samples of every batch by `cluster_permutation`.

    The permutation is computed on the CPU by `tf.numpy_function` from the named features, then
    EVERY tensor of the element (all features, the label, the sample weight) is gathered by it,
    so each sample keeps its label and weight. The map is parallel but deterministic, and the
    result is prefetched, so the clustering runs asynchronously ahead of the training step.

    Args:
      dataset: a tf.data.Dataset of batches: `(x, y)`, `(x, y, sample_weight)` or a bare `x`,
        where x is a dict of tensors of leading dimension B; y / sample_weight may be tensors
        or nests of tensors of leading dimension B ([B], [B, 1], ...).
      feature_names: keys of x to cluster on (e.g. "C1".."C26"); each an integer or string
        tensor [B] or [B, k], or a tf.RaggedTensor [B, None] (multi-hot). Strings are hashed
        with tf.strings.to_hash_bucket_fast first.
      num_micro_batches: N >= 1, the frozen-window micro-batches per batch (1: no reordering,
        the dataset is returned prefetched).
      num_parallel_calls: parallelism of the map; None = tf.data.AUTOTUNE.
      seed: passed to cluster_permutation.
    Returns:
      dataset with the same element_spec, each batch permuted: x'[j] = x[perm[j]] for every
      tensor of the element.
    Raises:
      ValueError: a named feature is missing from x, feature_names is empty, x is not a dict,
        num_micro_batches < 1.
      TypeError: an element tensor is a tf.SparseTensor (not supported by tf.gather), or a
        named feature is neither integer nor string.
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    n = int(num_micro_batches)
    if n < 1:
        raise ValueError(f"num_micro_batches must be >= 1, got {num_micro_batches}")
    names = list(feature_names)
    if not names:
        raise ValueError("feature_names is empty: need at least one feature to cluster on")
    spec = dataset.element_spec
    if isinstance(spec, Mapping):
        x_spec = spec
    elif isinstance(spec, tuple) and len(spec) in (2, 3) and isinstance(spec[0], Mapping):
        x_spec = spec[0]
    else:
        raise ValueError("cluster_dataset expects elements (x, y), (x, y, sample_weight) or x "
                         f"with x a dict of tensors; got element_spec {spec}")
    for name in names:
        if name not in x_spec:
            raise ValueError(f"feature {name!r} to cluster on is not in the batch (features: "
                             f"{sorted(x_spec)})")
        s = x_spec[name]
        if not isinstance(s, (tf.TensorSpec, tf.RaggedTensorSpec)):
            raise TypeError(f"feature {name!r}: expected a tensor or tf.RaggedTensor, got {s}")
        if not (s.dtype.is_integer or s.dtype == tf.string):
            raise TypeError(f"feature {name!r}: ids must be integers or strings, got {s.dtype}")
    for s in tf.nest.flatten(spec):
        if isinstance(s, tf.SparseTensorSpec):
            raise TypeError("cluster_dataset cannot reorder tf.SparseTensor elements (tf.gather "
                            "does not take them); use dense or ragged tensors")
    if n == 1:
        return dataset.prefetch(tf.data.AUTOTUNE)
    ragged = [isinstance(x_spec[name], tf.RaggedTensorSpec) for name in names]
    for name, is_ragged in zip(names, ragged):
        if is_ragged and x_spec[name].ragged_rank != 1:
            raise ValueError(f"feature {name!r}: only ragged [B, None] (ragged_rank 1) is "
                             f"supported, got ragged_rank {x_spec[name].ragged_rank}")

    def permutation_np(*arrays):
        # Per feature: the id array, or (flat ids, row_splits) for a ragged feature (handed
        # over as _RaggedIds, so B small per-sample arrays are never built).
        feats, i = {}, 0
        for name, is_ragged in zip(names, ragged):
            if is_ragged:
                feats[name] = _RaggedIds(arrays[i], arrays[i + 1])
                i += 2
            else:
                feats[name] = arrays[i]
                i += 1
        return cluster_permutation(feats, n, seed)

    def as_ids(t):
        if t.dtype == tf.string:
            return tf.strings.to_hash_bucket_fast(t, 2 ** 62)
        return tf.cast(t, tf.int64)

    def permute(*element):
        x = element[0]  # a bare dict element arrives as the only argument
        inputs = []
        for name, is_ragged in zip(names, ragged):
            t = x[name]
            inputs += [as_ids(t.flat_values), t.row_splits] if is_ragged else [as_ids(t)]
        perm = tf.numpy_function(permutation_np, inputs, tf.int64, stateful=False)
        perm.set_shape(x_spec[names[0]].shape[:1])
        # Every tensor of the element, labels and weights included, follows the same order.
        permuted = tf.nest.map_structure(lambda t: tf.gather(t, perm), element)
        return permuted[0] if len(element) == 1 else permuted

    parallel = tf.data.AUTOTUNE if num_parallel_calls is None else num_parallel_calls
    out = dataset.map(permute, num_parallel_calls=parallel, deterministic=True)
    # Prefetch so the (CPU) clustering of the next batches overlaps the training step.
    return out.prefetch(tf.data.AUTOTUNE)
