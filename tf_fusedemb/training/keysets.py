"""Set operations on the owner's compact key sets (NestPipe: "a dedicated kernel computes
the intersection of compact key sets between consecutive batches").

Sorting the smaller side once and binary-searching the other is O((u + v) log v) with
stock TF ops, on keys only (never on rows).
"""
from typing import Tuple

import tensorflow as tf

from tf_fusedemb.ops.sorted_search import search_sorted

def find_keys(keys: tf.Tensor, table_keys: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
    """Where each of ``keys`` occurs in ``table_keys`` (whose entries are unique).

    Args:
      keys: int64[k].  table_keys: int64[v], unique.
    Returns:
      found: bool[k]; index: int32[k], the position in ``table_keys`` where found (0
      elsewhere, a valid index only when ``v > 0``).
    """
    keys = tf.convert_to_tensor(keys, tf.int64)
    table_keys = tf.convert_to_tensor(table_keys, tf.int64)
    order = tf.argsort(table_keys, stable=True)
    sorted_keys = tf.gather(table_keys, order)
    size = tf.size(sorted_keys)
    pos = search_sorted(sorted_keys, keys, side="left", out_type=tf.int32)
    pos = tf.clip_by_value(pos, 0, tf.maximum(size - 1, 0))
    found = tf.logical_and(size > 0, tf.equal(
        tf.gather(tf.concat([sorted_keys, tf.zeros([1], tf.int64)], 0), pos), keys))
    index = tf.gather(tf.concat([order, tf.zeros([1], tf.int32)], 0), pos)
    return found, tf.where(found, index, tf.zeros_like(index))


def coalesce(keys: tf.Tensor, grads: tf.Tensor,
             init_keys: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """Sums gradient rows of equal keys (EmbRace's COALESCE; FWP's accumulation over
    micro-batches).

    Args:
      keys: int64[n] (duplicates allowed).  grads: float32[n, D].  init_keys: int64[n],
        equal for equal keys.
    Returns:
      (unique keys int64[u], summed grads float32[u, D], init keys int64[u]), keys in
      first-occurrence order.
    """
    unique, index = tf.unique(keys, out_idx=tf.int32)
    count = tf.size(unique)
    summed = tf.math.unsorted_segment_sum(grads, index, count)
    first = tf.math.unsorted_segment_min(tf.range(tf.size(keys)), index, count)
    return unique, summed, tf.gather(init_keys, first)
