"""Splitting a rank's batch into N contiguous micro-batches (NestPipe FWP)."""
from typing import Any, Callable, List, Sequence, Tuple, Union

import tensorflow as tf


def micro_batch_slices(batch_size: Union[int, tf.Tensor],
                       num_micro_batches: int) -> List[Tuple[tf.Tensor, tf.Tensor]]:
    """(lo, hi) int64 scalar tensors of micro-batch i = rows [i*B//N, (i+1)*B//N).

    Sizes differ by at most one; with B < N some micro-batches are empty (valid)."""
    b = tf.cast(batch_size, tf.int64)
    return [(b * i // num_micro_batches, b * (i + 1) // num_micro_batches)
            for i in range(num_micro_batches)]


def slice_rows(value: Any, lo: tf.Tensor, hi: tf.Tensor) -> Any:
    """Rows [lo, hi) of a Tensor [B, ...], RaggedTensor [B, None] or SparseTensor [B, L];
    nested dicts/lists/tuples are sliced leaf by leaf; None stays None."""
    if value is None:
        return None
    if isinstance(value, dict):
        return {k: slice_rows(v, lo, hi) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(slice_rows(v, lo, hi) for v in value)
    if isinstance(value, tf.RaggedTensor):
        return value[lo:hi]
    if isinstance(value, tf.SparseTensor):
        start = tf.stack([lo] + [tf.constant(0, tf.int64)] * (value.shape.rank - 1))
        size = tf.concat([[hi - lo], value.dense_shape[1:]], 0)
        return tf.sparse.slice(value, start, size)
    return tf.convert_to_tensor(value)[lo:hi]


def micro_batch_parts(values: Sequence[Any], num_micro_batches: int,
                      batch_size: Callable[[], tf.Tensor]) -> List[Tuple[Any, ...]]:
    """Per micro-batch, each of ``values`` (``slice_rows``'s kinds) cut to its rows
    (``micro_batch_slices`` of ``batch_size()``). One micro-batch is the batch itself:
    the values as they are, so a step without micro-batches traces no slicing ops."""
    if num_micro_batches == 1:
        return [tuple(values)]
    return [tuple(slice_rows(v, lo, hi) for v in values)
            for lo, hi in micro_batch_slices(batch_size(), num_micro_batches)]


def batch_size_of(y: Any) -> tf.Tensor:
    """int64 scalar: rows of the label tensor ``y`` (the batch size)."""
    if isinstance(y, dict):
        y = next(iter(y.values()))
    return tf.shape(y, out_type=tf.int64)[0]
