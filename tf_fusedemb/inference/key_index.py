"""KeyIndex: the stored keys and rows of one dynamic group as a SavedModel's variables,
looked up by binary search in core TensorFlow.

The rows are laid out in S segments (one per exporting rank; S = 1 for a one-process
export): segment r holds the rows whose instance ID rank r of S owns (``owner_rank``),
sorted by their hashed key and padded to a common width L with ``PAD_KEY``:

    keys    int64[S, L]        sorted within each segment, pad keys last
    lengths int64[S]           the real keys of each segment
    rows    [S, L, dim]        in the export's row dtype (``row_codec``)
    scales  float32[S, L]      int8 rows only

A lookup routes each key to its segment by its ID and finds it with ``tf.searchsorted``
(a lower bound): found where the position is below the segment's length and the key
there is equal. Every int64 is a valid key (a key equal to ``PAD_KEY`` sorts before
the padding, so its lower bound is itself), and nothing is built when the model loads:
restoring the variables is all. The variables are created with unknown shapes, so
``saved_model.pb`` does not depend on the table's size at all.
"""
from typing import NamedTuple, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tf_fusedemb.inference.row_codec import decode_rows, encode_rows, tf_dtype
from tf_fusedemb.layers.group_store import GroupStore
from tf_fusedemb.ops import hashing

PAD_KEY = np.iinfo(np.int64).max


class Segment(NamedTuple):
    """One segment padded to its width L: ``keys`` int64[L], ``length`` (real keys),
    ``rows`` [L, dim] and ``scales`` float32[L] or None (``row_codec.EncodedRows``)."""
    keys: np.ndarray
    length: int
    rows: np.ndarray
    scales: Optional[np.ndarray]


def segment_width(lengths: Sequence[int]) -> int:
    """L for segments of ``lengths`` keys: the longest, and at least 1 (one pad key at
    least, so a lookup always has a position to read, even in an empty table)."""
    return max([1, *lengths])


def pad_segment(keys: np.ndarray, values: np.ndarray, row_dtype: str, width: int) -> Segment:
    """The segment of ``keys`` int64[s] (sorted, unique) and their rows ``values``
    float32[s, dim], encoded in ``row_dtype`` and padded to ``width`` >= s."""
    encoded = encode_rows(values, row_dtype)
    pad = width - len(keys)
    rows = np.concatenate([encoded.rows, np.zeros((pad,) + encoded.rows.shape[1:],
                                                  encoded.rows.dtype)])
    scales = None if encoded.scales is None else np.concatenate(
        [encoded.scales, np.zeros([pad], np.float32)])
    return Segment(np.concatenate([keys, np.full([pad], PAD_KEY, np.int64)]), len(keys),
                   rows, scales)


def sorted_rows(keys: np.ndarray, values: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """``keys`` int64[s] and ``values`` [s, dim] in key order (signed, as searchsorted)."""
    order = np.argsort(keys, kind="stable")
    return keys[order], values[order]


class KeyIndex(tf.Module):
    """The segments' variables and their lookup.

    Args:
      segments: the S segments, of one width L (``pad_segment``).
      dim: row width.  row_dtype: "float32" | "bfloat16" | "int8".
    """

    def __init__(self, segments: Sequence[Segment], dim: int, row_dtype: str):
        super().__init__(name="key_index")
        self.dim, self.row_dtype = dim, row_dtype

        def variable(value, shape, dtype, name):
            # Unknown shapes: the graph records none of the table's sizes.
            return tf.Variable(tf.constant(value, dtype), trainable=False,
                               shape=tf.TensorShape(shape), name=name)
        self.keys = variable(np.stack([s.keys for s in segments]), [None, None], tf.int64,
                             "keys")
        self.lengths = variable(np.array([s.length for s in segments], np.int64), [None],
                                tf.int64, "lengths")
        self.rows = variable(np.stack([s.rows for s in segments]), [None, None, dim],
                             tf_dtype(row_dtype), "rows")
        self.scales = None if row_dtype != "int8" else variable(
            np.stack([np.asarray(s.scales) for s in segments]), [None, None], tf.float32, "scales")

    def lookup(self, ids: tf.Tensor, keys: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
        """(found bool[n], rows float32[n, dim]) of hashed ``keys`` int64[n] of instance
        ``ids`` int64[n] (which decide the segment); a row not found is zeros."""
        num_segments = tf.shape(self.lengths, out_type=tf.int64)[0]
        owner = hashing.tf_owner_rank(ids, num_segments)
        order = tf.argsort(owner, stable=True)  # queries grouped by segment
        segment, wanted = tf.gather(owner, order), tf.gather(keys, order)
        grouped = tf.RaggedTensor.from_value_rowids(wanted, segment, nrows=num_segments,
                                                   validate=False)  # sorted by segment
        lower = tf.searchsorted(self.keys, grouped.to_tensor(), side="left", out_type=tf.int64)
        position = tf.RaggedTensor.from_tensor(lower, lengths=grouped.row_lengths()).flat_values
        width = tf.shape(self.keys, out_type=tf.int64)[1]
        at = tf.stack([segment, tf.minimum(position, width - 1)], axis=1)
        found = tf.logical_and(position < tf.gather(self.lengths, segment),
                               tf.equal(tf.gather_nd(self.keys, at), wanted))
        rows = decode_rows(tf.gather_nd(self.rows, at),
                           None if self.scales is None else tf.gather_nd(self.scales, at))
        rows = tf.where(found[:, None], rows, tf.zeros_like(rows))
        back = tf.math.invert_permutation(order)
        return tf.gather(found, back), tf.gather(rows, back)


def read_rows(store: GroupStore, keys: np.ndarray, init_keys: np.ndarray) -> np.ndarray:
    """The stored rows float32[n, dim] of ``store``'s storage ``keys`` int64[n] (their
    ``init_keys`` int64[n] beside them), read from its table (either tier) in that order."""
    if not len(keys):
        return np.zeros([0, store.group.dim], np.float32)
    return store.lookup_rows(tf.constant(keys, tf.int64),
                             tf.constant(init_keys, tf.int64)).numpy()
