"""GroupKeys: how one fused group names its rows, both ways.

A row is the pair (table, instance ID). Its *storage key* is what the group's table is
keyed by:

* static tables (``vocabulary_size``): ``offset[table] + ID``, a dense index;
* ``key_mode="packed"``: ``(table << id_bits) | ID``, exact (IDs must fit);
* ``key_mode="hashed"``: ``mix64(ID ^ tag(table))``, any int64 ID.

Its *init key* is always the hashed key: the plan-independent seed of its initial row,
so a row starts the same whatever the fusion plan, key mode or number of ranks. The owner
computes both in the step's graph (:meth:`GroupKeys.owner_keys`, from the key exchange's
``category_hash``); checkpoints, weight loading and sharded inference compute them on the
host (:meth:`GroupKeys.storage_keys`) and decode stored keys (:meth:`GroupKeys.decode`).
The one-host serving lookup computes the hashed key in core TensorFlow
(:meth:`GroupKeys.serving_keys`) so its SavedModel needs no custom op.
"""
from typing import Any, Optional, Tuple

import numpy as np
import tensorflow as tf

from tf_fusedemb import ops
from tf_fusedemb.ops import hashing
from tf_fusedemb.specs import FusedGroup
from tf_fusedemb.storage.static_keys import StaticKeys


class GroupKeys:
    """The key codec of one group.

    Args:
      group: the FusedGroup (its tables in category order, features, static or not).
      key_mode: "hashed" or "packed" for dynamic tables (static tables ignore it).

    Attributes:
      table_names: the group's table names, in category order.
      feature_table: int64[M], each feature's table index (features sharing a table
        share rows).
      tags: int64[T], each table's hash tag (the uint64 bits, as graphs take them).
    """

    def __init__(self, group: FusedGroup, key_mode: str):
        self.group, self.key_mode = group, key_mode
        self.table_names = [t.name for t in group.tables]
        self.feature_table = tf.constant(group.table_index, tf.int64)
        # uint64 bits for host-side keys, int64 in graphs (TF has no uint64 XOR on CPU).
        self._tag_bits = hashing.category_tags(self.table_names).view(np.uint64)
        self.tags = tf.constant(self._tag_bits.view(np.int64))
        # A static group's key arithmetic, shared with its table.
        self.static_keys = StaticKeys.of([t.vocabulary_size or 0 for t in group.tables],
                                         self._tag_bits)

    @property
    def table_offsets(self) -> tf.Tensor:
        """Static groups: int64[T], the first key of each table (key = offset[table] + ID)."""
        if not self.group.is_static:
            raise ValueError(f"group '{self.group.name}' is dynamic: its keys have no offsets")
        return tf.constant(self.static_keys.offsets)

    def hashed_keys(self, ids: tf.Tensor, segment_ids: tf.Tensor) -> tf.Tensor:
        """Hashed keys mix64(id ^ tag(table)) of ``ids`` int[n] of the tables
        ``segment_ids`` int[n] (the op): int64[n]."""
        return ops.hashed_unified_keys(ids, segment_ids, self.tags)

    def owner_keys(self, hashed: Any) -> Tuple[tf.Tensor, tf.Tensor]:
        """(storage keys int64[u_l], init keys int64[u_l]) on the owner, from the
        ``category_hash`` result of the received key messages (in the step's graph)."""
        if self.group.is_static:
            keys = tf.gather(self.table_offsets, hashed.lookup_segment_ids) \
                + hashed.lookup_ids
        else:
            keys = hashed.lookup_keys
        init_keys = (hashed.lookup_keys if self.key_mode == "hashed"
                     else self.hashed_keys(hashed.lookup_ids, hashed.lookup_segment_ids))
        return keys, init_keys

    def storage_keys(self, ids: np.ndarray, tables: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(storage keys int64[n], init keys int64[n]) of instance ``ids`` int64[n] of the
        tables ``tables`` int64[n] (indices into ``table_names``), on the host."""
        ids, tables = np.asarray(ids, np.int64), np.asarray(tables, np.int64)
        hashed = hashing.tagged_keys(ids, self._tag_bits[tables])
        if self.group.is_static:
            return self.static_keys.keys(ids, tables), hashed
        if self.key_mode == "packed":
            return hashing.packed_unified_keys(ids, tables, len(self.table_names)), hashed
        return hashed, hashed

    def decode(self, keys: np.ndarray, stats: Optional[Any] = None
               ) -> Tuple[np.ndarray, np.ndarray]:
        """(table index int64[u], instance ID int64[u]) of stored ``keys`` int64[u]:
        arithmetic for static and packed keys; hashed keys are one-way, so their identity
        comes from the access statistics ``stats`` (eager), which record it for every
        stored row."""
        keys = np.asarray(keys, np.int64)
        if self.group.is_static:
            return self.static_keys.identity(keys)
        if self.key_mode == "packed":
            bits = hashing.default_id_bits(len(self.table_names))
            return keys >> bits, keys & ((1 << bits) - 1)
        if stats is None:
            raise ValueError(f"group '{self.group.name}': hashed keys are decoded from the "
                             "access statistics; pass them")
        tables, ids = (t.numpy() for t in stats.key_metadata(keys))
        if (tables < 0).any():
            raise ValueError(f"group '{self.group.name}': {int((tables < 0).sum())} of "
                             f"{len(keys)} stored keys have no recorded (table, ID), e.g. "
                             f"{keys[tables < 0][:3].tolist()}; every path that stores a row "
                             "records its identity, so the table holds a key none of them wrote")
        return tables, ids

    def serving_keys(self, ids: tf.Tensor, table: tf.Tensor) -> tf.Tensor:
        """Hashed keys int64[n] of ``ids`` int64[n] of tables ``table`` int64[n] in core
        TensorFlow ops (not the op library's kernel), for a SavedModel that must load
        without it."""
        mixed = tf.bitwise.bitwise_xor(ids, tf.gather(self.tags, table))
        return tf.bitcast(hashing.tf_mix64(mixed), tf.int64)
