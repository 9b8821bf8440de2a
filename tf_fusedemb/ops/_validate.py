"""Argument checks shared by the op wrappers: clear errors that name the argument."""
from typing import TypeAlias

import tensorflow as tf

# What the op wrappers accept where a tensor goes: a tensor, a numpy array, a (nested) list or a
# Python scalar, converted with tf.convert_to_tensor (TensorFlow ships no stubs: Any to mypy).
TensorLike: TypeAlias = tf.types.experimental.TensorLike

KEY_DTYPES = (tf.int32, tf.int64)


def invalid(message: str) -> tf.errors.InvalidArgumentError:
    """An InvalidArgumentError raised from Python with ``message``."""
    return tf.errors.InvalidArgumentError(None, None, message)


def key_tensor(value: TensorLike, arg_name: str) -> tf.Tensor:
    """``value`` as an int32/int64 tensor, or an error naming ``arg_name``."""
    t = tf.convert_to_tensor(value)
    if t.dtype not in KEY_DTYPES:
        raise invalid(f"{arg_name} must be int32 or int64, got {t.dtype.name}")
    return t


def int_tensor(value: TensorLike, dtype: tf.DType, arg_name: str) -> tf.Tensor:
    """``value`` cast to the integer ``dtype``; rejects floats, strings and bools.

    A narrowing cast (int64 -> int32, uint64 -> int64, ...) is checked: a value outside
    ``dtype``'s range raises InvalidArgumentError naming ``arg_name`` (eagerly for known
    values, else when the graph runs) instead of wrapping around silently."""
    t = tf.convert_to_tensor(value)
    if not t.dtype.is_integer:
        raise invalid(f"{arg_name} must be an integer tensor, got {t.dtype.name}")
    if t.dtype == dtype:
        return t
    below, above = t.dtype.min < dtype.min, t.dtype.max > dtype.max
    if not (below or above):
        return tf.cast(t, dtype)
    message = (f"{arg_name} must fit in {dtype.name} [{dtype.min}, {dtype.max}]; got "
               f"{t.dtype.name} values outside that range")
    static = tf.get_static_value(t)
    if static is not None:
        if static.size and ((below and static.min() < dtype.min) or
                            (above and static.max() > dtype.max)):
            raise invalid(message)
        return tf.cast(t, dtype)
    checks = []
    if below:
        checks.append(tf.debugging.assert_greater_equal(
            t, tf.constant(dtype.min, t.dtype), message=message))
    if above:
        checks.append(tf.debugging.assert_less_equal(
            t, tf.constant(dtype.max, t.dtype), message=message))
    with tf.control_dependencies(checks):
        return tf.cast(t, dtype)


def float_tensor(value: TensorLike, arg_name: str) -> tf.Tensor:
    """``value`` as a float32/float64 tensor (the dtypes the recovery kernels take)."""
    t = tf.convert_to_tensor(value)
    if t.dtype not in (tf.float32, tf.float64):
        raise invalid(f"{arg_name} must be float32 or float64, got {t.dtype.name}")
    return t
