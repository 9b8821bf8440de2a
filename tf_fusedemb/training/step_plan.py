"""One training step as a value: the plan it runs by, made before it is traced, what it
carries in from the step before, and what it gives out.

* :class:`StepPlan` (static, made once by whoever runs steps): how many micro-batches
  (NestPipe FWP), which exchange, and, for a pipeline, its :class:`PrefetchStages`.
* :class:`StepCarry` (tensors, the traced step's inputs): the rows prefetched for this
  batch (DBP), the previous step's delayed row updates (EmbRace's vertical scheduling)
  and the next batch's features to prefetch.
* :class:`StepOutput`: the step's :class:`StepResult` and what the next step takes: its
  prefetched rows, the delayed row updates and the dense update left for it.

The step (``tf_fusedemb.training.step.run_step``) reads the plan and the carry, and
returns everything it computed; nothing is written into an object while it is traced.

Shapes: u unique keys of one group's update on its owner, dim its width.
"""
import dataclasses
from typing import Any, List, Mapping, NamedTuple, Optional, Protocol, Sequence, Tuple

import tensorflow as tf

from tf_fusedemb.layers.group_interface import StoredGroup
from tf_fusedemb.layers.lookup_context import LookupContext
from tf_fusedemb.layers.routed_lookup import RoutedLookup
from tf_fusedemb.layers.row_update import RowUpdate

# One batch's prepared lookups: per micro-batch, one RoutedLookup (with ``rows`` once
# retrieved) per group lookup of the model, in ``ModelEmbeddings.lookups`` order.
Prepared = List[List[RoutedLookup]]


class StepResult(NamedTuple):
    """What a step returns (a tuple, so traced functions can return it): ``loss`` float32
    scalar (the global batch's loss, as Keras reports it per batch), ``weight`` (its
    weight in Keras's running ``loss`` Mean: the global batch's rows), this rank's
    ``predictions`` and ``per_output``: per output with a loss, its own loss on the global
    batch (``LossTotals.per_output``)."""
    loss: tf.Tensor
    weight: tf.Tensor
    predictions: object
    per_output: Tuple[tf.Tensor, ...] = ()


class PendingUpdate(NamedTuple):
    """One group's delayed row update (vertical scheduling): unique ``keys`` int64[u],
    their summed ``grads`` float32[u, dim], ``init_keys`` int64[u] and the optimizer
    ``step`` int64[] of the batch they belong to."""
    keys: tf.Tensor
    grads: tf.Tensor
    init_keys: tf.Tensor
    step: tf.Tensor


class DensePending(NamedTuple):
    """A step's dense update left for the next step: the ``bottom`` layers' local
    gradients (summed over ranks when applied) and the ``top`` layers' gradients,
    already summed over ranks (EmbRace's priority order)."""
    bottom: List[tf.Tensor]
    top: List[tf.Tensor]


class PrefetchStages(Protocol):
    """What a planned step asks of its pipeline (``NestedPipeline`` implements it): DBP's
    stages 3 and 4 for the next batch or a micro-batch, the previous step's delayed
    updates, and EmbRace's split of one group's update. Each returns what it built."""

    def route(self, x: Mapping[str, tf.Tensor]) -> Prepared:
        """Key routing of ``x``'s micro-batches (DBP stage 3), no rows yet."""

    def route_slice(self, x: Mapping[str, tf.Tensor], i: int) -> List[RoutedLookup]:
        """Key routing of micro-batch ``i``, whose inputs are ``x``."""

    def retrieve(self, routed: Prepared) -> Prepared:
        """``routed`` with each lookup's retrieved ``rows`` (DBP stage 4)."""

    def apply_pending(self, pending: Sequence[PendingUpdate]) -> list:
        """Applies the delayed row updates of the previous step, one per lookup."""

    def apply_prior(self, store: StoredGroup, keys: tf.Tensor, grads: tf.Tensor,
                    init_keys: tf.Tensor, next_rows: Sequence[RoutedLookup]
                    ) -> Tuple[PendingUpdate, List[tf.Tensor]]:
        """One group's coalesced update (``keys`` int64[u], ``grads`` float32[u, dim],
        ``init_keys`` int64[u]) split by the next batch's lookups ``next_rows`` (one per
        micro-batch): the part applied now, and (the delayed part, the next batch's rows
        per micro-batch with this step's writes in them)."""


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """How a training step runs, fixed before it is traced.

    Attributes:
      micro_batches: N, the rank's batch is split into N micro-batches whose forward and
        backward (and collectives) are independent; gradients are applied once (needs
        ``stages``, which prepare each micro-batch's lookups).
      exchange: "flat" or "hierarchical" for every group lookup of the step; None: each
        group's own (see ``LookupContext.exchange``).
      stages: the pipeline's :class:`PrefetchStages`; None: the synchronous step (every
        lookup routed during the forward pass, every row update applied at once).
    """
    micro_batches: int = 1
    exchange: Optional[str] = None
    stages: Optional[PrefetchStages] = None

    def context(self, i: int) -> LookupContext:
        """The LookupContext of micro-batch ``i``'s lookups (none prepared yet). The
        step's loss is the global batch's (scaled by global coefficients): row gradients
        summed over ranks are applied as they are."""
        return LookupContext(suffix=self.suffix(i), exchange=self.exchange,
                             row_update=RowUpdate(scale=1.0, marker_gradient=0.0))

    def suffix(self, i: int) -> str:
        """Collective-name suffix of micro-batch ``i`` (names must differ per micro-batch)."""
        return f"/mb{i}" if self.micro_batches > 1 else ""


class StepCarry(NamedTuple):
    """What one planned step takes from the step before (tensors of the traced step).

    Fields:
      prepared: this batch's lookups prefetched by the previous step (``Prepared``), or
        None (routed during this step).
      pending: the previous step's delayed row updates, one per group lookup (empty:
        none).
      next_x: the next batch's features, whose lookups this step routes and retrieves
        (DBP); None at the last step or without prefetch.
    """
    prepared: Optional[Prepared] = None
    pending: Sequence[PendingUpdate] = ()
    next_x: Optional[Mapping[str, Any]] = None


class StepOutput(NamedTuple):
    """What one planned step gives out.

    Fields:
      result: the step's :class:`StepResult`.
      next_prepared: the next batch's lookups with their rows, synchronised with this
        step's writes (DBP's dual buffer); empty without ``StepCarry.next_x``.
      pending: this step's delayed row updates, one per group lookup (empty: none).
      dense_pending: the dense update left for the next step (None: applied).
    """
    result: StepResult
    next_prepared: Prepared
    pending: List[PendingUpdate]
    dense_pending: Optional[DensePending]
