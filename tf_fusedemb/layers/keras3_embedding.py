"""``FusedEmbedding`` and ``ShardedEmbedding`` as Keras 3 layers (``import keras``,
TensorFlow backend).

The same layers as :class:`tf_fusedemb.layers.FusedEmbedding` and ``ShardedEmbedding``
(one ``FusedEmbeddingMixin``, one ``ShardedEmbeddingMixin``: fusion, sharding, the lookup
and the row updates through its row-update marker), built on
``keras.layers.Layer``: usable in functional and subclassed ``keras.Model``s with Keras 3's
own ``compile``/``fit``/``evaluate``/``predict`` and ``tf.GradientTape`` loops. Which Keras
a model uses is the user's choice, by the module they import: ``tf_fusedemb.keras3`` for
Keras 3, ``tf_fusedemb.layers`` for tf_keras; nothing in the library sets
``TF_USE_LEGACY_KERAS``.
"""
from typing import Any, Dict, Mapping

import keras

from tf_fusedemb.layers.fused_embedding import FusedEmbeddingMixin
from tf_fusedemb.layers.keras_mismatch import KerasKind
from tf_fusedemb.layers.sharded_embedding import ShardedEmbeddingMixin


@keras.saving.register_keras_serializable(package="tf_fusedemb")
class FusedEmbedding(FusedEmbeddingMixin, keras.layers.Layer):
    """Embeddings of many features, fused and sharded: the Keras 3 layer. Arguments,
    inputs, outputs and training as :class:`tf_fusedemb.layers.FusedEmbedding`.

    Keras 3 compiles ``fit``'s step with XLA where every layer allows it; this layer's
    ops are TensorFlow custom ops and collectives, so it does not (``supports_jit``)."""
    keras_kind = KerasKind("Keras 3", "tf_fusedemb.keras3.FusedEmbedding",
                           "tf_fusedemb.layers.FusedEmbedding")

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.supports_jit = False

    def _is_symbolic_tensor(self, value: Any) -> bool:
        return isinstance(value, keras.KerasTensor)

    def build(self, input_shape: Any = None) -> None:
        self.built = True  # its one weight, the row-update marker, exists already

    def compute_output_spec(self, inputs: Mapping[str, Any],
                            training: Any = None) -> Dict[str, keras.KerasTensor]:
        shapes = self.output_shapes({k: v.shape for k, v in inputs.items()})
        return {name: keras.KerasTensor(shape, dtype="float32") for name, shape in shapes.items()}


@keras.saving.register_keras_serializable(package="tf_fusedemb")
class ShardedEmbedding(ShardedEmbeddingMixin, keras.layers.Layer):
    """One sharded table looked up like ``keras.layers.Embedding``: the Keras 3 twin of
    :class:`tf_fusedemb.layers.ShardedEmbedding` (arguments and call as there)."""
    fused_class = FusedEmbedding
    keras_kind = KerasKind("Keras 3", "tf_fusedemb.keras3.ShardedEmbedding",
                           "tf_fusedemb.layers.ShardedEmbedding")

    def build(self, input_shape: Any = None) -> None:
        self.built = True  # its table is its FusedEmbedding's, which exists already

    def compute_output_spec(self, ids: Any, training: Any = None) -> keras.KerasTensor:
        return self.fused.compute_output_spec({self.feature.name: ids})[self.feature.name]
