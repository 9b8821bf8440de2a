"""``fuse_model`` for Keras 3: a functional ``keras.Model`` with N ``keras.layers.Embedding``
layers becomes the same ``keras.Model`` with one Keras 3 FusedEmbedding (the rewrite of
:mod:`tf_fusedemb.models.fuse_model`, on Keras 3's config format).

The result is a plain functional ``keras.Model``: it trains with Keras 3's own ``compile``
and ``fit`` (on N ranks with :class:`~tf_fusedemb.keras3.DistributedOptimizer`), as any
model holding the layer does.
"""
from typing import Any, Dict

import keras

from tf_fusedemb.layers.keras3_embedding import FusedEmbedding
from tf_fusedemb.models.fuse_model import KerasDialect, fuse_functional
from tf_fusedemb.specs import OptimizerSpec

__all__ = ["fuse_model"]


def _call_input(node: Any) -> Dict:
    """Keras 3 writes a call as {"args": [input], "kwargs": {...}}."""
    args = node.get("args") if isinstance(node, dict) else None
    if (not isinstance(args, (list, tuple)) or len(args) != 1 or node.get("kwargs")
            or not isinstance(args[0], dict) or args[0].get("class_name") != "__keras_tensor__"):
        raise ValueError(f"fuse_model: the call {node} is not a plain call on one tensor")
    return args[0]


KERAS3 = KerasDialect(
    name="Keras 3", model_class=keras.Model, sequential_class=keras.Sequential,
    embedding_class=keras.layers.Embedding,
    input_layer_class=keras.layers.InputLayer, fused_class=FusedEmbedding,
    fused_path="tf_fusedemb.keras3.FusedEmbedding",
    call_input=_call_input, fused_node=lambda refs: {"args": [refs], "kwargs": {}},
    call_tensor=lambda layer, k: layer._inbound_nodes[k].input_tensors[0],  # pylint: disable=protected-access
    from_config=lambda config: keras.Model.from_config(
        config, custom_objects={"FusedEmbedding": FusedEmbedding}),
    serialize=keras.layers.serialize)


def fuse_model(model: keras.Model, optimizer: OptimizerSpec, dynamic: bool = False,
               name: str = "fused_embedding", **layer_kwargs: Any) -> keras.Model:
    """The same Keras 3 model with its top-level Embedding layers fused into one
    FusedEmbedding; arguments, features and errors as
    :func:`tf_fusedemb.models.fuse_model` for a functional model or a ``Sequential`` built
    on an ``Input``. A subclassed Keras 3 model is refused: put
    :class:`tf_fusedemb.keras3.FusedEmbedding` in it in place of its Embeddings.

    Returns:
      A functional ``keras.Model`` (not compiled) whose predictions equal ``model``'s; it
      shares no weights with ``model``. Under horovodrun every rank calls this with the
      same model and keeps the rows it owns.
    """
    return fuse_functional(model, KERAS3, optimizer, dynamic, name, **layer_kwargs)
