"""The key exchange's wire format and the plan-independent unified key, one op each.

A key travels to its owner as the int64 pair ``(ID, count << category_bits() | table)``
(``tf_fusedemb.layers.exchange``): the owner learns the key's table and how often the
requester saw it without a second exchange.

* :func:`pack_key_messages`: the messages of ``rankwise_sort``'s output, in sorted order;
* :func:`unpack_key_messages`: their fields on the owner;
* :func:`hashed_unified_keys`: ``mix64(uint64(id) ^ tag[table])`` (the key that names a
  row's initial values and the hashed storage key; ``tf_fusedemb.ops.hashing`` mirrors it).
"""
import collections
import functools
from typing import Optional

import tensorflow as tf

from tf_fusedemb.ops import _loader, _validate
from tf_fusedemb.ops._validate import TensorLike



@functools.lru_cache(maxsize=None)
def category_bits() -> int:
    """The bits of a message's table field, as the op library defines them (its one
    definition, custom_ops/key_messages_kernels.cc); loads the library on first use."""
    with tf.init_scope():  # a constant, read eagerly even while a step is traced
        return int(_loader.raw_op("KeyMessageCategoryBits")())


def max_count() -> int:
    """The largest count a message carries: ``count << category_bits()`` stays a
    non-negative int64."""
    return (1 << (63 - category_bits())) - 1

KeyMessages = collections.namedtuple("KeyMessages", ["ids", "counts", "tables"])


def pack_key_messages(sorted_keys: TensorLike, sorted_segment_ids: TensorLike,
                      indices: TensorLike, counts: TensorLike, segment_table: TensorLike,
                      name: Optional[str] = None) -> tf.Tensor:
    """Key messages of rank-sorted keys, in one op.

    For unique key ``u`` at sorted position ``p = indices[u]``, ``messages[p] =
    (sorted_keys[p], counts[u] << category_bits() | segment_table[sorted_segment_ids[p]])``:
    what ``gather(counts, invert_permutation(indices))``, ``gather(segment_table,
    sorted_segment_ids)``, the shifts and a stack compute.

    Args:
      sorted_keys: int32/int64[n], ``rankwise_sort``'s ``sorted_keys``.
      sorted_segment_ids: int32[n], its ``sorted_segment_ids`` (in ``[0, M)``).
      indices: int32[n], its ``indices`` (I_s, a permutation of ``[0, n)``).
      counts: int32/int64[n] occurrences of each key in unique (pre-sort) order, in
        ``[0, max_count()]``.
      segment_table: int64[M] table index of each segment, in ``[0, 2^category_bits() - 1)``
        (the last value marks a bad-input report).
      name: optional name scope.

    Returns:
      int64[n, 2] key messages in sorted order. InvalidArgumentError names the argument
      of a length mismatch, a segment or table out of range, a count that does not fit or
      ``indices`` that are not a permutation.
    """
    with tf.name_scope(name or "pack_key_messages"):
        keys = _validate.key_tensor(sorted_keys, "sorted_keys")
        segs = _validate.int_tensor(sorted_segment_ids, tf.int32, "sorted_segment_ids")
        idx = _validate.int_tensor(indices, tf.int32, "indices")
        cnt = _validate.key_tensor(counts, "counts")
        table = _validate.int_tensor(segment_table, tf.int64, "segment_table")
        return _loader.raw_op("PackKeyMessages")(keys, segs, idx, cnt, table)


def unpack_key_messages(messages: TensorLike, name: Optional[str] = None) -> KeyMessages:
    """The fields of key messages int64[n, 2], in one op.

    Returns:
      KeyMessages with ``ids`` int64[n] (``messages[:, 0]``), ``counts`` int64[n]
      (``messages[:, 1] >> category_bits()``, arithmetic) and ``tables`` int32[n] (the low
      category_bits() bits). Any message decodes, a bad-input report's too (its table field
      is ``exchange.bad_input()``).
    """
    with tf.name_scope(name or "unpack_key_messages"):
        messages = _validate.int_tensor(messages, tf.int64, "messages")
        return KeyMessages(*_loader.raw_op("UnpackKeyMessages")(messages))


def hashed_unified_keys(ids: TensorLike, tables: TensorLike, tags: TensorLike,
                        name: Optional[str] = None) -> tf.Tensor:
    """Plan-independent unified keys ``mix64(uint64(ids[i]) ^ uint64(tags[tables[i]]))``.

    Args:
      ids: int32/int64[n] instance IDs (int32 sign-extended, as ``tf.cast``).
      tables: int32/int64[n] table index of each ID, in ``[0, T)``.
      tags: int64[T] table tags (``hashing.category_tags(table_names)``).
      name: optional name scope.

    Returns:
      int64[n]; equal to ``hashing.hashed_unified_keys(ids, names)`` with
      ``names[i] = table_names[tables[i]]``.
    """
    with tf.name_scope(name or "hashed_unified_keys"):
        ids = _validate.key_tensor(ids, "ids")
        tables = _validate.key_tensor(tables, "tables")
        tags = _validate.int_tensor(tags, tf.int64, "tags")
        return _loader.raw_op("HashedUnifiedKeys")(ids, tables, tags)


tf.no_gradient("FusedEmb>PackKeyMessages")
tf.no_gradient("FusedEmb>UnpackKeyMessages")
tf.no_gradient("FusedEmb>HashedUnifiedKeys")
