"""``segment_unique``: FusedRec's one-pass, category-aware deduplication (step a.2)."""
import collections
from typing import Optional

import tensorflow as tf

from tf_fusedemb.ops import _loader, _validate
from tf_fusedemb.ops._validate import TensorLike

SegmentUniqueResult = collections.namedtuple(
    "SegmentUniqueResult", ["unique_keys", "unique_segment_splits", "inverse", "counts"])


def segment_unique(keys: TensorLike, segment_splits: TensorLike,
                   name: Optional[str] = None) -> SegmentUniqueResult:
    """Removes duplicates inside each segment of a fused key vector, in one op.

    Equal keys in different segments are kept (a0 and b0 both stay). Segments keep their
    order, keys keep first-occurrence order within a segment.

    Args:
      keys: int32/int64[n], the keys of M categories concatenated segment-major.
      segment_splits: int64[M+1] row splits of the categories (int32 is cast).
      name: optional name scope.

    Returns:
      SegmentUniqueResult with
        unique_keys: keys.dtype[u], with ``unique_keys[inverse[i]] == keys[i]``;
        unique_segment_splits: int64[M+1], row splits of ``unique_keys``;
        inverse: int32[n], the paper's I_u;
        counts: int32[u], occurrences of each unique key.

    Example:
      >>> r = segment_unique([5, 7, 5, 5, 9], [0, 3, 5])   # doctest: +SKIP
      >>> r.unique_keys  -> [5, 7, 5, 9];  r.unique_segment_splits -> [0, 2, 4]
    """
    with tf.name_scope(name or "segment_unique"):
        keys = _validate.key_tensor(keys, "keys")
        splits = _validate.int_tensor(segment_splits, tf.int64, "segment_splits")
        return SegmentUniqueResult(*_loader.raw_op("SegmentUnique")(keys, splits))


tf.no_gradient("FusedEmb>SegmentUnique")
