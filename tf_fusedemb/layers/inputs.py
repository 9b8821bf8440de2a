"""Feature inputs to flat IDs and row splits, with errors that name the feature."""
import tensorflow as tf

from tf_fusedemb.specs import FeatureSpec


class FlatFeature:
    """One feature's IDs flattened: ``ids`` int64[n], ``row_splits`` int64[B+1] per
    sample, ``dense_length`` L when the input was a dense [B, L] tensor (else None)."""

    def __init__(self, ids, row_splits, dense_length=None):
        self.ids, self.row_splits, self.dense_length = ids, row_splits, dense_length

    @property
    def batch_size(self):
        return tf.shape(self.row_splits, out_type=tf.int64)[0] - 1


def flatten_feature(spec: FeatureSpec, value) -> FlatFeature:
    """int32/int64 ``[B]`` (one ID per sample), ``[B, L]`` (L IDs per sample, no padding),
    ``tf.RaggedTensor [B, None]`` or ``tf.SparseTensor [B, L]`` -> FlatFeature.

    Raises ValueError naming the feature for a wrong dtype or rank; static-vocabulary
    features get a run-time check that IDs lie in ``[0, vocabulary_size)``."""
    name = spec.name
    if isinstance(value, tf.SparseTensor):
        value = tf.RaggedTensor.from_sparse(value)
    if isinstance(value, tf.RaggedTensor):
        if value.ragged_rank != 1 or value.shape.rank != 2:
            raise ValueError(f"feature '{name}': a RaggedTensor input must be [B, None], got "
                             f"shape {value.shape} with ragged_rank {value.ragged_rank}")
        flat = FlatFeature(value.flat_values, tf.cast(value.row_splits, tf.int64))
    else:
        value = tf.convert_to_tensor(value)
        _check_dtype(name, value.dtype)
        if value.shape.rank == 1:
            n = tf.size(value, out_type=tf.int64)
            flat = FlatFeature(value, tf.range(n + 1, dtype=tf.int64))
        elif value.shape.rank == 2:
            batch = tf.shape(value, out_type=tf.int64)[0]
            length = tf.shape(value, out_type=tf.int64)[1]
            flat = FlatFeature(tf.reshape(value, [-1]),
                               tf.range(batch + 1, dtype=tf.int64) * length, value.shape[1])
        else:
            raise ValueError(f"feature '{name}': expected a [B] or [B, L] tensor, a "
                             f"RaggedTensor or a SparseTensor, got shape {value.shape}")
    _check_dtype(name, flat.ids.dtype)
    flat.ids = tf.cast(flat.ids, tf.int64)
    if spec.table.is_static:
        flat.ids = _check_range(name, flat.ids, spec.table.vocabulary_size)
    if spec.is_sequence and flat.dense_length is None:
        lengths = flat.row_splits[1:] - flat.row_splits[:-1]
        with tf.control_dependencies([tf.debugging.assert_less_equal(
                lengths, tf.constant(spec.max_len, tf.int64),
                message=f"feature '{name}': a sequence is longer than max_len={spec.max_len}; "
                        "raise max_len or truncate it in the input pipeline")]):
            flat.ids = tf.identity(flat.ids)
    return flat


def _check_dtype(name, dtype):
    if dtype not in (tf.int32, tf.int64):
        raise ValueError(f"feature '{name}': IDs must be int32 or int64, got {dtype.name}")


def _check_range(name, ids, vocabulary_size):
    checks = [
        tf.debugging.assert_non_negative(ids, message=f"feature '{name}': negative ID"),
        tf.debugging.assert_less(ids, tf.constant(vocabulary_size, tf.int64),
                                 message=f"feature '{name}': ID out of range "
                                         f"[0, {vocabulary_size}) of its static table"),
    ]
    with tf.control_dependencies(checks):
        return tf.identity(ids)
