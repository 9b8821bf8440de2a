"""The storage engine backend: a group's rows, optimizer slots and access statistics in
ONE block per key (custom_ops/embedding_engine.h), read and written in one pass.

:class:`EngineGroupTable` is the group table (same public surface as
:class:`~tf_fusedemb.storage.dynamic_table.DynamicGroupTable`) and
:class:`EngineStatistics` the access statistics (same public surface as
:class:`~tf_fusedemb.storage.statistics.AccessStatistics`); both hold the same
:class:`~tf_fusedemb.ops.embedding_engine.EmbeddingEngine`, so a key's row, slots and
statistics are one unit, and removing the row or forgetting the statistics never leaves
the other half behind unaccounted.

Example (one group on one rank)::

    table = EngineGroupTable("fusedemb_g0", 16, InitializerSpec(), OptimizerSpec.adagrad(0.1))
    stats = EngineStatistics("g0", ["user", "item"], table.engine)
    table.set_admission([2, 1])         # min_count per table, decided inside the update
"""
import dataclasses
from typing import Callable, Dict, Optional, Sequence, Tuple, Union

import numpy as np
import tensorflow as tf

from tf_fusedemb.ops.embedding_engine import DEFAULT_NUM_SHARDS, EmbeddingEngine
from tf_fusedemb.ops.category_hash import CategoryHashResult
from tf_fusedemb.ops.row_masks import masked_rows
from tf_fusedemb.specs import InitializerSpec, OptimizerSpec
from tf_fusedemb.storage import initializers
from tf_fusedemb.storage.group_table import GroupTable
from tf_fusedemb.storage.statistics import AccessStatistics

__all__ = ["BlockWrite", "DeltaCounts", "EngineGroupTable", "EngineStatistics", "FULL_WRITE"]


@dataclasses.dataclass(frozen=True)
class BlockWrite:
    """What a checkpoint write of an engine table's blocks writes, and for whom the engine
    records changes afterwards.

    Fields:
      delta: False: every block. True: only the blocks of the keys changed since
        ``owner``'s previous write, and a deletion for each such key without a block any
        more (refused unless the engine records changes for ``owner``).
      owner: who writes the next delta (a checkpoint manager's id, unique in the
        process): the engine records the keys whose blocks change from here on, in a
        per-shard set (custom_ops/engine_changes.h), for that owner. "": it records
        nothing (a full write only).
    """
    delta: bool = False
    owner: str = ""

    def __post_init__(self) -> None:
        if self.delta and not self.owner:
            raise ValueError("BlockWrite: a delta needs the owner its changes are recorded for")


FULL_WRITE = BlockWrite()  # every block, no change recorded afterwards


@dataclasses.dataclass(frozen=True)
class DeltaCounts:
    """What a delta write wrote: ``blocks`` (changed keys' blocks) and ``deletions``
    (changed keys without a block any more)."""
    blocks: int
    deletions: int


class EngineGroupTable(GroupTable):
    """Engine storage of one fused group: any int64 key, rows inserted on update.

    ``apply_gradients`` reads, updates and writes each key's row and slots in one kernel
    pass; admission (``set_admission``) is decided inside it from the block's statistics.
    A Python ``admission`` filter (the GroupTable attribute) is honoured too, through the
    generic read/optimize/write path.

    Args:
        name: group name. dim: row width. initializer: InitializerSpec.
        optimizer: OptimizerSpec (sgd, adagrad, ftrl, adam).
        num_shards: power of two; the engine's shards (parallelism and lock granularity).
        validate_unique: check that apply_gradients gets unique keys (debugging).
        memory_budget_bytes, spill_path: the SSD tier (TableSpec.memory_budget_bytes)
            and its directory (storage/spill_dir.py); None keeps every block in DRAM.
        row_dtype: "float32" or "bfloat16" (TableSpec.row_dtype).
        tables: the group's table names, named in the SSD tier's errors.
    """

    def __init__(self, name: str, dim: int, initializer: InitializerSpec, optimizer: OptimizerSpec,
                 num_shards: int = DEFAULT_NUM_SHARDS, validate_unique: bool = False,
                 memory_budget_bytes: Optional[int] = None, spill_path: Optional[str] = None,
                 row_dtype: str = "float32", tables: Sequence[str] = ()):
        super().__init__(name, dim, initializer, optimizer, validate_unique)
        with tf.init_scope():
            self.engine = EmbeddingEngine(
                name, dim, initializer, initializers._params(initializer),  # pylint: disable=protected-access
                optimizer, num_shards, memory_budget_bytes, spill_path, row_dtype, tables)
        self._min_counts: Optional[tf.Tensor] = None  # int64[T] while admission is on

    # ---------------------------------------------------------------- admission
    def set_admission(self, min_counts: Optional[Union[Sequence[int], np.ndarray]]) -> None:
        """Admission inside the update: ``min_counts`` int64[T], the count a key of table t
        needs before its row is stored (``policy.admission_filter``'s rule: a stored key or a
        key never recorded is always admitted); None turns admission off."""
        if min_counts is None:
            self._min_counts = None
            return
        values = np.asarray(min_counts, np.int64).reshape(-1)
        if values.size == 0 or (values < 0).any():
            raise ValueError(f"{self._kind}: min_counts must be int64[T] >= 0 with T >= 1, got "
                             f"{values.tolist()}")
        with tf.init_scope():
            self._min_counts = tf.constant(values)

    # ---------------------------------------------------------------- GroupTable
    def apply_gradients(self, keys: tf.Tensor, grads: tf.Tensor,
                        init_keys: Optional[tf.Tensor] = None, step: Optional[tf.Tensor] = None,
                        return_rows: bool = False
                        ) -> Union[tf.Operation, Tuple[tf.Operation, tf.Tensor]]:
        """GroupTable.apply_gradients in one engine pass per key (read, optimizer, write).

        Args:
            keys: int64[u] UNIQUE storage keys. grads: float32[u, dim], summed per key.
            init_keys: int64[u] keys seeding the initial rows; default ``keys``.
            step: optional int64 scalar (default: advance ``step`` and use it).
            return_rows: also return the updated rows float32[u, dim].

        Returns:
            The update op in graph mode (None eagerly); with ``return_rows`` the pair
            (op, rows).
        """
        if self.admission is not None:  # a Python filter: the generic path honours it
            return super().apply_gradients(keys, grads, init_keys, step, return_rows)
        keys, init_keys, grads = self._update_inputs(keys, grads, init_keys)
        step = self.advance_step() if step is None else tf.cast(step, tf.int64)
        rows = self.engine.apply_gradients(keys, init_keys, grads, step, self._min_counts)
        rows.set_shape([None, self.dim])
        op = None if tf.executing_eagerly() else rows.op
        return (op, rows) if return_rows else op

    def size(self) -> tf.Tensor:
        return self.engine.size().stored

    def bytes_held(self) -> tf.Tensor:
        """int64 scalar: DRAM bytes the engine allocated (arena chunks and index arrays)
        for rows, slots and statistics together."""
        return self.engine.size().bytes_held

    def ssd_bytes(self) -> tf.Tensor:
        """int64 scalar: bytes of the blocks in the SSD tier (0 without a budget)."""
        return self.engine.size().ssd_bytes

    def ssd_index_bytes(self) -> tf.Tensor:
        """int64 scalar: DRAM bytes of the SSD tier's index of its keys (0 without a
        budget)."""
        return self.engine.size().ssd_index_bytes

    def ssd_io(self) -> tf.Tensor:
        """int64[4] since creation: blocks read back from the SSD tier, their bytes, blocks
        spilled to it, their bytes (zeros without a budget)."""
        return self.engine.size().ssd_io

    @property
    def tiered(self) -> bool:
        """Whether the table has a memory budget (an SSD tier)."""
        return self.engine.memory_budget_bytes is not None

    def write_checkpoint(self, directory: str, write: BlockWrite = FULL_WRITE
                         ) -> Optional[DeltaCounts]:
        """Writes the table's blocks (rows, slots and statistics of both tiers) to
        ``directory`` as a RocksDB database, in C++ (EmbeddingEngine.write_checkpoint):
        a tiered table through its SSD tier's own checkpoint, an untiered one anew; or,
        for a delta ``write``, only the blocks changed since its owner's previous write,
        and deletions (EmbeddingEngine.write_delta). Returns the DeltaCounts of a delta,
        None otherwise. Eager."""
        if write.delta:
            blocks, deletions = self.engine.write_delta(directory, write.owner).numpy().tolist()
            return DeltaCounts(int(blocks), int(deletions))
        self.engine.write_checkpoint(directory, write.owner)
        return None

    def records_changes_for(self, owner: str) -> bool:
        """Whether a delta write for ``owner`` would follow that owner's last write (the
        engine records changes for it). Eager."""
        return bool(self.engine.records_changes_for(owner).numpy())

    def read_checkpoint(self, directories: Sequence[str], rank: int, size: int) -> int:
        """Puts the blocks that ``rank`` of ``size`` owns out of every saving rank's
        ``write_checkpoint`` directory into this table (tiered or not); a delta's
        deletions erase their keys. Returns the blocks put and deletions applied. Eager."""
        return int(self.engine.read_checkpoint(directories, rank, size).numpy())

    def prefetch(self, keys: tf.Tensor) -> Optional[tf.Operation]:
        """Reads the next batch's ``keys`` int64[u] from the SSD tier into DRAM now (while
        the current batch computes) and keeps them there until two more batches are
        prefetched (EmbeddingEngine.prefetch); a no-op untiered. Returns the op."""
        return self.engine.prefetch(self._as_keys(keys, "keys"))

    def export(self, keys: Optional[tf.Tensor] = None) -> Dict[str, tf.Tensor]:
        if keys is None:
            out = self.engine.export(stored_only=True, with_rows=True)
            keys, values, slots = out.keys, out.values, out.slots
        else:
            keys = tf.sort(tf.unique(self._as_keys(keys, "keys")).y)  # reproducible order
            keys, = masked_rows(self.engine.find(keys).stored, keys)
            values, slots = self.engine.gather_rows(keys)
        return dict(self.engine.slots_dict(slots, self.slot_names), keys=keys, values=values)

    def contains(self, keys: tf.Tensor) -> tf.Tensor:
        """bool[u]: whether each of ``keys`` int64[u] has a stored row."""
        return self.engine.find(self._as_keys(keys, "keys")).stored

    def stored_keys(self, known: Callable[[], np.ndarray]) -> np.ndarray:
        """int64[s], sorted: the keys of the blocks with a row, both tiers, listed by the
        engine itself (8 bytes a key; ``known`` is not needed)."""
        return self.engine.stored_keys().numpy()

    def remove(self, keys: tf.Tensor) -> Optional[tf.Operation]:
        """Removes the rows of ``keys`` int64[u] and their optimizer slots (absent keys
        are ignored); they read their initial rows again, their statistics stay. Returns
        the op (None eagerly)."""
        return self.engine.remove_rows(self._as_keys(keys, "keys"))

    def _lookup(self, keys, init_keys):
        rows = self.engine.lookup(keys, init_keys)
        rows.set_shape([None, self.dim])
        return rows

    def _read(self, keys, init_keys):
        """Rows, and slots: stored ones gathered, the others at their initial values."""
        stored = self.engine.find(keys).stored
        where = tf.where(stored)  # int64[s, 1]
        _, gathered = self.engine.gather_rows(tf.gather_nd(keys, where))
        initial = self.optimizer.initial_slots(tf.size(keys), self.dim)
        slots = {n: tf.tensor_scatter_nd_update(initial[n], where, gathered[:, i, :])
                 for i, n in enumerate(self.slot_names)}
        return self._lookup(keys, init_keys), slots

    def _write(self, keys, rows, slots):
        stacked = EmbeddingEngine.stack_slots(slots, self.slot_names, tf.size(keys), self.dim)
        return self.engine.write_rows(keys, rows, stacked)


class EngineStatistics(AccessStatistics):
    """AccessStatistics kept in the blocks of a group's engine (count, (table, ID) and
    last step per key) instead of four hash tables; same public surface and results.

    Args:
        group_name: the fused group's name (variable names).
        categories: the group's table names, in segment order.
        engine: the EmbeddingEngine of the group's EngineGroupTable (``table.engine``).
    """

    def __init__(self, group_name: str, categories: Sequence[str], engine: EmbeddingEngine):
        super().__init__(group_name, categories)
        self.engine = engine

    def _make_key_storage(self):
        pass  # the per-key fields live in the engine's blocks

    def _record_keys(self, keys, hashed, counts, step):
        last_steps = tf.constant(0, tf.int64) if step is None else tf.cast(step, tf.int64)
        return self.engine.record(keys, hashed.lookup_segment_ids, hashed.lookup_ids, counts,
                                  last_steps, overwrite_last_step=step is not None)

    def key_metadata(self, keys: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
        """(category index int64[u], instance ID int64[u]) behind unified ``keys``; category
        -1 for a key never recorded here."""
        found = self.engine.find(tf.convert_to_tensor(keys, tf.int64))
        return tf.cast(found.tables, tf.int64), found.ids

    def counts_of(self, keys: tf.Tensor) -> tf.Tensor:
        """int64[u]: access counts of unified ``keys`` (0 for a key never recorded)."""
        return self.engine.find(tf.convert_to_tensor(keys, tf.int64)).counts

    def size(self) -> tf.Tensor:
        """int64 scalar: number of keys tracked here (with a recorded (category, ID))."""
        return self.engine.size().tracked

    def known_keys(self) -> np.ndarray:
        """int64[k], sorted: every key whose (category, ID) is recorded here (eager)."""
        return self.export()["keys"]

    def export(self) -> Dict[str, np.ndarray]:
        """Per-key statistics as numpy arrays, sorted by key: keys, counts, categories,
        ids, last_steps (eager)."""
        out = self.engine.export(stored_only=False, with_rows=False)
        tracked = out.fields.tables.numpy() >= 0
        return {"keys": out.keys.numpy()[tracked],
                "counts": out.fields.counts.numpy()[tracked],
                "categories": out.fields.tables.numpy()[tracked].astype(np.int64),
                "ids": out.fields.ids.numpy()[tracked],
                "last_steps": out.fields.last_steps.numpy()[tracked]}

    def register(self, keys: np.ndarray, categories: np.ndarray, ids: np.ndarray,
                 step: int = 0) -> None:
        """Records the (category, ID) behind stored ``keys`` (int64[u], int64[u], int64[u])
        with no access; a key not tracked yet gets ``step`` as its last step (eager)."""
        if len(keys) == 0:
            return
        self.engine.record(keys, categories, ids, tf.zeros([len(keys)], tf.int64),
                           tf.constant(step, tf.int64), overwrite_last_step=False)

    def _forget(self, keys):
        self.engine.forget(keys)

    def _load_keys(self, keys, counts, categories, ids, last_steps):
        overwrite = last_steps is not None
        self.engine.record(keys, categories, ids, counts,
                           last_steps if overwrite else tf.constant(0, tf.int64),
                           overwrite_last_step=overwrite)
