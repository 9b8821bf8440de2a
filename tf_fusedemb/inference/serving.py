"""Single-host lookup of one fused group in core TensorFlow ops only.

A SavedModel that uses it needs neither the tf_fusedemb op library nor TFRA, so it
loads anywhere TensorFlow does (``saved_model_cli run`` included). Keys and rows are
variables (``key_index``), so its graph does not grow with the table. Rows are keyed by
the plan-independent hashed key mix64(id ^ tag(table)); keys never trained get their
deterministic initial row, exactly as in training.
"""
from typing import Any, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from tf_fusedemb.inference.key_index import KeyIndex, pad_segment, read_rows, segment_width
from tf_fusedemb.inference.row_codec import check_row_dtype
from tf_fusedemb.layers.group_interface import Combiners
from tf_fusedemb.layers.group_keys import GroupKeys
from tf_fusedemb.layers.group_store import GroupStore
from tf_fusedemb.layers.inputs import FlatFeature
from tf_fusedemb.ops.recovery import finish_pooling
from tf_fusedemb.specs import FusedGroup
from tf_fusedemb.storage.initializers import init_rows

_NO_KEYS = np.zeros([0], np.int64)


class ServingGroup(tf.Module):
    """Rows of one group and their lookup + pooling, for one host.

    The group's stored keys and rows are variables (``KeyIndex``): the graph holds no key
    and no row, whatever the table's size; a key not stored reads its initial row.

    Args:
      group: the FusedGroup.  key_mode: its layer's ("hashed" or "packed").
      store: the trained group's ``GroupStore`` (read here, not kept: the SavedModel
        holds none of the training tables).
      row_dtype: how the rows are stored, "float32" | "bfloat16" | "int8" (``row_codec``).
      with_rows: read the rows of a single-process layer (all rows local) into the
        variables; False leaves them empty, for an export whose ranks write the rows
        into the SavedModel's variables themselves (``segment_writer``).
    """

    # The layer checks the IDs as it flattens them (serving runs no key exchange).
    defers_range_check = False

    def __init__(self, group: FusedGroup, key_mode: str, store: GroupStore,
                 row_dtype: str = "float32", with_rows: bool = True):
        super().__init__(name=f"serving_{group.name}")
        self.group = group
        # The same key arithmetic as training, in core TF (``GroupKeys.serving_keys``).
        self._key_codec = GroupKeys(group, "packed" if group.is_static else key_mode)
        self.key_mode, self.table_names = self._key_codec.key_mode, self._key_codec.table_names
        keys, init_keys = _NO_KEYS, _NO_KEYS
        if with_rows:  # one process holds them all: one chunk
            ordered = store.stored_init_keys(max(1, store.num_stored_rows()))
            keys, init_keys = next(ordered.chunks, (_NO_KEYS, _NO_KEYS))
        values = read_rows(store, keys, init_keys)
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
                 record_statistics: bool = False,
                 marker: Optional[tf.Tensor] = None) -> List[tf.Tensor]:
        """Same contract as ``GroupLookup.__call__``: per feature [B_f, dim] pooled or
        [n_f, dim] one row per ID. ``context``, ``record_statistics`` and ``marker`` are
        ignored: serving neither trains, prefetches nor counts."""
        # One key hash, index search and initializer for the whole group, not one per
        # feature: the serving graph's size does not grow with the group's features.
        ids = tf.concat([flat.ids for flat in flats], axis=0)
        tables = tf.concat([tf.fill(tf.shape(flat.ids), self._key_codec.feature_table[f])
                            for f, flat in enumerate(flats)], axis=0)
        rows = tf.split(self._rows(ids, tables), [tf.size(flat.ids) for flat in flats])
        pooled = [(f, c) for f, c in enumerate(combiners) if c is not None]
        sums = self._row_sums([rows[f] for f, _ in pooled], [flats[f] for f, _ in pooled])
        outputs = list(rows)
        for (f, combiner), total in zip(pooled, sums):
            count = tf.cast(flats[f].row_splits[1:] - flats[f].row_splits[:-1], tf.float32)
            outputs[f] = finish_pooling(total, count, combiner)
        return outputs

    @staticmethod
    def _row_sums(rows: Sequence[tf.Tensor], flats: Sequence[FlatFeature]) -> List[tf.Tensor]:
        """Per feature, each sample's row sum float32[B_f, dim] of its ``rows`` [n_f, dim]
        (samples split by ``row_splits``): one segment reduction for all features, each
        sample's rows added in the same order as a reduction per feature."""
        if not rows:
            return []
        splits = [tf.cast(flats[0].row_splits, tf.int64)]
        for flat in flats[1:]:
            splits.append(tf.cast(flat.row_splits[1:], tf.int64) + splits[-1][-1])
        ragged = tf.RaggedTensor.from_row_splits(tf.concat(rows, axis=0),
                                                 tf.concat(splits, axis=0), validate=False)
        return tf.split(tf.reduce_sum(ragged, axis=1),
                        [tf.size(flat.row_splits) - 1 for flat in flats])
