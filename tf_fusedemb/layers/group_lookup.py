"""The distributed lookup of ONE fused group (its router): FusedRec Algorithm 1 over a
communicator. Its rows live in its ``group_store.GroupStore``.

Forward, per step: segment_unique -> the key exchange to the owners (flat: rankwise_sort
and one AlltoAll of (ID, count|category); hierarchical: through the node, see
``hierarchical_exchange``) -> category_hash on the owner -> table lookup -> the rows back
along the same path -> recovery. Backward is the tape's: recovery gradient (local
accumulation by I_r) -> the gradient AlltoAll(s) -> gather gradient (accumulation by I_l on
the owner). Three AlltoAll rounds per step (flat), six (hierarchical).
"""
from typing import Dict, List, Optional, Sequence

import tensorflow as tf

from tf_fusedemb import ops
from tf_fusedemb.comm import CommCounters, Communicator
from tf_fusedemb.layers.exchange import (EXCHANGES, FlatExchange, bad_input, decode_report,
                                         input_report, received_report)
from tf_fusedemb.layers.group_interface import Combiners, KeyExchange
from tf_fusedemb.layers.group_keys import GroupKeys
from tf_fusedemb.layers.group_store import GroupStore
from tf_fusedemb.layers.hierarchical_exchange import HierarchicalExchange
from tf_fusedemb.layers.inputs import FlatFeature, id_ranges, out_of_range_message
from tf_fusedemb.layers.lookup_context import NO_CONTEXT, LookupContext
from tf_fusedemb.layers.routed_lookup import RoutedLookup, same_ids
from tf_fusedemb.layers.row_update import RowUpdate, through_row_update
from tf_fusedemb.ops import hashing, static_sizes
from tf_fusedemb.specs import FusedGroup

KEY_MODES = ("hashed", "packed")


# What rows and their gradients may travel in between ranks (FusedEmbedding(wire_dtype=)).
WIRE_DTYPES = ("float32", "bfloat16")

class GroupLookup(tf.Module):
    """One group's lookup over the ranks: route keys to their owners, retrieve the
    owners' rows, serve them back (its exchanges and their counters); its ``store``
    (``GroupStore``) holds the owner-side table, statistics and policy.

    Args:
      group: the FusedGroup (features, shared spec).
      communicator: a tf_fusedemb.comm.Communicator.
      key_mode: unified keys of dynamic tables, "hashed" (any ID) or "packed" (exact,
        IDs must fit; see ``tf_fusedemb.ops.category_hash``). Static tables index rows
        by ``offset[table] + id`` and need neither.
      exchange: "flat" (one AlltoAll over all ranks) or "hierarchical" (node, then rail;
        needs several nodes of several ranks in ``communicator.topology``).
    """

    # It reports an ID out of range to every rank (``route``), not where it is flattened.
    defers_range_check = True

    def __init__(self, group: FusedGroup, communicator: Communicator, key_mode: str = "hashed",
                 exchange: str = "flat", wire_dtype: str = "float32"):
        super().__init__(name=f"group_{group.name}")
        if key_mode not in KEY_MODES:
            raise ValueError(f"key_mode must be one of {KEY_MODES}, got {key_mode!r}")
        if exchange not in EXCHANGES:
            raise ValueError(f"group '{group.name}': exchange must be one of {EXCHANGES}, "
                             f"got {exchange!r}")
        self.group = group
        self.comm = communicator
        if wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire_dtype must be one of {WIRE_DTYPES}, got {wire_dtype!r}")
        self.wire_dtype = tf.as_dtype(wire_dtype)  # rows' and row gradients' AlltoAll dtype
        self.key_mode = "packed" if group.is_static else key_mode
        # How (table, ID) pairs become storage and init keys, both ways.
        self._keys = GroupKeys(group, self.key_mode)
        self.table_names = self._keys.table_names
        if len(self.table_names) >= bad_input():
            raise ValueError(f"group '{group.name}' has {len(self.table_names)} tables; at most "
                             f"{bad_input()} fit the key exchange")
        # Each feature's valid ID range in words ("" where any ID is valid); where some
        # feature has one, an ID out of range is reported to every rank (``route``).
        id_bits = hashing.default_id_bits(len(self.table_names)) \
            if self.key_mode == "packed" and not group.is_static else None
        self._ranges = [" and ".join(words for _, _, words in id_ranges(f, id_bits))
                        for f in group.features]
        self.counters = CommCounters(group.name,
                                     link_classes=communicator.topology.cross_size > 1)
        # Both exchanges where the topology allows (same tables and owners: a step may
        # use either, see LookupContext.exchange); ``exchange`` is the group's own.
        self.exchanges: Dict[str, KeyExchange] = {
            "flat": FlatExchange(communicator, group.name, self.counters)}
        if exchange == "hierarchical" or communicator.topology.is_hierarchical:
            self.exchanges["hierarchical"] = HierarchicalExchange(
                communicator, group.name, self.counters, len(self.table_names))
        self.exchange = self.exchanges[exchange]
        # Its table, statistics, policy and snapshot: what checkpoints, export and
        # sharded inference use, and what the lookup reads and updates rows through.
        self.store = GroupStore(group, communicator, self._keys)

    def route(self, flats: Sequence[FlatFeature], context: LookupContext = NO_CONTEXT,
              record_statistics: bool = True) -> RoutedLookup:
        """Steps 1-5 of the lookup for ``flats``: fuse, segment unique, rankwise sort, the
        key AlltoAll and category hashing on the owner (access statistics recorded).
        Returns the RoutedLookup (no rows yet)."""
        lengths = static_sizes.stack_ints([static_sizes.num_elements(f.ids) for f in flats])
        splits = tf.concat([tf.zeros([1], tf.int64), tf.cumsum(lengths)], 0)
        ids = tf.concat([f.ids for f in flats], 0)
        uniq = ops.segment_unique(ids, splits)
        report = None
        if any(self._ranges):  # IDs checked against a range: bad input goes to every rank
            invalid = tf.concat([tf.zeros_like(f.ids, tf.bool) if f.invalid is None
                                 else f.invalid for f in flats], 0)
            report = input_report(ids, invalid, splits, self.comm.rank)
        recv, route = self.exchange_for(context).send_keys(uniq, self._keys.feature_table,
                                                           context.suffix, report)
        if report is not None:
            recv = self._fail_on_reported_input(recv)
        recv_ids, accesses, category = ops.unpack_key_messages(recv)
        hashed = ops.category_hash(recv_ids, category, self.table_names, mode=self.key_mode)
        keys, init_keys = self._keys.owner_keys(hashed)
        if record_statistics:  # training accesses only: not evaluation or prediction
            self.store.record_accesses(hashed, accesses)  # stateful; gates nothing
        return RoutedLookup(ids, uniq.inverse, keys, init_keys, hashed.inverse, route)

    def _fail_on_reported_input(self, recv):
        """``recv`` once it holds no bad-input report; else an InvalidArgumentError on
        this rank, as on every rank (each receives the report), naming the feature, the
        bad ID and the rank whose input held it."""
        failed, first = received_report(recv)
        rank, feature, bad_id = decode_report(first)
        where = tf.strings.join([" (in the input of rank ", tf.strings.as_string(rank),
                                 f" of {self.comm.size}; group '{self.group.name}')"])
        message = out_of_range_message(
            tf.gather(tf.constant([f.name for f in self.group.features]), feature), bad_id,
            tf.gather(tf.constant(self._ranges), feature), where)
        check = tf.debugging.Assert(tf.logical_not(failed), [message])
        with tf.control_dependencies([check]):
            return tf.identity(recv)

    def exchange_for(self, context: LookupContext) -> KeyExchange:
        """The exchange of ``context.exchange``, or the group's own."""
        if context.exchange is None:
            return self.exchange
        if context.exchange not in self.exchanges:
            raise ValueError(f"group '{self.group.name}': the step asks for the "
                             f"{context.exchange!r} exchange; this topology "
                             f"({self.comm.topology.describe()}) allows {sorted(self.exchanges)}")
        return self.exchanges[context.exchange]

    def retrieve(self, routed: RoutedLookup) -> tf.Tensor:
        """Step 6: the owner's rows of ``routed.keys``: float32[u_l, dim]."""
        return self.store.lookup_rows(routed.keys, routed.init_keys)

    def serve(self, routed: RoutedLookup, rows: tf.Tensor, flats: Sequence[FlatFeature],
              combiners: Combiners, context: LookupContext = NO_CONTEXT,
              marker: Optional[tf.Tensor] = None) -> List[tf.Tensor]:
        """Steps 7-8: rows back to the requesters (AlltoAll) and recovery per feature.
        Given the layer's row-update ``marker``, the owner's ``rows`` pass through it
        (``row_update.through_row_update``): differentiating the marker updates them."""
        if marker is not None:
            rows = through_row_update(marker, rows, self.store, routed.keys, routed.init_keys,
                                      context.row_update or RowUpdate.for_ranks(self.comm.size))
        served = tf.gather(rows, routed.inverse)
        # In wire_dtype both ways: the AlltoAll's gradient travels in its input's dtype.
        # (A cast to the same dtype adds no op: float32 graphs are unchanged.)
        back = self.exchange_for(context).send_rows(
            tf.cast(served, self.wire_dtype), routed.route, context.suffix)
        back = tf.cast(back, tf.float32)
        back.set_shape([None, self.group.dim])
        return ops.recover_features(back, routed.route.sort_indices, routed.unique_inverse,
                                    [f.sample_splits() for f in flats], combiners)

    def __call__(self, flats: Sequence[FlatFeature], combiners: Combiners,
                 context: LookupContext = NO_CONTEXT,
                 record_statistics: bool = True,
                 marker: Optional[tf.Tensor] = None) -> List[tf.Tensor]:
        """Embeddings of the group's features.

        Args:
          flats: one ``FlatFeature`` per feature of the group, in group order.
          combiners: per feature 'sum' | 'mean' | 'sqrtn', or None for one row per ID.
          context: the step's LookupContext (prepared lookups, names, row update).
          record_statistics: count these accesses (False for evaluation/prediction).
          marker: the layer's row-update marker (training), see ``serve``; unused for a
            prepared lookup, whose rows the step that prepared them differentiates.
        Returns:
          per feature float32[B_f, dim] (pooled) or float32[n_f, dim] (one row per ID).
        """
        prepared = context.prepared_for(self)
        if prepared is None:
            routed = self.route(flats, context, record_statistics)
            return self.serve(routed, self.retrieve(routed), flats, combiners, context,
                              marker)
        ids = tf.concat([f.ids for f in flats], 0)
        return self.serve(prepared, self._checked_rows(prepared, ids), flats,
                          combiners, context)

    def _checked_rows(self, prepared: RoutedLookup, ids: tf.Tensor) -> tf.Tensor:
        """The prepared rows; fails clearly when the layer is called with other IDs than
        were prefetched, or inside another graph than the step's."""
        _check_same_graph(prepared.rows)
        check = tf.debugging.Assert(same_ids(ids, prepared.ids), [
            f"group {self.group.name}: the FusedEmbedding layer got other IDs than the "
            "pipeline prefetched for it; pipelining needs each feature x[name] passed to "
            "the layer unchanged"])
        with tf.control_dependencies([check]):
            return tf.identity(prepared.rows)


def _check_same_graph(rows: tf.Tensor) -> None:
    """Fails clearly when the layer runs inside another graph than the step that prepared
    its ``rows``: a model whose ``call`` is a ``tf.function`` traces it once, so later
    steps would serve the first trace's rows (the synchronous step does not prepare)."""
    if tf.executing_eagerly() or rows.graph is tf.compat.v1.get_default_graph():
        return
    raise ValueError("tf_fusedemb: pipelining and micro-batches need the model's call "
                     "traced inside the training step: remove @tf.function from call(), "
                     "or compile without pipeline=")
