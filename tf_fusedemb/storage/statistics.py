"""Lossless access statistics of one fused group on its owner rank.

Recorded from the outputs of ``category_hash`` (step b.1), where every key still carries
its category and instance ID, so reports can name "feature/ID" even in hashed mode.
Per key: its access count, (category, ID) and the last step it was seen, which the
admission and eviction policies (``tf_fusedemb.storage.policy``) decide by.
"""
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tf_fusedemb.ops.category_hash import CategoryHashResult


class AccessStatistics(tf.Module):
    """Per-category and per-instance access counts of the keys this rank owns.

    Args:
      group_name: the fused group's name (used in variable names).
      categories: the group's M category (table) names, in segment order.
    """

    def __init__(self, group_name: str, categories: Sequence[str]):
        super().__init__(name=f"stats_{group_name}")
        self.categories = tuple(categories)
        with tf.init_scope():
            self.category_counts = tf.Variable(tf.zeros([len(categories)], tf.int64),
                                               trainable=False, name=f"{group_name}_cat_counts")
            self.last_unique_keys = tf.Variable(tf.constant(0, tf.int64), trainable=False,
                                                name=f"{group_name}_last_unique")
            self.last_received_keys = tf.Variable(tf.constant(0, tf.int64), trainable=False,
                                                  name=f"{group_name}_last_received")
            self.collisions = tf.Variable(tf.constant(0, tf.int64), trainable=False,
                                          name=f"{group_name}_collisions")
            self._make_key_storage()

    def _make_key_storage(self):
        """The per-key storage: four core-TF hash tables here (EngineStatistics keeps the
        same fields in the blocks of the group's storage engine instead)."""
        # unified key -> count, and -> the (category, id) pair behind it.
        self._counts = tf.lookup.experimental.MutableHashTable(tf.int64, tf.int64, 0)
        self._ids = tf.lookup.experimental.MutableHashTable(tf.int64, tf.int64, 0)
        self._cats = tf.lookup.experimental.MutableHashTable(tf.int64, tf.int64, -1)
        # unified key -> the last (training) step it was seen: TTL eviction's clock.
        self._last = tf.lookup.experimental.MutableHashTable(tf.int64, tf.int64, 0)

    def record(self, hashed: CategoryHashResult, accesses: tf.Tensor,
               step: Optional[tf.Tensor] = None) -> Optional[tf.Operation]:
        """Adds one step's owner-side lookups; returns an op.

        Args:
          hashed: the ``CategoryHashResult`` of the received keys.
          accesses: int64[n] occurrences of each received key in its sender's batch.
          step: int64 scalar, the step these accesses belong to (the group's step
            counter after this step's update), recorded as the keys' last step; None
            leaves the last steps as they are.
        """
        keys = hashed.lookup_keys
        counts = tf.math.unsorted_segment_sum(accesses, hashed.inverse, tf.size(keys))
        return tf.group(
            self._record_keys(keys, hashed, counts, step),
            self.category_counts.assign_add(tf.math.unsorted_segment_sum(
                counts, hashed.lookup_segment_ids, len(self.categories))),
            self.last_unique_keys.assign(tf.size(keys, out_type=tf.int64)),
            self.last_received_keys.assign(tf.size(accesses, out_type=tf.int64)),
            self.collisions.assign_add(hashed.num_collisions))

    def _record_keys(self, keys, hashed, counts, step):
        """Adds ``counts`` int64[u] to the unique ``keys`` int64[u], records their (category,
        ID) from ``hashed`` and, unless ``step`` is None, their last step; returns an op."""
        new_counts = self._counts.lookup(keys) + counts
        last = [] if step is None else [self._last.insert(
            keys, tf.fill(tf.shape(keys), tf.cast(step, tf.int64)))]
        return tf.group(*last,
            self._counts.insert(keys, new_counts),
            self._ids.insert(keys, tf.cast(hashed.lookup_ids, tf.int64)),
            self._cats.insert(keys, tf.cast(hashed.lookup_segment_ids, tf.int64)))

    def key_metadata(self, keys: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
        """(category index int64[u], instance ID int64[u]) behind unified ``keys``; category
        -1 for a key never recorded here."""
        keys = tf.convert_to_tensor(keys, tf.int64)
        return self._cats.lookup(keys), self._ids.lookup(keys)

    def counts_of(self, keys: tf.Tensor) -> tf.Tensor:
        """int64[u]: access counts of unified ``keys`` (0 for a key never recorded)."""
        return self._counts.lookup(tf.convert_to_tensor(keys, tf.int64))

    def size(self) -> tf.Tensor:
        """int64 scalar: number of keys tracked here (with a recorded (category, ID))."""
        return self._cats.size()

    def known_keys(self) -> np.ndarray:
        """int64[k], sorted: every unified key whose (category, ID) is recorded here, i.e.
        every key a training lookup, a restore or a weight import gave this rank (eager)."""
        return np.sort(self._cats.export()[0].numpy())

    def export(self) -> Dict[str, np.ndarray]:
        """Per-key statistics as numpy arrays, sorted by key: keys, counts, categories,
        ids, last_steps (eager)."""
        keys = np.sort(self._counts.export()[0].numpy())
        tensor = tf.constant(keys, tf.int64)
        cats, ids = (t.numpy() for t in self.key_metadata(tensor))
        return {"keys": keys, "counts": self._counts.lookup(tensor).numpy(), "categories": cats,
                "ids": ids, "last_steps": self._last.lookup(tensor).numpy()}

    def register(self, keys: np.ndarray, categories: np.ndarray, ids: np.ndarray,
                 step: int = 0) -> None:
        """Records the (category, ID) behind stored ``keys`` (int64[u], int64[u],
        int64[u]) with no access: rows written by a restore or a weight import carry
        their identity with them, so the table and its metadata stay one unit (eager).
        A key not tracked yet gets ``step`` as its last step (its TTL starts now)."""
        if len(keys) == 0:
            return
        keys = tf.constant(keys, tf.int64)
        new = tf.equal(self._cats.lookup(keys), -1)
        self._last.insert(keys, tf.where(new, tf.constant(step, tf.int64), self._last.lookup(keys)))
        self._counts.insert(keys, self._counts.lookup(keys))
        self._ids.insert(keys, tf.constant(ids, tf.int64))
        self._cats.insert(keys, tf.constant(categories, tf.int64))

    def remove(self, keys: np.ndarray) -> None:
        """Forgets ``keys`` int64[u] (unique, tracked here): counts, identities and last
        steps; their counts leave the category totals too, which stay the sums over the
        tracked keys (what a restore recomputes). Eviction's half of "rows, slots and
        statistics leave together" (eager)."""
        if len(keys) == 0:
            return
        keys = tf.constant(keys, tf.int64)
        self.category_counts.assign_sub(tf.math.unsorted_segment_sum(
            self.counts_of(keys), tf.cast(tf.maximum(self.key_metadata(keys)[0], 0), tf.int32),
            len(self.categories)))
        self._forget(keys)

    def _forget(self, keys):
        """Drops every per-key field of ``keys`` int64[u] (eager)."""
        for table in (self._counts, self._ids, self._cats, self._last):
            table.remove(keys)

    def load(self, keys: np.ndarray, counts: np.ndarray, categories: np.ndarray, ids: np.ndarray,
             last_steps: Optional[np.ndarray] = None) -> None:
        """Adds per-key statistics (e.g. this rank's share of a checkpoint); category
        totals are recomputed from them, so resharding loses no count (eager).
        ``last_steps`` int64[u] (default: kept, or 0 for a new key) are the keys' last
        steps."""
        if len(keys) == 0:
            return
        self._load_keys(keys, counts, categories, ids, last_steps)
        self.category_counts.assign_add(tf.math.unsorted_segment_sum(
            tf.constant(counts, tf.int64), tf.constant(categories, tf.int32),
            len(self.categories)))

    def recount_categories(self) -> None:
        """Sets the category totals from the per-key counts, after per-key statistics
        were put in place directly (the blocks of a checkpoint) rather than through
        ``load`` (eager)."""
        per_key = self.export()
        self.category_counts.assign(tf.math.unsorted_segment_sum(
            tf.constant(per_key["counts"], tf.int64),
            tf.constant(per_key["categories"], tf.int32), len(self.categories)))

    def _load_keys(self, keys, counts, categories, ids, last_steps):
        """load's per-key part: identity registered, last steps set (when given), counts
        added (eager)."""
        self.register(keys, categories, ids)
        keys = tf.constant(keys, tf.int64)
        if last_steps is not None:
            self._last.insert(keys, tf.constant(last_steps, tf.int64))
        self._counts.insert(keys, self._counts.lookup(keys) + tf.constant(counts, tf.int64))

    def category_totals(self) -> Dict[str, int]:
        """{category: accesses of its keys owned by this rank} (eager)."""
        return dict(zip(self.categories, self.category_counts.numpy().tolist()))

    def top_k(self, category: str, k: int = 10) -> List[Tuple[str, int]]:
        """The k most accessed IDs of ``category`` owned by this rank, as
        [("category/ID", count), ...], most accessed first (eager)."""
        if category not in self.categories:
            raise ValueError(f"unknown category {category!r}; this group has {self.categories}")
        stats = self.export()
        mine = stats["categories"] == self.categories.index(category)
        ids, counts = stats["ids"][mine], stats["counts"][mine]
        order = np.lexsort((ids, -counts))[:k]
        return [(f"{category}/{ids[i]}", int(counts[i])) for i in order]

    def metrics(self) -> Dict[str, int]:
        """Flat dict of scalar metrics for logging (eager)."""
        out = {f"access/{c}": v for c, v in self.category_totals().items()}
        out.update(unique_keys_last_step=int(self.last_unique_keys.numpy()),
                   received_keys_last_step=int(self.last_received_keys.numpy()),
                   hash_collisions=int(self.collisions.numpy()))
        return out
