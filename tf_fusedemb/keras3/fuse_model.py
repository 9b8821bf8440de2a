"""``fuse_model`` for Keras 3: a functional ``keras.Model`` with N ``keras.layers.Embedding``
layers becomes the same ``keras.Model`` with one Keras 3 FusedEmbedding (the rewrite of
:mod:`tf_fusedemb.models.fuse_model`, on Keras 3's config format). A subclassed Keras 3
model is converted in place, each Embedding becoming a Keras 3 ShardedEmbedding (the walk
of :mod:`tf_fusedemb.models.shard_embeddings`).

The result is a plain ``keras.Model``: it trains with Keras 3's own ``compile`` and ``fit``
(on N ranks with :class:`~tf_fusedemb.keras3.DistributedOptimizer`), as any model holding
the layer does.
"""
from typing import Any, Dict

import keras

from tf_fusedemb.layers.keras3_embedding import FusedEmbedding, ShardedEmbedding
from tf_fusedemb.models.fuse_model import KerasDialect, fuse_or_shard
from tf_fusedemb.models.shard_embeddings import ShardingDialect
from tf_fusedemb.specs import OptimizerSpec

__all__ = ["fuse_model"]


def _call_input(node: Any) -> Dict:
    """Keras 3 writes a call as {"args": [input], "kwargs": {...}}."""
    args = node.get("args") if isinstance(node, dict) else None
    if (not isinstance(args, (list, tuple)) or len(args) != 1 or node.get("kwargs")
            or not isinstance(args[0], dict) or args[0].get("class_name") != "__keras_tensor__"):
        raise ValueError(f"fuse_model: the call {node} is not a plain call on one tensor")
    return args[0]


def _put(holder: Any, key: Any, layer: Any) -> None:
    """Keras 3 neither untracks a layer on ``delattr`` nor on item assignment, and it locks
    a built layer's state; so the old layer is untracked and the new one tracked under the
    unlocked tracker, as Keras 3 itself does to untrack a variable
    (``Layer._untrack_variable``)."""
    is_item = isinstance(holder, (list, dict))
    tracker = holder.tracker if is_item else holder._tracker  # pylint: disable=protected-access
    locked = bool(tracker and tracker.locked)
    if tracker:
        tracker.unlock()
    try:
        if isinstance(holder, list):
            del holder[key]  # TrackedList untracks here and tracks on insert
            holder.insert(key, layer)
        elif isinstance(holder, dict):
            holder.pop(key)  # TrackedDict untracks here and tracks on assignment
            holder[key] = layer
        else:
            tracker.untrack(getattr(holder, key))
            setattr(holder, key, layer)
    finally:
        if locked:
            tracker.lock()


def _symbolic_input(sequential: keras.Sequential) -> keras.KerasTensor:
    spec = sequential.inputs[0]
    return keras.Input(batch_shape=spec.shape, dtype=spec.dtype)


KERAS3_SHARDING = ShardingDialect(
    layer_class=keras.layers.Layer, embedding_class=keras.layers.Embedding,
    sequential_class=keras.Sequential,
    sharded_class=ShardedEmbedding,
    built_shape=lambda layer: (getattr(layer, "_build_shapes_dict", None)
                               or {}).get("input_shape"),
    symbolic_input=_symbolic_input, put=_put)


KERAS3 = KerasDialect(
    name="Keras 3", model_class=keras.Model, sequential_class=keras.Sequential,
    embedding_class=keras.layers.Embedding,
    input_layer_class=keras.layers.InputLayer, fused_class=FusedEmbedding,
    fused_path="tf_fusedemb.keras3.FusedEmbedding",
    call_input=_call_input, fused_node=lambda refs: {"args": [refs], "kwargs": {}},
    call_tensor=lambda layer, k: layer._inbound_nodes[k].input_tensors[0],  # pylint: disable=protected-access
    node_on=lambda layer, j: {"args": [{"class_name": "__keras_tensor__", "config": {
        "shape": list(layer.output.shape), "dtype": layer.output.dtype,
        "keras_history": [layer.name, j, 0]}}], "kwargs": {}},
    first_node=lambda block: 0,  # Keras 3 numbers a nested model's calls from 0
    from_config=lambda config: keras.Model.from_config(
        config, custom_objects={"FusedEmbedding": FusedEmbedding}),
    serialize=keras.layers.serialize, sharding=KERAS3_SHARDING,
    # Keras 3 has no FusedModel: its own fit trains the model, each table looked up alone.
    train_fused=lambda model: model)


def fuse_model(model: keras.Model, optimizer: OptimizerSpec, dynamic: bool = False,
               name: str = "fused_embedding", **layer_kwargs: Any) -> keras.Model:
    """The same Keras 3 model with its Embedding layers sharded; arguments, features and
    errors as :func:`tf_fusedemb.models.fuse_model`: a functional model, or a
    ``Sequential`` built on an ``Input``, has its top-level Embeddings fused into one
    FusedEmbedding in a new model; a subclassed model (or one holding Sequential blocks)
    has each Embedding replaced in place by a :class:`tf_fusedemb.keras3.ShardedEmbedding`.

    Returns:
      From a functional or Sequential model, a functional ``keras.Model`` (not compiled)
      whose predictions equal ``model``'s and which shares no weights with it; from a
      subclassed model, ``model``, converted. Under horovodrun every rank calls this with
      the same model and keeps the rows it owns.
    """
    return fuse_or_shard(model, KERAS3, optimizer, dynamic, name, **layer_kwargs)
