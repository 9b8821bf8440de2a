"""TawPipe's topology-aware exchange of one fused group: inside the node, then along the rail.

With C nodes of L ranks (``comm.topology``), the owner of a key stays ``o = mix64(id) mod N``
(N = C * L); it sits on node ``o // L`` at local rank ``o mod L = mix64(id) mod L``.

Keys (forward):
  1. node stage: each requester sends each of its unique keys to the rank of ITS node on
     the owner's rail (local rank ``mix64(id) mod L``): one AlltoAll inside the node;
  2. node-level dedup: that rank removes the keys its node mates asked for more than once,
     per table (``segment_unique`` over table segments), summing their counts so the
     owner's access statistics stay exact;
  3. rail stage: one AlltoAll among the rail's ranks (one per node) delivers the node's
     unique keys to their owners. Only this stage crosses nodes.
Rows come back the same way: rail AlltoAll, fan-out of each node-unique row to the node
mates that asked for it (``recovery_gather``), node AlltoAll.
Backward mirrors it through the tape: the fan-out's gradient sums the node mates'
gradients of a key (TawPipe's group-local reduction) before the rail AlltoAll carries one
gradient row per node and key to the owner.
"""
from typing import TYPE_CHECKING, NamedTuple, Optional, Tuple

import numpy as np
import tensorflow as tf

from tf_fusedemb import ops
from tf_fusedemb.comm.counters import CommCounters
from tf_fusedemb.layers.exchange import InputReport, received_report, with_report

if TYPE_CHECKING:  # a type only, as in layers/exchange.py
    from tf_fusedemb.comm.communicator import Communicator


class HierarchicalRoute(NamedTuple):
    """What :meth:`HierarchicalExchange.send_keys` sent, for ``send_rows``:
    ``sort_indices`` int32[u] (I_s), ``recv_splits`` int32[L] (the node stage's received
    splits), the node stage's fan-out ``node_sort_indices`` int32[u1] and
    ``node_inverse`` int32[m1], and ``rail_splits`` int32[C] (the rail stage's received
    splits)."""
    sort_indices: tf.Tensor
    recv_splits: tf.Tensor
    node_sort_indices: tf.Tensor
    node_inverse: tf.Tensor
    rail_splits: tf.Tensor


class HierarchicalExchange:
    """Two-stage exchange (6 rounds per training step: keys, rows, gradients x 2 stages).

    Args:
      comm: a Communicator whose ``topology`` has several nodes of several ranks.
      group_name: names the collectives.  counters: the group's CommCounters.
      num_tables: T, the group's tables (categories of the node-level dedup).
    """
    kind = "hierarchical"
    rounds_per_step = 6

    def __init__(self, comm: "Communicator", group_name: str, counters: CommCounters,
                 num_tables: int):
        topo = comm.topology
        if not topo.is_hierarchical:
            raise ValueError(f"group '{group_name}': a hierarchical exchange needs several nodes "
                             f"of several ranks, the topology is {topo.describe()}")
        self.comm, self.counters, self.num_tables = comm, counters, num_tables
        self._node, self._rail = topo.node_members(), topo.rail_members()
        self._prefix = f"fusedemb/{group_name}"

    def send_keys(self, uniq: ops.SegmentUniqueResult, feature_table: tf.Tensor, suffix: str,
                  report: Optional[InputReport] = None) -> Tuple[tf.Tensor, HierarchicalRoute]:
        """Same contract as ``FlatExchange.send_keys``, with a HierarchicalRoute. A
        bad-input report received in the node stage is passed on to the whole rail
        instead of the node's keys, so it reaches every rank."""
        comm = self.comm
        # (1) by the owner's local rank: mix64(id) mod L (N = C * L, so (h mod N) mod L).
        srt = ops.rankwise_sort(uniq.unique_keys, uniq.unique_segment_splits,
                                comm.topology.local_size)
        send, splits = with_report(ops.pack_key_messages(srt.sorted_keys, srt.sorted_segment_ids,
                                                         srt.indices, uniq.counts, feature_table),
                                   srt.rank_splits, report)
        got, node_splits = comm.alltoall(send, splits, f"{self._prefix}/keys_node{suffix}",
                                         self.counters, self._node)
        if report is None:
            send, rail_send, node_sort, node_inverse = self._rail_messages(got)
        else:  # a node mate's report goes to the whole rail instead of the node's keys
            failed, first = received_report(got)
            rail = len(self._rail)
            send, rail_send, node_sort, node_inverse = tf.cond(
                failed, lambda: (tf.tile(first, [rail, 1]), tf.ones([rail], tf.int32),
                                 tf.zeros([0], tf.int32), tf.zeros([0], tf.int32)),
                lambda: self._rail_messages(got))
        recv, rail_splits = comm.alltoall(send, rail_send, f"{self._prefix}/keys_rail{suffix}",
                                          self.counters, self._rail)
        return recv, HierarchicalRoute(srt.indices, node_splits, node_sort, node_inverse,
                                       rail_splits)

    def _rail_messages(self, got):
        """(2) node-level dedup per table of the node stage's key messages ``got``, (3)
        sorted for their owners, all on this rank's rail: (messages int64[u1, 2], splits
        int32[C] by rail member, ``node_sort_indices``, ``node_inverse``)."""
        node_uniq, node_counts, order = self._node_dedup(got)
        owner = ops.rankwise_sort(node_uniq.unique_keys, node_uniq.unique_segment_splits,
                                  self.comm.size)
        rail_send = tf.gather(owner.rank_splits, self._rail)
        check = tf.debugging.assert_equal(
            tf.reduce_sum(rail_send), tf.reduce_sum(owner.rank_splits),
            message="hierarchical exchange: a key's owner is not on this rank's rail "
                    "(the ranks are not laid out node-major)")
        with tf.control_dependencies([check]):  # segments are tables here: the identity map
            send = ops.pack_key_messages(owner.sorted_keys, owner.sorted_segment_ids,
                                         owner.indices, node_counts,
                                         np.arange(self.num_tables, dtype=np.int64))
        return (send, tf.cast(rail_send, tf.int32), owner.indices,
                tf.gather(node_uniq.inverse, tf.math.invert_permutation(order)))

    def _node_dedup(self, got):
        """Node-level dedup of the key messages int64[m1, 2] of the node mates: (the
        ``segment_unique`` of their IDs grouped by table, its keys' summed counts
        int64[u1], the grouping permutation int32[m1])."""
        ids, counts, tables = ops.unpack_key_messages(got)
        order = tf.argsort(tables, stable=True)
        per_table = tf.math.bincount(tables, minlength=self.num_tables,
                                     maxlength=self.num_tables, dtype=tf.int64)
        table_splits = tf.concat([tf.zeros([1], tf.int64), tf.cumsum(per_table)], 0)
        node_uniq = ops.segment_unique(tf.gather(ids, order), table_splits)
        node_counts = tf.math.unsorted_segment_sum(tf.gather(counts, order), node_uniq.inverse,
                                                   tf.size(node_uniq.unique_keys))
        return node_uniq, node_counts, order

    def send_rows(self, rows: tf.Tensor, route: HierarchicalRoute, suffix: str) -> tf.Tensor:
        """Same contract as ``FlatExchange.send_rows``."""
        comm = self.comm
        node_rows, _ = comm.alltoall(rows, route.rail_splits,
                                     f"{self._prefix}/rows_rail{suffix}", self.counters,
                                     self._rail)
        node_rows.set_shape([None, rows.shape[1]])  # collectives lose the static dim
        # Fan-out to every node mate's request; its gradient is the node-level reduction.
        fanned, _ = ops.recovery_gather(node_rows, route.node_sort_indices,
                                        route.node_inverse)
        back, _ = comm.alltoall(fanned, route.recv_splits,
                                f"{self._prefix}/rows_node{suffix}", self.counters, self._node)
        return back
