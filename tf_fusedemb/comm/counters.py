"""Per-group communication counters, updated inside the graph, readable from Python."""
import tensorflow as tf

FIELDS = ("rounds", "bytes_sent", "bytes_received", "messages")


class CommCounters(tf.Module):
    """Cumulative AlltoAll counters of one fused group on this rank.

    ``rounds``: AlltoAll calls (keys, rows and gradients each count one);
    ``bytes_sent`` / ``bytes_received``: payload exchanged with OTHER ranks (the slice a
    rank keeps for itself is not counted); ``messages``: non-empty messages to other
    ranks. Per-step figures are differences of two :meth:`snapshot` calls.
    """

    def __init__(self, group_name):
        super().__init__(name=f"comm_{group_name}")
        self.group_name = group_name
        with tf.init_scope():
            self._vars = {f: tf.Variable(tf.constant(0, tf.int64), trainable=False,
                                         name=f"{group_name}_{f}") for f in FIELDS}

    def record(self, send_splits, recv_splits, row_bytes, rank):
        """Adds one AlltoAll round: int32[N] splits sent and received, bytes per row."""
        send = tf.cast(send_splits, tf.int64)
        recv = tf.cast(recv_splits, tf.int64)
        others = tf.cast(tf.not_equal(tf.range(tf.size(send)), rank), tf.int64)
        updates = {
            "rounds": tf.constant(1, tf.int64),
            "bytes_sent": tf.reduce_sum(send * others) * row_bytes,
            "bytes_received": tf.reduce_sum(recv * others) * row_bytes,
            "messages": tf.reduce_sum(tf.cast(send > 0, tf.int64) * others),
        }
        return tf.group([self._vars[f].assign_add(updates[f]) for f in FIELDS])

    def snapshot(self):
        """Current cumulative values as a dict of Python ints."""
        return {f: int(v.numpy()) for f, v in self._vars.items()}

    @staticmethod
    def per_step(before, after, steps=1):
        """Per-step figures between two snapshots, with the mean message size."""
        d = {f: (after[f] - before[f]) / steps for f in FIELDS}
        d["mean_message_bytes"] = (after["bytes_sent"] - before["bytes_sent"]) / max(
            1, after["messages"] - before["messages"])
        return d
