"""Per-group communication counters, updated inside the graph, readable from Python."""
from typing import Dict, Mapping, Optional, Sequence

import tensorflow as tf

FIELDS = ("rounds", "bytes_sent", "bytes_received", "messages")  # totals, always counted
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
        with tf.init_scope():
            self._vars = {f: tf.Variable(tf.constant(0, tf.int64), trainable=False,
                                         name=f"{group_name}_{f}") for f in self.fields}

    def record(self, send_splits: tf.Tensor, recv_splits: tf.Tensor, row_bytes: tf.Tensor,
               rank: int, same_node: Optional[Sequence[bool]] = None) -> tf.Operation:
        """Adds one AlltoAll round.

        Args:
          send_splits, recv_splits: int32[k] rows sent to / received from each member of
            the collective's set (the world or a process set), in set order.
          row_bytes: bytes per row (int64 scalar).
          rank: this rank's position in the set.
          same_node: bool[k] (Python list), whether each member is on this rank's node
            (used with ``link_classes``; None counts only the totals).
        """
        send = tf.cast(send_splits, tf.int64)
        recv = tf.cast(recv_splits, tf.int64)
        others = tf.not_equal(tf.range(tf.size(send)), rank)
        updates = _class_updates("", send, recv, row_bytes, others)
        if same_node is not None and len(self.fields) > len(FIELDS):
            same = tf.constant(list(same_node), tf.bool)
            updates.update(_class_updates("intra_", send, recv, row_bytes,
                                          tf.logical_and(others, same)))
            updates.update(_class_updates("inter_", send, recv, row_bytes,
                                          tf.logical_not(same)))
        return tf.group([self._vars[f].assign_add(v) for f, v in updates.items()])

    def snapshot(self) -> Dict[str, int]:
        """Current cumulative values as a dict of Python ints."""
        return {f: int(v.numpy()) for f, v in self._vars.items()}

    @staticmethod
    def per_step(before: Mapping[str, int], after: Mapping[str, int],
                 steps: int = 1) -> Dict[str, float]:
        """Per-step figures between two snapshots, with the mean message size."""
        d = {f: (after[f] - before[f]) / steps for f in FIELDS + LINK_FIELDS
             if f in after and f in before}
        d["mean_message_bytes"] = (after["bytes_sent"] - before["bytes_sent"]) / max(
            1, after["messages"] - before["messages"])
        return d


def _class_updates(prefix, send, recv, row_bytes, peers):
    """Counter increments of one round restricted to the ``peers`` mask (bool[k])."""
    mask = tf.cast(peers, tf.int64)
    return {
        f"{prefix}rounds": tf.cast(tf.reduce_any(peers), tf.int64) if prefix
        else tf.constant(1, tf.int64),
        f"{prefix}bytes_sent": tf.reduce_sum(send * mask) * row_bytes,
        f"{prefix}bytes_received": tf.reduce_sum(recv * mask) * row_bytes,
        f"{prefix}messages": tf.reduce_sum(tf.cast(send > 0, tf.int64) * mask),
    }
