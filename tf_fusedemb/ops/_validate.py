"""Argument checks shared by the op wrappers: clear errors that name the argument."""
import tensorflow as tf

KEY_DTYPES = (tf.int32, tf.int64)


def invalid(message):
    """An InvalidArgumentError raised from Python with ``message``."""
    return tf.errors.InvalidArgumentError(None, None, message)


def key_tensor(value, arg_name):
    """``value`` as an int32/int64 tensor, or an error naming ``arg_name``."""
    t = tf.convert_to_tensor(value)
    if t.dtype not in KEY_DTYPES:
        raise invalid(f"{arg_name} must be int32 or int64, got {t.dtype.name}")
    return t


def int_tensor(value, dtype, arg_name):
    """``value`` cast to the integer ``dtype``; rejects floats, strings and bools."""
    t = tf.convert_to_tensor(value)
    if not t.dtype.is_integer:
        raise invalid(f"{arg_name} must be an integer tensor, got {t.dtype.name}")
    return tf.cast(t, dtype) if t.dtype != dtype else t


def float_tensor(value, arg_name):
    """``value`` as a float32/float64 tensor (the dtypes the recovery kernels take)."""
    t = tf.convert_to_tensor(value)
    if t.dtype not in (tf.float32, tf.float64):
        raise invalid(f"{arg_name} must be float32 or float64, got {t.dtype.name}")
    return t
