"""StaticGroupTable: the rows a rank owns of a static-vocabulary group, in dense variables.

Keys are global row indices in [0, vocabulary_size). Rank ``rank`` of ``num_ranks`` stores
only the rows it owns (owner = ``owner_rank(owner_ids(key), num_ranks)``, the rule the key
exchange routes by), so a rank holds about 1/N of the group: dense [V_owned, dim] rows and
slots, in key order. A key is mapped to its local row by a rank/select directory instead
of a per-row key array:

* ``owned_bits``: int64[ceil(V / 64)], bit ``k % 64`` of word ``k // 64`` set when this
  rank owns key ``k`` (V bits);
* ``owned_before``: int32[ceil(V / 64)] (int64 past 2**31 keys), owned keys before each
  word, so key ``k``'s local row is ``owned_before[k // 64] + popcount(the word's bits
  below k)``: one gather and one popcount per key;
* ``touched_bits``: int64[ceil(V_owned / 64)], bit per local row, the rows ever written.

That is V x 3/16 bytes plus V_owned / 8 bytes next to V_owned x dim x (1 + slots) x 4 of
rows: about 1% for 16-float rows, SGD, on 2 or 3 ranks (4 bytes per row, 6.25%, with the
sorted key array it replaces). The global key of a local row (export) is found back
by a search in ``owned_before`` and a 6-step popcount select in the word.
"""
from typing import Callable, Dict, Optional, Union

import numpy as np
import tensorflow as tf

from tf_fusedemb.ops import hashing
from tf_fusedemb.ops.row_masks import masked_examples, masked_rows
from tf_fusedemb.ops.sorted_search import search_sorted
from tf_fusedemb.storage.initializers import init_rows
from tf_fusedemb.specs import InitializerSpec, OptimizerSpec
from tf_fusedemb.storage.group_table import GroupTable, _object_name

# A per-key argument: None (the key itself), a callable mapping int64[k] keys to int64[k], or an
# int64[vocabulary_size] array (a tensor is read eagerly).
PerKey = Union[None, Callable[[np.ndarray], np.ndarray], np.ndarray, tf.Tensor]

__all__ = ["StaticGroupTable"]

_INIT_CHUNK_ROWS = 1 << 18  # rows initialised per init_rows call at creation
_OWNER_CHUNK_KEYS = 1 << 22  # keys hashed per owner_rank call at creation (bounds temporaries)
_WORD = 64  # bits per bitmap word (int64)


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


def _owner_masks(vocabulary_size, rank, num_ranks, owner_ids):
    """Yields (keys int64[c], owned bool[c]) over [0, vocabulary_size) in chunks (a
    multiple of 64 keys each, so bitmap words never straddle two chunks)."""
    for start in range(0, vocabulary_size, _OWNER_CHUNK_KEYS):
        keys = np.arange(start, min(start + _OWNER_CHUNK_KEYS, vocabulary_size), dtype=np.int64)
        if num_ranks == 1:
            yield keys, np.ones(len(keys), bool)
            continue
        ids = _per_key(owner_ids, keys, vocabulary_size, "owner_ids")
        yield keys, hashing.owner_rank(ids, num_ranks) == rank


def _pack_bits(mask: np.ndarray) -> np.ndarray:
    """int64[ceil(len / 64)]: bit i % 64 of word i // 64 = mask[i]."""
    padded = np.zeros(-(-len(mask) // _WORD) * _WORD, np.uint8)
    padded[:len(mask)] = mask
    return np.packbits(padded, bitorder="little").view("<i8").astype(np.int64)


def _ownership_directory(vocabulary_size, rank, num_ranks, owner_ids):
    """(owned keys int64[V_owned], owned_bits int64[W], owned keys per word int64[W])."""
    keys, words, counts = [], [], []
    for chunk, owned in _owner_masks(vocabulary_size, rank, num_ranks, owner_ids):
        keys.append(chunk[owned])
        words.append(_pack_bits(owned))
        padded = np.zeros(len(words[-1]) * _WORD, bool)
        padded[:len(owned)] = owned
        counts.append(padded.reshape(-1, _WORD).sum(1))
    return np.concatenate(keys), np.concatenate(words), np.concatenate(counts)


def _popcount(words) -> tf.Tensor:
    """int64 number of set bits of each int64 word."""
    return tf.cast(tf.raw_ops.PopulationCount(x=words), tf.int64)


def _below(bits) -> tf.Tensor:
    """int64 mask of the bits below position ``bits`` (0..63) of a word."""
    return tf.bitwise.invert(tf.bitwise.left_shift(tf.constant(-1, tf.int64), bits))


def _bit(words, bits) -> tf.Tensor:
    """bool: bit ``bits`` of each int64 word."""
    return tf.equal(tf.bitwise.bitwise_and(tf.bitwise.right_shift(words, bits), 1), 1)


def _select(words, nth) -> tf.Tensor:
    """int64 position of the ``nth`` (0-based) set bit of each int64 word (which has more
    than ``nth`` set bits): a binary search by popcounts of halves, 6 steps."""
    pos = tf.zeros_like(nth)
    for width in (32, 16, 8, 4, 2, 1):
        low = _popcount(tf.bitwise.bitwise_and(tf.bitwise.right_shift(words, pos),
                                               (1 << width) - 1))
        upper = nth >= low
        nth = tf.where(upper, nth - low, nth)
        pos = tf.where(upper, pos + width, pos)
    return pos


class StaticGroupTable(GroupTable):
    """Dense storage of the owned rows of one fused group with keys in [0, vocabulary_size).

    Every owned row is initialised at creation with ``init_rows(init_keys[key])`` and every
    slot with its initial value, so a never-updated key reads its initial row, as in the
    dynamic table. Updates scatter the touched rows only. A ``touched`` bit per row
    records the rows ever written, so :meth:`size` and :meth:`export` report the same
    rows a dynamic table would hold. Exported and loaded keys are global keys.

    Bytes per rank: V_owned x dim x (1 + slots) x 4 (rows and slots) + V x 3/16 (the
    ownership bitmap and its per-word counts; V x 1/4 past 2**31 keys) + V_owned / 8 (the
    touched bits), V_owned about V / num_ranks (see the module docstring).

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

    def __init__(self, name: str, dim: int, initializer: InitializerSpec, optimizer: OptimizerSpec,
                 vocabulary_size: int, init_keys: PerKey = None, validate_unique: bool = False,
                 rank: int = 0, num_ranks: int = 1, owner_ids: PerKey = None):
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
            owned, words, counts = _ownership_directory(vocabulary_size, rank, num_ranks,
                                                        owner_ids)
            if isinstance(init_keys, tf.Tensor):
                init_keys = init_keys.numpy()
            row_keys = _per_key(init_keys, owned, vocabulary_size, f"{self._kind}: init_keys")
            n = self._num_owned = len(owned)
            # int32 counts halve their bytes while every count fits.
            count_dtype = np.int32 if vocabulary_size <= np.iinfo(np.int32).max else np.int64
            before = (np.cumsum(counts) - counts).astype(count_dtype)
            self.owned_bits = tf.Variable(words, trainable=False, name=f"{base}_owned_bits")
            self.owned_before = tf.Variable(before, trainable=False, name=f"{base}_owned_before")
            self.touched_bits = tf.Variable(tf.zeros([-(-n // _WORD)], tf.int64),
                                            trainable=False, name=f"{base}_touched_bits")
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
        message = f"{self._op_kind}: keys must lie in [0, {self.vocabulary_size}), got"
        bad = tf.logical_or(keys < 0, keys >= self.vocabulary_size)
        check = tf.debugging.Assert(tf.logical_not(tf.reduce_any(bad)),
                                    [message, masked_examples(bad, keys)])
        with tf.control_dependencies([check]):
            return tf.identity(keys)

    def _keys_of(self, rows) -> tf.Tensor:
        """int64[u] global keys of the local ``rows`` int64[u] (select in the bitmap)."""
        if self.num_ranks == 1:
            return rows
        before = tf.cast(self.owned_before, tf.int64)
        word = search_sorted(before, rows, side="right", out_type=tf.int64) - 1
        pos = _select(tf.gather(self.owned_bits, word), rows - tf.gather(before, word))
        return word * _WORD + pos

    def owned_keys(self) -> tf.Tensor:
        """int64[V_owned]: the global keys this rank stores, ascending."""
        return self._keys_of(tf.range(self._num_owned, dtype=tf.int64))

    def _touched(self, rows) -> tf.Tensor:
        """bool[u]: whether the local ``rows`` int64[u] were ever written."""
        return _bit(tf.gather(self.touched_bits, rows // _WORD), rows % _WORD)

    def _local(self, keys):
        """(local rows int64[u], owned bool[u]) of range-checked global keys; the row of a
        key this rank does not own is clipped into range (and meaningless)."""
        if self._num_owned == 0:  # a rank may own no row of a small group
            return tf.zeros_like(keys), tf.zeros_like(keys, tf.bool)
        if self.num_ranks == 1:  # every key, in order
            return keys, tf.ones_like(keys, tf.bool)
        word, bit = keys // _WORD, keys % _WORD
        bits = tf.gather(self.owned_bits, word)
        rows = (tf.cast(tf.gather(self.owned_before, word), tf.int64)
                + _popcount(tf.bitwise.bitwise_and(bits, _below(bit))))
        return tf.minimum(rows, self._num_owned - 1), _bit(bits, bit)

    def _rows(self, keys):
        """int64[u] local rows of checked keys, all of which this rank must own."""
        rows, hit = self._local(keys)
        check = tf.debugging.Assert(tf.reduce_all(hit), [
            f"{self._op_kind}: keys owned by another rank (this is rank {self.rank} of "
            f"{self.num_ranks}), e.g.", masked_examples(tf.logical_not(hit), keys)])
        with tf.control_dependencies([check]):
            return tf.identity(rows)

    def size(self) -> tf.Tensor:
        return tf.reduce_sum(_popcount(self.touched_bits))

    def contains(self, keys: tf.Tensor) -> tf.Tensor:
        rows, hit = self._local(self._check_keys(self._as_keys(keys, "keys")))
        return tf.logical_and(hit, self._touched(rows)) if self._num_owned else hit

    def remove(self, keys: tf.Tensor) -> Optional[tf.Operation]:
        raise ValueError(f"{self._kind}: a static table's rows cannot be removed (its memory "
                         "is fixed; eviction needs a dynamic table)")

    def stored_keys(self, known: Callable[[], np.ndarray]) -> np.ndarray:
        """int64[s], sorted: the keys of the touched rows (a static table holds its keys'
        rows in an array: ``known`` is not needed)."""
        return self.export()["keys"].numpy()

    def export(self, keys: Optional[tf.Tensor] = None) -> Dict[str, tf.Tensor]:
        if keys is None:  # int64[s], ascending like the keys
            words = tf.convert_to_tensor(self.touched_bits)
            flags = _bit(words[:, None], tf.range(_WORD, dtype=tf.int64)[None, :])
            rows = tf.reshape(tf.where(tf.reshape(flags, [-1])), [-1])  # < V_owned: padding is 0
        else:  # the stored ones of the given keys, found by lookups: no iteration involved
            keys = tf.sort(tf.unique(self._check_keys(self._as_keys(keys, "keys"))).y)
            rows, hit = self._local(keys)
            stored = tf.logical_and(hit, self._touched(rows)) if self._num_owned else hit
            rows, = masked_rows(stored, rows)
        out = {"keys": self._keys_of(rows), "values": tf.gather(self.values, rows)}
        for n in self.slot_names:
            out[n] = tf.gather(self.slots[n], rows)
        return out

    def _lookup(self, keys, init_keys):
        return tf.gather(self.values, self._rows(keys))

    def _read(self, keys, init_keys):
        rows = self._rows(keys)
        return (tf.gather(self.values, rows),
                {n: tf.gather(self.slots[n], rows) for n in self.slot_names})

    def _mark_touched(self, rows):
        """Sets the touched bits of the local ``rows`` int64[u] (duplicates allowed): the
        distinct bits of a word are summed (= OR'ed) and OR'ed into it."""
        rows = tf.unique(rows).y
        words, slot = tf.unique(rows // _WORD)
        bits = tf.math.unsorted_segment_sum(
            tf.bitwise.left_shift(tf.constant(1, tf.int64), rows % _WORD), slot,
            tf.size(words))
        merged = tf.bitwise.bitwise_or(tf.gather(self.touched_bits, words), bits)
        return self.touched_bits.scatter_update(tf.IndexedSlices(merged, words))

    def _write(self, keys, rows, slots):
        local = self._rows(keys)
        ops = [self.values.scatter_update(tf.IndexedSlices(rows, local)),
               self._mark_touched(local)]
        ops += [self.slots[n].scatter_update(tf.IndexedSlices(slots[n], local))
                for n in self.slot_names]
        return tf.group(ops)
