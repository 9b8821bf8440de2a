"""Splitting a rank's batch into N contiguous micro-batches (NestPipe FWP)."""
from typing import Any, Callable, List, Sequence, Tuple, Union

import tensorflow as tf

BatchSize = Union[int, tf.Tensor]  # a Python int where the batch's shape is static


def micro_batch_slices(batch_size: BatchSize,
                       num_micro_batches: int) -> List[Tuple[Any, Any]]:
    """(lo, hi) of micro-batch i = rows [i*B//N, (i+1)*B//N): Python ints for an int
    ``batch_size``, else int64 scalar tensors.

    Sizes differ by at most one; with B < N some micro-batches are empty (valid)."""
    b = batch_size if isinstance(batch_size, int) else tf.cast(batch_size, tf.int64)
    return [(b * i // num_micro_batches, b * (i + 1) // num_micro_batches)
            for i in range(num_micro_batches)]


def slice_rows(value: Any, lo: Any, hi: Any) -> Any:
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
        lo, hi = tf.cast(lo, tf.int64), tf.cast(hi, tf.int64)
        start = tf.stack([lo] + [tf.constant(0, tf.int64)] * (value.shape.rank - 1))
        size = tf.concat([[hi - lo], value.dense_shape[1:]], 0)
        return tf.sparse.slice(value, start, size)
    return tf.convert_to_tensor(value)[lo:hi]


def split_rows(value: Any, slices: Sequence[Tuple[Any, Any]]) -> List[Any]:
    """``value`` (``slice_rows``'s kinds) cut into the row ranges ``slices``, one part
    per range, nests leaf by leaf. A plain tensor is cut by one ``Split`` op (its N parts
    at once, static shapes where the sizes are ints) instead of N strided slices with
    their bounds."""
    parts = [_split_leaf(leaf, slices) for leaf in tf.nest.flatten(value)]
    return [tf.nest.pack_sequence_as(value, [p[i] for p in parts])
            for i in range(len(slices))]


def _split_leaf(value: Any, slices: Sequence[Tuple[Any, Any]]) -> List[Any]:
    """One leaf of ``split_rows``: a Tensor, RaggedTensor, SparseTensor or None."""
    n = len(slices)
    if value is None:
        return [None] * n
    if isinstance(value, tf.RaggedTensor) and value.ragged_rank == 1:
        return _split_ragged(value, slices)
    if isinstance(value, (tf.RaggedTensor, tf.SparseTensor)):
        return [slice_rows(value, lo, hi) for lo, hi in slices]
    return tf.split(tf.convert_to_tensor(value), _sizes(slices), num=n)


def _sizes(slices: Sequence[Tuple[Any, Any]]) -> Any:
    """Rows per range: a list of ints for int bounds, else an int64[N] tensor."""
    sizes = [hi - lo for lo, hi in slices]
    return sizes if all(isinstance(s, int) for s in sizes) else tf.stack(sizes)


def _split_ragged(value: tf.RaggedTensor, slices: Sequence[Tuple[Any, Any]]
                  ) -> List[tf.RaggedTensor]:
    """A RaggedTensor [B, None] cut into the row ranges ``slices`` by two ``Split`` ops
    (its values and its row lengths) rather than N ragged slices of about 30 ops each."""
    bounds = [lo for lo, _ in slices] + [slices[-1][1]]
    splits = value.row_splits
    at = tf.gather(splits, tf.cast(tf.stack(bounds), splits.dtype))  # value offsets
    values = tf.split(value.values, at[1:] - at[:-1], num=len(slices))
    lengths = tf.split(value.row_lengths(), _sizes(slices), num=len(slices))
    return [tf.RaggedTensor.from_row_lengths(v, l, validate=False)
            for v, l in zip(values, lengths)]


def micro_batch_parts(values: Sequence[Any], num_micro_batches: int,
                      batch_size: Callable[[], BatchSize]) -> List[Tuple[Any, ...]]:
    """Per micro-batch, each of ``values`` (``slice_rows``'s kinds) cut to its rows
    (``micro_batch_slices`` of ``batch_size()``). One micro-batch is the batch itself:
    the values as they are, so a step without micro-batches traces no slicing ops."""
    if num_micro_batches == 1:
        return [tuple(values)]
    slices = micro_batch_slices(batch_size(), num_micro_batches)
    columns = [split_rows(v, slices) for v in values]
    return [tuple(c[i] for c in columns) for i in range(num_micro_batches)]


def batch_size_of(y: Any) -> BatchSize:
    """Rows of the label tensor ``y`` (the batch size; a dict's first entry):
    ``rows_of``."""
    if isinstance(y, dict):
        y = next(iter(y.values()))
    return rows_of(y)


def rows_of(value: Any) -> BatchSize:
    """Rows of a Tensor [B, ...], RaggedTensor [B, None] or SparseTensor [B, L]: an int
    where its shape is static, else an int64 scalar tensor."""
    shape = getattr(value, "shape", None)
    if shape is not None and shape.rank and shape[0] is not None:
        return int(shape[0])
    if isinstance(value, tf.RaggedTensor):
        return value.nrows(out_type=tf.int64)
    if isinstance(value, tf.SparseTensor):
        return value.dense_shape[0]
    return tf.shape(value, out_type=tf.int64)[0]
