"""The store of ONE fused group on this rank: its table, access statistics, admission and
eviction policy, snapshot and memory.

Its router (``group_lookup.GroupLookup``: route, retrieve, serve) reads and updates rows
through it; checkpoints, export and sharded inference use it alone (save, restore, the
stored rows, owner-side reads). The table sits behind ``tf_fusedemb.storage.backend``
(the engine, TFRA or static variables), one interface whichever it is.

Shapes: u unique keys of this owner, s rows it stores.
"""
from typing import TYPE_CHECKING, Optional, Sequence, Tuple, Union, cast

import numpy as np
import tensorflow as tf

from tf_fusedemb.comm import Communicator
from tf_fusedemb.layers.group_interface import GroupState, StoredRows
from tf_fusedemb.layers.group_keys import GroupKeys
from tf_fusedemb.layers.group_snapshot import GroupSnapshot, InitOrderedKeys
from tf_fusedemb.ops.category_hash import CategoryHashResult
from tf_fusedemb.specs import FusedGroup
from tf_fusedemb.storage.backend import StatisticsStorage, StaticLayout, backend_for
from tf_fusedemb.storage.engine_table import FULL_WRITE, BlockWrite
from tf_fusedemb.storage.policy import GroupPolicy

if TYPE_CHECKING:  # a type only: the static backend makes this table
    from tf_fusedemb.storage.static_table import StaticGroupTable


class GroupStore(tf.Module):
    """One group's rows, optimizer slots, statistics and policy on this rank.

    Args:
      group: the FusedGroup (features, shared spec).
      communicator: the ranks the group is sharded over (a static table's share of the
        rows; eviction's agreement between ranks).
      keys: the group's key codec (``GroupKeys``), shared with its router.
    """

    def __init__(self, group: FusedGroup, communicator: Communicator, keys: GroupKeys):
        super().__init__(name=f"store_{group.name}")
        self.group = group
        self._comm = communicator
        self._keys = keys
        # The group's storage (TableSpec.storage), one interface whichever it is.
        self._backend = backend_for(group)
        layout = StaticLayout(keys.static_keys, communicator.rank, communicator.size) \
            if group.is_static else None
        self._storage = self._backend.create(group, f"fusedemb_{group.name}", layout)
        self.table, self._stats = self._storage
        # Admission and eviction per table (TableSpec.admission / .eviction), decided on
        # the owner from the statistics; static tables cannot have policies (specs/tables.py).
        self._policy = GroupPolicy(group.tables) if any(t.has_policy for t in group.tables) \
            else None
        if self._policy is not None and self._policy.admits:
            self._backend.install_admission(self._storage, self._policy.min_counts)
        # The storage's contents as numpy arrays (checkpoints, export, loaded weights).
        self._snapshot = GroupSnapshot(group, self._storage, keys)

    # ------------------------------------------------------------ the step's reads/writes
    def record_accesses(self, hashed: CategoryHashResult, accesses: tf.Tensor) -> None:
        """Counts a training step's accesses of the owner's ``hashed`` keys (``accesses``
        int64[u] per key), for the step the next update takes (TTL clock). Stateful."""
        self._stats.record(hashed, accesses, self.table.step + 1)

    def lookup_rows(self, keys: tf.Tensor, init_keys: Optional[tf.Tensor] = None) -> tf.Tensor:
        """This rank's rows of storage ``keys`` int64[u] (initial rows from ``init_keys``
        for keys never stored, not inserted): float32[u, dim]."""
        rows = self.table.lookup(keys, init_keys)
        rows.set_shape([None, self.group.dim])  # tables lose the static dim
        return rows

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

    # ------------------------------------------------------------ state (eager)
    def storage_keys(self, ids: np.ndarray, tables: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(storage keys, init keys), int64[n] each, of ``ids`` int64[n] of the tables
        ``tables`` int64[n] (indices in the group)."""
        return self._keys.storage_keys(ids, tables)

    def stored_rows(self) -> StoredRows:
        """The rows this rank stores and their identities (``GroupSnapshot.stored_rows``)."""
        return self._snapshot.stored_rows()

    def stored_init_keys(self, chunk_rows: int) -> InitOrderedKeys:
        """This rank's stored rows' (storage keys, init keys) in init-key order,
        ``chunk_rows`` at a time, no row read (``GroupSnapshot.stored_init_keys``)."""
        return self._snapshot.stored_init_keys(chunk_rows)

    def load_rows(self, table: str, ids: np.ndarray, rows: np.ndarray) -> None:
        """Writes ``rows`` float32[n, dim] as the values of ``ids`` int64[n] of ``table``,
        keeping the IDs this rank owns (``GroupSnapshot.load_rows``)."""
        self._snapshot.load_rows(table, ids, rows, self._comm.rank, self._comm.size)

    def save_state(self, directory: Optional[str] = None, write: BlockWrite = FULL_WRITE) -> dict:
        """This rank's state of the group, a checkpoint shard's part; a storage-engine
        table writes its blocks (every block, or those changed: ``write``) to
        ``directory`` (``GroupSnapshot.save``)."""
        return self._snapshot.save(directory, write)

    def records_changes_for(self, owner: str) -> bool:
        """Whether a delta ``save_state`` for ``owner`` would follow that owner's last
        one (``GroupSnapshot.records_changes_for``)."""
        return self._snapshot.records_changes_for(owner)

    def restore_state(self, shards: Sequence[GroupState], rank: int, size: int,
                      directories: Sequence[str] = (),
                      deltas: Sequence[Sequence[str]] = ()) -> None:
        """Loads what rank ``rank`` of ``size`` owns out of every saving rank's
        ``save_state`` and, for a storage-engine table, its directory, then each delta's
        directories in order (``GroupSnapshot.restore``)."""
        self._snapshot.restore(shards, rank, size, directories, deltas)

    def dense_rows(self) -> np.ndarray:
        """A static group's every row on this rank, float32[V_local, dim] (one host: all
        of them), in key order (key = ``table_offsets[table] + ID``)."""
        if not self.group.is_static:
            raise ValueError(f"group '{self.group.name}' is dynamic: it has no dense rows; "
                             "use stored_rows()")
        return self._static_table().dense_values().numpy()

    def static_shard(self) -> Tuple[int, int, int]:
        """A static group's (rank, number of ranks, vocabulary size) its rows were
        allocated for (one rank's share of the rows)."""
        if not self.group.is_static:
            raise ValueError(f"group '{self.group.name}' is dynamic: it has no static shard")
        table = self._static_table()
        return table.rank, table.num_ranks, table.vocabulary_size

    def num_stored_rows(self) -> int:
        """Rows this rank stores for the group: written (trained or restored) rows."""
        return int(self.table.size())

    def num_resident_rows(self) -> int:
        """Rows the group occupies in memory on this rank: a static table's allocated
        rows (all it owns, written or not), a dynamic table's stored rows."""
        if self.group.is_static:
            return int(self._static_table().values.shape[0])
        return self.num_stored_rows()

    @property
    def statistics(self) -> StatisticsStorage:
        """The group's access statistics on this rank (``AccessStatistics``)."""
        return self._stats

    @property
    def has_policy(self) -> bool:
        """Whether some table of the group has an admission or eviction policy."""
        return self._policy is not None

    @property
    def has_eviction(self) -> bool:
        """Whether some table of the group has an EvictionPolicy."""
        return self._policy is not None and bool(self._policy.evictions)

    def enforce_policy(self) -> int:
        """Evicts the keys the tables' EvictionPolicies select after the step the
        group's step counter shows (TTL, then the cap; see ``EvictionPolicy``): their
        rows, optimizer slots and statistics together. Every rank must call it after
        the same steps (it may run up to two collectives); calling it twice after one
        step evicts nothing more.

        Returns:
          int, the number of keys this rank evicted.
        """
        if self._policy is None or not self._policy.due(int(self.table.step.numpy())):
            return 0
        keys = self._policy.evictions_at(int(self.table.step.numpy()), self._stats.export(),
                                         self._comm.allgather_object)
        if len(keys):
            self.table.remove(tf.constant(keys, tf.int64))
            self._stats.remove(keys)
        return len(keys)

    def memory(self) -> dict:
        """What this rank holds for the group: ``rows`` stored rows, ``tracked_keys``
        keys with statistics, and ``bytes`` (``StorageBackend.memory_bytes``): on the
        engine the bytes it really allocated for rows, slots and statistics; on TFRA and
        static tables their payload (per row the key (8) and dim float32 values per row
        and optimizer slot, per tracked key 5 int64: key, count, table, ID, last step;
        hash-table overhead not counted); ``ssd_bytes``, the bytes of its blocks in the
        SSD tier (TableSpec.memory_budget_bytes; 0 without one); ``ssd_index_bytes``, the
        DRAM of the SSD tier's index of its keys (apart from ``bytes``); ``ssd_blocks_read`` and
        ``ssd_blocks_spilled``, the blocks moved between the tiers so far."""
        rows, tracked = int(self.table.size().numpy()), int(self._stats.size().numpy())
        blocks_read, blocks_spilled = self._backend.ssd_blocks_moved(self._storage)
        return {"rows": rows, "tracked_keys": tracked,
                "bytes": self._backend.memory_bytes(self._storage, self.group.dim),
                "ssd_bytes": self._backend.ssd_bytes(self._storage),
                "ssd_index_bytes": self._backend.ssd_index_bytes(self._storage),
                "ssd_blocks_read": blocks_read, "ssd_blocks_spilled": blocks_spilled}

    def _static_table(self) -> "StaticGroupTable":
        """A static group's table (the static backend made it; callers check is_static)."""
        return cast("StaticGroupTable", self.table)
