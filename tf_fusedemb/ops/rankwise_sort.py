"""``rankwise_sort`` and ``owner_rank``: routing keys to their owner ranks (step a.3)."""
import collections
from typing import Optional

import tensorflow as tf

from tf_fusedemb.ops import _loader, _validate
from tf_fusedemb.ops._validate import TensorLike

RankwiseSortResult = collections.namedtuple(
    "RankwiseSortResult", ["sorted_keys", "sorted_segment_ids", "rank_splits", "indices"])


def rankwise_sort(keys: TensorLike, segment_splits: TensorLike, num_ranks: TensorLike,
                  name: Optional[str] = None) -> RankwiseSortResult:
    """Stable counting sort of keys by owner rank, ready for ``hvd.alltoall``.

    The owner of a key is ``mix64(uint64(key)) % num_ranks`` (see
    :mod:`tf_fusedemb.ops.hashing`); it depends on the ID only, so equal IDs of
    different categories go to the same rank. Keys keep their input order within an owner.

    Args:
      keys: int32/int64[n] keys of M segments, segment-major (``segment_unique``'s output).
      segment_splits: int64[M+1] row splits of the segments.
      num_ranks: int32 scalar N > 0 (a Python int or a tensor such as ``hvd.size()``).
      name: optional name scope.

    Returns:
      RankwiseSortResult with
        sorted_keys: keys.dtype[n], grouped by owner rank 0..N-1;
        sorted_segment_ids: int32[n], the segment of each sorted key;
        rank_splits: int32[N], keys per owner, the ``splits`` of ``hvd.alltoall``;
        indices: int32[n], the paper's I_s: ``sorted_keys[indices[i]] == keys[i]``.
    """
    with tf.name_scope(name or "rankwise_sort"):
        keys = _validate.key_tensor(keys, "keys")
        splits = _validate.int_tensor(segment_splits, tf.int64, "segment_splits")
        ranks = _validate.int_tensor(num_ranks, tf.int32, "num_ranks")
        return RankwiseSortResult(*_loader.raw_op("RankwiseSort")(keys, splits, ranks))


def owner_rank(keys: TensorLike, num_ranks: TensorLike,
               name: Optional[str] = None) -> tf.Tensor:
    """Owner rank of each key, int32 with the shape of ``keys`` (the rule of rankwise_sort)."""
    with tf.name_scope(name or "owner_rank"):
        keys = _validate.key_tensor(keys, "keys")
        ranks = _validate.int_tensor(num_ranks, tf.int32, "num_ranks")
        return _loader.raw_op("OwnerRank")(keys, ranks)


tf.no_gradient("FusedEmb>RankwiseSort")
tf.no_gradient("FusedEmb>OwnerRank")
