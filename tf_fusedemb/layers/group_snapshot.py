"""GroupSnapshot: what one fused group's storage holds on this rank, read and written as
numpy arrays (eager).

Checkpoints save and restore it (any number of saving ranks onto any number of restoring
ranks: a row goes to the owner of its instance ID), the export and serving read its
stored rows, and ``FusedEmbedding.set_embedding_weights`` loads a Keras Embedding's
weights through it. Rows keep their identity, (table, instance ID), next to their
storage key in every array set, so a key is never trusted alone.
"""
from typing import Iterable, Iterator, Mapping, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tf_fusedemb.layers.group_interface import StoredRows
from tf_fusedemb.layers.group_keys import GroupKeys
from tf_fusedemb.ops import hashing
from tf_fusedemb.specs import FusedGroup
from tf_fusedemb.storage.backend import EngineBackend, GroupStorage
from tf_fusedemb.storage.engine_table import FULL_WRITE, BlockWrite, EngineGroupTable

# Init keys are put in order a range at a time: 2^6 ranges by their top bits.
INIT_ORDER_BUCKET_BITS = 6
# Keys hashed, decoded or looked up per call when a whole rank's keys are walked.
_WALK_CHUNK = 1 << 20


class InitOrderedKeys(NamedTuple):
    """A rank's stored keys in init-key order: ``num_keys`` of them, and ``chunks`` yielding
    (storage keys int64[c], init keys int64[c]), c = chunk_rows but for the last."""
    num_keys: int
    chunks: Iterator[Tuple[np.ndarray, np.ndarray]]


def _chunks(n: int) -> Iterator[slice]:
    """Slices of ``_WALK_CHUNK`` over range(n)."""
    return (slice(i, min(i + _WALK_CHUNK, n)) for i in range(0, n, _WALK_CHUNK))


def _rechunk(pieces: Iterable[np.ndarray], size: int) -> Iterator[np.ndarray]:
    """The concatenation of ``pieces`` (index arrays) cut into arrays of ``size``, the
    last one shorter; empty pieces are passed over."""
    carry = np.zeros([0], np.int64)
    for piece in pieces:
        carry = np.concatenate([carry, piece])
        while len(carry) >= size:
            yield carry[:size]
            carry = carry[size:]
    if len(carry):
        yield carry


# A save_state entry saying the group's blocks are in its block checkpoint directory (the
# name earlier versions wrote for tiered tables, which alone wrote blocks then).
BLOCK_CHECKPOINT = "ssd_checkpoint"


class GroupSnapshot:
    """Numpy access to one group's table and statistics on this rank.

    Args:
      group: the FusedGroup.  storage: its table and statistics on this rank.
      key_codec: the group's GroupKeys.
    """

    def __init__(self, group: FusedGroup, storage: GroupStorage, key_codec: GroupKeys):
        self.group, self.storage, self.key_codec = group, storage, key_codec

    def stored_rows(self) -> StoredRows:
        """The rows this rank stores and their identities: the unit a checkpoint or an
        export reads (eager). A dynamic table's rows are read by lookups of the keys
        whose identity is recorded, never by iterating the hash table (see
        ``DynamicGroupTable.export``), and must account for every stored row.

        Returns:
          The StoredRows, keys sorted.
        """
        known = None if self.group.is_static else self.storage.stats.known_keys()
        slots = {k: v.numpy() for k, v in self.storage.table.export(known).items()}
        keys, values = slots.pop("keys"), slots.pop("values")
        stored = int(self.storage.table.size().numpy())
        if len(keys) != stored:
            raise ValueError(f"group '{self.group.name}': the table stores {stored} rows but "
                             f"{len(keys)} of them have a recorded (table, ID); every "
                             "path that stores a row records its identity")
        tables, ids = self.key_codec.decode(keys, self.storage.stats)
        return StoredRows(keys, values, slots, tables, ids)

    def stored_init_keys(self, chunk_rows: int) -> InitOrderedKeys:
        """The storage and init keys of the rows this rank stores, in init-key order (the
        hashed key a serving lookup computes, signed), ``chunk_rows`` at a time, without
        reading a row: what an export reads its rows by (eager).

        A rank holds the keys, their init keys and a byte per key meanwhile (17 bytes a
        row; 9 where the storage key is the init key), never a sort of them all: the
        init keys fall into ``2^INIT_ORDER_BUCKET_BITS`` ranges by their top bits, and
        each range is sorted alone.
        """
        keys = self._stored_keys()
        init = self._init_keys(keys)
        shift = 64 - INIT_ORDER_BUCKET_BITS
        buckets = np.empty(len(init), np.uint8)
        for at in _chunks(len(init)):  # signed top bits, offset: ranges in signed order
            buckets[at] = (init[at] >> shift) + (1 << (INIT_ORDER_BUCKET_BITS - 1))

        def in_order() -> Iterator[np.ndarray]:
            for b in range(1 << INIT_ORDER_BUCKET_BITS):
                where = np.flatnonzero(buckets == b)
                yield where[np.argsort(init[where], kind="stable")]

        def chunks() -> Iterator[Tuple[np.ndarray, np.ndarray]]:
            for at in _rechunk(in_order(), chunk_rows):
                yield keys[at], init[at]
        return InitOrderedKeys(len(keys), chunks())

    def _stored_keys(self) -> np.ndarray:
        """int64[s]: the storage keys of the rows this rank stores, sorted."""
        table, stats = self.storage.table, self.storage.stats
        keys = table.stored_keys(stats.known_keys)
        count = int(table.size().numpy())
        if len(keys) != count:
            raise ValueError(f"group '{self.group.name}': the table stores {count} rows but "
                             f"{len(keys)} of them have a recorded (table, ID); every "
                             "path that stores a row records its identity")
        return keys

    def _init_keys(self, keys: np.ndarray) -> np.ndarray:
        """int64[s]: the init keys of storage ``keys`` int64[s], computed a chunk at a time
        (the hashing's temporaries stay a chunk's)."""
        if self.key_codec.key_mode == "hashed" and not self.group.is_static:
            return keys  # the storage key is the hashed key itself
        init = np.empty_like(keys)
        for at in _chunks(len(keys)):
            tables, ids = self.key_codec.decode(keys[at], self.storage.stats)
            init[at] = self.key_codec.storage_keys(ids, tables)[1]
        return init

    def load_rows(self, table: str, ids: np.ndarray, rows: np.ndarray, rank: int,
                  size: int) -> None:
        """Writes ``rows`` as the values of ``ids`` of ``table`` (e.g. weights of a Keras
        Embedding being converted), keeping only the IDs this rank owns. The rows become
        stored keys with optimizer slots at their initial values, and their (table, ID)
        is recorded in the statistics (with no access), so checkpoints and export see the
        table and its statistics as one unit (eager).

        Args:
          table: one of the group's table names.
          ids: int64[n] instance IDs. rows: float32[n, dim].
          rank, size: this rank and the number of ranks (owner = mix64(ID) mod size).
        """
        names = self.key_codec.table_names
        if table not in names:
            raise ValueError(f"group '{self.group.name}' has no table {table!r}; its tables "
                             f"are {names}")
        ids = np.asarray(ids, np.int64).reshape(-1)
        rows = np.asarray(rows, np.float32)
        if rows.shape != (len(ids), self.group.dim):
            raise ValueError(f"table {table!r}: rows must be float32[{len(ids)}, "
                             f"{self.group.dim}], got shape {rows.shape}")
        mine = hashing.owner_rank(ids, size) == rank
        ids, rows = ids[mine], rows[mine]
        segment = np.full(len(ids), names.index(table), np.int64)
        keys, _ = self.key_codec.storage_keys(ids, segment)
        self.storage.table.load({"keys": keys, "values": rows})
        self.storage.stats.register(keys, segment, ids,
                                    step=int(self.storage.table.step.numpy()))

    def save(self, directory: Optional[str] = None, write: BlockWrite = FULL_WRITE) -> dict:
        """This rank's state of the group (eager), a checkpoint shard's part: the
        ``stored_rows`` arrays, ``step`` (int64 scalar) and the access statistics under
        ``stats/`` (keys, counts, categories, ids, last_steps).

        A storage-engine table given a ``directory`` (which must not exist) writes its
        blocks (rows, slots and statistics) there instead, in C++ straight from the
        engine (``EngineGroupTable.write_checkpoint``): no row passes through Python, so
        the save holds no second copy of the table, and a tiered table's DRAM holds no
        more than its budget meanwhile; ``write`` says whether every block or only those
        changed since the previous save (``BlockWrite``). The state is then ``step`` and
        ``BLOCK_CHECKPOINT``. Other storage always returns every row (``write`` does not
        apply to it): an incremental checkpoint holds such a group in full."""
        step = np.array(self.storage.table.step.numpy())
        table = self.storage.table
        if directory is not None and isinstance(table, EngineGroupTable):
            table.write_checkpoint(directory, write)
            return {"step": step, BLOCK_CHECKPOINT: np.array(True)}
        state = self.stored_rows().arrays()
        state["step"] = step
        state.update({"stats/" + k: v for k, v in self.storage.stats.export().items()})
        return state

    def records_changes_for(self, owner: str) -> bool:
        """Whether a delta ``save`` for ``owner`` would follow that owner's last save: a
        storage-engine table records changes for it; other storage is saved whole anyway
        (True). Eager."""
        table = self.storage.table
        return not isinstance(table, EngineGroupTable) or table.records_changes_for(owner)

    def restore(self, shards: Sequence[Mapping[str, np.ndarray]], rank: int, size: int,
                directories: Sequence[str] = (), deltas: Sequence[Sequence[str]] = ()) -> None:
        """Loads, out of ``shards`` (the ``save`` dicts of every rank of the run
        that saved, any number), the rows and statistics that rank ``rank`` of ``size``
        owns (owner = mix64(raw ID) mod size), with their optimizer slots, and the
        largest saved step. Shards saved as blocks (a storage-engine table) are read from
        ``directories`` (one per saving rank, as ``save`` was given them: a save of every
        block), then from each of ``deltas`` in order (the directories of the later delta
        saves, ``BlockWrite(delta=True)``, one per saving rank); ``shards`` are the last
        save's. Shards saved as arrays hold every row: ``deltas`` do not apply to them.
        Eager."""
        if any(BLOCK_CHECKPOINT in s for s in shards):
            self._restore_blocks(shards, rank, size, directories, deltas)
            return

        def merged(key):
            return np.concatenate([s[key] for s in shards])
        ids = merged("ids")
        mine = hashing.owner_rank(ids, size) == rank
        rows = {"keys": merged("keys")[mine], "values": merged("values")[mine]}
        for slot in self.storage.table.slot_names:
            rows[slot] = merged(slot)[mine]
        self.storage.table.load(rows)
        self.storage.table.step.assign(max(int(s["step"]) for s in shards))
        fields = ["keys", "counts", "categories", "ids"]
        if all("stats/last_steps" in s for s in shards):  # absent before eviction
            fields.append("last_steps")
        stats = {k: merged("stats/" + k) for k in fields}
        owned = hashing.owner_rank(stats["ids"], size) == rank
        self.storage.stats.load(*(stats[k][owned] for k in fields))
        # The rows' (table, ID) come from the rows' own arrays, last: a restored row can
        # never lack (or get another) identity, whatever the access statistics hold.
        self.storage.stats.register(rows["keys"], merged("tables")[mine], ids[mine],
                                    step=int(self.storage.table.step.numpy()))

    def _restore_blocks(self, shards, rank, size, directories, deltas):
        """``restore`` of shards saved as blocks: the blocks this rank owns go into the
        engine as they were saved (rows, slots and statistics), the full save's first,
        then each delta's over them."""
        if (any(len(d) != len(shards) for d in [directories, *deltas])
                or not all(BLOCK_CHECKPOINT in s for s in shards)):
            raise ValueError(f"group '{self.group.name}': {len(shards)} saved shards, "
                             f"{len(directories)} block directories; every saving rank "
                             "writes one")
        table = self.storage.table
        if not isinstance(table, EngineGroupTable):  # other storage: through arrays
            self.restore([self._arrays_of_blocks(shards, rank, size, directories, deltas)],
                         rank, size)
            return
        for link in [directories, *deltas]:
            table.read_checkpoint(link, rank, size)
        table.step.assign(max(int(s["step"]) for s in shards))
        # The blocks held the per-key counts; the totals per table follow from them.
        self.storage.stats.recount_categories()

    def _arrays_of_blocks(self, shards, rank, size, directories, deltas) -> dict:
        """The ``save`` arrays of the saved blocks that rank ``rank`` of ``size`` owns,
        read into a temporary storage engine of the group's spec: what a table of other
        storage restores from. Holds this rank's share twice meanwhile."""
        storage = EngineBackend().create(self.group, f"{self.group.name}_blocks")
        engine = GroupSnapshot(self.group, storage, self.key_codec)
        engine.restore(shards, rank, size, directories, deltas)
        return engine.save()
