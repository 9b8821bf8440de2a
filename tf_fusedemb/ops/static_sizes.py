"""Sizes known when the step is traced, kept as Python ints.

``tf.size`` of a tensor whose shape is static is already a constant, but one graph node
per call; a step over 26 features calls it a few times per feature. These helpers return
the Python int where the shape is known and stack such values into ONE constant, so a
static batch costs no node per feature (a dynamic one costs what ``tf.size`` costs)."""
from typing import Sequence, Union

import numpy as np
import tensorflow as tf

IntLike = Union[int, tf.Tensor]


def num_elements(t: tf.Tensor, dtype: tf.DType = tf.int64) -> IntLike:
    """The element count of ``t``: a Python int when its shape is static, else a
    ``dtype`` scalar tensor."""
    static = t.shape.num_elements()
    return static if static is not None else tf.size(t, out_type=dtype)


def stack_ints(values: Sequence[IntLike], dtype: tf.DType = tf.int64) -> tf.Tensor:
    """``dtype[len(values)]`` of Python ints and scalar tensors: one constant when every
    value is an int, else ``tf.stack`` (the ints become constants)."""
    if all(isinstance(v, (int, np.integer)) for v in values):
        return tf.constant(np.asarray(values, dtype.as_numpy_dtype).reshape([len(values)]))
    return tf.stack([tf.cast(v, dtype) if isinstance(v, tf.Tensor) else
                     tf.constant(v, dtype) for v in values])
