"""``ModelEmbeddings``: the FusedEmbedding layers of one model and their group lookups,
found once.

The training step, the pipelines, checkpoints, export and sharded inference all need the
same things of a model: its FusedEmbedding layers, each group's lookup and store by
name, the communicator they share, and a way to install a forward pass's
``LookupContext`` on every layer. ``ModelEmbeddings.of(model)`` walks the model once and
checks what must hold (one communicator, unique group names); the record is then passed
to whatever needs it (``FusedModel`` builds it once and hands it down).
"""
import contextlib
import dataclasses
from typing import Any, FrozenSet, Iterator, List, NamedTuple, Optional, Tuple

from tf_fusedemb.comm import Communicator, get_communicator
from tf_fusedemb.layers.fused_embedding import FusedEmbeddingMixin
from tf_fusedemb.layers.group_lookup import GroupLookup
from tf_fusedemb.layers.group_store import GroupStore
from tf_fusedemb.layers.lookup_context import GroupName, LookupContext

__all__ = ["ModelEmbeddings", "NamedLookup", "fused_embedding_layers", "sublayers",
           "use_context"]


class NamedLookup(NamedTuple):
    """One group lookup of a model and its ``GroupName`` (its layer's name, its group's),
    by which a ``LookupContext`` substitutes it."""
    name: GroupName
    lookup: GroupLookup


def sublayers(model: Any) -> List[Any]:
    """Every module below ``model``: tf.Module's ``submodules`` (tf_keras), else Keras 3's
    layer walk."""
    if hasattr(model, "submodules"):
        return list(model.submodules)
    if hasattr(model, "_flatten_layers"):
        return list(model._flatten_layers(include_self=False, recursive=True))
    return []


def fused_embedding_layers(model: Any) -> List[FusedEmbeddingMixin]:
    """The FusedEmbedding layers of ``model`` (itself included), in tracking order."""
    found = [m for m in [model, *sublayers(model)] if isinstance(m, FusedEmbeddingMixin)]
    return list({id(m): m for m in found}.values())


@dataclasses.dataclass(frozen=True)
class ModelEmbeddings:
    """The FusedEmbedding layers of one model, their group lookups and communicator.

    Attributes:
      layers: the FusedEmbedding layers, in tracking order.
      named: each layer's group lookups in order, layer by layer, with their names. A
        step's prepared lookups and a pipeline's buffers are lists in this order.
      communicator: the one the layers run over (the process's default without layers).
    """
    layers: Tuple[FusedEmbeddingMixin, ...]
    named: Tuple[NamedLookup, ...]
    communicator: Communicator

    @classmethod
    def of(cls, model: Any, communicator: Optional[Communicator] = None) -> "ModelEmbeddings":
        """Walks ``model`` (a Keras model or layer) once.

        Args:
          communicator: overrides the layers' (a caller that runs the model over another
            set of ranks than it was built with, e.g. sharded inference's per-rank one).
        Raises:
          ValueError: the layers were built with different communicators, or two groups
            have one name (two FusedEmbedding layers of one name in nested models).
        """
        layers = tuple(fused_embedding_layers(model))
        named = tuple(NamedLookup(GroupName(layer.name, g.group.name), g)
                      for layer in layers for g in layer.groups)
        _check_unique_names(named)
        return cls(layers, named, communicator or _shared_communicator(model, layers))

    @property
    def lookups(self) -> Tuple[GroupLookup, ...]:
        """The group lookups, in ``named`` order."""
        return tuple(n.lookup for n in self.named)

    @property
    def stores(self) -> Tuple[GroupStore, ...]:
        """Each group lookup's store, in ``named`` order."""
        return tuple(n.lookup.store for n in self.named)

    @property
    def feature_names(self) -> FrozenSet[str]:
        """The features the layers look up (the inputs they take from ``x``)."""
        return frozenset(f.name for layer in self.layers for f in layer.features)

    @contextlib.contextmanager
    def use_context(self, context: LookupContext) -> Iterator[LookupContext]:
        """Installs ``context`` on every layer for the block; yields it."""
        previous = [layer.lookup_context for layer in self.layers]
        for layer in self.layers:
            layer.lookup_context = context
        try:
            yield context
        finally:
            for layer, old in zip(self.layers, previous):
                layer.lookup_context = old


@contextlib.contextmanager
def use_context(model: Any, context: LookupContext) -> Iterator[LookupContext]:
    """Installs ``context`` on every FusedEmbedding layer of ``model`` (a Keras model or
    layer) for the block; yields it (``ModelEmbeddings.use_context``)."""
    with ModelEmbeddings.of(model).use_context(context) as installed:
        yield installed


def _check_unique_names(named: Tuple[NamedLookup, ...]) -> None:
    seen: dict = {}
    for name, lookup in named:
        if seen.setdefault(name, lookup) is not lookup:
            raise ValueError(f"two FusedEmbedding layers named {name.layer!r} both have a "
                             f"table group {name.group!r}: give the layers distinct names "
                             f"(name=...) so that serving and sharded inference can tell "
                             f"their groups apart")


def _shared_communicator(model: Any, layers: Tuple[FusedEmbeddingMixin, ...]) -> Communicator:
    """The one communicator of ``layers``; the process's default without layers."""
    comms = {id(layer.communicator): layer.communicator for layer in layers}
    if len(comms) > 1:
        raise ValueError(f"{type(model).__name__} '{getattr(model, 'name', '')}': its "
                         "FusedEmbedding layers were built with different communicators; "
                         "build them with one")
    return next(iter(comms.values())) if comms else get_communicator()
