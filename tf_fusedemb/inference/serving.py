"""Single-host lookup of one fused group in core TensorFlow ops only.

A SavedModel that uses it needs neither the tf_fusedemb op library nor TFRA, so it
loads anywhere TensorFlow does (``saved_model_cli run`` included). Keys and rows are
variables (``key_index``), so its graph does not grow with the table. Rows are keyed by
the plan-independent hashed key mix64(id ^ tag(table)); keys never trained get their
deterministic initial row, exactly as in training.
"""
from typing import Any, List, Sequence

import numpy as np
import tensorflow as tf

from tf_fusedemb.inference.key_index import KeyIndex, pad_segment, read_rows, segment_width
from tf_fusedemb.inference.row_codec import check_row_dtype
from tf_fusedemb.layers.group_interface import Combiners
from tf_fusedemb.layers.group_lookup import GroupLookup
from tf_fusedemb.layers.inputs import FlatFeature
from tf_fusedemb.ops.recovery import finish_pooling
from tf_fusedemb.storage.initializers import init_rows

_NO_KEYS = np.zeros([0], np.int64)


class ServingGroup(tf.Module):
    """Rows of one group and their lookup + pooling, for one host.

    The group's stored keys and rows are variables (``KeyIndex``): the graph holds no key
    and no row, whatever the table's size; a key not stored reads its initial row.

    Args:
      lookup: the trained ``GroupLookup``.
      row_dtype: how the rows are stored, "float32" | "bfloat16" | "int8" (``row_codec``).
      with_rows: read the rows of a single-process layer (all rows local) into the
        variables; False leaves them empty, for an export whose ranks write the rows
        into the SavedModel's variables themselves (``segment_writer``).
    """

    def __init__(self, lookup: GroupLookup, row_dtype: str = "float32", with_rows: bool = True):
        super().__init__(name=f"serving_{lookup.group.name}")
        self.group = lookup.group
        self.key_mode, self.table_names = lookup.key_mode, lookup.table_names  # input checks
        self._key_codec = lookup.key_codec
        keys, init_keys = lookup.stored_init_keys() if with_rows else (_NO_KEYS, _NO_KEYS)
        values = read_rows(lookup, keys, init_keys)
        self.index = KeyIndex([pad_segment(init_keys, values, check_row_dtype(row_dtype),
                                           segment_width([len(keys)]))],
                              self.group.dim, row_dtype)

    def _rows(self, ids, table):
        # In core TF (not the op's kernel): the SavedModel carries no FusedEmb op, so it
        # loads without the op library.
        keys = self._key_codec.serving_keys(ids, table)
        found, stored = self.index.lookup(ids, keys)
        fresh = init_rows(keys, self.group.dim, self.group.initializer)
        if self.group.row_dtype == "bfloat16":  # as the engine stores and looks them up
            fresh = tf.cast(tf.cast(fresh, tf.bfloat16), tf.float32)
        return tf.where(found[:, None], stored, fresh)

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
