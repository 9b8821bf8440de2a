"""The distributed lookup of ONE fused group: FusedRec Algorithm 1 over a communicator.

Forward, per step: segment_unique -> rankwise_sort -> AlltoAll of (ID, category|count) ->
category_hash on the owner -> table lookup -> AlltoAll of rows -> recovery. Backward is
the tape's: recovery gradient (local accumulation by I_r) -> the gradient AlltoAll ->
gather gradient (accumulation by I_l on the owner). Three AlltoAll rounds per step.
"""
import numpy as np
import tensorflow as tf

from tf_fusedemb import ops
from tf_fusedemb.comm import CommCounters
from tf_fusedemb.layers import recording
from tf_fusedemb.ops import hashing
from tf_fusedemb.specs import FusedGroup
from tf_fusedemb.storage.statistics import AccessStatistics

KEY_MODES = ("hashed", "packed")
# The key AlltoAll carries (ID, count << CATEGORY_BITS | category) as int64 pairs: the
# owner learns each key's category (lossless lookup) and how often the sender saw it
# (exact access statistics) without a second exchange.
CATEGORY_BITS = 16


class GroupLookup(tf.Module):
    """Owner-side table, statistics and counters of one group, and its lookup.

    Args:
      group: the FusedGroup (features, shared spec).
      communicator: a tf_fusedemb.comm.Communicator.
      key_mode: unified keys of dynamic tables, "hashed" (any ID) or "packed" (exact,
        IDs must fit; see ``tf_fusedemb.ops.category_hash``). Static tables index rows
        by ``offset[table] + id`` and need neither.
    """

    def __init__(self, group: FusedGroup, communicator, key_mode="hashed"):
        super().__init__(name=f"group_{group.name}")
        if key_mode not in KEY_MODES:
            raise ValueError(f"key_mode must be one of {KEY_MODES}, got {key_mode!r}")
        self.group = group
        self.comm = communicator
        self.key_mode = "packed" if group.is_static else key_mode
        self.table_names = [t.name for t in group.tables]
        if len(self.table_names) >= 1 << CATEGORY_BITS:
            raise ValueError(f"group '{group.name}' has {len(self.table_names)} tables; at most "
                             f"{(1 << CATEGORY_BITS) - 1} fit the key exchange")
        # Category of each feature = its table, so features sharing a table share rows.
        self._feature_table = tf.constant(group.table_index, tf.int64)
        tags = np.array([hashing.category_tag(n) for n in self.table_names], np.uint64)
        self._tags = tf.constant(tags.view(np.int64))
        self.counters = CommCounters(group.name)
        self.stats = AccessStatistics(group.name, self.table_names)
        self.table = self._make_table()

    def _make_table(self):
        from tf_fusedemb.storage import tables  # pylint: disable=import-outside-toplevel
        g = self.group
        if not g.is_static:
            return tables.DynamicGroupTable(f"fusedemb_{g.name}", g.dim, g.initializer,
                                            g.optimizer)
        sizes = [t.vocabulary_size for t in g.tables]
        self._offsets = tf.constant(np.concatenate([[0], np.cumsum(sizes)[:-1]]), tf.int64)
        init_keys = np.concatenate([hashing.hashed_unified_keys(np.arange(v), [t.name] * v)
                                    for t, v in zip(g.tables, sizes)])
        return tables.StaticGroupTable(f"fusedemb_{g.name}", g.dim, g.initializer,
                                       g.optimizer, int(sum(sizes)), init_keys)

    def key_metadata(self, keys):
        """(table index int64[u], instance ID int64[u]) of stored keys: decoded for static
        and packed keys, from the access statistics for hashed keys (eager)."""
        keys = np.asarray(keys, np.int64)
        if self.group.is_static:
            offsets = self._offsets.numpy()
            tables = np.searchsorted(offsets, keys, side="right") - 1
            return tables, keys - offsets[tables]
        if self.key_mode == "packed":
            bits = hashing.default_id_bits(len(self.table_names))
            return keys >> bits, keys & ((1 << bits) - 1)
        tables, ids = (t.numpy() for t in self.stats.key_metadata(keys))
        if (tables < 0).any():
            raise ValueError(f"group '{self.group.name}': {int((tables < 0).sum())} stored keys "
                             "have no recorded (table, ID); the statistics were not restored")
        return tables, ids

    def hashed_keys(self, ids, segment_ids):
        """Plan-independent unified keys mix64(id ^ tag(table)): int64[n]."""
        mixed = tf.bitwise.bitwise_xor(tf.cast(ids, tf.int64), tf.gather(self._tags, segment_ids))
        return tf.bitcast(hashing.tf_mix64(mixed), tf.int64)

    def __call__(self, flats, combiners):
        """Embeddings of the group's features.

        Args:
          flats: one ``FlatFeature`` per feature of the group, in group order.
          combiners: per feature 'sum' | 'mean' | 'sqrtn', or None for one row per ID.
        Returns:
          per feature float32[B_f, dim] (pooled) or float32[n_f, dim] (one row per ID).
        """
        g = self.group.name
        lengths = tf.stack([tf.size(f.ids, out_type=tf.int64) for f in flats])
        splits = tf.concat([tf.zeros([1], tf.int64), tf.cumsum(lengths)], 0)
        uniq = ops.segment_unique(tf.concat([f.ids for f in flats], 0), splits)
        srt = ops.rankwise_sort(uniq.unique_keys, uniq.unique_segment_splits, self.comm.size)
        sorted_counts = tf.gather(uniq.counts, tf.math.invert_permutation(srt.indices))
        tag = tf.bitwise.bitwise_or(
            tf.bitwise.left_shift(tf.cast(sorted_counts, tf.int64), CATEGORY_BITS),
            tf.gather(self._feature_table, srt.sorted_segment_ids))
        send = tf.stack([srt.sorted_keys, tag], axis=1)
        recv, recv_splits = self.comm.alltoall(send, srt.rank_splits, f"fusedemb/{g}/keys",
                                               self.counters)
        category = tf.cast(tf.bitwise.bitwise_and(recv[:, 1], (1 << CATEGORY_BITS) - 1), tf.int32)
        accesses = tf.bitwise.right_shift(recv[:, 1], CATEGORY_BITS)
        hashed = ops.category_hash(recv[:, 0], category, self.table_names, mode=self.key_mode)
        if self.group.is_static:
            keys = tf.gather(self._offsets, hashed.lookup_segment_ids) + hashed.lookup_ids
        else:
            keys = hashed.lookup_keys
        init_keys = (hashed.lookup_keys if self.key_mode == "hashed"
                     else self.hashed_keys(hashed.lookup_ids, hashed.lookup_segment_ids))
        with tf.control_dependencies([self.stats.record(hashed, accesses)]):
            rows = self.table.lookup(keys, init_keys)
        rows.set_shape([None, self.group.dim])  # collectives and tables lose the static dim
        active = recording.active()
        if active is not None:
            tape, records = active
            tape.watch(rows)
            records.append(recording.LookupRecord(rows, keys, init_keys, self.table, None, g))
        served = tf.gather(rows, hashed.inverse)
        back, _ = self.comm.alltoall(served, recv_splits, f"fusedemb/{g}/rows", self.counters)
        back.set_shape([None, self.group.dim])
        return ops.recover_features(back, srt.indices, uniq.inverse,
                                    [f.row_splits for f in flats], combiners)
