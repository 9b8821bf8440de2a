"""DynamicGroupTable: a group's rows and slots in TFRA dynamic embedding hash tables."""
import os
from typing import Dict, Optional, Sequence

import tensorflow as tf

from tf_fusedemb.ops.row_masks import masked_rows
from tf_fusedemb.storage import serial_insert  # noqa: F401  (before any table exists)
from tf_fusedemb.storage.initializers import init_rows
from tf_fusedemb.specs import InitializerSpec, OptimizerSpec
from tf_fusedemb.storage.group_table import GroupTable, _object_name

__all__ = ["DynamicGroupTable"]


def _tfra():
    if os.environ.get("TF_USE_LEGACY_KERAS", "").lower() not in ("1", "true", "yes"):
        # TFRA 0.8.1 is built on tf.keras = Keras 2; the library never sets this for the user.
        raise RuntimeError("TableSpec(storage='tfra') needs TFRA, which needs tf.keras to be "
                           "Keras 2: set TF_USE_LEGACY_KERAS=1 in the environment before "
                           "TensorFlow is imported, or use the default storage (the engine)")
    # Imported on first table creation: TFRA (optional) loads its kernels at import and
    # is only needed by this storage backend.
    import tensorflow_recommenders_addons as tfra  # pylint: disable=import-outside-toplevel
    return tfra.dynamic_embedding


class DynamicGroupTable(GroupTable):
    """Hash-table storage of one fused group: any int64 key, rows inserted on update.

    The values and each optimizer slot live in their own TFRA ``dynamic_embedding.Variable``
    named ``"{name}-values"``, ``"{name}-{slot}"`` (deterministic; unique while group names
    are). They are built with the ``Variable`` constructor, not ``get_variable``:
    get_variable keeps a process-wide registry that silently hands back the existing
    tables when a name is reused (a rebuilt model would share rows with the old one).

    Missing keys read as: rows -> ``init_rows(init_keys)``, computed only for the missing
    keys; slots -> the optimizer's initial slot values (the hash table's default value).

    Args:
        name: group name. dim: row width. initializer: InitializerSpec.
        optimizer: OptimizerSpec.
        devices: optional TFRA devices (default: TFRA's choice, the first GPU or CPU).
        validate_unique: check that apply_gradients gets unique keys (debugging).
    """

    def __init__(self, name: str, dim: int, initializer: InitializerSpec, optimizer: OptimizerSpec,
                 devices: Optional[Sequence[str]] = None, validate_unique: bool = False):
        super().__init__(name, dim, initializer, optimizer, validate_unique)
        de = _tfra()
        base = _object_name(name)

        def table(part, default):
            return de.Variable(key_dtype=tf.int64, value_dtype=tf.float32, dim=dim,
                               name=f"{base}-{part}", initializer=float(default),
                               devices=devices, trainable=False)

        with tf.init_scope():
            self.values = table("values", 0.0)
            self.slots = {n: table(n, v) for n, v in self.optimizer.initial_slot_values.items()}

    def size(self) -> tf.Tensor:
        # Not de.Variable.size(): it caches the size tensor of the first graph that calls
        # it, and a second tf.function then fails with "out of scope".
        return tf.add_n([t.size() for t in self.values.tables])

    def export(self, keys: Optional[tf.Tensor] = None) -> Dict[str, tf.Tensor]:
        if keys is None:
            # TFRA 0.8.1's CPU export sizes its output by the table's element counter and
            # fills it by iterating the buckets; libcuckoo's counter and iteration can
            # disagree after concurrent inserts (efficient/libcuckoo#157), and then the
            # output's tail is uninitialised memory. Every exported key is therefore
            # looked up again, and callers that need completeness pass the keys they
            # know (GroupStore.stored_rows) instead of relying on the iteration.
            keys, _ = self.values.export()
        keys = tf.sort(tf.unique(self._as_keys(keys, "keys")).y)  # reproducible order
        _, exists = self.values.lookup(keys, return_exists=True)
        keys, = masked_rows(exists, keys)
        out = {"keys": keys, "values": self.values.lookup(keys)}
        for n in self.slot_names:
            out[n] = self.slots[n].lookup(keys)
        return out

    def contains(self, keys: tf.Tensor) -> tf.Tensor:
        """bool[u]: whether each of ``keys`` int64[u] has a stored row."""
        return self.values.lookup(self._as_keys(keys, "keys"), return_exists=True)[1]

    def remove(self, keys: tf.Tensor) -> Optional[tf.Operation]:
        """Removes the rows of ``keys`` int64[u] and their optimizer slots (absent keys
        are ignored); they read their initial rows again. Returns the op (None eagerly)."""
        keys = self._as_keys(keys, "keys")
        return tf.group([self.values.remove(keys)] +
                        [self.slots[n].remove(keys) for n in self.slot_names])

    def _lookup(self, keys, init_keys):
        rows, exists = self.values.lookup(keys, return_exists=True)
        if self.initializer.name == "zeros":  # the table's default value is already right
            return rows
        # Initial rows only for the missing keys: in steady state most keys exist.
        missing = tf.where(tf.logical_not(exists))  # int64[m, 1]
        init = init_rows(tf.gather_nd(init_keys, missing), self.dim, self.initializer)
        return tf.tensor_scatter_nd_update(rows, missing, init)

    def _read(self, keys, init_keys):
        return (self._lookup(keys, init_keys),
                {n: self.slots[n].lookup(keys) for n in self.slot_names})

    def _write(self, keys, rows, slots):
        # One thread per insert (storage/serial_insert.py): TFRA's parallel insert can
        # lose rows when the table resizes.
        ops = [self.values.upsert(keys, rows)]
        ops += [self.slots[n].upsert(keys, slots[n]) for n in self.slot_names]
        return tf.group(ops)
