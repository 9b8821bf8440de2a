"""Per-group communication counters, updated inside the graph, readable from Python."""
from typing import Dict, Mapping, Optional, Sequence

import tensorflow as tf

from tf_fusedemb.ops.exchange_counts import FIELDS, exchange_counts  # FIELDS: the totals

LINK_CLASSES = ("intra", "inter")  # inside a node / between nodes (comm.topology)
LINK_FIELDS = tuple(f"{c}_{f}" for c in LINK_CLASSES for f in FIELDS)


class CommCounters(tf.Module):
    """Cumulative AlltoAll counters of one fused group on this rank.

    ``rounds``: AlltoAll calls (keys, rows and gradients each count one);
    ``bytes_sent`` / ``bytes_received``: payload exchanged with OTHER ranks (the slice a
    rank keeps for itself is not counted); ``messages``: non-empty messages to other
    ranks. With ``link_classes`` (several nodes), the same four per link class,
    ``intra_*`` (peers on this rank's node) and ``inter_*`` (peers on other nodes): a
    round counts in a class when it exchanges with at least one peer of that class (a
    flat AlltoAll over nodes of several ranks counts in both). Per-step figures are
    differences of two :meth:`snapshot` calls.
    """

    def __init__(self, group_name: str, link_classes: bool = False):
        super().__init__(name=f"comm_{group_name}")
        self.group_name = group_name
        self.fields = FIELDS + LINK_FIELDS if link_classes else FIELDS
        with tf.init_scope():  # one variable, so a round is one AssignAdd
            self._counts = tf.Variable(tf.zeros([len(self.fields)], tf.int64), trainable=False,
                                       name=f"{group_name}_counts")

    def record(self, send_splits: tf.Tensor, recv_splits: tf.Tensor, like: tf.Tensor,
               rank: int, same_node: Optional[Sequence[bool]] = None) -> tf.Operation:
        """Adds one AlltoAll round (two ops: ``ops.exchange_counts`` and its AssignAdd).

        Args:
          send_splits, recv_splits: int32[k] rows sent to / received from each member of
            the collective's set (the world or a process set), in set order.
          like: the tensor exchanged, [rows, ...] (its row size in bytes is counted).
          rank: this rank's position in the set.
          same_node: bool[k] (Python list), whether each member is on this rank's node
            (used with ``link_classes``; None counts only the totals).
        """
        classes = same_node if len(self.fields) > len(FIELDS) else None
        return self._counts.assign_add(
            exchange_counts(send_splits, recv_splits, like, rank, classes)).op

    def snapshot(self) -> Dict[str, int]:
        """Current cumulative values as a dict of Python ints."""
        return dict(zip(self.fields, (int(v) for v in self._counts.numpy())))

    @staticmethod
    def per_step(before: Mapping[str, int], after: Mapping[str, int],
                 steps: int = 1) -> Dict[str, float]:
        """Per-step figures between two snapshots, with the mean message size."""
        d = {f: (after[f] - before[f]) / steps for f in FIELDS + LINK_FIELDS
             if f in after and f in before}
        d["mean_message_bytes"] = (after["bytes_sent"] - before["bytes_sent"]) / max(
            1, after["messages"] - before["messages"])
        return d

