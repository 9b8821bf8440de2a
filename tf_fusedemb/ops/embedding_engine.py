"""The embedding storage engine's ops (custom_ops/embedding_engine*.cc) as one resource.

:class:`EmbeddingEngine` owns the engine of one group table on one rank: per key ONE
block with its identity and access statistics (table, ID, count, last step), its row and
its optimizer slots. The table (:class:`tf_fusedemb.storage.engine_table.EngineGroupTable`)
and the statistics (:class:`~tf_fusedemb.storage.engine_table.EngineStatistics`) of a
group read and write the same engine, so rows, slots and statistics stay one unit.

Example::

    engine = EmbeddingEngine("g0", 16, InitializerSpec(), (-0.05, 0.1), OptimizerSpec.adagrad(0.1))
    rows = engine.lookup(keys, keys)                                 # float32[u, 16]
    rows = engine.apply_gradients(keys, keys, grads, step=1)         # one pass per key

With ``memory_budget_bytes``, the engine keeps at most that many bytes of blocks and
index in DRAM and spills the others whole to a file of block slots in ``spill_path``
(an SSD tier); every call returns what it would without a budget.
"""
import itertools
from typing import Dict, NamedTuple, Optional, Sequence, Tuple

import tensorflow as tf

from tf_fusedemb.ops import _loader
from tf_fusedemb.ops._validate import TensorLike
from tf_fusedemb.specs import InitializerSpec, OptimizerSpec

__all__ = ["DEFAULT_NUM_SHARDS", "EmbeddingEngine", "EngineExport", "EngineKeyFields",
           "EngineSize"]

DEFAULT_NUM_SHARDS = 16
_instances = itertools.count()  # shared names: one engine per Python object


class EngineKeyFields(NamedTuple):
    """What the engine holds for some keys, all [u]: ``stored`` bool (a row),
    ``tables`` int32 (-1: statistics not tracked), ``ids``, ``counts`` and
    ``last_steps`` int64 (0 where not tracked)."""
    stored: tf.Tensor
    tables: tf.Tensor
    ids: tf.Tensor
    counts: tf.Tensor
    last_steps: tf.Tensor


class EngineExport(NamedTuple):
    """Blocks sorted by key: ``keys`` int64[k], ``fields`` EngineKeyFields of [k],
    ``values`` float32[k, dim] and ``slots`` float32[k, num_slots, dim] (0 rows when
    exported without rows)."""
    keys: tf.Tensor
    fields: EngineKeyFields
    values: tf.Tensor
    slots: tf.Tensor


class EngineSize(NamedTuple):
    """int64 scalars: ``stored`` rows, ``tracked`` keys with statistics (both over DRAM
    and SSD), ``bytes_held`` (DRAM: arena chunks and hash-index arrays the engine
    allocated), ``ssd_bytes`` (blocks in the SSD tier; 0 without one), ``ssd_io``
    int64[4] since creation: blocks read back from SSD, their bytes, blocks spilled,
    their bytes; ``ssd_index_bytes`` (DRAM of the SSD tier's index of its keys, apart
    from ``bytes_held`` and the budget; 0 without one)."""
    stored: tf.Tensor
    tracked: tf.Tensor
    bytes_held: tf.Tensor
    ssd_bytes: tf.Tensor
    ssd_io: tf.Tensor
    ssd_index_bytes: tf.Tensor


def _op(name: str):
    return _loader.raw_op(name)


def _keys(keys: TensorLike, what: str = "keys") -> tf.Tensor:
    keys = tf.convert_to_tensor(keys)
    if keys.dtype not in (tf.int32, tf.int64):
        raise TypeError(f"{what} must be int64, got {keys.dtype.name}")
    return tf.reshape(tf.cast(keys, tf.int64), [-1])


class EmbeddingEngine(tf.saved_model.experimental.TrackableResource):
    """The engine of one group table on this rank, a TF resource (CPU).

    Created eagerly in the constructor (under ``tf.init_scope``), destroyed when the
    object is garbage collected (``DestroyResourceOp`` on its handle). Each instance has
    its own shared name, so two tables never share rows by accident.

    Args:
        name: table name (part of the shared name, for messages).
        dim: row width.
        initializer: InitializerSpec of new rows (bit-equal to ``init_rows``).
        init_params: (loc, scale) of the initializer as float64, as
            ``tf_fusedemb.storage.initializers`` computes them (the storage layer passes
            them: initial rows must be bit-equal to ``init_rows``).
        optimizer: OptimizerSpec; sgd, adagrad, ftrl or adam (lazy).
        num_shards: power of two; keys are split by hash into this many shards, each
            with its own index, arena and lock.
        memory_budget_bytes: None: every block in DRAM. Else the DRAM bytes of blocks and
            index kept at most (blocks a running call or a prefetch pinned aside); the
            others live in a file of block slots (see TableSpec.memory_budget_bytes).
        spill_path: the store's directory, required with a budget: this engine's alone
            (emptied when the engine is made, removed when it is destroyed); see
            tf_fusedemb.storage.spill_dir for where the storage layer puts it.
        row_dtype: "float32" or "bfloat16": how rows are stored (TableSpec.row_dtype);
            lookups, gradients and slots are float32 either way.
        tables: the names of the tables the engine holds, named in the SSD tier's errors
            (a budget smaller than the blocks a batch pins, say).
    """

    def __init__(self, name: str, dim: int, initializer: InitializerSpec,
                 init_params: Tuple[float, float], optimizer: OptimizerSpec,
                 num_shards: int = DEFAULT_NUM_SHARDS, memory_budget_bytes: Optional[int] = None,
                 spill_path: Optional[str] = None, row_dtype: str = "float32",
                 tables: Sequence[str] = ()):
        if not isinstance(dim, int) or isinstance(dim, bool) or dim <= 0:
            raise ValueError(f"engine {name!r}: dim must be an int > 0, got {dim!r}")
        if not isinstance(num_shards, int) or num_shards <= 0 or num_shards & (num_shards - 1):
            raise ValueError(f"engine {name!r}: num_shards must be a power of two, got "
                             f"{num_shards!r}")
        super().__init__(device="/CPU:0")
        self.name = name
        self.dim = dim
        self.num_slots = len(optimizer.slot_names)
        self.num_shards = num_shards
        loc, scale = init_params
        hp = optimizer.hparams
        self._attrs = dict(
            dim=dim, optimizer=optimizer.name, learning_rate=optimizer.learning_rate,
            initializer=initializer.name, init_params=[repr(float(loc)), repr(float(scale))],
            num_shards=num_shards, row_dtype=row_dtype,
            shared_name=f"fusedemb_engine_{next(_instances)}_{name}")
        self.memory_budget_bytes = memory_budget_bytes
        self.spill_path = spill_path
        if memory_budget_bytes is not None:
            if not spill_path:
                raise ValueError(f"engine {name!r}: a memory budget needs a spill_path")
            self._attrs.update(memory_budget_bytes=memory_budget_bytes, spill_path=spill_path,
                               tables=", ".join(tables))
        for key in ("initial_accumulator_value", "beta1", "beta2", "epsilon",
                    "learning_rate_power", "l1", "l2"):
            if key in hp:
                self._attrs[key] = hp[key]
        with tf.init_scope():
            self.resource_handle  # pylint: disable=pointless-statement  (creates it now)

    # ------------------------------------------------------------ TrackableResource
    def _create_resource(self):
        return _op("EngineHandle")(**self._attrs)

    def _destroy_resource(self):
        tf.raw_ops.DestroyResourceOp(resource=self.resource_handle, ignore_lookup_error=True)

    # ------------------------------------------------------------ rows
    def lookup(self, keys: TensorLike, init_keys: TensorLike) -> tf.Tensor:
        """Rows of ``keys: int64[u]``; a key without a stored row gets the initial row of
        its ``init_keys: int64[u]`` entry and is NOT inserted. Returns float32[u, dim]."""
        return _op("EngineLookup")(self.resource_handle, _keys(keys), _keys(init_keys, "init_keys"),
                                   dim=self.dim)

    def apply_gradients(self, keys: TensorLike, init_keys: TensorLike, grads: TensorLike,
                        step: TensorLike, min_counts: Optional[TensorLike] = None) -> tf.Tensor:
        """One optimizer step per key in one pass (read, update, write).

        Args:
            keys: int64[u] UNIQUE storage keys. init_keys: int64[u].
            grads: float32[u, dim], summed per key.
            step: int64 scalar, the optimizer step (1 on the first update).
            min_counts: optional int64[T]: admission per table (the rule of
                ``storage.policy.admission_filter``: a key with no row whose statistics
                are tracked with table t and a count below min_counts[t] is not stored).

        Returns:
            float32[u, dim], the rows after the step (a key not admitted: its initial row).
        """
        min_counts = tf.zeros([0], tf.int64) if min_counts is None else tf.cast(min_counts, tf.int64)
        return _op("EngineApplyGradients")(
            self.resource_handle, _keys(keys), _keys(init_keys, "init_keys"),
            tf.convert_to_tensor(grads, tf.float32), tf.cast(step, tf.int64), min_counts,
            dim=self.dim)

    def gather_rows(self, keys: TensorLike) -> Tuple[tf.Tensor, tf.Tensor]:
        """(values float32[u, dim], slots float32[u, num_slots, dim]) of STORED ``keys``
        int64[u]; fails naming a key without a stored row."""
        values, slots = _op("EngineGatherRows")(self.resource_handle, _keys(keys), dim=self.dim,
                                                num_slots=self.num_slots)
        return values, slots

    def write_rows(self, keys: TensorLike, values: TensorLike,
                   slots: TensorLike) -> Optional[tf.Operation]:
        """Stores rows and slots of unique ``keys`` int64[u] (values float32[u, dim], slots
        float32[u, num_slots, dim]); statistics unchanged. Returns the op (None eagerly)."""
        return _op("EngineWriteRows")(self.resource_handle, _keys(keys),
                                      tf.convert_to_tensor(values, tf.float32),
                                      tf.convert_to_tensor(slots, tf.float32))

    def remove_rows(self, keys: TensorLike) -> Optional[tf.Operation]:
        """Drops the rows and slots of ``keys`` int64[u] (absent ones ignored); their
        statistics stay. Returns the op (None eagerly)."""
        return _op("EngineRemoveRows")(self.resource_handle, _keys(keys))

    def pin(self, keys: TensorLike) -> Optional[tf.Operation]:
        """Reads the blocks of ``keys`` int64[u] from the SSD tier into DRAM and keeps
        them there until :meth:`unpin` of the same keys (a prefetch of the next batch);
        a no-op without a budget. Returns the op (None eagerly)."""
        return _op("EnginePin")(self.resource_handle, _keys(keys))

    def unpin(self, keys: TensorLike) -> Optional[tf.Operation]:
        """Releases :meth:`pin` of ``keys`` int64[u], then spills over the budget."""
        return _op("EngineUnpin")(self.resource_handle, _keys(keys))

    def prefetch(self, keys: TensorLike) -> Optional[tf.Operation]:
        """Pins the blocks of the next batch's ``keys`` int64[u] in DRAM (reading them from
        the SSD tier now) and releases those of the batch prefetched two calls before:
        DBP's batch t+1 is retrieved in step t and updated in steps t+1 and t+2. A no-op
        without a budget. Returns the op (None eagerly)."""
        return _op("EnginePrefetch")(self.resource_handle, _keys(keys))

    # ------------------------------------------------------------ statistics
    def record(self, keys: TensorLike, tables: TensorLike, ids: TensorLike, counts: TensorLike,
               last_steps: TensorLike, overwrite_last_step: bool) -> Optional[tf.Operation]:
        """Adds statistics of unique ``keys`` int64[u]: ``tables`` int[u] in [0, 65535),
        ``ids`` int64[u], ``counts`` int64[u] >= 0 (added). ``last_steps`` (int64 scalar or
        [u]) become the last steps of keys not tracked before, and of all keys when
        ``overwrite_last_step``. Returns the op (None eagerly)."""
        return _op("EngineRecord")(
            self.resource_handle, _keys(keys), tf.cast(tables, tf.int32),
            tf.cast(ids, tf.int64), tf.cast(counts, tf.int64), tf.cast(last_steps, tf.int64),
            overwrite_last_step=overwrite_last_step)

    def forget(self, keys: TensorLike) -> Optional[tf.Operation]:
        """Forgets the statistics of ``keys`` int64[u]; their rows stay. Returns the op."""
        return _op("EngineForget")(self.resource_handle, _keys(keys))

    def find(self, keys: TensorLike) -> EngineKeyFields:
        """EngineKeyFields of ``keys`` int64[u] (any keys, duplicates allowed)."""
        return EngineKeyFields(*_op("EngineFind")(self.resource_handle, _keys(keys)))

    # ------------------------------------------------------------ whole engine
    def export(self, stored_only: bool, with_rows: bool) -> EngineExport:
        """Every block (``stored_only``: those with a row) sorted by key; see EngineExport."""
        out = _op("EngineExport")(self.resource_handle, stored_only=stored_only,
                                  with_rows=with_rows, dim=self.dim, num_slots=self.num_slots)
        return EngineExport(out[0], EngineKeyFields(*out[1:6]), out[6], out[7])

    def stored_keys(self) -> tf.Tensor:
        """int64[s], sorted: the keys of every block with a row, both tiers, without their
        rows or fields (8 bytes a key where ``export`` returns about 40)."""
        return _op("EngineStoredKeys")(self.resource_handle)

    def write_checkpoint(self, directory: str, changes_for: str = "") -> Optional[tf.Operation]:
        """Writes every block of this engine (rows, slots and statistics; both tiers) to
        ``directory`` (which must not exist; its parent must), straight from its arenas:
        as a new RocksDB database (a tiered engine's: the SSD tier's blocks, with the
        DRAM tier's in place of their stored copies). With ``changes_for`` (who writes
        the deltas, e.g. a checkpoint manager's id) the engine then records which keys
        change, for that owner's :meth:`write_delta`; with "" it records nothing.
        Returns the op (None eagerly)."""
        return _op("EngineWriteCheckpoint")(self.resource_handle, directory, changes_for)

    def write_delta(self, directory: str, changes_for: str) -> tf.Tensor:
        """Writes to ``directory`` (which must not exist; its parent must), in
        :meth:`write_checkpoint`'s format, the blocks of the keys changed since the last
        checkpoint write by ``changes_for`` (full or delta), and an empty value (a
        deletion) for each such key that has no block any more; then records changes
        afresh. Returns int64[2]: [blocks, deletions] written. Fails unless
        :meth:`records_changes_for` that owner."""
        return _op("EngineWriteDelta")(self.resource_handle, directory, changes_for)

    def records_changes_for(self, owner: str) -> tf.Tensor:
        """bool scalar: whether the engine records changes for ``owner`` (its last
        checkpoint write was that owner's, with changes recorded)."""
        return _op("EngineRecordsChangesFor")(self.resource_handle, owner)

    def read_checkpoint(self, directories: Sequence[str], rank: int, num_ranks: int) -> tf.Tensor:
        """Puts into this engine (tiered or not) the blocks that ``rank`` of ``num_ranks``
        owns (owner = mix64(ID) mod num_ranks) out of ``directories``, one per saving
        rank, as :meth:`write_checkpoint` or :meth:`write_delta` wrote them (a delta's
        deletions erase their keys on every rank). Returns the blocks put and deletions
        applied (int64 scalar)."""
        return _op("EngineReadCheckpoint")(self.resource_handle, list(directories),
                                           tf.constant(rank, tf.int32),
                                           tf.constant(num_ranks, tf.int32))

    def size(self) -> EngineSize:
        """EngineSize: stored rows, tracked keys, DRAM bytes held and SSD bytes."""
        return EngineSize(*_op("EngineSize")(self.resource_handle))

    def slots_dict(self, slots: tf.Tensor, slot_names: Sequence[str]) -> Dict[str, tf.Tensor]:
        """``slots`` float32[u, num_slots, dim] as {name: float32[u, dim]}."""
        return {n: slots[:, i, :] for i, n in enumerate(slot_names)}

    @staticmethod
    def stack_slots(slots: Dict[str, tf.Tensor], slot_names: Sequence[str], num_rows: TensorLike,
                    dim: int) -> tf.Tensor:
        """{name: float32[u, dim]} as float32[u, num_slots, dim] (in ``slot_names`` order)."""
        if not slot_names:
            return tf.zeros(tf.stack([tf.cast(num_rows, tf.int32), 0, dim]), tf.float32)
        return tf.stack([tf.convert_to_tensor(slots[n], tf.float32) for n in slot_names], axis=1)

