"""The storage backend interface: what the rest of the library needs from one fused
group's per-rank storage, and the three backends that provide it.

A group's storage is a pair (:class:`GroupStorage`): the *table* (rows, optimizer slots,
step counter; :class:`TableStorage`) and the *statistics* (per-key access counts and the
(table, ID) behind each key; :class:`StatisticsStorage`). Their users, and what each reads:

* ``GroupLookup`` (layers/group_lookup.py): ``table.lookup``, ``table.apply_gradients``
  (through the training step and the pipelines, ``return_rows=True`` for the dual
  buffer), ``stats.record``, ``stats.key_metadata``, ``load_rows``/``stored_rows``;
* eviction (``GroupStore.enforce_policy``, storage/policy.py): ``stats.export``,
  ``table.remove``, ``stats.remove``; admission: :meth:`StorageBackend.install_admission`;
* checkpoints (training/checkpoint.py): ``table.export``/``load``/``step``/``slot_names``,
  ``stats.export``/``load``/``register``;
* export and serving (inference/export.py, serving.py): ``stored_rows`` (``table.export``
  of ``stats.known_keys()``, ``table.size``);
* sharded inference (inference/distributed.py): ``table.lookup``, ``table.size``;
* ``GroupStore.memory``: :meth:`StorageBackend.memory_bytes`.

Backends, chosen per table by ``TableSpec.storage`` (a group's tables share one):

* ``"engine"`` (:class:`EngineBackend`): our storage engine, one block per key holding
  the row, its optimizer slots and its statistics; table and statistics share it;
  admission is decided inside the update kernel.
* ``"tfra"`` (:class:`TfraBackend`): TFRA hash tables for rows and slots, core-TF hash
  tables for the statistics; admission by a filter in the update.
* ``"static"`` (:class:`StaticBackend`): dense variables of the rows a rank owns
  (``vocabulary_size`` tables), the statistics in core-TF hash tables; no policies.

Example::

    backend = backend_for(group)                       # from group.storage
    storage = backend.create(group, "fusedemb_g0")     # GroupStorage(table, stats)
    rows = storage.table.lookup(keys, init_keys)       # float32[u, dim]
"""
import abc
from typing import (TYPE_CHECKING, Callable, ClassVar, Dict, NamedTuple, Optional, Protocol,
                    Sequence, Tuple, Union, cast, runtime_checkable)

import numpy as np
import tensorflow as tf

from tf_fusedemb.specs import FusedGroup, STORAGES
from tf_fusedemb.storage.dynamic_table import DynamicGroupTable  # TFRA loads on first table
from tf_fusedemb.storage.engine_table import EngineGroupTable, EngineStatistics
from tf_fusedemb.storage.policy import admission_filter
from tf_fusedemb.storage.spill_dir import make_spill_path
from tf_fusedemb.storage.static_table import StaticGroupTable
from tf_fusedemb.storage.static_keys import StaticKeys
from tf_fusedemb.storage.statistics import AccessStatistics

if TYPE_CHECKING:  # the backends import their tables when they create one (TFRA is heavy)
    from tf_fusedemb.ops.category_hash import CategoryHashResult
    from tf_fusedemb.storage.engine_table import EngineGroupTable

__all__ = ["BACKENDS", "EngineBackend", "GroupStorage", "StaticBackend", "StaticLayout",
           "StatisticsStorage", "StorageBackend", "TableStorage", "TfraBackend", "backend_for"]


@runtime_checkable
class TableStorage(Protocol):
    """One group's rows, optimizer slots and step on this rank (``GroupTable`` and its
    subclasses implement it). Keys are the group's storage keys, int64."""

    dim: int
    step: tf.Variable  # int64 scalar, optimizer steps taken
    # Optional admission filter, keys int64[u] -> bool[u]: only admitted keys are written
    # (StorageBackend.install_admission sets it where the update does not decide itself).
    admission: Optional[Callable[[tf.Tensor], tf.Tensor]]

    def set_admission_filter(self, admitted: Optional[Callable[[tf.Tensor], tf.Tensor]]
                             ) -> None:
        """Stores only the keys ``admitted`` (keys int64[u] -> bool[u]) lets through in
        every update; None: all."""

    @property
    def slot_names(self) -> tuple: ...

    def lookup(self, keys: tf.Tensor, init_keys: Optional[tf.Tensor] = None) -> tf.Tensor:
        """float32[u, dim] rows of ``keys`` int64[u]; a key without a stored row gets its
        initial row (of ``init_keys`` int64[u]) and is not inserted."""

    def apply_gradients(self, keys: tf.Tensor, grads: tf.Tensor,
                        init_keys: Optional[tf.Tensor] = None, step: Optional[tf.Tensor] = None,
                        return_rows: bool = False
                        ) -> Union[tf.Operation, Tuple[tf.Operation, tf.Tensor]]:
        """One optimizer step on the rows of UNIQUE ``keys`` int64[u] with ``grads``
        float32[u, dim]; inserts new keys. Returns the op, or (op, rows float32[u, dim])."""

    def advance_step(self) -> tf.Tensor:
        """Adds 1 to ``step``; returns the new value."""

    def export(self, keys: Optional[tf.Tensor] = None) -> Dict[str, tf.Tensor]:
        """Stored rows sorted by key: keys int64[s], values float32[s, dim], per slot
        float32[s, dim]; with ``keys`` int64[k], only the stored ones among them."""

    def load(self, exported: Dict[str, tf.Tensor]) -> Optional[tf.Operation]:
        """Writes rows as :meth:`export` returns them (slots optional)."""

    def contains(self, keys: tf.Tensor) -> tf.Tensor:
        """bool[u]: whether each of ``keys`` int64[u] has a stored row."""

    def stored_keys(self, known: Callable[[], np.ndarray]) -> np.ndarray:
        """int64[s], sorted: the keys with a stored row, no row read (eager); ``known``
        lists the keys whose identity the statistics recorded, for a table that cannot
        list its own."""

    def remove(self, keys: tf.Tensor) -> Optional[tf.Operation]:
        """Drops the rows and slots of ``keys`` int64[u] (eviction)."""

    def size(self) -> tf.Tensor:
        """int64 scalar: stored rows."""


@runtime_checkable
class StatisticsStorage(Protocol):
    """One group's per-key access statistics on this rank (``AccessStatistics`` and
    ``EngineStatistics`` implement it). Arrays are numpy unless stated."""

    categories: tuple

    def record(self, hashed: "CategoryHashResult", accesses: tf.Tensor,
               step: Optional[tf.Tensor] = None) -> Optional[tf.Operation]:
        """Adds one step's owner-side accesses (``CategoryHashResult``, int64[n]); an op."""

    def key_metadata(self, keys: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
        """(table int64[u], ID int64[u]) tensors of ``keys``; table -1 if never recorded."""

    def counts_of(self, keys: tf.Tensor) -> tf.Tensor:
        """int64[u] access counts of ``keys``."""

    def size(self) -> tf.Tensor:
        """int64 scalar: keys with a recorded (table, ID)."""

    def known_keys(self) -> np.ndarray:
        """int64[k] sorted: every key with a recorded (table, ID)."""

    def export(self) -> Dict[str, np.ndarray]:
        """keys, counts, categories, ids, last_steps, sorted by key."""

    def register(self, keys: np.ndarray, categories: np.ndarray, ids: np.ndarray,
                 step: int = 0) -> None:
        """Records the identity of stored keys with no access."""

    def recount_categories(self) -> None:
        """Sets the category totals from the per-key counts (after a restore of blocks)."""

    def remove(self, keys: np.ndarray) -> None:
        """Forgets ``keys`` (their counts leave the category totals)."""

    def load(self, keys: np.ndarray, counts: np.ndarray, categories: np.ndarray, ids: np.ndarray,
             last_steps: Optional[np.ndarray] = None) -> None:
        """Adds per-key statistics (a checkpoint's share)."""

    def category_totals(self) -> Dict[str, int]:
        """{table: accesses of its keys on this rank}."""

    def top_k(self, category: str, k: int = 10) -> list:
        """The k most accessed IDs of ``category`` on this rank."""

    def metrics(self) -> Dict[str, int]:
        """Flat scalar metrics for logging."""


class GroupStorage(NamedTuple):
    """A group's storage on this rank: its table and its statistics."""
    table: TableStorage
    stats: StatisticsStorage


class StaticLayout(NamedTuple):
    """Where a static group's rows live: its key space ``keys`` (a
    ``static_keys.StaticKeys``: each key's table, instance ID and init key) and this
    ``rank`` of ``num_ranks`` (a row lives on the owner of its instance ID)."""
    keys: StaticKeys
    rank: int
    num_ranks: int


class StorageBackend(abc.ABC):
    """Creates and describes one kind of group storage (stateless; one instance each)."""

    name: ClassVar[str]

    @abc.abstractmethod
    def create(self, group: FusedGroup, table_name: str,
               static: Optional[StaticLayout] = None) -> GroupStorage:
        """The table (named ``table_name``) and statistics of ``group`` on this rank;
        ``static`` is required by, and only by, the static backend."""

    def install_admission(self, storage: GroupStorage, min_counts: np.ndarray) -> None:
        """Makes updates store only admitted keys: per table t a key without a row needs
        an access count >= ``min_counts[t]`` (int64[T]). Default: the rule
        (``policy.admission_filter``) as a filter in the table's update."""
        storage.table.set_admission_filter(
            admission_filter(min_counts, storage.table, storage.stats))

    def memory_bytes(self, storage: GroupStorage, dim: int) -> int:
        """Bytes this rank holds for the group (eager). Default: the payload, per row the
        key (8) and dim float32 per row and slot, per tracked key 5 int64 (key, count,
        table, ID, last step); the hash tables' overhead is not counted."""
        rows, tracked = int(storage.table.size().numpy()), int(storage.stats.size().numpy())
        per_row = 8 + 4 * dim * (1 + len(storage.table.slot_names))
        return rows * per_row + tracked * 40

    def ssd_bytes(self, storage: GroupStorage) -> int:
        """Bytes of the group's blocks on this rank's SSD tier (eager); 0: none."""
        return 0

    def ssd_index_bytes(self, storage: GroupStorage) -> int:
        """DRAM bytes of the index of the group's keys on this rank's SSD tier (eager)."""
        return 0

    def ssd_blocks_moved(self, storage: GroupStorage) -> Tuple[int, int]:
        """(blocks read back from the SSD tier, blocks spilled to it) since the group's
        storage was made, on this rank (eager); (0, 0) without a tier."""
        return 0, 0

    def prefetch(self, storage: GroupStorage, keys: tf.Tensor) -> Optional[tf.Operation]:
        """Brings the blocks of a coming batch's ``keys`` int64[u] into DRAM and keeps
        them there while it is updated; None where every row is in DRAM already."""
        return None


class TfraBackend(StorageBackend):
    """TFRA hash tables (``DynamicGroupTable``) and core-TF statistics tables."""

    name = "tfra"

    def create(self, group: FusedGroup, table_name: str,
               static: Optional[StaticLayout] = None) -> GroupStorage:
        _no_layout(self, group, static)
        return GroupStorage(DynamicGroupTable(table_name, group.dim, group.initializer,
                                              group.optimizer),
                            AccessStatistics(group.name, [t.name for t in group.tables]))


class EngineBackend(StorageBackend):
    """The storage engine: ``EngineGroupTable`` and ``EngineStatistics`` on ONE engine
    (rows, slots and statistics in one block per key)."""

    name = "engine"

    def create(self, group: FusedGroup, table_name: str,
               static: Optional[StaticLayout] = None) -> GroupStorage:
        _no_layout(self, group, static)
        budget = group.memory_budget_bytes
        tables = [t.name for t in group.tables]
        path = None if budget is None else make_spill_path(group.name, tables, group.spill_dir)
        table = EngineGroupTable(table_name, group.dim, group.initializer, group.optimizer,
                                 memory_budget_bytes=budget, spill_path=path,
                                 row_dtype=group.row_dtype, tables=tables)
        return GroupStorage(table, EngineStatistics(group.name, tables, table.engine))

    def install_admission(self, storage: GroupStorage, min_counts: np.ndarray) -> None:
        # Decided inside the update kernel from the block's count and table: the same rule.
        _engine_table(storage).set_admission(min_counts)

    def memory_bytes(self, storage: GroupStorage, dim: int) -> int:
        """The DRAM bytes the engine allocated (arena chunks and index arrays) for rows,
        slots and statistics together: what the process really holds for the group."""
        return int(_engine_table(storage).bytes_held().numpy())

    def ssd_bytes(self, storage: GroupStorage) -> int:
        return int(_engine_table(storage).ssd_bytes().numpy())

    def ssd_index_bytes(self, storage: GroupStorage) -> int:
        return int(_engine_table(storage).ssd_index_bytes().numpy())

    def ssd_blocks_moved(self, storage: GroupStorage) -> Tuple[int, int]:
        io = _engine_table(storage).ssd_io().numpy()
        return int(io[0]), int(io[2])

    def prefetch(self, storage: GroupStorage, keys: tf.Tensor) -> Optional[tf.Operation]:
        table = _engine_table(storage)
        return table.prefetch(keys) if table.tiered else None


class StaticBackend(StorageBackend):
    """Dense variables of the owned rows (``StaticGroupTable``), core-TF statistics."""

    name = "static"

    def create(self, group: FusedGroup, table_name: str,
               static: Optional[StaticLayout] = None) -> GroupStorage:
        if static is None:
            raise ValueError(f"group '{group.name}': the static backend needs its StaticLayout")
        keys = static.keys
        table = StaticGroupTable(table_name, group.dim, group.initializer, group.optimizer,
                                 keys.vocabulary_size, keys.init_keys, rank=static.rank,
                                 num_ranks=static.num_ranks, owner_ids=keys.owner_ids)
        return GroupStorage(table, AccessStatistics(group.name, [t.name for t in group.tables]))

    def install_admission(self, storage: GroupStorage, min_counts: np.ndarray) -> None:
        raise ValueError("static tables have no admission (their memory is fixed)")


def _engine_table(storage: GroupStorage) -> "EngineGroupTable":
    """The table of a storage the engine backend created (EngineBackend.create makes it)."""
    return cast("EngineGroupTable", storage.table)


def _no_layout(backend: StorageBackend, group: FusedGroup,
               static: Optional[StaticLayout]) -> None:
    if static is not None or group.is_static:
        raise ValueError(f"group '{group.name}': the {backend.name!r} backend is for dynamic "
                         "tables; static tables use the 'static' backend")


BACKENDS: Dict[str, StorageBackend] = {
    b.name: b for b in (EngineBackend(), TfraBackend(), StaticBackend())}
assert set(STORAGES) <= set(BACKENDS)


def backend_for(group: FusedGroup) -> StorageBackend:
    """The backend of ``group``'s storage (``TableSpec.storage``, shared by its tables)."""
    return BACKENDS[group.storage]
