"""StaticGroupTable: a group's rows and slots in dense variables [vocabulary_size, dim]."""
import tensorflow as tf

from tf_fusedemb.storage.initializers import init_rows
from tf_fusedemb.storage.group_table import GroupTable, _object_name

__all__ = ["StaticGroupTable"]

_INIT_CHUNK_ROWS = 1 << 18  # rows initialised per init_rows call at creation


class StaticGroupTable(GroupTable):
    """Dense storage of one fused group: keys are row indices in [0, vocabulary_size).

    Every row is initialised at creation with ``init_rows(init_keys[index])`` and every
    slot with its initial value, so a never-updated key reads its initial row, as in the
    dynamic table. Updates scatter the touched rows only. A bool ``touched`` variable
    records the rows ever written, so :meth:`size` and :meth:`export` report the same
    rows a dynamic table would hold.

    The ``init_keys`` arguments of :meth:`lookup` and :meth:`apply_gradients` are
    ignored: each row's init key was fixed at creation.

    Args:
        name: group name. dim: row width. initializer: InitializerSpec.
        optimizer: OptimizerSpec.
        vocabulary_size: int > 0, number of rows.
        init_keys: the init key of each row: None (the row index), a callable mapping
            int64[vocabulary_size] indices to int64[vocabulary_size] init keys, or an
            int64[vocabulary_size] tensor/array.
        validate_unique: check that apply_gradients gets unique keys (debugging).

    Raises:
        tf.errors.InvalidArgumentError (at run time): a key outside [0, vocabulary_size);
            the message names the table.
    """

    def __init__(self, name, dim, initializer, optimizer, vocabulary_size, init_keys=None,
                 validate_unique=False):
        super().__init__(name, dim, initializer, optimizer, validate_unique)
        if not isinstance(vocabulary_size, int) or isinstance(vocabulary_size, bool) \
                or vocabulary_size <= 0:
            raise ValueError(f"{self._kind}: vocabulary_size must be an int > 0, got {vocabulary_size!r}")
        self.vocabulary_size = vocabulary_size
        base = _object_name(name)
        with tf.init_scope():  # create (and initialise) once, eagerly, even from a trace
            index = tf.range(vocabulary_size, dtype=tf.int64)
            if init_keys is None:
                row_keys = index
            else:
                row_keys = init_keys(index) if callable(init_keys) else init_keys
                row_keys = tf.reshape(tf.cast(row_keys, tf.int64), [-1])
                if row_keys.shape[0] != vocabulary_size:
                    raise ValueError(f"{self._kind}: init_keys must be int64[{vocabulary_size}], "
                                     f"got shape {row_keys.shape}")
            # In chunks: init_rows holds float64 temporaries several times the rows' size.
            chunks = [init_rows(row_keys[i:i + _INIT_CHUNK_ROWS], dim, initializer)
                      for i in range(0, vocabulary_size, _INIT_CHUNK_ROWS)]
            self.values = tf.Variable(tf.concat(chunks, 0), trainable=False, name=f"{base}_values")
            self.slots = {n: tf.Variable(tf.fill([vocabulary_size, dim], tf.constant(v, tf.float32)),
                                         trainable=False, name=f"{base}_{n}")
                          for n, v in self.optimizer.initial_slot_values.items()}
            self.touched = tf.Variable(tf.zeros([vocabulary_size], tf.bool), trainable=False,
                                       name=f"{base}_touched")

    def _check_keys(self, keys):
        message = f"{self._op_kind}: keys must lie in [0, {self.vocabulary_size})"
        checks = [tf.debugging.assert_non_negative(keys, message=message),
                  tf.debugging.assert_less(keys, tf.constant(self.vocabulary_size, tf.int64),
                                           message=message)]
        with tf.control_dependencies(checks):
            return tf.identity(keys)

    def size(self):
        return tf.reduce_sum(tf.cast(self.touched, tf.int64))

    def export(self, keys=None):
        stored = tf.reshape(tf.where(self.touched), [-1])  # int64[s], ascending
        if keys is None:
            keys = stored
        else:  # the stored ones of the given keys, found by index: no iteration involved
            keys = tf.sort(tf.unique(self._check_keys(self._as_keys(keys, "keys"))).y)
            keys = tf.boolean_mask(keys, tf.gather(self.touched, keys))
        out = {"keys": keys, "values": tf.gather(self.values, keys)}
        for n in self.slot_names:
            out[n] = tf.gather(self.slots[n], keys)
        return out

    def _lookup(self, keys, init_keys):
        return tf.gather(self.values, keys)

    def _read(self, keys, init_keys):
        return (tf.gather(self.values, keys),
                {n: tf.gather(self.slots[n], keys) for n in self.slot_names})

    def _write(self, keys, rows, slots):
        ops = [self.values.scatter_update(tf.IndexedSlices(rows, keys)),
               self.touched.scatter_update(tf.IndexedSlices(tf.ones_like(keys, tf.bool), keys))]
        ops += [self.slots[n].scatter_update(tf.IndexedSlices(slots[n], keys)) for n in self.slot_names]
        return tf.group(ops)
