"""Set operations on the owner's compact key sets: where a batch's keys occur in the next
batch's (``find_keys``, one op of ``tf_fusedemb.ops``: NestPipe's "dedicated kernel
computes the intersection of compact key sets between consecutive batches"), and the
sum of gradient rows of equal keys (``coalesce``).
"""
from typing import Tuple

import tensorflow as tf

from tf_fusedemb.ops.find_keys import find_keys

__all__ = ["coalesce", "find_keys"]


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
