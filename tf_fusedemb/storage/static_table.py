"""StaticGroupTable: the rows a rank owns of a static-vocabulary group, in dense variables.

Keys are global row indices in [0, vocabulary_size). Rank ``rank`` of ``num_ranks`` stores
only the rows it owns (owner = ``owner_rank(owner_ids(key), num_ranks)``, the rule the key
exchange routes by), so a rank holds about 1/N of the group: its sorted owned keys and
dense [V_owned, dim] rows and slots. A key is mapped to its local row by
``tf.searchsorted`` on the owned keys, which also carry each row's ``touched`` flag in
their low bit (``key << 1 | touched``: one int32 per row, 4 bytes of overhead).
"""
import numpy as np
import tensorflow as tf

from tf_fusedemb.ops import hashing
from tf_fusedemb.storage.initializers import init_rows
from tf_fusedemb.storage.group_table import GroupTable, _object_name

__all__ = ["StaticGroupTable"]

_INIT_CHUNK_ROWS = 1 << 18  # rows initialised per init_rows call at creation
_OWNER_CHUNK_KEYS = 1 << 22  # keys hashed per owner_rank call at creation (bounds temporaries)


def _per_key(arg, keys, vocabulary_size, what):
    """int64[k] values of a per-key argument at ``keys``: None (the key itself), a callable
    mapping int64[k] keys to int64[k], or an int64[vocabulary_size] array."""
    if arg is None:
        return keys
    if callable(arg):
        out = np.asarray(arg(keys), np.int64).reshape(-1)
        if out.shape != keys.shape:
            raise ValueError(f"{what} must map int64[k] keys to int64[k], got shape {out.shape} "
                             f"for {keys.shape[0]} keys")
        return out
    arr = np.asarray(arg, np.int64).reshape(-1)
    if arr.shape[0] != vocabulary_size:
        raise ValueError(f"{what} must be int64[{vocabulary_size}], got shape {arr.shape}")
    return arr[keys]


def owned_keys_of_rank(vocabulary_size: int, rank: int, num_ranks: int,
                       owner_ids=None) -> np.ndarray:
    """The keys in [0, vocabulary_size) owned by ``rank``: int64[V_owned], ascending.

    Args:
      owner_ids: None (a key's owner is decided by the key itself), a callable mapping
        int64[k] keys to the int64[k] IDs the owner is decided by, or an int64[V] array.
    """
    if num_ranks == 1:
        return np.arange(vocabulary_size, dtype=np.int64)
    parts = []
    for start in range(0, vocabulary_size, _OWNER_CHUNK_KEYS):
        keys = np.arange(start, min(start + _OWNER_CHUNK_KEYS, vocabulary_size), dtype=np.int64)
        ids = _per_key(owner_ids, keys, vocabulary_size, "owner_ids")
        parts.append(keys[hashing.owner_rank(ids, num_ranks) == rank])
    return np.concatenate(parts)


class StaticGroupTable(GroupTable):
    """Dense storage of the owned rows of one fused group with keys in [0, vocabulary_size).

    Every owned row is initialised at creation with ``init_rows(init_keys[key])`` and every
    slot with its initial value, so a never-updated key reads its initial row, as in the
    dynamic table. Updates scatter the touched rows only. A ``touched`` bit per row
    records the rows ever written, so :meth:`size` and :meth:`export` report the same
    rows a dynamic table would hold. Exported and loaded keys are global keys.

    Bytes per rank: V_owned x (dim x (1 + slots) x 4 + 4) (rows and slots, an int32 owned
    key with its touched bit (int64 past 2**30 keys)), V_owned about V / num_ranks.

    The ``init_keys`` arguments of :meth:`lookup` and :meth:`apply_gradients` are
    ignored: each row's init key was fixed at creation.

    Args:
        name: group name. dim: row width. initializer: InitializerSpec.
        optimizer: OptimizerSpec.
        vocabulary_size: int > 0, number of rows of the whole group (all ranks).
        init_keys: the init key of each row: None (the key), a callable mapping int64[k]
            keys to int64[k] init keys, or an int64[vocabulary_size] tensor/array.
        validate_unique: check that apply_gradients gets unique keys (debugging).
        rank, num_ranks: this rank and the world size (default 0 of 1: every row).
        owner_ids: what decides a key's owner, ``owner_rank(owner_ids(key), num_ranks)``:
            None (the key), a callable int64[k] -> int64[k] or an int64[vocabulary_size]
            array (a fused group passes the instance ID of each key).

    Raises:
        tf.errors.InvalidArgumentError (at run time): a key outside [0, vocabulary_size),
            or one another rank owns; the message names the table.
    """

    def __init__(self, name, dim, initializer, optimizer, vocabulary_size, init_keys=None,
                 validate_unique=False, rank=0, num_ranks=1, owner_ids=None):
        super().__init__(name, dim, initializer, optimizer, validate_unique)
        if not isinstance(vocabulary_size, int) or isinstance(vocabulary_size, bool) \
                or vocabulary_size <= 0:
            raise ValueError(f"{self._kind}: vocabulary_size must be an int > 0, got {vocabulary_size!r}")
        if not (isinstance(num_ranks, int) and num_ranks >= 1 and isinstance(rank, int)
                and 0 <= rank < num_ranks):
            raise ValueError(f"{self._kind}: need 0 <= rank < num_ranks, got rank={rank!r}, "
                             f"num_ranks={num_ranks!r}")
        self.vocabulary_size, self.rank, self.num_ranks = vocabulary_size, rank, num_ranks
        base = _object_name(name)
        with tf.init_scope():  # create (and initialise) once, eagerly, even from a trace
            owned = owned_keys_of_rank(vocabulary_size, rank, num_ranks, owner_ids)
            if isinstance(init_keys, tf.Tensor):
                init_keys = init_keys.numpy()
            row_keys = _per_key(init_keys, owned, vocabulary_size, f"{self._kind}: init_keys")
            n = self._num_owned = len(owned)
            # int32 entries halve the map's bytes; searchsorted needs the query's dtype.
            fits = vocabulary_size <= np.iinfo(np.int32).max >> 1
            self._key_dtype = tf.int32 if fits else tf.int64
            # key << 1 | touched: sorted like the keys, all start untouched.
            self.key_entries = tf.Variable(tf.constant(owned << 1, self._key_dtype),
                                           trainable=False, name=f"{base}_key_entries")
            # In chunks: init_rows holds float64 temporaries several times the rows' size.
            chunks = [init_rows(tf.constant(row_keys[i:i + _INIT_CHUNK_ROWS]), dim, initializer)
                      for i in range(0, n, _INIT_CHUNK_ROWS)] or [tf.zeros([0, dim])]
            self.values = tf.Variable(tf.concat(chunks, 0), trainable=False, name=f"{base}_values")
            self.slots = {s: tf.Variable(tf.fill([n, dim], tf.constant(v, tf.float32)),
                                         trainable=False, name=f"{base}_{s}")
                          for s, v in self.optimizer.initial_slot_values.items()}

    def dense_values(self) -> tf.Tensor:
        """float32[vocabulary_size, dim]: every row, indexed by key; only a rank that owns
        every key has them (one process, e.g. a SavedModel export)."""
        if self.num_ranks != 1:
            raise ValueError(f"{self._kind}: rank {self.rank} of {self.num_ranks} stores only "
                             "its own rows; dense values need one process (restore the "
                             "checkpoint on one process first)")
        return tf.identity(self.values)

    def _check_keys(self, keys):
        message = f"{self._op_kind}: keys must lie in [0, {self.vocabulary_size})"
        checks = [tf.debugging.assert_non_negative(keys, message=message),
                  tf.debugging.assert_less(keys, tf.constant(self.vocabulary_size, tf.int64),
                                           message=message)]
        with tf.control_dependencies(checks):
            return tf.identity(keys)

    def owned_keys(self) -> tf.Tensor:
        """int64[V_owned]: the global keys this rank stores, ascending."""
        return tf.cast(tf.bitwise.right_shift(self.key_entries, 1), tf.int64)

    def _touched(self, rows) -> tf.Tensor:
        """bool[u]: whether the local ``rows`` int64[u] were ever written."""
        return tf.equal(tf.bitwise.bitwise_and(tf.gather(self.key_entries, rows), 1), 1)

    def _local(self, keys):
        """(local rows int64[u], owned bool[u]) of range-checked global keys."""
        if self._num_owned == 0:  # a rank may own no row of a small group
            return tf.zeros_like(keys), tf.zeros_like(keys, tf.bool)
        entries = tf.convert_to_tensor(self.key_entries)
        query = tf.bitwise.left_shift(tf.cast(keys, self._key_dtype), 1)
        index = tf.searchsorted(entries, query, out_type=tf.int64)  # key's entry, if owned
        clipped = tf.minimum(index, self._num_owned - 1)  # a key past the last owned one
        hit = tf.equal(tf.bitwise.right_shift(tf.gather(entries, clipped), 1),
                       tf.bitwise.right_shift(query, 1))
        return clipped, hit

    def _rows(self, keys):
        """int64[u] local rows of checked keys, all of which this rank must own."""
        rows, hit = self._local(keys)
        check = tf.debugging.Assert(tf.reduce_all(hit), [
            f"{self._op_kind}: keys owned by another rank (this is rank {self.rank} of "
            f"{self.num_ranks}), e.g.", tf.boolean_mask(keys, tf.logical_not(hit))[:3]])
        with tf.control_dependencies([check]):
            return tf.identity(rows)

    def size(self):
        return tf.reduce_sum(tf.cast(tf.bitwise.bitwise_and(self.key_entries, 1), tf.int64))

    def export(self, keys=None):
        if keys is None:  # int64[s], ascending like the keys
            touched = tf.bitwise.bitwise_and(self.key_entries, 1)
            rows = tf.reshape(tf.where(tf.equal(touched, 1)), [-1])
        else:  # the stored ones of the given keys, found by search: no iteration involved
            keys = tf.sort(tf.unique(self._check_keys(self._as_keys(keys, "keys"))).y)
            rows, hit = self._local(keys)
            stored = tf.logical_and(hit, self._touched(rows)) if self._num_owned else hit
            rows = tf.boolean_mask(rows, stored)
        out = {"keys": tf.gather(self.owned_keys(), rows),
               "values": tf.gather(self.values, rows)}
        for n in self.slot_names:
            out[n] = tf.gather(self.slots[n], rows)
        return out

    def _lookup(self, keys, init_keys):
        return tf.gather(self.values, self._rows(keys))

    def _read(self, keys, init_keys):
        rows = self._rows(keys)
        return (tf.gather(self.values, rows),
                {n: tf.gather(self.slots[n], rows) for n in self.slot_names})

    def _write(self, keys, rows, slots):
        local = self._rows(keys)
        marked = tf.bitwise.bitwise_or(tf.bitwise.left_shift(tf.cast(keys, self._key_dtype), 1), 1)
        ops = [self.values.scatter_update(tf.IndexedSlices(rows, local)),
               self.key_entries.scatter_update(tf.IndexedSlices(marked, local))]
        ops += [self.slots[n].scatter_update(tf.IndexedSlices(slots[n], local))
                for n in self.slot_names]
        return tf.group(ops)
