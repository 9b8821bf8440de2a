"""Pure-TF routes that do what the custom ops do, the way one would without them.

They are the baselines of ``tf_fusedemb.benchmarks.ops`` and an independent
reference for the tests. None of them loads the op library except where noted.
"""
from typing import List, Tuple

import tensorflow as tf

from tf_fusedemb.ops import hashing


def segment_ids_from_splits(segment_splits: tf.Tensor) -> tf.Tensor:
    """int32[n] segment of each key from int64[M+1] row splits."""
    lengths = segment_splits[1:] - segment_splits[:-1]
    return tf.repeat(tf.range(tf.size(lengths), dtype=tf.int32), lengths)


def per_segment_unique(keys: tf.Tensor, segment_splits: tf.Tensor,
                       num_segments: int) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
    """Strawman 1: one ``tf.unique`` per category (M op launches), same outputs as
    ``segment_unique``. ``num_segments`` must be a Python int."""
    uniques, inverses, counts, sizes = [], [], [], []
    offset = tf.constant(0, tf.int32)
    for s in range(num_segments):
        part = keys[segment_splits[s]:segment_splits[s + 1]]
        u, idx, c = tf.unique_with_counts(part, out_idx=tf.int32)
        uniques.append(u)
        inverses.append(idx + offset)
        counts.append(c)
        size = tf.size(u, out_type=tf.int32)
        sizes.append(tf.cast(size, tf.int64))
        offset += size
    splits = tf.concat([tf.zeros([1], tf.int64), tf.cumsum(tf.stack(sizes))], axis=0)
    return tf.concat(uniques, 0), splits, tf.concat(inverses, 0), tf.concat(counts, 0)


def hashed_unique(keys: tf.Tensor, segment_splits: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
    """Strawman 2: one ``tf.unique`` over keys hashed with their category (the paper's
    lossy scheme). Returns (unique hashed keys, inverse). Hash: ``mix64(key ^ tag_s)``
    with a per-segment 64-bit tag, in pure TF."""
    seg = segment_ids_from_splits(segment_splits)
    tags = tf.bitcast(tf_mix64_range(tf.reduce_max(seg) + 1), tf.int64)
    hashed = hashing.tf_mix64(tf.bitwise.bitwise_xor(tf.cast(keys, tf.int64), tf.gather(tags, seg)))
    unique, inverse = tf.unique(tf.bitcast(hashed, tf.int64), out_idx=tf.int32)
    return unique, inverse


def tf_mix64_range(m: tf.Tensor) -> tf.Tensor:
    """M distinct 64-bit tags (mix64 of 1..M), uint64[M]."""
    return hashing.tf_mix64(tf.range(1, m + 1, dtype=tf.int64))


def owners_pure_tf(keys: tf.Tensor, num_ranks: tf.Tensor) -> tf.Tensor:
    """Owner ranks with the library's hash, in pure TF: int32[n]."""
    return tf.cast(tf.math.floormod(hashing.tf_mix64(keys), tf.cast(num_ranks, tf.uint64)),
                   tf.int32)


def argsort_rankwise_sort(keys: tf.Tensor, segment_splits: tf.Tensor, num_ranks: int,
                          owners: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
    """The argsort route: stable ``tf.argsort`` of the owners, then gathers.
    ``owners`` (int32[n]) is given so the route is timed on sorting alone."""
    perm = tf.argsort(owners, stable=True)
    sorted_keys = tf.gather(keys, perm)
    sorted_segs = tf.gather(segment_ids_from_splits(segment_splits), perm)
    rank_splits = tf.math.bincount(owners, minlength=num_ranks, maxlength=num_ranks)
    indices = tf.math.invert_permutation(perm)
    return sorted_keys, sorted_segs, rank_splits, indices


def dynamic_partition_rankwise_sort(
        keys: tf.Tensor, segment_splits: tf.Tensor, num_ranks: int,
        owners: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
    """The dynamic_partition route (what TFRA's HvdAllToAllEmbedding does).
    ``num_ranks`` must be a Python int."""
    positions = tf.range(tf.size(keys, out_type=tf.int32))
    key_parts = tf.dynamic_partition(keys, owners, num_ranks)
    seg_parts = tf.dynamic_partition(segment_ids_from_splits(segment_splits), owners, num_ranks)
    pos_parts = tf.dynamic_partition(positions, owners, num_ranks)
    rank_splits = tf.stack([tf.size(p, out_type=tf.int32) for p in key_parts])
    perm = tf.concat(pos_parts, 0)
    return tf.concat(key_parts, 0), tf.concat(seg_parts, 0), rank_splits, \
        tf.math.invert_permutation(perm)


def scatter_nd_recovery(rows: tf.Tensor, partition_positions: tf.Tensor,
                        unique_inverse: tf.Tensor) -> tf.Tensor:
    """TFRA's recovery: ``tf.scatter_nd`` the received rows back to unique order by the
    positions ``dynamic_partition`` produced (sorted position -> unique position, the
    inverse of I_s), then ``tf.gather`` by the unique inverse: [n, D]."""
    unique_rows = tf.scatter_nd(tf.expand_dims(partition_positions, -1), rows, tf.shape(rows))
    return tf.gather(unique_rows, unique_inverse)


def gather_pool(rows: tf.Tensor, recover_indices: tf.Tensor, row_splits: tf.Tensor,
                combiner: str) -> tf.Tensor:
    """Pure-TF pooled recovery of one feature: ``tf.sparse.segment_{sum,mean,sqrt_n}``."""
    seg = tf.cast(segment_ids_from_splits(tf.cast(row_splits, tf.int64)), tf.int32)
    fn = {"sum": tf.sparse.segment_sum, "mean": tf.sparse.segment_mean,
          "sqrtn": tf.sparse.segment_sqrt_n}[combiner]
    return fn(rows, recover_indices, seg, num_segments=tf.size(row_splits) - 1)
