"""Admission and eviction of one fused group's keys, per table (category), decided on
the owner ranks from the lossless access statistics.

The policies are :class:`tf_fusedemb.specs.AdmissionPolicy` and
:class:`tf_fusedemb.specs.EvictionPolicy` on the TableSpecs (their docstrings give the
semantics). Admission runs inside every training step (``GroupTable.apply_gradients``
stores only admitted keys); eviction runs between steps (``GroupStore.enforce_policy``,
called by ``FusedModel.fit`` after every step, and by custom loops after
``train_step``): TTL first, then the cap.

The cap is global (over all ranks) and the order of eviction is a total order on
(access count, last step, ID), so which keys leave does not depend on the number of
ranks: each rank offers its ``excess`` smallest keys, one ``allgather_object`` merges
them, and every rank evicts its own keys up to the global ``excess``-th smallest.
"""
from typing import Any, Callable, Dict, List, Mapping, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tf_fusedemb.specs import EvictionPolicy, TableSpec

# Communicator.allgather_object: one picklable object from each rank, in rank order.
Allgather = Callable[[Any], List[Any]]

__all__ = ["GroupPolicy", "admission_filter", "ttl_expired", "cap_order"]


def admission_filter(min_counts: np.ndarray, table: Any, stats: Any
                     ) -> Callable[[tf.Tensor], tf.Tensor]:
    """The admission rule as a filter for a table whose update does not decide it itself:
    keys int64[u] -> bool[u], which of an owner's unique keys an update may store. A key
    is admitted when ``table`` already stores it, when ``stats`` never recorded it (a
    direct table call), or when its access count (this step's accesses included: they
    are recorded during the forward pass) reached its table's ``min_counts[t]``
    (int64[T]). The engine decides the same rule inside its update kernel."""
    thresholds = tf.constant(np.asarray(min_counts, np.int64))

    def admitted(keys: tf.Tensor) -> tf.Tensor:
        cats, _ = stats.key_metadata(keys)
        known = cats >= 0
        need = tf.where(known, tf.gather(thresholds, tf.maximum(cats, 0)), 0)
        return tf.logical_or(stats.counts_of(keys) >= need, table.contains(keys))
    return admitted


def ttl_expired(last_steps: np.ndarray, step: int, ttl_steps: int) -> np.ndarray:
    """bool[k]: keys whose last step ``last_steps`` int64[k] is more than ``ttl_steps``
    before ``step``."""
    return step - np.asarray(last_steps, np.int64) > ttl_steps


def cap_order(counts: np.ndarray, last_steps: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """int64[k]: the keys in the order the cap evicts them (least accessed first, then
    least recently seen, then the smaller ID); inputs int64[k] each."""
    return np.lexsort((np.asarray(ids, np.int64), np.asarray(last_steps, np.int64),
                       np.asarray(counts, np.int64)))


class GroupPolicy:
    """The policies of one group's tables, indexed by category (table position).

    Args:
      tables: the group's distinct TableSpecs, in category order.

    Attributes:
      min_counts: int64[T], each table's admission threshold (0: no admission policy).
      evictions: {category index: EvictionPolicy}.
    """

    def __init__(self, tables: Sequence[TableSpec]):
        self.min_counts = np.array([t.admission.min_count if t.admission else 0
                                    for t in tables], np.int64)
        self.evictions = {c: t.eviction for c, t in enumerate(tables) if t.eviction is not None}

    @property
    def admits(self) -> bool:
        """Whether some table has an admission threshold above 1."""
        return bool((self.min_counts > 1).any())

    def due(self, step: int) -> Dict[int, EvictionPolicy]:
        """{category: EvictionPolicy} of the tables evaluated after ``step``."""
        return {c: p for c, p in self.evictions.items() if step > 0 and step % p.every_steps == 0}

    def evictions_at(self, step: int, stats: Mapping[str, np.ndarray],
                     allgather: Allgather) -> np.ndarray:
        """The keys this rank evicts after ``step``.

        Args:
          step: the group's step counter (steps taken).
          stats: this rank's per-key statistics, ``AccessStatistics.export()``: keys,
            counts, categories, ids, last_steps (int64[k] each).
          allgather: ``Communicator.allgather_object`` (one object per rank, rank order);
            called the same number of times on every rank (0, 1 or 2).

        Returns:
          int64[e], the unified keys to evict (their rows, slots and statistics).
        """
        due = self.due(step)
        if not due:
            return np.zeros([0], np.int64)
        cats = np.asarray(stats["categories"])
        evict = np.zeros(len(cats), bool)
        for c, policy in due.items():
            if policy.ttl_steps is not None:
                evict |= (cats == c) & ttl_expired(stats["last_steps"], step, policy.ttl_steps)
        capped = sorted(c for c, p in due.items() if p.max_rows is not None)
        if capped:
            evict |= self._over_cap(capped, due, stats, evict, allgather)
        return np.asarray(stats["keys"], np.int64)[evict]

    def _over_cap(self, capped: List[int], due: Dict[int, EvictionPolicy],
                  stats: Mapping[str, np.ndarray], evicted: np.ndarray,
                  allgather: Allgather) -> np.ndarray:
        """bool[k]: the keys the caps of the ``capped`` tables evict, among the keys not
        ``evicted`` already. Two collectives: the tables' sizes, then, for the tables
        over their cap by ``excess`` keys, each rank's ``excess`` first keys in cap order
        as (count, last step, ID) rows."""
        cats = np.asarray(stats["categories"])
        alive = {c: np.flatnonzero((cats == c) & ~evicted) for c in capped}
        sizes = allgather({c: len(alive[c]) for c in capped})
        excess = {c: sum(r[c] for r in sizes) - due[c].max_rows for c in capped}
        excess = {c: e for c, e in excess.items() if e > 0}
        out = np.zeros(len(cats), bool)
        if not excess:
            return out
        # category -> (local positions, int64[o, 3] order keys), the first e of each
        offers: Dict[int, Tuple[np.ndarray, np.ndarray]] = {}
        for c, e in excess.items():
            tuples = np.stack([np.asarray(stats[k], np.int64)[alive[c]]
                               for k in ("counts", "last_steps", "ids")], 1).reshape(-1, 3)
            first = cap_order(tuples[:, 0], tuples[:, 1], tuples[:, 2])[:e]
            offers[c] = (alive[c][first], tuples[first])
        gathered = allgather({c: t for c, (_, t) in offers.items()})
        for c, e in excess.items():
            merged = np.concatenate([g[c] for g in gathered])
            bound = merged[cap_order(merged[:, 0], merged[:, 1], merged[:, 2])[e - 1]]
            rows, tuples = offers[c]
            out[rows[_lexicographic_le(tuples, bound)]] = True
        return out


def _lexicographic_le(rows: np.ndarray, bound: np.ndarray) -> np.ndarray:
    """bool[k]: rows int64[k, 3] that are <= ``bound`` int64[3] in lexicographic order."""
    less = np.zeros(len(rows), bool)
    equal = np.ones(len(rows), bool)
    for j in range(rows.shape[1]):
        less |= equal & (rows[:, j] < bound[j])
        equal &= rows[:, j] == bound[j]
    return less | equal
