"""LookupContext: the one explicit channel between a training step and its FusedEmbedding
layers.

A step (``tf_fusedemb.training.step``, the pipeline) builds a :class:`LookupContext` and
installs it on the model's FusedEmbedding layers for the duration of one forward pass
(``with use_context(model, context):``, ``tf_fusedemb.layers.fused_embedding``). In it, each group lookup

* takes its *prepared* lookup, routed and retrieved ahead of the forward pass (NestPipe's
  DBP prefetch), instead of routing anew;
* appends ``suffix`` to its collective names (micro-batches need distinct names: FWP);
* uses the ``exchange`` the step asks for ("flat" | "hierarchical"), else its own, so one
  model can be trained with either (a measured choice, ``PipelineOptions(exchange="auto")``);
* with a ``tape``, watches the owner-side rows it looked up and appends a
  :class:`LookupRecord`, so the step can differentiate them and apply the row update
  (pipelines and micro-batches, whose row updates are deferred or coalesced);
* without one, passes the owner-side rows through the layer's row-update marker
  (:mod:`tf_fusedemb.layers.row_update`) with ``row_update``, so whoever differentiates
  the layer's variables also updates the rows.

Outside any context (``NO_CONTEXT``: a plain Keras model, a custom loop) a lookup routes
and retrieves, and its rows take the plain-Keras update of the layer's ranks.
"""
import dataclasses
from typing import Any, Dict, List, Optional

import tensorflow as tf

from tf_fusedemb.layers.routed_lookup import RoutedLookup
from tf_fusedemb.layers.row_update import RowUpdate


@dataclasses.dataclass
class LookupRecord:
    """Owner-side rows of one group in one forward pass.

    rows: float32[u_l, dim], watched by the tape; keys: int64[u_l] storage keys;
    init_keys: int64[u_l] plan-independent keys seeding new rows; lookup: the group's
    ``group_interface.DistributedGroupLookup`` (whose ``apply_gradients`` takes the
    rows' gradient); group: the group's name."""
    rows: tf.Tensor
    keys: tf.Tensor
    init_keys: tf.Tensor
    lookup: Any
    group: str


@dataclasses.dataclass
class LookupContext:
    """What one forward pass's lookups take from, and give back to, their step.

    Attributes:
      tape: the step's GradientTape (None: record nothing).
      prepared: {id(GroupLookup): its RoutedLookup with ``rows``}, lookups done ahead
        of the forward pass.
      suffix: appended to collective names, e.g. "/mb2" for micro-batch 2.
      records: filled with one LookupRecord per group lookup when ``tape`` is set.
      exchange: "flat" or "hierarchical" for every group lookup; None: each group's own
        (``FusedEmbedding(exchange=...)``).
      substitutes: {id(GroupLookup): a ``group_interface.GroupEmbeddings``} that gives the
        group's embeddings instead of its distributed lookup, for this forward pass
        (the one-host serving copy of an export, the pushed rows of sharded inference):
        the layer keeps its lookups.
      row_update: how rows are updated from their gradient when no ``tape`` records them;
        None: the plain-Keras update of the layer's ranks (``RowUpdate.for_ranks``).
    """
    tape: Optional[tf.GradientTape] = None
    prepared: Dict[int, RoutedLookup] = dataclasses.field(default_factory=dict)
    suffix: str = ""
    records: List[LookupRecord] = dataclasses.field(default_factory=list)
    exchange: Optional[str] = None
    substitutes: Dict[int, Any] = dataclasses.field(default_factory=dict)
    row_update: Optional[RowUpdate] = None

    def lookup_for(self, lookup: Any) -> Any:
        """What gives ``lookup``'s embeddings in this pass: its substitute, or itself."""
        return self.substitutes.get(id(lookup), lookup)

    def prepared_for(self, lookup: Any) -> Optional[RoutedLookup]:
        """The prepared lookup of ``lookup``, or None."""
        return self.prepared.get(id(lookup))

    def record(self, rows: tf.Tensor, keys: tf.Tensor, init_keys: tf.Tensor, lookup: Any,
               group: str) -> None:
        """Watches ``rows`` on the tape and records them (no-op without a tape)."""
        if self.tape is None:
            return
        self.tape.watch(rows)
        self.records.append(LookupRecord(rows, keys, init_keys, lookup, group))


NO_CONTEXT = LookupContext()
