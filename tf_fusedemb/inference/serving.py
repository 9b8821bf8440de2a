"""Single-host lookup of one fused group in core TensorFlow ops only.

A SavedModel that uses it needs neither the tf_fusedemb op library nor TFRA, so it
loads anywhere TensorFlow does (``saved_model_cli run`` included). Rows are keyed by
the plan-independent hashed key mix64(id ^ tag(table)); keys never trained get their
deterministic initial row, exactly as in training.
"""
from typing import Any, List, Sequence

import numpy as np
import tensorflow as tf

from tf_fusedemb.layers.group_interface import Combiners
from tf_fusedemb.layers.group_lookup import GroupLookup
from tf_fusedemb.layers.inputs import FlatFeature
from tf_fusedemb.ops.recovery import finish_pooling
from tf_fusedemb.storage.initializers import init_rows


class ServingGroup(tf.Module):
    """Merged rows of one group and their lookup + pooling, for one host.

    Args:
      lookup: the trained ``GroupLookup`` of a single-process layer (all rows local).
    """

    def __init__(self, lookup: GroupLookup):
        super().__init__(name=f"serving_{lookup.group.name}")
        self.group = lookup.group
        self.key_mode, self.table_names = lookup.key_mode, lookup.table_names  # input checks
        self._key_codec = lookup.key_codec
        if self.group.is_static:  # every row is defined: keep the dense table as it is
            self._offsets = lookup.key_codec.table_offsets
            self.rows = tf.Variable(lookup.dense_rows(), trainable=False, name="rows")
            self.index = None
            return
        stored = lookup.stored_rows()
        values = stored.values
        _, hashed = lookup.key_codec.storage_keys(stored.ids, stored.tables)  # init keys
        if not len(hashed):
            # A group that never trained stores no row: every key reads its initial row.
            # (A lookup table cannot be initialised from empty tensors, so one row whose
            # key no lookup asks for stands in: index -1 is never stored.)
            hashed = np.zeros([1], np.int64)
            values = np.zeros([1, self.group.dim], np.float32)
            self._empty = True
        self.rows = tf.Variable(values.reshape(-1, self.group.dim), trainable=False, name="rows")
        self.index = tf.lookup.StaticHashTable(tf.lookup.KeyValueTensorInitializer(
            tf.constant(hashed, tf.int64), tf.range(len(hashed), dtype=tf.int64)), -1)

    def _rows(self, ids, table):
        if self.index is None:
            return tf.gather(self.rows, tf.gather(self._offsets, table) + ids)
        # In core TF (not the op's kernel): the SavedModel carries no FusedEmb op, so it
        # loads without the op library.
        keys = self._key_codec.serving_keys(ids, table)
        pos = self.index.lookup(keys)
        if getattr(self, "_empty", False):
            pos = tf.fill(tf.shape(pos), tf.constant(-1, tf.int64))
        stored = tf.gather(self.rows, tf.maximum(pos, 0))
        fresh = init_rows(keys, self.group.dim, self.group.initializer)
        if self.group.row_dtype == "bfloat16":  # as the engine stores and looks them up
            fresh = tf.cast(tf.cast(fresh, tf.bfloat16), tf.float32)
        return tf.where((pos >= 0)[:, None], stored, fresh)

    def __call__(self, flats: Sequence[FlatFeature], combiners: Combiners, context: Any = None,
                 record_statistics: bool = False) -> List[tf.Tensor]:
        """Same contract as ``GroupLookup.__call__``: per feature [B_f, dim] pooled or
        [n_f, dim] one row per ID. ``context`` and ``record_statistics`` are ignored:
        serving neither trains, prefetches nor counts."""
        outputs = []
        for f, flat, combiner in zip(range(len(flats)), flats, combiners):
            table = tf.fill(tf.shape(flat.ids), self._key_codec.feature_table[f])
            rows = self._rows(flat.ids, table)
            if combiner is None:
                outputs.append(rows)
                continue
            ragged = tf.RaggedTensor.from_row_splits(rows, flat.row_splits, validate=False)
            outputs.append(finish_pooling(tf.reduce_sum(ragged, axis=1),
                                          tf.cast(ragged.row_lengths(), tf.float32), combiner))
        return outputs
