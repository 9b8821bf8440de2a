"""``category_hash``: deferred category hashing and the owner-side unique (step b.1).

Runs on the owner after the key AlltoAll, where both the category and the instance ID
of every received key are known, so statistics stay lossless.

Collision behaviour:
  * ``mode="packed"`` is exact: key = ``(category << id_bits) | id``; it needs IDs in
    ``[0, 2^id_bits)``, ``id_bits = 63 - ceil(log2(M))`` by default, and raises
    InvalidArgumentError naming the category of the first ID that does not fit.
  * ``mode="hashed"`` takes any int64 ID: key = ``mix64(uint64(id) ^ tag(category))``.
    ``mix64`` is a bijection, so two IDs of ONE category never collide; IDs x of
    category a and y of category b collide exactly when ``x ^ y == tag(a) ^ tag(b)``
    (:func:`collision_partner` constructs them). Colliding pairs share one table row;
    each call reports how many (category, id) pairs met a key held by another pair.
"""
import collections
from typing import Optional, Sequence

import numpy as np
import tensorflow as tf

from tf_fusedemb.ops import _loader, _validate, hashing
from tf_fusedemb.ops._validate import TensorLike

CategoryHashResult = collections.namedtuple(
    "CategoryHashResult", ["lookup_keys", "lookup_ids", "lookup_segment_ids", "inverse",
                           "counts", "num_collisions"])
MODES = ("hashed", "packed")


def category_hash(ids: TensorLike, segment_ids: TensorLike, categories: Sequence[str],
                  mode: str = "hashed", id_bits: Optional[int] = None,
                  name: Optional[str] = None) -> CategoryHashResult:
    """Unified keys H(category, id) of received keys, deduplicated.

    Args:
      ids: int32/int64[n] instance IDs received from all peers.
      segment_ids: int32[n] category index of each ID, in ``[0, M)``.
      categories: M category (feature) names of the fused group, in segment order.
      mode: ``"hashed"`` (any ID) or ``"packed"`` (exact, IDs must fit; see module doc).
      id_bits: packed mode only, bits of the ID part (default ``63 - ceil(log2(M))``).
      name: optional name scope.

    Returns:
      CategoryHashResult with
        lookup_keys: int64[u] unique unified keys, first-occurrence order (the table keys);
        lookup_ids: ids.dtype[u] instance ID behind each key (its first pair);
        lookup_segment_ids: int32[u] category behind each key;
        inverse: int32[n], the paper's I_l: ``lookup_keys[inverse[i]]`` is the key of i;
        counts: int32[u] occurrences of each key;
        num_collisions: int64 scalar, pairs that met a key of another pair (hashed mode).
    """
    categories = [str(c) for c in categories]
    if not categories:
        raise _validate.invalid("categories must name at least one category")
    if len(set(categories)) != len(categories):
        raise _validate.invalid(f"categories must be distinct, got {categories}")
    if mode not in MODES:
        raise _validate.invalid(f"mode must be one of {MODES}, got {mode!r}")
    if id_bits is not None and mode != "packed":
        raise _validate.invalid("id_bits is only meaningful with mode='packed'")
    with tf.name_scope(name or "category_hash"):
        ids = _validate.key_tensor(ids, "ids")
        segs = _validate.int_tensor(segment_ids, tf.int32, "segment_ids")
        return CategoryHashResult(*_loader.raw_op("CategoryHash")(
            ids, segs, categories=categories, mode=mode,
            id_bits=-1 if id_bits is None else int(id_bits)))


def category_key_strings(segment_ids: TensorLike, ids: TensorLike,
                         categories: Sequence[str]) -> tf.Tensor:
    """Readable "name/ID" strings of (category, id) pairs, for reports.

    ``segment_ids``: int32[n] category index, ``ids``: int[n]; returns tf.string[n]."""
    names = tf.constant([str(c) for c in categories])
    return tf.strings.join([tf.gather(names, segment_ids), tf.strings.as_string(ids)], "/")


def collision_partner(x: int, category_a: str, category_b: str) -> int:
    """The one ID y of ``category_b`` whose hashed key equals that of ID x of ``category_a``."""
    delta = int(hashing.category_tag(category_a) ^ hashing.category_tag(category_b))
    y = (int(x) & 0xFFFFFFFFFFFFFFFF) ^ delta
    return y - (1 << 64) if y >= (1 << 63) else y  # back to a signed int64 ID


tf.no_gradient("FusedEmb>CategoryHash")
