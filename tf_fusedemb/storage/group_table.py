"""GroupTable, the abstract per-rank storage of one fused group (owner side of the lookup).

A rank owns the rows of the keys that hash to it. For each fused group it keeps one
table of rows (float32[dim] per key) plus the group optimizer's per-row slots, and a
step counter. The owner looks rows up (step 6 of the fused lookup) and, after the
gradient AlltoAll, applies the summed gradients of the unique touched keys.

Two implementations share this interface:

* :class:`~tf_fusedemb.storage.dynamic_table.DynamicGroupTable`: TFRA hash tables, any
  int64 key; rows are inserted on their first update.
* :class:`~tf_fusedemb.storage.static_table.StaticGroupTable`: keys in
  [0, vocabulary_size); each rank keeps dense rows for the keys it owns only (sharded).

Both give a never-updated key its deterministic initial row
(:func:`~tf_fusedemb.storage.initializers.init_rows` of its *init key*), so for the same
sequence of lookups and updates they return the same values. The init key defaults to
the storage key; it differs when storage keys are packed per group, because the initial
value must not depend on the fusion plan.

Keys passed to :meth:`GroupTable.apply_gradients` must be UNIQUE (the owner runs a unique
before it): a duplicated key would be read twice and written twice, and only one of the
two updates would survive. ``validate_unique=True`` adds a check for debugging.
"""
import re
from typing import Callable, Dict, Optional, Tuple, Union

import numpy as np
import tensorflow as tf

from tf_fusedemb.ops.row_masks import masked_rows
from tf_fusedemb.specs import InitializerSpec, OptimizerSpec
from tf_fusedemb.storage.optimizers import RowOptimizer

# Keys asked per contains() call when a whole table's stored keys are listed.
_CONTAINS_CHUNK = 1 << 20

__all__ = ["GroupTable"]


def _object_name(name: str) -> str:
    """A valid Python/TF identifier derived from a table name (tf.Module needs one)."""
    clean = re.sub(r"[^A-Za-z0-9_]", "_", name)
    return clean if re.match(r"[A-Za-z_]", clean) else "t_" + clean


class GroupTable(tf.Module):
    """Abstract per-rank table of one fused group: rows, optimizer slots and a step.

    Attributes:
        name: str, the group (table) name; error messages name it.
        dim: int, row width.
        initializer: InitializerSpec of new rows.
        optimizer: RowOptimizer built from the OptimizerSpec.
        slot_names: tuple of the optimizer's slot names.
        step: tf.Variable int64 scalar, optimizer steps taken (0 before the first update).

    A tf.Module, so ``tf.train.Checkpoint(table=t)`` tracks its variables.
    """

    def __init__(self, name: str, dim: int, initializer: InitializerSpec, optimizer: OptimizerSpec,
                 validate_unique: bool = False):
        if not isinstance(name, str) or not name:
            raise ValueError(f"{type(self).__name__}: name must be a non-empty str, got {name!r}")
        kind = f"{type(self).__name__} {name!r}"
        if not isinstance(dim, int) or isinstance(dim, bool) or dim <= 0:
            raise ValueError(f"{kind}: dim must be an int > 0, got {dim!r}")
        if not isinstance(initializer, InitializerSpec):
            raise ValueError(f"{kind}: initializer must be an InitializerSpec, got {initializer!r}")
        if not isinstance(optimizer, OptimizerSpec):
            raise ValueError(f"{kind}: optimizer must be an OptimizerSpec, got {optimizer!r}")
        super().__init__(name=_object_name(name))
        self._table_name = name
        self._kind = kind
        # Run-time (assert op) messages: TF escapes quotes in them, so the name goes bare.
        self._op_kind = f"{type(self).__name__} {name}"
        self.dim = dim
        self.initializer = initializer
        self.optimizer_spec = optimizer
        self.optimizer = RowOptimizer.from_spec(optimizer)
        self.validate_unique = validate_unique
        # Optional admission filter, keys int64[u] -> bool[u] (set_admission_filter, when
        # a table has an AdmissionPolicy): apply_gradients stores only admitted keys.
        self.admission: Optional[Callable[[tf.Tensor], tf.Tensor]] = None
        with tf.init_scope():  # state is created once, even if the first call is traced
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False,
                                    name=f"{_object_name(name)}_step")

    @property
    def name(self) -> str:
        return self._table_name

    @property
    def slot_names(self) -> tuple:
        return self.optimizer.slot_names

    # ---------------------------------------------------------------- public API
    def set_admission_filter(self, admitted: Optional[Callable[[tf.Tensor], tf.Tensor]]
                             ) -> None:
        """Every later update stores only the keys ``admitted`` (keys int64[u] ->
        bool[u], e.g. ``policy.admission_filter``) lets through; the others keep no row
        and no slots. None: all keys are stored."""
        self.admission = admitted

    def lookup(self, keys: tf.Tensor, init_keys: Optional[tf.Tensor] = None) -> tf.Tensor:
        """Rows of ``keys``; a never-updated key gets its initial row and is NOT inserted.

        Args:
            keys: int64[u] storage keys (duplicates allowed here).
            init_keys: int64[u] keys seeding the initial rows; default ``keys``.

        Returns:
            float32[u, dim].
        """
        keys = self._check_keys(self._as_keys(keys, "keys"))
        return self._lookup(keys, self._init_keys(keys, init_keys))

    def apply_gradients(self, keys: tf.Tensor, grads: tf.Tensor,
                        init_keys: Optional[tf.Tensor] = None, step: Optional[tf.Tensor] = None,
                        return_rows: bool = False
                        ) -> Union[tf.Operation, Tuple[tf.Operation, tf.Tensor]]:
        """One optimizer step on the rows of ``keys``; new keys are inserted.

        Reads the rows (stored, or the initial rows of ``init_keys``) and their slots
        (stored, or initial), runs ``RowOptimizer.apply`` and writes rows and slots back.

        Args:
            keys: int64[u] UNIQUE storage keys.
            grads: float32[u, dim], the gradient summed per key.
            init_keys: int64[u] keys seeding the initial rows; default ``keys``.
            step: optional int64 scalar. By default the table's ``step`` is advanced by
                1 first and its new value used (the first call uses 1); pass an explicit
                step to split one batch's update into several calls (e.g. prior rows
                first), after advancing the counter once with :meth:`advance_step`.
                With an ``admission`` filter set, only admitted keys are written; the
                others keep no row and no slots.

            return_rows: also return the updated rows float32[u, dim] (a pipeline copies
                them into its prefetch buffer: NestPipe's dual-buffer synchronisation).

        Returns:
            The update op in graph mode (None when executing eagerly); with
            ``return_rows``, the pair (op, updated rows).
        """
        keys, init_keys, grads = self._update_inputs(keys, grads, init_keys)
        step = self.advance_step() if step is None else tf.cast(step, tf.int64)
        rows, slots = self._read(keys, init_keys)
        new_rows, new_slots = self.optimizer.apply(rows, slots, grads, step)
        if self.admission is None:
            op = self._write(keys, new_rows, new_slots)
        else:  # keys not admitted yet: nothing stored, they keep reading their initial row
            admitted = tf.reshape(self.admission(keys), [-1])  # hash lookups lose the rank
            names = list(new_slots)
            kept = masked_rows(admitted, keys, new_rows, *(new_slots[n] for n in names))
            op = self._write(kept[0], kept[1], dict(zip(names, kept[2:])))
            new_rows = tf.where(admitted[:, None], new_rows, rows)
        return (op, new_rows) if return_rows else op

    def _update_inputs(self, keys, grads, init_keys):
        """apply_gradients' arguments checked: (keys int64[u], init_keys int64[u], grads
        float32[u, dim]); with ``validate_unique`` the keys carry a uniqueness check."""
        keys = self._check_keys(self._as_keys(keys, "keys"))
        init_keys = self._init_keys(keys, init_keys)
        grads = tf.convert_to_tensor(grads)
        if grads.dtype != tf.float32:
            raise TypeError(f"{self._kind}: grads must be float32, got {grads.dtype.name}")
        if grads.shape.rank not in (None, 2) or grads.shape[-1] not in (None, self.dim):
            raise ValueError(f"{self._kind}: grads must be float32[u, {self.dim}], got shape {grads.shape}")
        if self.validate_unique:
            check = tf.debugging.assert_equal(
                tf.size(tf.unique(keys).y), tf.size(keys),
                message=f"{self._op_kind}: apply_gradients needs unique keys")
            with tf.control_dependencies([check]):
                keys = tf.identity(keys)
        return keys, init_keys, grads

    def advance_step(self) -> tf.Tensor:
        """Adds 1 to ``step`` and returns the new value (int64 scalar)."""
        return tf.identity(self.step.assign_add(1))

    def export(self, keys: Optional[tf.Tensor] = None) -> Dict[str, tf.Tensor]:
        """The stored rows, sorted by key.

        Args:
            keys: optional int64[k] candidate keys (duplicates allowed): export the stored
                ones among them, found by lookups instead of by iterating the table.

        Returns:
            dict with "keys" int64[s], "values" float32[s, dim] and, per slot name,
            float32[s, dim].
        """
        raise NotImplementedError

    def load(self, exported: Dict[str, tf.Tensor]) -> Optional[tf.Operation]:
        """Writes rows exported by :meth:`export` (of this or another table of the same
        spec); slots missing from ``exported`` start at their initial values.

        Returns:
            The write op in graph mode (None when executing eagerly).
        """
        keys = self._check_keys(self._as_keys(exported["keys"], "exported keys"))
        values = tf.convert_to_tensor(exported["values"], tf.float32)
        initial = self.optimizer.initial_slots(tf.size(keys), self.dim)
        slots = {n: tf.convert_to_tensor(exported[n], tf.float32) if n in exported else initial[n]
                 for n in self.slot_names}
        return self._write(keys, values, slots)

    def size(self) -> tf.Tensor:
        """int64 scalar: number of stored (updated or loaded) keys."""
        raise NotImplementedError

    def contains(self, keys: tf.Tensor) -> tf.Tensor:
        """bool[u]: whether each of ``keys`` int64[u] has a stored (updated or loaded) row."""
        raise NotImplementedError

    def stored_keys(self, known: Callable[[], np.ndarray]) -> np.ndarray:
        """int64[s], sorted: the keys with a stored row, without reading a row (eager).
        ``known`` gives every key whose identity the statistics recorded (sorted): a hash
        table is not iterated, so its stored keys are the known ones it contains,
        asked a chunk at a time."""
        candidates = known()
        stored = np.empty(len(candidates), bool)
        for i in range(0, len(candidates), _CONTAINS_CHUNK):
            chunk = tf.constant(candidates[i:i + _CONTAINS_CHUNK], tf.int64)
            stored[i:i + _CONTAINS_CHUNK] = self.contains(chunk).numpy()
        return candidates[stored]

    def remove(self, keys: tf.Tensor) -> Optional[tf.Operation]:
        """Removes the rows and optimizer slots of ``keys`` int64[u] (absent keys are
        ignored); they read their initial rows again. Returns the op (None eagerly)."""
        raise NotImplementedError

    # ---------------------------------------------------------------- implementation hooks
    def _lookup(self, keys, init_keys):
        """float32[u, dim] rows of checked keys."""
        raise NotImplementedError

    def _read(self, keys, init_keys):
        """(rows float32[u, dim], slots dict name -> float32[u, dim]) of checked keys."""
        raise NotImplementedError

    def _write(self, keys, rows, slots):
        """Stores rows and slots of unique checked keys; returns an op or None."""
        raise NotImplementedError

    def _check_keys(self, keys):
        """Validates int64[u] keys against the storage (range checks); returns them."""
        return keys

    # ---------------------------------------------------------------- helpers
    def _as_keys(self, keys, what) -> tf.Tensor:
        keys = tf.convert_to_tensor(keys)
        if keys.dtype not in (tf.int64, tf.int32):
            raise TypeError(f"{self._kind}: {what} must be int64, got {keys.dtype.name}")
        if keys.shape.rank not in (None, 1):
            raise ValueError(f"{self._kind}: {what} must be int64[u], got shape {keys.shape}")
        return tf.cast(keys, tf.int64)

    def _init_keys(self, keys, init_keys: Optional[tf.Tensor]) -> tf.Tensor:
        return keys if init_keys is None else self._as_keys(init_keys, "init_keys")
