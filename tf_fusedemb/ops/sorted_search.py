"""Binary search of a 1-D sorted tensor, as one graph op.

``tf.searchsorted`` accepts any rank, so for 1-D inputs it traces about 19 nodes of
shape checks and reshapes around its ``LowerBound``/``UpperBound``; a step calls it per
group and micro-batch. Here the 1-D case is the kernel between two reshapes."""
import tensorflow as tf

_KERNELS = {"left": tf.raw_ops.LowerBound, "right": tf.raw_ops.UpperBound}


def search_sorted(sorted_values: tf.Tensor, values: tf.Tensor, side: str = "left",
                  out_type: tf.DType = tf.int32) -> tf.Tensor:
    """Per value, its insertion index in ``sorted_values`` (T[n], ascending):
    ``tf.searchsorted(sorted_values, values, side, out_type)`` for ``values`` T[k],
    out_type[k]. ``side`` "left": the first index i with ``sorted_values[i] >= v``;
    "right": the first with ``sorted_values[i] > v``."""
    if side not in _KERNELS:
        raise ValueError(f"search_sorted: side must be 'left' or 'right', got {side!r}")
    found = _KERNELS[side](sorted_inputs=tf.reshape(sorted_values, [1, -1]),
                           values=tf.reshape(values, [1, -1]), out_type=out_type)
    return tf.reshape(found, [-1])
