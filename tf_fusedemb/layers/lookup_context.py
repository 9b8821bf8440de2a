"""LookupContext: what a training step gives its FusedEmbedding layers for one forward pass.

A step (``tf_fusedemb.training.step``, the pipeline) builds a :class:`LookupContext` and
installs it on the model's FusedEmbedding layers for the duration of one forward pass
(``with use_context(model, context):``, ``tf_fusedemb.layers.fused_embedding``). Data
flows one way, from the step to the layers: nothing is written back. In it, each group
lookup

* serves its *prepared* lookup, which the step routed and retrieved ahead of the forward
  pass (``GroupLookup.route`` / ``retrieve`` return values; NestPipe's DBP prefetch, or
  the micro-batch being computed). The step watches those rows on its own tape and applies
  their update itself (micro-batches coalesce their gradients first, pipelines defer
  parts), so the layer passes them on untouched;
* appends ``suffix`` to its collective names (micro-batches need distinct names: FWP);
* uses the ``exchange`` the step asks for ("flat" | "hierarchical"), else its own, so one
  model can be trained with either (a measured choice, ``PipelineOptions(exchange="auto")``);
* serves the *served* features (``ServedFeature``): embeddings of a feature looked up on
  its own (``FusedEmbedding.lookup_feature``, a ``ShardedEmbedding``), which the step
  computed ahead of the forward pass with its group's other features (one exchange per
  group, ``tf_fusedemb.layers.keys_ahead``);
* in a probe pass (``probe``), looks nothing up: it gives the probe its IDs and returns
  zeros (``tf_fusedemb.layers.key_probe``);
* without a prepared lookup, routes and retrieves during the forward pass and passes the
  owner-side rows through the layer's row-update marker (:mod:`tf_fusedemb.layers.row_update`)
  with ``row_update``, so whoever differentiates the layer's variables also updates the rows.

Outside any context (``NO_CONTEXT``: a plain Keras model, a custom loop) a lookup routes
and retrieves, and its rows take the plain-Keras update of the layer's ranks.
"""
import dataclasses
from typing import Any, Dict, NamedTuple, Optional, Tuple

from tf_fusedemb.layers.key_probe import FeatureKey, KeyProbe, ServedFeature
from tf_fusedemb.layers.routed_lookup import RoutedLookup
from tf_fusedemb.layers.row_update import RowUpdate


class GroupName(NamedTuple):
    """Names one table group of a model: its FusedEmbedding layer's name and the group's
    (``TableGroup.name``). Unique within a model (``ModelEmbeddings.of`` checks it)."""
    layer: str
    group: str


@dataclasses.dataclass(frozen=True)
class LookupContext:
    """What one forward pass's lookups take from their step.

    Attributes:
      prepared: (GroupLookup, its RoutedLookup with ``rows``) pairs: lookups done ahead of
        the forward pass, whose rows the step differentiates itself.
      suffix: appended to collective names, e.g. "/mb2" for micro-batch 2.
      exchange: "flat" or "hierarchical" for every group lookup; None: each group's own
        (``FusedEmbedding(exchange=...)``).
      substitutes: {GroupName: a ``group_interface.GroupEmbeddings``} that gives the
        group's embeddings instead of its distributed lookup, for this forward pass
        (the one-host serving copy of an export, the pushed rows of sharded inference):
        the layer keeps its lookups.
      row_update: how rows looked up during the forward pass are updated from their
        gradient (a step of ours sets it); None: the plain-Keras update of the layer's
        ranks (``RowUpdate.for_ranks``).
      served: the features whose embeddings the step computed ahead of the forward pass.
      probe: set for a probe pass only (no lookup runs, see ``key_probe``).
    """
    prepared: Tuple[Tuple[Any, RoutedLookup], ...] = ()
    suffix: str = ""
    exchange: Optional[str] = None
    substitutes: Dict[GroupName, Any] = dataclasses.field(default_factory=dict)
    row_update: Optional[RowUpdate] = None
    served: Tuple[ServedFeature, ...] = ()
    probe: Optional[KeyProbe] = None

    @property
    def in_our_step(self) -> bool:
        """Whether a step of ours (which averages the dense gradients and owns the rows'
        update) runs this pass."""
        return self.row_update is not None

    def lookup_for(self, name: GroupName, lookup: Any) -> Any:
        """What gives the embeddings of ``lookup`` (the group named ``name``) in this pass:
        its substitute, or itself."""
        return self.substitutes.get(name, lookup)

    def prepared_for(self, lookup: Any) -> Optional[RoutedLookup]:
        """The prepared lookup of ``lookup``, or None (route during the forward pass)."""
        return next((routed for owner, routed in self.prepared if owner is lookup), None)

    def served_for(self, key: FeatureKey) -> Optional[ServedFeature]:
        """The embeddings of feature ``key`` computed ahead, or None."""
        return next((s for s in self.served if s.key == key), None)


NO_CONTEXT = LookupContext()
