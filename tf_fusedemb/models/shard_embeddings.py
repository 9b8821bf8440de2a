"""``shard_embeddings``: every ``Embedding`` of a tf_keras model whose layers cannot be
rewired by ``fuse_model`` (a subclassed model, ``Sequential`` blocks such as TensorFlow
Recommenders' ``Sequential([StringLookup(...), Embedding(...)])``) becomes a
:class:`~tf_fusedemb.layers.ShardedEmbedding` with the same table: sharded over the
ranks, trained by its row optimizer on every Keras path, started from the Embedding's
weights.

The model is changed in place (it is the user's object, with its own ``call``): each
Embedding held by an attribute (directly, in a list or dict attribute, or inside a
``Sequential`` held by one) is replaced; a Sequential holding one is replaced by a new
Sequential of the same layers. Lookup layers (``StringLookup``/``IntegerLookup``) are
kept as they are, whatever their vocabulary's type. The model must have been called
once (each Embedding's input rank decides pooled [B] or sequence [B, L] IDs).
"""
from typing import Any, Iterator, List, Set, Tuple

import tensorflow as tf
import tf_keras

from tf_fusedemb.layers.converter import embedding_table_spec
from tf_fusedemb.layers.sharded_embedding import ShardedEmbedding
from tf_fusedemb.specs import FeatureSpec, OptimizerSpec

__all__ = ["shard_embeddings"]


def shard_embeddings(model: tf_keras.Model, optimizer: OptimizerSpec,
                     dynamic: bool = False) -> tf_keras.Model:
    """Replaces, in place, every Embedding of ``model`` by a ShardedEmbedding of the same
    table (see the module doc) and returns ``model``. A collective under horovodrun: every
    rank converts the same model (each keeps the rows it owns).

    Args:
      model: a built tf_keras model (subclassed, or holding Sequential blocks).
      optimizer: the row optimizer of every table.
      dynamic: dynamic hash tables (any int64 ID) instead of the static vocabularies.
    Raises:
      ValueError: a Keras 3 model, an Embedding never called, a [B, L] input without a
        static L, or no Embedding at all.
    """
    if not isinstance(model, tf_keras.Model):
        raise ValueError(f"shard_embeddings takes a tf_keras model; got {type(model).__name__} "
                         "(for Keras 3 use tf_fusedemb.keras3.FusedEmbedding in the model)")
    replaced = _replace_in(model, optimizer, dynamic, set())
    if not replaced:
        raise ValueError(f"shard_embeddings: model '{model.name}' holds no Embedding layer in "
                         "its attributes or their Sequential blocks")
    return model


def _replace_in(container: Any, optimizer: OptimizerSpec, dynamic: bool,
                seen: Set[int]) -> List[str]:
    """Replaces the Embeddings below ``container`` (a Layer) not in ``seen`` (ids of the
    layers already walked: a layer may hold its parent); returns their names."""
    seen.add(id(container))
    done: List[str] = []
    for holder, key, layer in list(_children(container)):
        if isinstance(layer, tf_keras.layers.Embedding):
            _put(holder, key, _sharded(layer, optimizer, dynamic))
            done.append(layer.name)
        elif isinstance(layer, tf_keras.Sequential) and _holds_embedding(layer):
            new = tf_keras.Sequential(
                [_sharded(l, optimizer, dynamic) if isinstance(l, tf_keras.layers.Embedding)
                 else l for l in layer.layers], name=layer.name)
            _build_like(new, layer)
            _put(holder, key, new)
            done += [l.name for l in layer.layers if isinstance(l, tf_keras.layers.Embedding)]
        elif isinstance(layer, tf_keras.layers.Layer) and id(layer) not in seen:
            done += _replace_in(layer, optimizer, dynamic, seen)
    return done


def _children(container: Any) -> Iterator[Tuple[Any, Any, Any]]:
    """(holder, key, layer) of the layers ``container`` holds in its attributes: the
    holder is the container (key: the attribute name) or a list/dict attribute (key: the
    index or dict key)."""
    for name, value in list(vars(container).items()):
        if name.startswith("_"):
            continue
        if isinstance(value, tf_keras.layers.Layer):
            yield container, name, value
        elif _is_mapping(value):
            yield from ((value, k, v) for k, v in list(value.items())
                        if isinstance(v, tf_keras.layers.Layer))
        elif _is_sequence(value):
            yield from ((value, i, v) for i, v in enumerate(list(value))
                        if isinstance(v, tf_keras.layers.Layer))


def _is_mapping(value: Any) -> bool:
    return hasattr(value, "items") and hasattr(value, "__setitem__")


def _is_sequence(value: Any) -> bool:
    return isinstance(value, list) or type(value).__name__ == "ListWrapper"


def _put(holder: Any, key: Any, layer: Any) -> None:
    """``layer`` in place of ``holder``'s attribute or item ``key`` (Keras tracks both)."""
    if isinstance(key, str) and not _is_mapping(holder):
        delattr(holder, key)  # untracks the old layer and its variables
        setattr(holder, key, layer)
    else:
        holder[key] = layer


def _build_like(new: Any, old: Any) -> None:
    """Builds the Sequential ``new`` on the input ``old`` was built for (its dtype too: a
    StringLookup takes strings), by a symbolic call: no lookup runs."""
    inputs = getattr(old, "inputs", None)
    if not inputs:
        raise ValueError(f"shard_embeddings: Sequential '{old.name}' was never called; call "
                         "the model once on a batch before converting it")
    new(tf_keras.Input(type_spec=inputs[0].type_spec))


def _holds_embedding(sequential: Any) -> bool:
    return any(isinstance(l, tf_keras.layers.Embedding) for l in sequential.layers)


def _sharded(embedding: Any, optimizer: OptimizerSpec, dynamic: bool) -> ShardedEmbedding:
    """The ShardedEmbedding of one built Embedding, its rows loaded (a collective)."""
    shape = getattr(embedding, "_build_input_shape", None)
    if shape is None:
        raise ValueError(f"shard_embeddings: Embedding '{embedding.name}' was never called; "
                         "call the model once on a batch before converting it")
    shape = tuple(tf.TensorShape(shape).as_list())
    table = embedding_table_spec(embedding.name, embedding.get_config(), optimizer, dynamic)
    if len(shape) == 1:
        feature = FeatureSpec(embedding.name, table, combiner="sum")
    elif len(shape) == 2 and shape[1] is not None:
        feature = FeatureSpec(embedding.name, table, combiner=None, max_len=int(shape[1]))
    else:
        raise ValueError(f"shard_embeddings: Embedding '{embedding.name}' was called on shape "
                         f"{shape}; it takes IDs [B] or [B, L] with a static L")
    sharded = ShardedEmbedding(feature, name=embedding.name)
    sharded.fused.set_embedding_weights({embedding.name: embedding.get_weights()[0]})
    return sharded
