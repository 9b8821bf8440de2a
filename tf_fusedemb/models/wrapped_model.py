"""``WrappedModel``: a FusedModel whose forward pass is another tf_keras model's, so a
subclassed model of the user's class trains with FusedModel's step.

``fuse_model`` converts a subclassed model in place (its Embeddings become
ShardedEmbeddings of one shared FusedEmbedding) and returns it wrapped: ``fit`` then runs
the step of :mod:`tf_fusedemb.training.step`, which computes every table's keys before
the forward pass and makes one exchange per fused group, averages the dense gradients
over the ranks itself (no DistributedOptimizer) and reports as Keras does. A model with
a ``train_step`` of its own (``tfrs.Model``'s) is not wrapped: its step is its own.
"""
from typing import Any

import tf_keras

from tf_fusedemb.models.fused_model import FusedModel, register_model_class

__all__ = ["WrappedModel", "has_own_train_step"]


@register_model_class
class WrappedModel(FusedModel):
    """FusedModel's ``compile``/``fit``/``evaluate``/``predict`` around ``model``.

    Args:
      model: a built tf_keras model (a subclassed one, converted by ``fuse_model``); its
        layers and variables are this model's, shared, not copied.
      **kwargs: the Model's (name, ...); the name defaults to ``model``'s.

    Call: what ``model`` takes and gives.
    """

    def __init__(self, model: tf_keras.Model, **kwargs: Any):
        kwargs.setdefault("name", f"{model.name}_fused")
        super().__init__(**kwargs)
        self.wrapped = model

    def call(self, inputs: Any, training: Any = None) -> Any:
        return self.wrapped(inputs, training=training)


def has_own_train_step(model: tf_keras.Model) -> bool:
    """Whether ``model``'s class defines the training step itself (``train_step`` or
    ``compute_loss`` other than Keras's)."""
    return any(getattr(type(model), name) is not getattr(tf_keras.Model, name)
               for name in ("train_step", "compute_loss"))
