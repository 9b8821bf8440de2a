"""The declared interfaces of one fused group's lookup: what the layer, the training step,
the pipelines, checkpoints, export and sharded inference may ask of a group, and nothing
else (they never read or replace a group's attributes).

* :class:`GroupEmbeddings`: embeddings of the group's features for one forward pass. It
  is what ``FusedEmbedding.call`` needs. ``GroupLookup`` (the distributed lookup)
  implements it, as do the stand-ins a :class:`~tf_fusedemb.layers.lookup_context.LookupContext`
  installs for a forward pass (``LookupContext.substitutes``): the one-host serving
  lookup of an export (``inference.serving.ServingGroup``) and the pushed embeddings of
  sharded inference. The user's layer is never changed.
* :class:`DistributedGroupLookup`: the steps of the distributed lookup, for the training
  step and the pipelines (route keys to their owners, retrieve rows, serve them back),
  and its ``store``.
* :class:`StoredGroup`: the group's state on this rank (``group_store.GroupStore``), for
  the step (row reads and updates), checkpoints, export and sharded inference (save,
  restore, the stored rows, owner-side reads). Its storage sits behind
  ``tf_fusedemb.storage.backend``.
* :class:`KeyExchange`: how a group's keys reach their owners and the rows come back
  (``exchange.FlatExchange``, ``hierarchical_exchange.HierarchicalExchange``).

Shapes: n fused IDs of this rank, u unique per feature, u_l unique keys on the owner,
m key messages received by the owner.
"""
from typing import (Any, Dict, List, Mapping, NamedTuple, Optional, Protocol, Sequence, Tuple,
                    Union, runtime_checkable)

import numpy as np
import tensorflow as tf

from tf_fusedemb.layers.lookup_context import LookupContext
from tf_fusedemb.layers.routed_lookup import RoutedLookup
from tf_fusedemb.specs import FusedGroup
from tf_fusedemb.storage.engine_table import FULL_WRITE, BlockWrite

Combiners = Sequence[Optional[str]]
GroupState = Dict[str, np.ndarray]


class StoredRows(NamedTuple):
    """The rows one rank stores for a group and their identities, s rows.

    Fields:
      keys: int64[s], the storage keys, sorted.  values: float32[s, dim].
      slots: {optimizer slot name: float32[s, dim]}.
      tables: int64[s], each row's table index in the group.  ids: int64[s], its ID.
    """
    keys: np.ndarray
    values: np.ndarray
    slots: Mapping[str, np.ndarray]
    tables: np.ndarray
    ids: np.ndarray

    def arrays(self) -> Dict[str, np.ndarray]:
        """{name: array} as a checkpoint shard stores them (each slot under its name)."""
        return dict(self.slots, keys=self.keys, values=self.values, tables=self.tables,
                    ids=self.ids)


@runtime_checkable
class GroupEmbeddings(Protocol):
    """Embeddings of one fused group's features.

    Attributes:
      group: the FusedGroup (its features, in order, and the shared spec).
      key_mode: "hashed" or "packed" (how the layer validates the IDs it flattens).
      table_names: the group's table names, in category order.
      defers_range_check: whether it reports IDs out of range itself (the distributed
        lookup, to every rank); else the layer checks them as it flattens them.
    """
    group: FusedGroup
    key_mode: str
    table_names: List[str]
    defers_range_check: bool

    def __call__(self, flats: Sequence[Any], combiners: Combiners, context: LookupContext,
                 record_statistics: bool, marker: Optional[tf.Tensor] = None
                 ) -> List[tf.Tensor]:
        """Per feature float32[B_f, dim] (pooled by its combiner) or float32[n_f, dim]
        (combiner None: one row per ID), for ``flats``: one ``inputs.FlatFeature`` per
        feature of the group, in group order. ``marker``: the layer's row-update marker
        in a training pass (``row_update``); lookups that train nothing ignore it."""


@runtime_checkable
class StoredGroup(Protocol):
    """One group's state on this rank (``group_store.GroupStore``): its rows' reads and
    updates for the step and the pipelines, and for checkpoints, export and sharded
    inference its snapshot (save, restore, the stored rows, owner-side reads).

    Attributes:
      group: the FusedGroup.  tiered: whether its engine has a memory budget (SSD tier).
    """
    group: FusedGroup
    tiered: bool

    def lookup_rows(self, keys: tf.Tensor, init_keys: Optional[tf.Tensor] = None) -> tf.Tensor:
        """This rank's rows of storage ``keys`` int64[u] (never-stored keys: their
        initial rows of ``init_keys``, not inserted): float32[u, dim]."""

    def apply_gradients(self, keys: tf.Tensor, grads: tf.Tensor,
                        init_keys: Optional[tf.Tensor] = None, step: Optional[tf.Tensor] = None,
                        return_rows: bool = False
                        ) -> Union[tf.Operation, Tuple[tf.Operation, tf.Tensor]]:
        """One optimizer step on the owner rows of UNIQUE ``keys`` int64[u] with ``grads``
        float32[u, dim] (new keys start from their initial rows of ``init_keys``). Returns
        the op, or (op, the updated rows float32[u, dim]) with ``return_rows``."""

    def advance_step(self) -> tf.Tensor:
        """Adds 1 to the group's optimizer step; returns the new step (int64 scalar)."""

    def prefetch(self, keys: tf.Tensor) -> Optional[tf.Operation]:
        """Pins the owner-side ``keys`` int64[u] of a coming batch in DRAM (SSD tier);
        None without a tier."""

    def save_state(self, directory: Optional[str] = None,
                   write: BlockWrite = FULL_WRITE) -> GroupState:
        """This rank's state of the group as numpy arrays (rows, optimizer slots, each
        row's (table, ID), access statistics, step): one checkpoint shard's part. A
        storage-engine table writes its blocks to ``directory`` (which must not exist)
        instead of the arrays: every block, or (a delta ``write``) those changed since
        its owner's previous save."""

    def records_changes_for(self, owner: str) -> bool:
        """Whether a delta ``save_state`` for ``owner`` would follow that owner's last
        one (the group's storage records changes for it, or is saved whole anyway)."""

    def restore_state(self, shards: Sequence[Mapping[str, np.ndarray]], rank: int,
                      size: int, directories: Sequence[str] = (),
                      deltas: Sequence[Sequence[str]] = ()) -> None:
        """Loads what rank ``rank`` of ``size`` owns out of every saving rank's
        ``save_state`` (any number of them) and, for shards of a storage-engine table, of
        the ``directories`` they were saved to (one per saving rank), then of each delta's
        directories in order; ``shards`` are the last save's."""

    def stored_rows(self) -> StoredRows:
        """The rows this rank stores and their identities: keys int64[s], values
        float32[s, dim], one float32[s, dim] per slot, tables int64[s], ids int64[s]."""

    def storage_keys(self, ids: np.ndarray, tables: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(storage keys, init keys) int64[n] of ``ids`` int64[n] of tables ``tables``."""

    def num_stored_rows(self) -> int:
        """Rows written on this rank (trained or restored)."""

    def num_resident_rows(self) -> int:
        """Rows occupying memory on this rank (a static table: all it owns)."""


@runtime_checkable
class DistributedGroupLookup(GroupEmbeddings, Protocol):
    """One group's lookup over the ranks (FusedRec Algorithm 1): the steps the training
    step and the pipelines run, and the group's ``store``.

    Attributes:
      store: the group's state on this rank (:class:`StoredGroup`).
    """
    store: StoredGroup

    def route(self, flats: Sequence[Any], context: LookupContext,
              record_statistics: bool = True) -> RoutedLookup:
        """Keys to their owners: the RoutedLookup that :meth:`retrieve` and :meth:`serve`
        take."""

    def retrieve(self, routed: RoutedLookup) -> tf.Tensor:
        """The owner's rows of ``routed.keys``: float32[u_l, dim]."""

    def serve(self, routed: RoutedLookup, rows: tf.Tensor, flats: Sequence[Any],
              combiners: Combiners, context: LookupContext,
              marker: Optional[Any] = None) -> List[tf.Tensor]:
        """The owner's ``rows`` back to the requesters, recovered per feature; with the
        layer's row-update ``marker``, differentiating it updates the rows
        (``tf_fusedemb.layers.row_update``)."""


class KeyExchange(Protocol):
    """How a group's unique keys reach their owners and the owners' rows come back."""
    kind: str
    rounds_per_step: int

    def send_keys(self, uniq: Any, feature_table: tf.Tensor, suffix: str,
                  report: Any = None) -> Tuple[tf.Tensor, Any]:
        """Key messages int64[m, 2] received by this owner, and the exchange's record of
        what it sent, which :meth:`send_rows` takes (a NamedTuple with ``sort_indices``
        int32[u] among its fields)."""

    def send_rows(self, rows: tf.Tensor, route: Any, suffix: str) -> tf.Tensor:
        """The owner's ``rows`` float32[m, dim] back: float32[u, dim] in rank-sorted order."""
