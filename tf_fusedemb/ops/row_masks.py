"""Rows of tensors picked by one boolean mask over their leading dimension.

``tf.boolean_mask`` traces about 15 graph nodes per call (shape checks, a reshape to the
mask's rank, its own ``Where`` and ``GatherV2``), and a step calls it per group and per
micro-batch, on several tensors with the same mask. Here the mask's indices are found
once (one ``Where``) and each tensor costs one ``GatherV2``; the values are the same."""
from typing import Tuple

import tensorflow as tf


def mask_indices(mask: tf.Tensor) -> tf.Tensor:
    """int64[k]: the positions, in order, where ``mask`` (bool[n]) is true."""
    return tf.reshape(tf.where(mask), [-1])


def masked_rows(mask: tf.Tensor, *values: tf.Tensor) -> Tuple[tf.Tensor, ...]:
    """Each of ``values`` ([n, ...] each) cut to its rows where ``mask`` (bool[n]) is
    true ([k, ...] each, in order): ``tf.boolean_mask(v, mask)`` for every ``v``."""
    picked = mask_indices(mask)
    return tuple(tf.gather(v, picked) for v in values)


def masked_examples(mask: tf.Tensor, values: tf.Tensor, count: int = 3) -> tf.Tensor:
    """string[<= count]: the first ``count`` of ``values`` (int[n]) where ``mask``
    (bool[n]) is true, as text for an error message. Strings keep a traced
    ``tf.debugging.Assert`` one op: with int64 data it adds a ``cond`` and two branch
    functions to the graph."""
    return tf.strings.as_string(masked_rows(mask, values)[0][:count])
