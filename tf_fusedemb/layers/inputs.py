"""Feature inputs to flat IDs and row splits, with errors that name the feature."""
from typing import Any, List, Optional, Tuple, Union

import tensorflow as tf

from tf_fusedemb.ops import static_sizes
from tf_fusedemb.ops.recovery import SampleSplits, UniformSplits
from tf_fusedemb.ops.row_masks import masked_examples, masked_rows
from tf_fusedemb.specs import FeatureSpec


class FlatFeature:
    """One feature's IDs flattened: ``ids`` int64[n], ``row_splits`` int64[B+1] per
    sample, ``dense_length`` L when the input was a dense [B, L] tensor (else None).

    Give ``row_splits``, or ``ids_per_sample`` L when every sample has exactly L IDs (a
    [B] or [B, L] input): then ``row_splits`` is only built if something reads it; the
    step's recovery pools such a feature from L alone (``sample_splits``), so a model of
    many one-ID features runs no per-feature splits op."""

    def __init__(self, ids: tf.Tensor, row_splits: Optional[tf.Tensor] = None,
                 dense_length: Optional[int] = None, ids_per_sample: Optional[int] = None):
        if (row_splits is None) == (ids_per_sample is None):
            raise ValueError("FlatFeature: give row_splits or ids_per_sample, not both")
        self.ids, self.dense_length, self.ids_per_sample = ids, dense_length, ids_per_sample
        self._row_splits = row_splits
        # A deferred range check (``flatten_feature(defer_range_check=True)``): bool[n]
        # marking the IDs out of range; None: nothing to check.
        self.invalid: Optional[tf.Tensor] = None

    @property
    def row_splits(self) -> tf.Tensor:
        """int64[B+1]: sample b's IDs are ``ids[row_splits[b]:row_splits[b+1]]``."""
        if self._row_splits is None:
            splits = tf.range(self.batch_size + 1, dtype=tf.int64)
            self._row_splits = splits if self.ids_per_sample == 1 else \
                splits * self.ids_per_sample
        return self._row_splits

    @property
    def batch_size(self) -> tf.Tensor:
        """int64 scalar B, the samples of the batch."""
        if self.ids_per_sample is None:
            return tf.shape(self.row_splits, out_type=tf.int64)[0] - 1
        n = tf.size(self.ids, out_type=tf.int64)
        return n if self.ids_per_sample == 1 else n // self.ids_per_sample

    def sample_splits(self) -> SampleSplits:
        """How the IDs split into samples, for ``recover_features``: ``UniformSplits``
        where every sample has the same number of IDs, else ``row_splits``."""
        if self.ids_per_sample is None:
            return self.row_splits
        return UniformSplits(self.ids_per_sample, static_sizes.num_elements(self.ids))


def flatten_feature(spec: FeatureSpec, value: Any, id_bits: Optional[int] = None,
                    defer_range_check: bool = False) -> FlatFeature:
    """int32/int64 ``[B]`` (one ID per sample), ``[B, L]`` (L IDs per sample, no padding),
    ``tf.RaggedTensor [B, None]`` or ``tf.SparseTensor [B, L]`` -> FlatFeature.

    A SparseTensor may come in any index order (it is reordered); a pooled feature's
    sample may have gaps between its columns, a sequence feature's may not (its IDs must
    be left-aligned, columns 0..len-1); repeated or out-of-shape indices are errors.

    Raises ValueError naming the feature for a wrong dtype or rank; static-vocabulary
    features get a run-time check that IDs lie in ``[0, vocabulary_size)``, tables with
    ``key_dtype="int32"`` one that IDs fit in int32, and ``id_bits`` (packed unified keys
    of a dynamic table) one that IDs lie in ``[0, 2^id_bits)``; the error names the
    feature and the first bad ID. ``defer_range_check``: no check here, the result's
    ``invalid`` (bool[n]) is set instead, for a caller that reports a bad ID to every rank
    (``GroupLookup.route``)."""
    name = spec.name
    if value is None:
        raise ValueError(f"feature '{name}': got None instead of a tensor of IDs")
    if isinstance(value, tf.SparseTensor):
        value = _sparse_to_ragged(spec, value)
    if isinstance(value, tf.RaggedTensor):
        if value.ragged_rank != 1 or value.shape.rank != 2:
            raise ValueError(f"feature '{name}': a RaggedTensor input must be [B, None], got "
                             f"shape {value.shape} with ragged_rank {value.ragged_rank}")
        flat = FlatFeature(value.flat_values, tf.cast(value.row_splits, tf.int64))
    else:
        value = to_tensor(name, value)
        _check_dtype(name, value.dtype)
        if value.shape.rank == 1:
            flat = FlatFeature(value, ids_per_sample=1)
        elif value.shape.rank == 2 and (value.shape[1] or 0) >= 1:  # L IDs per sample
            flat = FlatFeature(tf.reshape(value, [-1]), dense_length=value.shape[1],
                               ids_per_sample=value.shape[1])
        elif value.shape.rank == 2:  # L unknown when traced (or 0)
            batch = tf.shape(value, out_type=tf.int64)[0]
            length = tf.shape(value, out_type=tf.int64)[1]
            flat = FlatFeature(tf.reshape(value, [-1]),
                               tf.range(batch + 1, dtype=tf.int64) * length, value.shape[1])
        else:
            raise ValueError(f"feature '{name}': expected a [B] or [B, L] tensor, a "
                             f"RaggedTensor or a SparseTensor, got shape {value.shape}")
    _check_dtype(name, flat.ids.dtype)
    wide = flat.ids.dtype == tf.int64
    flat.ids = tf.cast(flat.ids, tf.int64)
    ranges = id_ranges(spec, id_bits, wide)
    if ranges:
        invalid = tf.zeros_like(flat.ids, tf.bool)
        for low, limit, _ in ranges:
            invalid = tf.logical_or(invalid, tf.logical_or(
                flat.ids < tf.constant(low, tf.int64), flat.ids >= tf.constant(limit, tf.int64)))
        if defer_range_check:
            flat.invalid = invalid
        else:
            flat.ids = _check_range(name, flat.ids, invalid,
                                    " and ".join(words for _, _, words in ranges))
    if spec.is_sequence and flat.dense_length is None:
        lengths = flat.row_splits[1:] - flat.row_splits[:-1]
        too_long = lengths > spec.max_len
        with tf.control_dependencies([tf.debugging.Assert(
                tf.logical_not(tf.reduce_any(too_long)),
                [f"feature '{name}': a sequence is longer than max_len={spec.max_len}; "
                 "raise max_len or truncate it in the input pipeline; lengths",
                 masked_examples(too_long, lengths)])]):
            flat.ids = tf.identity(flat.ids)
    return flat


def id_ranges(spec: FeatureSpec, id_bits: Optional[int] = None,
              wide: bool = True) -> List[Tuple[int, int, str]]:
    """[(low, limit, the range in words)]: the ranges [low, limit) a feature's IDs must lie
    in: a static table's vocabulary, ``id_bits`` of packed keys, int32 for a
    ``key_dtype="int32"`` table fed int64 (``wide``) IDs. Empty: any int64 ID."""
    ranges: List[Tuple[int, int, str]] = []
    if spec.table.is_static:
        size = spec.table.vocabulary_size
        assert size is not None  # a static table has one (TableSpec checks)
        ranges.append((0, size, f"[0, {size}) of its static table"))
    elif id_bits is not None:
        ranges.append((0, 1 << id_bits, f"[0, 2^{id_bits}) of key_mode='packed'"))
    if wide and spec.table.key_dtype == "int32" and not spec.table.is_static:
        int32 = tf.int32
        ranges.append((int32.min, int32.max + 1, f"[{int32.min}, {int32.max}] of its "
                                                 "key_dtype='int32' table"))
    return ranges


def _check_dtype(name, dtype):
    if dtype not in (tf.int32, tf.int64):
        raise ValueError(f"feature '{name}': IDs must be int32 or int64, got {dtype.name}")


def to_tensor(name: str, value: Any) -> Union[tf.Tensor, tf.RaggedTensor, tf.SparseTensor]:
    """``value`` (a tensor, numpy array or Python list) as a tensor, or a ValueError naming
    the feature (e.g. Python ints beyond int64, ragged nested lists, None)."""
    if isinstance(value, (tf.Tensor, tf.RaggedTensor, tf.SparseTensor)):
        return value
    try:
        return tf.convert_to_tensor(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"feature '{name}': cannot convert the input to a tensor of IDs "
                         f"({e})") from e


def out_of_range_message(feature: Union[str, tf.Tensor], bad_id: tf.Tensor,
                         valid_range: Union[str, tf.Tensor], where: str = "") -> tf.Tensor:
    """The error of an ID out of range, as a string tensor: ``feature '<name>': ID <id>
    is out of range <range><where>``; ``feature`` and ``valid_range`` are strings or string
    tensors, ``bad_id`` an int64 scalar tensor. (A traced Assert prints the quotes
    escaped, \\', as in the other input errors.)"""
    return tf.strings.join(["feature '", feature, "': ID ", tf.strings.as_string(bad_id),
                            " is out of range ", valid_range, where])


def _check_range(name, ids, invalid, valid_range):
    """``ids`` once none is ``invalid`` (bool[n]); else an InvalidArgumentError naming the
    feature and the first bad ID (not the first IDs of the batch)."""
    first_bad = tf.concat([masked_rows(invalid, ids)[0][:1], tf.zeros([1], tf.int64)], 0)[0]
    check = tf.debugging.Assert(tf.logical_not(tf.reduce_any(invalid)),
                                [out_of_range_message(name, first_bad, valid_range)])
    with tf.control_dependencies([check]):
        return tf.identity(ids)


def _sparse_to_ragged(spec, st):
    """A SparseTensor [B, L] as a RaggedTensor [B, None] holding each sample's IDs in
    column order. ``tf.RaggedTensor.from_sparse`` is not used: it silently assigns the
    values of unordered indices to the wrong samples and its errors name no feature."""
    name = spec.name
    if st.shape.rank is not None and st.shape.rank != 2:
        raise ValueError(f"feature '{name}': a SparseTensor input must be [B, L], got "
                         f"shape {st.shape}")
    _check_dtype(name, st.values.dtype)
    prefix = f"feature '{name}': SparseTensor"
    shape = st.dense_shape
    rank_check = tf.debugging.assert_equal(tf.size(shape), 2, message=f"{prefix} must be [B, L]")
    with tf.control_dependencies([rank_check]):  # before indices[:, 1] can fail unnamed
        st = tf.sparse.reorder(tf.SparseTensor(tf.identity(st.indices), st.values, shape))
    rows, cols = st.indices[:, 0], st.indices[:, 1]
    # After reorder, a repeated index is equal to its predecessor.
    repeated = tf.reduce_any(tf.logical_and(tf.equal(rows[1:], rows[:-1]),
                                            tf.equal(cols[1:], cols[:-1])))
    checks = [
        tf.debugging.assert_non_negative(st.indices, message=f"{prefix} has a negative index"),
        tf.debugging.assert_less(rows, shape[0], message=f"{prefix} has a row index >= B"),
        tf.debugging.assert_less(cols, shape[1], message=f"{prefix} has a column index >= L"),
        tf.debugging.assert_equal(repeated, False, message=f"{prefix} has a repeated index"),
    ]
    with tf.control_dependencies(checks):  # before the row ids index anything
        rows = tf.identity(rows)
    ragged = tf.RaggedTensor.from_value_rowids(st.values, rows, nrows=shape[0], validate=False)
    if not spec.is_sequence:
        return ragged
    # A sequence keeps positions: column j must be the sample's j-th ID (no gaps).
    position = tf.range(tf.size(rows, out_type=tf.int64)) - tf.gather(ragged.row_splits, rows)
    aligned = tf.debugging.assert_equal(
        cols, position, message=f"{prefix} of a sequence feature must be left-aligned "
                                "(columns 0..len-1 of each sample, no gaps)")
    with tf.control_dependencies([aligned]):
        return tf.RaggedTensor.from_row_splits(tf.identity(ragged.flat_values),
                                               ragged.row_splits, validate=False)
