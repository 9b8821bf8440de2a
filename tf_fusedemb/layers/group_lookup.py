"""The distributed lookup of ONE fused group: FusedRec Algorithm 1 over a communicator.

Forward, per step: segment_unique -> the key exchange to the owners (flat: rankwise_sort
and one AlltoAll of (ID, count|category); hierarchical: through the node, see
``hierarchical_exchange``) -> category_hash on the owner -> table lookup -> the rows back
along the same path -> recovery. Backward is the tape's: recovery gradient (local
accumulation by I_r) -> the gradient AlltoAll(s) -> gather gradient (accumulation by I_l on
the owner). Three AlltoAll rounds per step (flat), six (hierarchical).
"""
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple, Union, cast

import numpy as np
import tensorflow as tf

from tf_fusedemb import ops
from tf_fusedemb.comm import CommCounters, Communicator
from tf_fusedemb.layers.exchange import (EXCHANGES, FlatExchange, bad_input, decode_report,
                                         input_report, received_report)
from tf_fusedemb.layers.group_interface import Combiners, GroupState, KeyExchange, StoredRows
from tf_fusedemb.layers.group_keys import GroupKeys
from tf_fusedemb.layers.group_snapshot import GroupSnapshot, InitOrderedKeys
from tf_fusedemb.layers.hierarchical_exchange import HierarchicalExchange
from tf_fusedemb.layers.inputs import FlatFeature, id_ranges, out_of_range_message
from tf_fusedemb.layers.lookup_context import NO_CONTEXT, LookupContext
from tf_fusedemb.layers.routed_lookup import RoutedLookup, same_ids
from tf_fusedemb.layers.row_update import RowUpdate, through_row_update
from tf_fusedemb.ops import hashing
from tf_fusedemb.specs import FusedGroup
from tf_fusedemb.storage.backend import StaticLayout, backend_for
from tf_fusedemb.storage.engine_table import FULL_WRITE, BlockWrite
from tf_fusedemb.storage.policy import GroupPolicy

if TYPE_CHECKING:  # a type only: the static backend makes this table
    from tf_fusedemb.storage.static_table import StaticGroupTable

KEY_MODES = ("hashed", "packed")


# What rows and their gradients may travel in between ranks (FusedEmbedding(wire_dtype=)).
WIRE_DTYPES = ("float32", "bfloat16")

class GroupLookup(tf.Module):
    """Owner-side table, statistics and counters of one group, and its lookup.

    Args:
      group: the FusedGroup (features, shared spec).
      communicator: a tf_fusedemb.comm.Communicator.
      key_mode: unified keys of dynamic tables, "hashed" (any ID) or "packed" (exact,
        IDs must fit; see ``tf_fusedemb.ops.category_hash``). Static tables index rows
        by ``offset[table] + id`` and need neither.
      exchange: "flat" (one AlltoAll over all ranks) or "hierarchical" (node, then rail;
        needs several nodes of several ranks in ``communicator.topology``).
    """

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
        self.key_codec = GroupKeys(group, self.key_mode)
        self.table_names = self.key_codec.table_names
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
        # The group's storage (TableSpec.storage: the engine, TFRA or static variables),
        # one interface whichever it is (tf_fusedemb.storage.backend).
        self._backend = backend_for(group)
        self._storage = self._backend.create(
            group, f"fusedemb_{group.name}", self._static_layout() if group.is_static else None)
        self.table, self.stats = self._storage
        # Admission and eviction per table (TableSpec.admission / .eviction), decided on
        # the owner from the statistics; static tables cannot have policies (specs/tables.py).
        self.policy = GroupPolicy(group.tables) if any(t.has_policy for t in group.tables) \
            else None
        if self.policy is not None and self.policy.admits:
            self._backend.install_admission(self._storage, self.policy.min_counts)
        # The storage's contents as numpy arrays (checkpoints, export, loaded weights).
        self._snapshot = GroupSnapshot(group, self._storage, self.key_codec)

    def _static_table(self) -> "StaticGroupTable":
        """A static group's table (the static backend made it; callers check is_static)."""
        return cast("StaticGroupTable", self.table)

    def _static_layout(self) -> StaticLayout:
        return StaticLayout(self.key_codec.static_keys, self.comm.rank, self.comm.size)

    def stored_rows(self) -> StoredRows:
        """The rows this rank stores and their identities (``GroupSnapshot.stored_rows``)."""
        return self._snapshot.stored_rows()

    def stored_init_keys(self, chunk_rows: int) -> InitOrderedKeys:
        """This rank's stored rows' (storage keys, init keys) in init-key order,
        ``chunk_rows`` at a time, no row read (``GroupSnapshot.stored_init_keys``)."""
        return self._snapshot.stored_init_keys(chunk_rows)

    def load_rows(self, table: str, ids: np.ndarray, rows: np.ndarray) -> None:
        """Writes ``rows`` float32[n, dim] as the values of ``ids`` int64[n] of ``table``,
        keeping the IDs this rank owns (``GroupSnapshot.load_rows``). Eager."""
        self._snapshot.load_rows(table, ids, rows, self.comm.rank, self.comm.size)

    def save_state(self, directory: Optional[str] = None, write: BlockWrite = FULL_WRITE) -> dict:
        """This rank's state of the group, a checkpoint shard's part; a storage-engine
        table writes its blocks (every block, or those changed: ``write``) to
        ``directory`` (``GroupSnapshot.save``). Eager."""
        return self._snapshot.save(directory, write)

    def records_changes_for(self, owner: str) -> bool:
        """Whether a delta ``save_state`` for ``owner`` would follow that owner's last
        one (``GroupSnapshot.records_changes_for``). Eager."""
        return self._snapshot.records_changes_for(owner)

    def restore_state(self, shards: Sequence[GroupState], rank: int, size: int,
                      directories: Sequence[str] = (),
                      deltas: Sequence[Sequence[str]] = ()) -> None:
        """Loads what rank ``rank`` of ``size`` owns out of every saving rank's
        ``save_state`` and, for a storage-engine table, its directory, then each delta's
        directories in order (``GroupSnapshot.restore``). Eager."""
        self._snapshot.restore(shards, rank, size, directories, deltas)

    def dense_rows(self) -> np.ndarray:
        """A static group's every row on this rank, float32[V_local, dim] (one host: all
        of them), in key order (key = ``table_offsets[table] + ID``). Eager."""
        if not self.group.is_static:
            raise ValueError(f"group '{self.group.name}' is dynamic: it has no dense rows; "
                             "use stored_rows()")
        return self._static_table().dense_values().numpy()

    def apply_gradients(self, keys: tf.Tensor, grads: tf.Tensor,
                        init_keys: Optional[tf.Tensor] = None, step: Optional[tf.Tensor] = None,
                        return_rows: bool = False
                        ) -> Union[tf.Operation, Tuple[tf.Operation, tf.Tensor]]:
        """One optimizer step on the owner rows of UNIQUE ``keys`` int64[u] with ``grads``
        float32[u, dim]; new keys start from the initial rows of ``init_keys`` int64[u]
        (admission decides which are stored). ``step``: the step the update belongs to
        (default: advance the group's step). Returns the op, or (op, the updated rows
        float32[u, dim]) with ``return_rows`` (the pipelines' dual buffer)."""
        return self.table.apply_gradients(keys, grads, init_keys, step=step,
                                          return_rows=return_rows)

    def advance_step(self) -> tf.Tensor:
        """Adds 1 to the group's optimizer step (int64); returns the new value."""
        return self.table.advance_step()

    @property
    def tiered(self) -> bool:
        """Whether the group's engine has a memory budget (an SSD tier)."""
        return self.group.memory_budget_bytes is not None

    def prefetch(self, keys: tf.Tensor) -> Optional[tf.Operation]:
        """Reads the owner-side ``keys`` int64[u] of a coming batch from the SSD tier
        into DRAM now and keeps them there while that batch is updated (a pipeline's
        prefetch calls it once per batch, before retrieving the batch's rows); None
        without a tier."""
        return self._backend.prefetch(self._storage, keys)

    def num_stored_rows(self) -> int:
        """Rows this rank stores for the group: written (trained or restored) rows (eager)."""
        return int(self.table.size())

    def num_resident_rows(self) -> int:
        """Rows the group occupies in memory on this rank: a static table's allocated
        rows (all it owns, written or not), a dynamic table's stored rows (eager)."""
        if self.group.is_static:
            return int(self._static_table().values.shape[0])
        return self.num_stored_rows()

    def static_shard(self) -> tuple:
        """A static group's (rank, number of ranks, vocabulary size) its rows were
        allocated for (one rank's share of the rows)."""
        if not self.group.is_static:
            raise ValueError(f"group '{self.group.name}' is dynamic: it has no static shard")
        table = self._static_table()
        return table.rank, table.num_ranks, table.vocabulary_size

    def lookup_rows(self, keys: tf.Tensor, init_keys: Optional[tf.Tensor] = None) -> tf.Tensor:
        """This rank's rows of storage ``keys`` int64[u] (initial rows from ``init_keys``
        for keys never stored, not inserted): float32[u, dim]. Sharded inference's
        owner-side read."""
        return self.table.lookup(keys, init_keys)

    def enforce_policy(self) -> int:
        """Evicts the keys the tables' EvictionPolicies select after the step the
        group's step counter shows (TTL, then the cap; see ``EvictionPolicy``): their
        rows, optimizer slots and statistics together. Every rank must call it after
        the same steps (it may run up to two collectives); calling it twice after one
        step evicts nothing more. Eager.

        Returns:
          int, the number of keys this rank evicted.
        """
        if self.policy is None or not self.policy.due(int(self.table.step.numpy())):
            return 0
        keys = self.policy.evictions_at(int(self.table.step.numpy()), self.stats.export(),
                                        self.comm.allgather_object)
        if len(keys):
            self.table.remove(tf.constant(keys, tf.int64))
            self.stats.remove(keys)
        return len(keys)

    def memory(self) -> dict:
        """What this rank holds for the group (eager): ``rows`` stored rows, ``tracked_keys``
        keys with statistics, and ``bytes`` (``StorageBackend.memory_bytes``): on the
        engine the bytes it really allocated for rows, slots and statistics; on TFRA and
        static tables their payload (per row the key (8) and dim float32 values per row
        and optimizer slot, per tracked key 5 int64: key, count, table, ID, last step;
        hash-table overhead not counted); ``ssd_bytes``, the bytes of its blocks in the
        SSD tier (TableSpec.memory_budget_bytes; 0 without one); ``ssd_index_bytes``, the
        DRAM of the SSD tier's index of its keys (apart from ``bytes``); ``ssd_blocks_read`` and
        ``ssd_blocks_spilled``, the blocks moved between the tiers so far."""
        rows, tracked = int(self.table.size().numpy()), int(self.stats.size().numpy())
        blocks_read, blocks_spilled = self._backend.ssd_blocks_moved(self._storage)
        return {"rows": rows, "tracked_keys": tracked,
                "bytes": self._backend.memory_bytes(self._storage, self.group.dim),
                "ssd_bytes": self._backend.ssd_bytes(self._storage),
                "ssd_index_bytes": self._backend.ssd_index_bytes(self._storage),
                "ssd_blocks_read": blocks_read, "ssd_blocks_spilled": blocks_spilled}

    def route(self, flats: Sequence[FlatFeature], context: LookupContext = NO_CONTEXT,
              record_statistics: bool = True) -> RoutedLookup:
        """Steps 1-5 of the lookup for ``flats``: fuse, segment unique, rankwise sort, the
        key AlltoAll and category hashing on the owner (access statistics recorded).
        Returns the RoutedLookup (no rows yet)."""
        lengths = tf.stack([tf.size(f.ids, out_type=tf.int64) for f in flats])
        splits = tf.concat([tf.zeros([1], tf.int64), tf.cumsum(lengths)], 0)
        ids = tf.concat([f.ids for f in flats], 0)
        uniq = ops.segment_unique(ids, splits)
        report = None
        if any(self._ranges):  # IDs checked against a range: bad input goes to every rank
            invalid = tf.concat([tf.zeros_like(f.ids, tf.bool) if f.invalid is None
                                 else f.invalid for f in flats], 0)
            report = input_report(ids, invalid, splits, self.comm.rank)
        recv, route = self.exchange_for(context).send_keys(uniq, self.key_codec.feature_table,
                                                           context.suffix, report)
        if report is not None:
            recv = self._fail_on_reported_input(recv)
        recv_ids, accesses, category = ops.unpack_key_messages(recv)
        hashed = ops.category_hash(recv_ids, category, self.table_names, mode=self.key_mode)
        keys, init_keys = self.key_codec.owner_keys(hashed)
        if record_statistics:  # training accesses only: not evaluation or prediction
            # The step these accesses belong to: the one the next update takes (TTL clock).
            self.stats.record(hashed, accesses, self.table.step + 1)  # stateful; gates nothing
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
        rows = self.table.lookup(routed.keys, routed.init_keys)
        rows.set_shape([None, self.group.dim])  # collectives and tables lose the static dim
        return rows

    def serve(self, routed: RoutedLookup, rows: tf.Tensor, flats: Sequence[FlatFeature],
              combiners: Combiners, context: LookupContext = NO_CONTEXT,
              marker: Optional[tf.Tensor] = None) -> List[tf.Tensor]:
        """Steps 7-8: rows back to the requesters (AlltoAll) and recovery per feature.
        Given the layer's row-update ``marker``, the owner's ``rows`` pass through it
        (``row_update.through_row_update``): differentiating the marker updates them."""
        if marker is not None:
            rows = through_row_update(marker, rows, self, routed.keys, routed.init_keys,
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
