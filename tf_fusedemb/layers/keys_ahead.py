"""Every table's keys before the forward pass, for models that look their features up one
at a time (``ShardedEmbedding``s sharing a FusedEmbedding: subclassed models, separate
blocks), so that each fused group makes one exchange per step.

A training step of ours (``tf_fusedemb.training.step``) calls, per batch:

1. :func:`keys_ahead`: the model's ``call`` is traced once in a scratch graph with a
   ``KeyProbe`` (``tf_fusedemb.layers.key_probe``), and the part of that graph that
   computes each feature's IDs from the model's inputs (a ``StringLookup``, say) is cut
   out (``tf.compat.v1.wrap_function``'s ``prune``) and called on the step's inputs:
   only the ops the IDs need run (no dense layer, no state update of the scratch pass).
   A feature whose IDs depend on another embedding's output cannot be computed ahead:
   it keeps its own exchange during the forward pass, and the layer says so once.
2. :func:`route_ahead`: per group, the key exchange of all its features computed ahead
   and the retrieval of the owners' rows.
3. :func:`serve_ahead` (under the step's tape, which watches the rows): per group, the
   row exchange and recovery; the forward pass's feature lookups return these
   embeddings (``LookupContext.served``), checking their IDs.

Without such a layer, in eager execution, or where nothing can be computed ahead, the
step runs as before (``keys_ahead`` returns None).
"""
import logging
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import tensorflow as tf

from tf_fusedemb.layers.fused_embedding import FusedEmbeddingMixin
from tf_fusedemb.layers.key_probe import FeatureKey, KeyProbe, ServedFeature
from tf_fusedemb.layers.lookup_context import LookupContext
from tf_fusedemb.layers.model_embeddings import ModelEmbeddings, sublayers
from tf_fusedemb.layers.routed_lookup import RoutedLookup
from tf_fusedemb.layers.sharded_embedding import ShardedEmbeddingMixin

__all__ = ["KeysAhead", "keys_ahead", "route_ahead", "serve_ahead", "shared_tables"]

_LOG = logging.getLogger("tf_fusedemb")


class KeysAhead(NamedTuple):
    """The IDs of one batch's feature lookups, computed from the model's inputs in the
    step's graph before the forward pass.

    Fields:
      ids: (feature, its IDs int [B] or [B, L]) per feature computed ahead.
      own_exchange: the features whose IDs depend on another embedding's output (or that
        the model looks up more than once): each makes its own exchange.
    """
    ids: Tuple[Tuple[FeatureKey, tf.Tensor], ...]
    own_exchange: Tuple[FeatureKey, ...]

    def of_layer(self, layer: FusedEmbeddingMixin) -> dict:
        """{feature name: IDs} of ``layer``'s features computed ahead."""
        return {key.feature: ids for key, ids in self.ids if key.layer == layer.name}


def shared_tables(model: Any, embeddings: ModelEmbeddings) -> List[FusedEmbeddingMixin]:
    """The FusedEmbedding layers of ``model`` (its ``embeddings``) that its
    ShardedEmbeddings look up (each once), in ``embeddings.layers`` order."""
    looked_up = {id(m.fused) for m in sublayers(model) if isinstance(m, ShardedEmbeddingMixin)}
    return [layer for layer in embeddings.layers if id(layer) in looked_up]


def keys_ahead(model: Any, embeddings: ModelEmbeddings, x: Any,
               tables: Sequence[FusedEmbeddingMixin]) -> Optional[KeysAhead]:
    """The IDs the ShardedEmbeddings of ``model`` (its ``embeddings``) look up in the
    FusedEmbedding layers ``tables`` (``shared_tables``) for inputs ``x`` (a batch, in the
    step's graph), computed ahead of the forward pass; None in eager execution (no graph
    to cut the IDs' part from), or where no feature's IDs can be computed ahead."""
    if not tables or tf.executing_eagerly():
        return None
    flat = tf.nest.flatten(x, expand_composites=True)
    if not all(isinstance(t, tf.Tensor) for t in flat):
        return None
    probes: List[KeyProbe] = []

    def probe_pass(*inputs):
        probe = KeyProbe()
        with embeddings.use_context(LookupContext(probe=probe)):
            model(tf.nest.pack_sequence_as(x, list(inputs), expand_composites=True),
                  training=True)
        probes.append(probe)

    # Any batch size: the cut-out part is called on the step's tensors.
    specs = [tf.TensorSpec([None] + t.shape[1:] if t.shape.rank else t.shape, t.dtype)
             for t in flat]
    scratch = tf.compat.v1.wrap_function(probe_pass, specs)
    found = probes[0].found
    counts: Dict[FeatureKey, int] = {}
    for p in found:
        counts[p.key] = counts.get(p.key, 0) + 1
    ahead = [p for p in found if p.ahead and counts[p.key] == 1]
    own = tuple(dict.fromkeys(p.key for p in found if not p.ahead or counts[p.key] > 1))
    _say_once(tables, own, counts)
    if not ahead:
        return None
    ids_of = scratch.prune(scratch.graph.inputs[:len(flat)], [p.ids for p in ahead])
    values = ids_of(*flat)
    for value, p in zip(values, ahead):  # a pruned function's outputs lose their shapes
        value.set_shape(p.ids.shape)
    return KeysAhead(tuple((p.key, v) for p, v in zip(ahead, values)), own)


def route_ahead(embeddings: ModelEmbeddings, ahead: KeysAhead, context: LookupContext
                ) -> List[Optional[RoutedLookup]]:
    """Per group lookup of a model (``embeddings.lookups`` order), its RoutedLookup of the
    features of ``ahead`` with the owners' rows, None for a group with none of them."""
    return [r for layer in embeddings.layers
            for r in layer.route_ahead(ahead.of_layer(layer), context)]


def serve_ahead(embeddings: ModelEmbeddings, ahead: KeysAhead, routed: Sequence[Optional[RoutedLookup]],
                context: LookupContext) -> Tuple[ServedFeature, ...]:
    """The embeddings of every feature of ``ahead`` from ``routed`` (``route_ahead``'s),
    one row exchange per group."""
    served: List[ServedFeature] = []
    start = 0
    for layer in embeddings.layers:
        mine = routed[start:start + len(layer.groups)]
        start += len(layer.groups)
        served += layer.serve_ahead(mine, ahead.of_layer(layer), context)
    return tuple(served)


def _say_once(tables: Sequence[FusedEmbeddingMixin], own: Sequence[FeatureKey],
              counts: Mapping[FeatureKey, int]) -> None:
    """Logs, once per feature, that it keeps its own exchange, naming its table and why
    (``counts``: how often the probe pass looked each feature up)."""
    for layer in tables:
        for key in own:
            if key.layer == layer.name and layer.note_own_exchange(key.feature):
                table = next(f.table.name for f in layer.features if f.name == key.feature)
                why = (f"it is looked up {counts[key]} times per step" if counts[key] > 1 else
                       "its IDs are computed from another embedding's output")
                _LOG.warning("tf_fusedemb: table '%s' (feature '%s' of '%s') keeps its own "
                             "exchange: %s, so they cannot be known before the forward pass",
                             table, key.feature, layer.name, why)
