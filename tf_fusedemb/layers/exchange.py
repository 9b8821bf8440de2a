"""The key and row exchange of one fused group between requesters and owners.

A group lookup (``group_lookup.GroupLookup``) deduplicates its keys per category, hands
them to an exchange, which delivers them to their owners (``mix64(id) mod N``) and brings
the owners' rows back in the requester's order. Two exchanges:

* :class:`FlatExchange` (FusedRec, b.2 and step 7): one AlltoAll over all ranks for the
  keys, one for the rows; the gradient AlltoAll is the rows' (the tape's).
* ``hierarchical_exchange.HierarchicalExchange`` (TawPipe): two stages, inside the node
  then along the rail, with node-level dedup and gradient reduction.

Both carry a key as an int64 pair ``(ID, count << category_bits() | table)``: the owner
learns each key's table (lossless lookup) and how often the requester(s) saw it (exact
access statistics) without a second exchange. One op packs them from the rank-sorted keys
(``ops.pack_key_messages``), one unpacks them (``ops.unpack_key_messages``).

Bad input is reported through the same exchange, at no extra round: a requester with an
ID out of its feature's range (``InputReport``) sends every peer one message ``(ID, rank
<< 32 | feature << category_bits() | bad_input())`` instead of its keys, so every rank receives
it from the key exchange and fails with the same error (``GroupLookup.route``), instead of
the bad rank failing alone while the others wait for it.
"""
from typing import TYPE_CHECKING, NamedTuple, Optional, Tuple

import tensorflow as tf

from tf_fusedemb import ops
from tf_fusedemb.comm.counters import CommCounters
from tf_fusedemb.ops.key_messages import category_bits
from tf_fusedemb.ops.sorted_search import search_sorted

if TYPE_CHECKING:  # a type only: the communicator module starts Horovod's watchdog machinery
    from tf_fusedemb.comm.communicator import Communicator


class FlatRoute(NamedTuple):
    """What :meth:`FlatExchange.send_keys` sent, for ``send_rows``: ``sort_indices``
    int32[u] (I_s, the order of the rows that come back) and ``recv_splits`` int32[N]
    (the key messages received from each rank)."""
    sort_indices: tf.Tensor
    recv_splits: tf.Tensor


EXCHANGES = ("flat", "hierarchical")


def bad_input() -> int:
    """The table field of a bad-input report: the largest, which no table has."""
    return (1 << category_bits()) - 1


class InputReport(NamedTuple):
    """A requester's bad input: ``failed`` bool[] (some ID is out of range) and
    ``message`` int64[1, 2], the report sent to every peer instead of the keys."""
    failed: tf.Tensor
    message: tf.Tensor


def input_report(ids: tf.Tensor, invalid: tf.Tensor, segment_splits: tf.Tensor,
                 rank: int) -> InputReport:
    """The InputReport of fused ``ids`` int64[n] with ``invalid`` bool[n] (out of range),
    features cut at ``segment_splits`` int64[M+1]: the first bad ID and its feature."""
    first = tf.argmax(tf.concat([tf.cast(invalid, tf.int32), [1]], 0), output_type=tf.int64)
    bad_id = tf.concat([ids, tf.zeros([1], tf.int64)], 0)[first]
    feature = search_sorted(segment_splits, [first], side="right", out_type=tf.int64)[0] - 1
    tag = tf.bitwise.bitwise_or(
        tf.bitwise.left_shift(tf.constant(rank, tf.int64), 32),
        tf.bitwise.bitwise_or(tf.bitwise.left_shift(feature, category_bits()), bad_input()))
    return InputReport(tf.reduce_any(invalid), tf.reshape(tf.stack([bad_id, tag]), [1, 2]))


def with_report(messages: tf.Tensor, splits: tf.Tensor,
                report: Optional[InputReport]) -> Tuple[tf.Tensor, tf.Tensor]:
    """``(messages, splits)`` to send, or, when ``report`` failed, its message once to
    every peer (``splits`` int32[k] all ones)."""
    if report is None:
        return messages, splits
    k = tf.size(splits)
    return tf.cond(report.failed,
                   lambda: (tf.tile(report.message, tf.stack([k, 1])), tf.ones_like(splits)),
                   lambda: (messages, splits))


def received_report(messages: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
    """(bool[]: some of the key ``messages`` int64[m, 2] is a bad-input report, the first
    one int64[1, 2] (zeros when none)."""
    bad = tf.equal(tf.bitwise.bitwise_and(messages[:, 1], bad_input()), bad_input())
    first = tf.argmax(tf.concat([tf.cast(bad, tf.int32), [1]], 0), output_type=tf.int32)
    return tf.reduce_any(bad), tf.concat([messages, tf.zeros([1, 2], tf.int64)], 0)[first:first + 1]


def decode_report(message: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """(rank int64[], feature index int64[], bad ID int64[]) of a report int64[1, 2]."""
    tag = message[0, 1]
    return (tf.bitwise.right_shift(tag, 32),
            # the feature field: the bits between the table field and the rank (bit 32)
            tf.bitwise.bitwise_and(tf.bitwise.right_shift(tag, category_bits()),
                                   (1 << (32 - category_bits())) - 1),
            message[0, 0])


class FlatExchange:
    """One AlltoAll over all ranks for keys, one for rows (3 rounds per training step).

    Args:
      comm: the Communicator.  group_name: names the collectives.
      counters: the group's CommCounters.
    """
    kind = "flat"
    rounds_per_step = 3  # keys, rows, gradients

    def __init__(self, comm: "Communicator", group_name: str, counters: CommCounters):
        self.comm, self.counters = comm, counters
        self._prefix = f"fusedemb/{group_name}"

    def send_keys(self, uniq: ops.SegmentUniqueResult, feature_table: tf.Tensor, suffix: str,
                  report: Optional[InputReport] = None) -> Tuple[tf.Tensor, FlatRoute]:
        """Sends the requester's unique keys to their owners.

        Args:
          uniq: ``segment_unique`` of the fused IDs (per feature segment).
          feature_table: int64[M], the table index of each feature.
          suffix: appended to collective names.
          report: this requester's InputReport (None: its IDs need no range check); a
            failed one is sent instead of the keys.
        Returns:
          (key messages received by this owner int64[m, 2], the FlatRoute that
          ``send_rows`` takes).
        """
        srt = ops.rankwise_sort(uniq.unique_keys, uniq.unique_segment_splits, self.comm.size)
        send, splits = with_report(ops.pack_key_messages(srt.sorted_keys, srt.sorted_segment_ids,
                                                         srt.indices, uniq.counts, feature_table),
                                   srt.rank_splits, report)
        recv, recv_splits = self.comm.alltoall(send, splits, f"{self._prefix}/keys{suffix}",
                                               self.counters)
        return recv, FlatRoute(srt.indices, recv_splits)

    def send_rows(self, rows: tf.Tensor, route: FlatRoute, suffix: str) -> tf.Tensor:
        """The owner's ``rows`` float32[m, dim] (one per received key message) back to the
        requesters: float32[u, dim] in rank-sorted order (``route.sort_indices``)."""
        back, _ = self.comm.alltoall(rows, route.recv_splits, f"{self._prefix}/rows{suffix}",
                                     self.counters)
        return back
