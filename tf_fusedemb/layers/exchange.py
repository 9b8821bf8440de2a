"""The key and row exchange of one fused group between requesters and owners.

A group lookup (``group_lookup.GroupLookup``) deduplicates its keys per category, hands
them to an exchange, which delivers them to their owners (``mix64(id) mod N``) and brings
the owners' rows back in the requester's order. Two exchanges:

* :class:`FlatExchange` (FusedRec, b.2 and step 7): one AlltoAll over all ranks for the
  keys, one for the rows; the gradient AlltoAll is the rows' (the tape's).
* ``hierarchical_exchange.HierarchicalExchange`` (TawPipe): two stages, inside the node
  then along the rail, with node-level dedup and gradient reduction.

Both carry a key as an int64 pair ``(ID, count << CATEGORY_BITS | table)``: the owner
learns each key's table (lossless lookup) and how often the requester(s) saw it (exact
access statistics) without a second exchange.
"""
from typing import Dict, Tuple

import tensorflow as tf

from tf_fusedemb import ops

CATEGORY_BITS = 16
EXCHANGES = ("flat", "hierarchical")


def encode_keys(ids, counts, tables):
    """Key messages int64[n, 2] of ``ids`` int64[n] seen ``counts`` int[n] times, of table
    ``tables`` int[n]."""
    tag = tf.bitwise.bitwise_or(tf.bitwise.left_shift(tf.cast(counts, tf.int64), CATEGORY_BITS),
                                tf.cast(tables, tf.int64))
    return tf.stack([tf.cast(ids, tf.int64), tag], axis=1)


def decode_keys(messages) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """(ids int64[n], counts int64[n], tables int32[n]) of key messages int64[n, 2]."""
    tables = tf.cast(tf.bitwise.bitwise_and(messages[:, 1], (1 << CATEGORY_BITS) - 1), tf.int32)
    return messages[:, 0], tf.bitwise.right_shift(messages[:, 1], CATEGORY_BITS), tables


class FlatExchange:
    """One AlltoAll over all ranks for keys, one for rows (3 rounds per training step).

    Args:
      comm: the Communicator.  group_name: names the collectives.
      counters: the group's CommCounters.
    """
    kind = "flat"
    rounds_per_step = 3  # keys, rows, gradients

    def __init__(self, comm, group_name: str, counters):
        self.comm, self.counters = comm, counters
        self._prefix = f"fusedemb/{group_name}"

    def send_keys(self, uniq, feature_table, suffix: str) -> Tuple[tf.Tensor, Dict]:
        """Sends the requester's unique keys to their owners.

        Args:
          uniq: ``segment_unique`` of the fused IDs (per feature segment).
          feature_table: int64[M], the table index of each feature.
          suffix: appended to collective names.
        Returns:
          (key messages received by this owner int64[m, 2], state): state holds
          ``sort_indices`` int32[u] (I_s, the order of the rows ``send_rows`` returns) and
          what ``send_rows`` needs.
        """
        srt = ops.rankwise_sort(uniq.unique_keys, uniq.unique_segment_splits, self.comm.size)
        counts = tf.gather(uniq.counts, tf.math.invert_permutation(srt.indices))
        tables = tf.gather(feature_table, srt.sorted_segment_ids)
        recv, recv_splits = self.comm.alltoall(encode_keys(srt.sorted_keys, counts, tables),
                                               srt.rank_splits, f"{self._prefix}/keys{suffix}",
                                               self.counters)
        return recv, {"sort_indices": srt.indices, "recv_splits": recv_splits}

    def send_rows(self, rows, state: Dict, suffix: str):
        """The owner's ``rows`` float32[m, dim] (one per received key message) back to the
        requesters: float32[u, dim] in rank-sorted order (``state["sort_indices"]``)."""
        back, _ = self.comm.alltoall(rows, state["recv_splits"], f"{self._prefix}/rows{suffix}",
                                     self.counters)
        return back
