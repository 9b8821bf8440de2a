"""``ShardedEmbedding``: a drop-in for one ``tf_keras.layers.Embedding`` (a tensor of IDs in,
their rows out), its table sharded over the ranks and trained by its row optimizer.

It looks up one feature of a FusedEmbedding, so it trains on every Keras path as
FusedEmbedding does; it is what ``shard_embeddings`` puts in place of the Embeddings of a
model whose layers cannot be rewired (a subclassed model, ``Sequential`` blocks). Alone it
holds a FusedEmbedding of its one feature. Several ShardedEmbeddings may share one
FusedEmbedding of all their features (``tables=``, which ``shard_embeddings`` gives
them): their same-spec tables are then one group, and a training step of ours
(``FusedModel``) computes every feature's IDs before the forward pass and makes one
exchange per group (``tf_fusedemb.layers.keys_ahead``); elsewhere (plain Keras ``fit``, a
custom loop) each feature makes its own. The Keras 3 twin
(``tf_fusedemb.keras3.ShardedEmbedding``) shares :class:`ShardedEmbeddingMixin` with it.
"""
from typing import Any, Dict, Optional, cast

import tensorflow as tf
import tf_keras

from tf_fusedemb.layers.fused_embedding import FusedEmbedding
from tf_fusedemb.layers.keras_mismatch import KerasKind, refuse_other_keras
from tf_fusedemb.specs import FeatureSpec


class ShardedEmbeddingMixin:
    """One sharded table looked up like ``Embedding``, for a Keras whose FusedEmbedding
    layer class is ``fused_class``.

    Args:
      feature: the FeatureSpec: combiner "sum" for IDs int[B] (gives [B, dim], the row
        itself), combiner None with ``max_len`` L for IDs int[B, L] (gives [B, L, dim]).
      tables: the FusedEmbedding (of this class's Keras) holding ``feature`` among others,
        shared with the other ShardedEmbeddings of the model; default a FusedEmbedding of
        ``feature`` alone.
      **kwargs: the Layer's (name, ...).

    Call: ``ids`` int32/int64 [B] or [B, L] -> float32[B, dim] or [B, L, dim].
    """
    fused_class: type
    keras_kind: KerasKind  # which Keras the concrete class is a layer of

    def __init__(self, feature: FeatureSpec, tables: Optional[Any] = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.feature = feature
        if tables is None:
            tables = self.fused_class([feature], name=f"{self.name}_table")  # type: ignore[attr-defined]
        elif not isinstance(tables, self.fused_class) or feature not in cast(Any, tables).features:
            raise ValueError(f"ShardedEmbedding '{self.name}': tables= must be a "  # type: ignore[attr-defined]
                             f"{self.fused_class.__name__} of this Keras holding the feature "
                             f"'{feature.name}'; got {type(tables).__name__}")
        self.fused: Any = tables  # the FusedEmbedding holding this feature's table

    def __call__(self, ids: Any, *args: Any, **kwargs: Any) -> Any:
        refuse_other_keras(self, self.keras_kind, ids)
        return super().__call__(ids, *args, **kwargs)  # type: ignore[misc]

    def call(self, ids: tf.Tensor, training: Any = None) -> tf.Tensor:
        return self.fused.lookup_feature(self.feature.name, ids, training)

    def get_config(self) -> Dict[str, Any]:
        if len(self.fused.features) > 1:  # a config cannot refer to another layer
            raise NotImplementedError(f"ShardedEmbedding '{self.name}' shares its tables "  # type: ignore[attr-defined]
                                      f"'{self.fused.name}' with other layers; it has no config")
        return dict(super().get_config(), feature=self.feature.to_dict())  # type: ignore[misc]

    @classmethod
    def from_config(cls, config: Dict[str, Any]) -> Any:
        config = dict(config)
        config["feature"] = FeatureSpec.from_dict(config["feature"])
        return cls(**config)


@tf_keras.saving.register_keras_serializable(package="tf_fusedemb")
class ShardedEmbedding(ShardedEmbeddingMixin, tf_keras.layers.Layer):
    """One sharded table looked up like ``tf_keras.layers.Embedding``; arguments and call
    as :class:`ShardedEmbeddingMixin`."""
    fused_class = FusedEmbedding
    keras_kind = KerasKind("tf_keras", "tf_fusedemb.layers.ShardedEmbedding",
                           "tf_fusedemb.keras3.ShardedEmbedding")
