"""``exchange_counts``: one AlltoAll round's communication counters in one op."""
from typing import Optional, Sequence

import tensorflow as tf

from tf_fusedemb.ops import _loader, _validate
from tf_fusedemb.ops._validate import TensorLike

FIELDS = ("rounds", "bytes_sent", "bytes_received", "messages")  # the order of its output


def exchange_counts(send_splits: TensorLike, recv_splits: TensorLike, like: tf.Tensor,
                    rank: int, same_node: Optional[Sequence[bool]] = None,
                    name: Optional[str] = None) -> tf.Tensor:
    """The counter increments of one AlltoAll round among the k ranks of its set.

    Args:
      send_splits, recv_splits: int32[k] rows sent to / received from each member.
      like: the tensor exchanged, [rows, ...]; only its shape and dtype are read (a row's
        bytes are its elements after the first dimension times the dtype's size).
      rank: this rank's position in the set, 0 <= rank < k.
      same_node: bool[k] (a Python list), whether each member is on this rank's node; None
        counts the totals only.
      name: optional name scope.

    Returns:
      int64[4]: ``FIELDS`` over the other members (rounds is 1); with ``same_node``,
      int64[12]: those, then ``FIELDS`` over the other members on this node, then over
      the members on other nodes (each class's rounds is 1 when it has a member).
    """
    with tf.name_scope(name or "exchange_counts"):
        send = _validate.int_tensor(send_splits, tf.int32, "send_splits")
        recv = _validate.int_tensor(recv_splits, tf.int32, "recv_splits")
        return _loader.raw_op("ExchangeCounts")(send, recv, like, rank=rank,
                                                same_node=list(same_node or []))


tf.no_gradient("FusedEmb>ExchangeCounts")
