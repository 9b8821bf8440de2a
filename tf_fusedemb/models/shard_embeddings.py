"""``shard_embeddings``: every ``Embedding`` of a Keras model whose layers cannot be
rewired by ``fuse_model`` (a subclassed model, ``Sequential`` blocks such as TensorFlow
Recommenders' ``Sequential([StringLookup(...), Embedding(...)])``) becomes a
ShardedEmbedding with the same table: sharded over the ranks, trained by its row
optimizer on every Keras path, started from the Embedding's weights.

The model is changed in place (it is the user's object, with its own ``call``): each
Embedding held by an attribute (directly, in a list or dict attribute, or inside a
``Sequential`` held by one) is replaced; a Sequential holding one is replaced by a new
Sequential of the same layers. The ShardedEmbeddings share one FusedEmbedding holding all
the tables, so same-spec tables form one fused group: a training step of ours
(``FusedModel``, which ``fuse_model`` wraps the model in) computes every table's keys
before the forward pass and exchanges each group once
(``tf_fusedemb.layers.keys_ahead``); plain ``fit`` looks each table up on its own.
Lookup layers (``StringLookup``/``IntegerLookup``) are kept as they are, whatever their
vocabulary's type. The model must have been called once (each Embedding's input rank
decides pooled [B] or sequence [B, L] IDs).

tf_keras and Keras 3 track a layer's sub-layers differently; a :class:`ShardingDialect`
says how one Keras does, and the walk is the same for both (``tf_fusedemb.keras3``'s
``fuse_model`` takes a subclassed Keras 3 model this way).
"""
from typing import Any, Callable, Iterator, List, NamedTuple, Optional, Set, Tuple

import tensorflow as tf
import tf_keras

from tf_fusedemb.layers.converter import embedding_table_spec
from tf_fusedemb.layers.sharded_embedding import ShardedEmbedding
from tf_fusedemb.specs import FeatureSpec, OptimizerSpec

__all__ = ["ShardingDialect", "shard_embeddings", "shard_in_place"]


class ShardingDialect(NamedTuple):
    """What differs between tf_keras and Keras 3 for the in-place conversion.

    Fields:
      layer_class, embedding_class, sequential_class: that Keras's classes.
      sharded_class: its ShardedEmbedding class.
      built_shape: (Embedding) -> the input shape it was built for, None if never built.
      symbolic_input: (a built Sequential) -> an ``Input`` like the one it was built on.
      put: (holder, key, layer) -> None: ``layer`` in place of the holder's attribute or
        item ``key``, the old layer untracked (its weights leave the model).
    """
    layer_class: type
    embedding_class: Any  # Any: isinstance against a plain type would narrow to object
    sequential_class: Any
    sharded_class: Any  # a ShardedEmbedding class (its fused_class is read)
    built_shape: Callable[[Any], Optional[Any]]
    symbolic_input: Callable[[Any], Any]
    put: Callable[[Any, Any, Any], None]


def _tf_keras_put(holder: Any, key: Any, layer: Any) -> None:
    """tf_keras untracks an attribute's layer (and its variables) on ``delattr`` and
    tracks list and dict items on assignment."""
    if isinstance(key, str) and not _is_mapping(holder):
        delattr(holder, key)
        setattr(holder, key, layer)
    else:
        holder[key] = layer


TF_KERAS_SHARDING = ShardingDialect(
    layer_class=tf_keras.layers.Layer, embedding_class=tf_keras.layers.Embedding,
    sequential_class=tf_keras.Sequential,
    sharded_class=ShardedEmbedding,
    built_shape=lambda layer: getattr(layer, "_build_input_shape", None),
    symbolic_input=lambda seq: tf_keras.Input(type_spec=seq.inputs[0].type_spec),
    put=_tf_keras_put)


def shard_embeddings(model: tf_keras.Model, optimizer: OptimizerSpec,
                     dynamic: bool = False) -> tf_keras.Model:
    """Replaces, in place, every Embedding of the tf_keras ``model`` by a ShardedEmbedding
    of the same table (see the module doc) and returns ``model``. A collective under
    horovodrun: every rank converts the same model (each keeps the rows it owns).

    Args:
      model: a built tf_keras model (subclassed, or holding Sequential blocks).
      optimizer: the row optimizer of every table.
      dynamic: dynamic hash tables (any int64 ID) instead of the static vocabularies.
    Raises:
      ValueError: a Keras 3 model (``tf_fusedemb.keras3.fuse_model`` takes it), an
        Embedding never called, a [B, L] input without a static L, or no Embedding at all.
    """
    if not isinstance(model, tf_keras.Model):
        raise ValueError(f"shard_embeddings takes a tf_keras model; got {type(model).__name__} "
                         "(for a Keras 3 model use tf_fusedemb.keras3.fuse_model)")
    return shard_in_place(model, TF_KERAS_SHARDING, optimizer, dynamic)


def shard_in_place(model: Any, dialect: ShardingDialect, optimizer: OptimizerSpec,
                   dynamic: bool, name: str = "fused_embedding") -> Any:
    """``shard_embeddings`` for the Keras that ``dialect`` describes (arguments as there):
    the ShardedEmbeddings share one FusedEmbedding named ``name`` holding every table, so
    same-spec tables are one fused group; with an optimizer that counts steps (Adam) each
    table keeps a FusedEmbedding of its own (``OptimizerSpec.counts_steps``)."""
    sites = _sites(model, dialect, set())
    embeddings = list({id(site.layer): site.layer for site in sites
                       if isinstance(site.layer, dialect.embedding_class)}.values())
    embeddings += [l for site in sites if isinstance(site.layer, dialect.sequential_class)
                   for l in site.layer.layers if isinstance(l, dialect.embedding_class)
                   and all(l is not e for e in embeddings)]
    if not embeddings:
        raise ValueError(f"shard_embeddings: model '{model.name}' holds no Embedding layer in "
                         "its attributes or their Sequential blocks")
    features = [_feature(e, dialect, optimizer, dynamic) for e in embeddings]
    if optimizer.counts_steps:
        # A group of several tables steps once per feature exchange where the features
        # are exchanged one at a time (plain Keras fit, loops): each its own table.
        views = {id(e): dialect.sharded_class(f, name=e.name)
                 for e, f in zip(embeddings, features)}
        for e in embeddings:
            views[id(e)].fused.set_embedding_weights({e.name: e.get_weights()[0]})
    else:
        tables = dialect.sharded_class.fused_class(features, name=name)
        tables.set_embedding_weights({e.name: e.get_weights()[0] for e in embeddings})
        views = {id(e): dialect.sharded_class(f, tables=tables, name=e.name)
                 for e, f in zip(embeddings, features)}
    for site in sites:
        if isinstance(site.layer, dialect.embedding_class):
            dialect.put(site.holder, site.key, views[id(site.layer)])
        else:
            new = dialect.sequential_class([views.get(id(l), l) for l in site.layer.layers],
                                           name=site.layer.name)
            _build_like(new, site.layer, dialect)
            dialect.put(site.holder, site.key, new)
    return model


class _Site(NamedTuple):
    """Where a model holds an Embedding (``layer``) or a Sequential holding one: in
    ``holder`` (a layer, or a list/dict attribute's value) under ``key``."""
    holder: Any
    key: Any
    layer: Any


def _sites(container: Any, dialect: ShardingDialect, seen: Set[int]) -> List[_Site]:
    """The sites of the Embeddings below ``container`` (a Layer), not walking the layers
    in ``seen`` (ids of the layers already walked: a layer may hold its parent)."""
    seen.add(id(container))
    found: List[_Site] = []
    embedding = dialect.embedding_class
    for holder, key, layer in list(_children(container, dialect.layer_class)):
        if isinstance(layer, embedding) or (isinstance(layer, dialect.sequential_class) and any(
                isinstance(l, embedding) for l in layer.layers)):
            found.append(_Site(holder, key, layer))
        elif isinstance(layer, dialect.layer_class) and id(layer) not in seen:
            found += _sites(layer, dialect, seen)
    return found


def _children(container: Any, layer_class: type) -> Iterator[Tuple[Any, Any, Any]]:
    """(holder, key, layer) of the layers ``container`` holds in its attributes: the
    holder is the container (key: the attribute name) or a list/dict attribute (key: the
    index or dict key)."""
    for name, value in list(vars(container).items()):
        if name.startswith("_"):
            continue
        if isinstance(value, layer_class):
            yield container, name, value
        elif _is_mapping(value):
            yield from ((value, k, v) for k, v in list(value.items())
                        if isinstance(v, layer_class))
        elif _is_sequence(value):
            yield from ((value, i, v) for i, v in enumerate(list(value))
                        if isinstance(v, layer_class))


def _is_mapping(value: Any) -> bool:
    return hasattr(value, "items") and hasattr(value, "__setitem__")


def _is_sequence(value: Any) -> bool:
    return isinstance(value, list) or type(value).__name__ == "ListWrapper"


def _build_like(new: Any, old: Any, dialect: ShardingDialect) -> None:
    """Builds the Sequential ``new`` on the input ``old`` was built for (its dtype too: a
    StringLookup takes strings), by a symbolic call: no lookup runs."""
    inputs = getattr(old, "inputs", None)
    if not inputs:
        raise ValueError(f"shard_embeddings: Sequential '{old.name}' was never called; call "
                         "the model once on a batch before converting it")
    new(dialect.symbolic_input(old))


def _feature(embedding: Any, dialect: ShardingDialect, optimizer: OptimizerSpec,
             dynamic: bool) -> FeatureSpec:
    """The FeatureSpec of one built Embedding (named after it): pooled for IDs [B], a
    sequence for [B, L]."""
    shape = dialect.built_shape(embedding)
    if shape is None:
        raise ValueError(f"shard_embeddings: Embedding '{embedding.name}' was never called; "
                         "call the model once on a batch before converting it")
    shape = tuple(tf.TensorShape(shape).as_list())
    table = embedding_table_spec(embedding.name, embedding.get_config(), optimizer, dynamic)
    if len(shape) == 1:
        return FeatureSpec(embedding.name, table, combiner="sum")
    if len(shape) == 2 and shape[1] is not None:
        return FeatureSpec(embedding.name, table, combiner=None, max_len=int(shape[1]))
    raise ValueError(f"shard_embeddings: Embedding '{embedding.name}' was called on shape "
                     f"{shape}; it takes IDs [B] or [B, L] with a static L")
