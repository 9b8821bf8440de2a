"""``fuse_model``: a functional Keras model with N ``Embedding`` layers becomes the same
model with one FusedEmbedding, the Embeddings' weights carried into the tables. A
``Sequential`` model built on an ``Input`` is taken as the functional model of its layers;
a subclassed model, which has no config to rebuild from, is converted in place by
:func:`~tf_fusedemb.models.shard_embeddings` (its Embeddings become ShardedEmbeddings of
one shared FusedEmbedding) and returned in a FusedModel
(:class:`~tf_fusedemb.models.wrapped_model.WrappedModel`), whose step fuses the exchanges.

The rewrite works on the model's config (the documented functional format): the
``Sequential`` blocks holding Embeddings (``Sequential([StringLookup, Embedding])``) are
opened into the model (:mod:`~tf_fusedemb.models.sequential_blocks`); the Embedding
layers are replaced by one FusedEmbedding layer whose input is a dict {feature: the tensor
the Embedding was called on} and whose dict output feeds every former consumer; the model
is rebuilt from the rewritten config, lookup layers without their vocabularies, and every
layer's state (weights, vocabularies as they are) is copied over directly
(:mod:`~tf_fusedemb.models.layer_state`). So the result shares no layer or variable with
the original, and predicts the same before training.

tf_keras and Keras 3 write the same graph in two config formats; a :class:`KerasDialect`
says how one Keras writes a call's input and builds the model, and the rewrite is the same
for both (``tf_fusedemb.keras3.fuse_model`` is the Keras 3 entry point).
"""
from typing import Any, Callable, Dict, List, NamedTuple, Tuple

import tensorflow as tf
import tf_keras
# How tf_keras numbers a nested model's calls in a config (its own graph's node first, not
# written); no public export, and Keras's own rule is what makes the references match.
from tf_keras.src.engine.functional import _should_skip_first_node

from tf_fusedemb.layers.converter import embedding_table_spec
from tf_fusedemb.layers.fused_embedding import FusedEmbedding
from tf_fusedemb.layers.model_embeddings import sublayers
from tf_fusedemb.models.fused_model import FusedModel, SparseTrainingMixin
from tf_fusedemb.models.layer_state import copy_state, with_vocabularies
from tf_fusedemb.models.sequential_blocks import map_references, open_blocks
from tf_fusedemb.models.shard_embeddings import (TF_KERAS_SHARDING, ShardingDialect,
                                                 shard_in_place)
from tf_fusedemb.models.wrapped_model import WrappedModel, has_own_train_step
from tf_fusedemb.specs import FeatureSpec, OptimizerSpec

__all__ = ["KerasDialect", "fuse_functional", "fuse_model", "fuse_or_shard"]


class KerasDialect(NamedTuple):
    """What differs between tf_keras and Keras 3 for the rewrite.

    Fields:
      name: "tf_keras" or "Keras 3", for messages.
      model_class, sequential_class, embedding_class, input_layer_class: that Keras's
        classes.
      fused_class: the FusedEmbedding layer class of that Keras; fused_path: its public
        import path, for messages.
      call_input: (config node of one Embedding call) -> that call's input reference, in
        the config's own form; raises ValueError if the call is not on one tensor.
      fused_node: ({feature: input reference}) -> the fused layer's one config node.
      call_tensor: (Embedding, call index) -> the symbolic tensor it was called on.
      node_on: (layer, call index j) -> the config node of a call on the output of that
        layer's call j.
      first_node: (a nested model) -> the index by which the config refers to its first
        call in the model.
      from_config: (config) -> the rebuilt model.
      serialize: (layer) -> its config entry.
      sharding: how that Keras's subclassed models are sharded in place.
      train_fused: (a subclassed model, converted in place) -> what ``fuse_model``
        returns for it.
    """
    name: str
    model_class: Any  # Any, as sequential_class
    sequential_class: Any  # Any: isinstance against a plain type would narrow to object
    embedding_class: type
    input_layer_class: type
    fused_class: type
    fused_path: str
    call_input: Callable[[Any], Any]
    fused_node: Callable[[Dict[str, Any]], Any]
    call_tensor: Callable[[Any, int], Any]
    node_on: Callable[[Any, int], Any]
    first_node: Callable[[Any], int]
    from_config: Callable[[Dict], Any]
    serialize: Callable[[Any], Dict]
    sharding: ShardingDialect
    train_fused: Callable[[Any], Any]


def _tf_keras_train_fused(model: tf_keras.Model) -> tf_keras.Model:
    """A FusedModel around ``model`` (its step fuses the shared tables' exchanges), unless
    it is one already or defines its own training step."""
    if isinstance(model, SparseTrainingMixin) or has_own_train_step(model):
        return model
    return WrappedModel(model)


def _tf_keras_call_input(node):
    """tf_keras writes a call as [[src, node, tensor, kwargs]] (or the bare reference)."""
    ref = node[0] if len(node) == 1 and isinstance(node[0], list) else node
    if len(ref) not in (3, 4) or not isinstance(ref[0], str) or (len(ref) == 4 and ref[3]):
        raise ValueError(f"fuse_model: the call {node} is not a plain call on one tensor")
    return [ref[0], ref[1], ref[2], {}]


TF_KERAS = KerasDialect(
    name="tf_keras", model_class=tf_keras.Model, sequential_class=tf_keras.Sequential,
    embedding_class=tf_keras.layers.Embedding,
    input_layer_class=tf_keras.layers.InputLayer, fused_class=FusedEmbedding,
    fused_path="tf_fusedemb.layers.FusedEmbedding",
    call_input=_tf_keras_call_input, fused_node=lambda refs: refs,
    call_tensor=lambda layer, k: layer.get_input_at(k),
    node_on=lambda layer, j: [[layer.name, j, 0, {}]],
    first_node=lambda block: int(_should_skip_first_node(block)),
    from_config=lambda config: FusedModel.from_config(
        config, custom_objects={"FusedEmbedding": FusedEmbedding}),
    serialize=tf_keras.layers.serialize, sharding=TF_KERAS_SHARDING,
    train_fused=_tf_keras_train_fused)


def fuse_model(model: tf_keras.Model, optimizer: OptimizerSpec, dynamic: bool = False,
               name: str = "fused_embedding", **layer_kwargs: Any) -> tf_keras.Model:
    """The same model with its Embedding layers sharded: fused into one FusedEmbedding
    where the model can be rebuilt from its config, else each one sharded in place.

    Each call of an Embedding becomes one feature (named after the layer; a second call of
    the same layer is ``"<layer>_1"`` etc. and shares its table): an int [B] input gives a
    pooled feature (``[B, dim]``, the row itself, as Embedding gives), an int [B, L] input
    (static L) a sequence feature (``[B, L, dim]``). Tables take the Embedding's name,
    ``output_dim``, initializer and (unless ``dynamic``) ``input_dim`` as a static vocabulary.

    Args:
      model: a tf_keras model, built:
        - functional (from ``tf_keras.Input``s), or ``Sequential`` built on an ``Input``:
          its Embeddings, top-level or in ``Sequential`` blocks (such as
          ``Sequential([StringLookup(vocabulary), Embedding(n, dim)])``, whose layers are
          then called in the new model itself), are fused into one FusedEmbedding in a new
          model;
        - subclassed, or holding ``Sequential`` blocks in its attributes (the TensorFlow
          Recommenders shape): it has no config to rebuild from, so each Embedding is
          replaced in place by a ShardedEmbedding (:func:`shard_embeddings`), all of
          them looking up one FusedEmbedding named ``name`` (same-spec tables: one
          group), and ``model`` is returned in a FusedModel (``WrappedModel``, sharing
          its layers), whose ``fit`` computes every table's keys first and exchanges each
          group once per step; a FusedModel, or a model with its own ``train_step``, is
          returned itself. ``layer_kwargs`` do not apply.
        A Keras 3 model goes to ``tf_fusedemb.keras3.fuse_model`` (the error says so),
        which takes the same shapes.
      optimizer: the row optimizer of every table (the dense layers keep the Keras
        optimizer given to ``compile``).
      dynamic: True for dynamic hash tables (any int64 ID) instead of static vocabularies.
      name: the FusedEmbedding layer's name.
      **layer_kwargs: passed to FusedEmbedding (``plan``, ``key_mode``).
    Returns:
      From a functional or Sequential model, a functional FusedModel (not compiled) whose
      predictions equal ``model``'s and which shares no weights with it; from a subclassed
      model, ``model`` converted, in a WrappedModel (see above). Under horovodrun every
      rank calls this with the same model and keeps the rows it owns.
    Raises:
      ValueError: a Keras 3 model, a model never built, no Embedding, a functional model's
        nested model (other than a Sequential block) holding Embeddings, a block's layer
        named as another layer of the model, float or ragged Embedding inputs,
        ``mask_zero=True``, a name clash, or ``layer_kwargs`` for a subclassed model.
    """
    return fuse_or_shard(model, TF_KERAS, optimizer, dynamic, name, **layer_kwargs)


def fuse_or_shard(model: Any, dialect: KerasDialect, optimizer: OptimizerSpec, dynamic: bool,
                  name: str, **layer_kwargs: Any) -> Any:
    """``fuse_model`` for the Keras that ``dialect`` describes (arguments as there): a
    subclassed model is sharded in place (its tables in one FusedEmbedding named
    ``name``) and given to ``dialect.train_fused``, any other is fused into a new model."""
    if (isinstance(model, dialect.model_class) and not isinstance(model, dialect.sequential_class)
            and not _is_functional(model)):
        if layer_kwargs:
            raise ValueError(f"fuse_model: {sorted(layer_kwargs)} configure one fused layer; "
                             f"the subclassed model '{model.name}' has its Embeddings sharded "
                             "in place (shard_embeddings), so they do not apply")
        return dialect.train_fused(shard_in_place(model, dialect.sharding, optimizer, dynamic,
                                                  name))
    return fuse_functional(model, dialect, optimizer, dynamic, name, **layer_kwargs)


def _is_functional(model: Any) -> bool:
    """Whether ``model``'s config is a functional graph: a Sequential's config has no
    "input_layers", a subclassed model's no "layers" (or no config at all)."""
    try:
        config = model.get_config()
    except NotImplementedError:
        return False
    return isinstance(config, dict) and "layers" in config and "input_layers" in config


def fuse_functional(model: Any, dialect: KerasDialect, optimizer: OptimizerSpec,
                    dynamic: bool, name: str, **layer_kwargs: Any) -> Any:
    """``fuse_model`` of a functional or Sequential model, for the Keras that ``dialect``
    describes (arguments as there)."""
    if isinstance(model, dialect.sequential_class):
        if not getattr(model, "inputs", None):
            raise ValueError(f"fuse_model: the Sequential model '{model.name}' has no Input; "
                             "build it as Sequential([Input(...), ...]) or call it once on a "
                             "batch")
        model = dialect.model_class(model.inputs, model.outputs, name=model.name)
    opened = open_blocks(_functional_config(model, dialect), model,
                         dialect.sequential_class, dialect.embedding_class, dialect.node_on,
                         dialect.first_node)
    embeddings: List[Any] = [l for l in opened.layers.values()
                             if isinstance(l, dialect.embedding_class)]
    _check_convertible(model, opened, embeddings, name, dialect)
    features, calls = _features(opened, embeddings, optimizer, dynamic, dialect)
    layer = dialect.fused_class(features, name=name, **layer_kwargs)
    config = dict(opened.config, layers=[
        with_vocabularies(e, opened.layers[e["name"]]) for e in opened.config["layers"]])
    fused = dialect.from_config(_rewrite(config, layer, calls, dialect))
    for new_name, old in opened.layers.items():
        if not isinstance(old, (dialect.embedding_class, dialect.input_layer_class)):
            copy_state(old, fused.get_layer(new_name))
    fused.get_layer(name).set_embedding_weights({e.name: e.get_weights()[0] for e in embeddings})
    return fused


def _functional_config(model, dialect) -> Dict:
    if not isinstance(model, dialect.model_class):
        keras3 = type(model).__module__.startswith("keras")
        raise ValueError(
            f"fuse_model needs a functional {dialect.name} model; got {type(model).__name__} "
            f"({'a Keras 3 model' if keras3 else type(model).__module__}). "
            + ("For Keras 3 models use tf_fusedemb.keras3.fuse_model" if keras3 else
               "For tf_keras models use tf_fusedemb.models.fuse_model"))
    if not _is_functional(model):
        names = [l.name for l in sublayers(model) if isinstance(l, dialect.embedding_class)]
        raise ValueError(
            f"fuse_model needs a functional {dialect.name} model (Model(inputs, outputs)) or a "
            f"Sequential built on an Input; got {type(model).__name__} '{model.name}', whose "
            f"layers it cannot rewire. Put {dialect.fused_path} in the model in place of its "
            "Embedding layers "
            f"{names} (it trains in a plain Keras model, subclassed or not), or give a "
            "Sequential model an Input first")
    return model.get_config()


def _check_convertible(model, opened, embeddings, name, dialect):
    nested = [l.name for l in opened.layers.values() if isinstance(l, dialect.model_class)
              and any(isinstance(s, dialect.embedding_class) for s in sublayers(l))]
    if nested:
        raise ValueError(f"fuse_model: the nested models {nested} hold Embedding layers; the "
                         "Embeddings of a functional model and of its Sequential blocks are "
                         "converted, not those of other nested models: call the nested "
                         "model's layers in the model itself")
    if not embeddings:
        raise ValueError(f"fuse_model: model '{model.name}' has no top-level Embedding layer")
    if name in opened.layers:
        raise ValueError(f"fuse_model: the model already has a layer named {name!r}; pass "
                         "name=... for the FusedEmbedding layer")


def _features(opened, embeddings, optimizer, dynamic,
              dialect) -> Tuple[List[FeatureSpec], Dict]:
    """FeatureSpecs, one per Embedding call, and {(layer name, node index): (feature name,
    the call's input reference in the config)}. An Embedding of a Sequential block was
    called once, in the block's own graph, on what every call of the block gives it."""
    nodes = {l["name"]: l["inbound_nodes"] for l in opened.config["layers"]}
    features, calls = [], {}
    for emb in embeddings:
        table = embedding_table_spec(emb.name, emb.get_config(), optimizer, dynamic)
        in_block = emb.name in opened.opened
        if not in_block and len(nodes[emb.name]) != len(emb._inbound_nodes):  # pylint: disable=protected-access
            raise ValueError(f"fuse_model: Embedding '{emb.name}' is also used outside this "
                             "model; convert a model whose Embeddings are its own")
        for k, node in enumerate(nodes[emb.name]):
            feature = emb.name if k == 0 else f"{emb.name}_{k}"
            features.append(_feature_spec(feature, table, emb.name,
                                          dialect.call_tensor(emb, 0 if in_block else k)))
            try:
                calls[(emb.name, k)] = (feature, dialect.call_input(node))
            except ValueError as err:
                raise ValueError(f"Embedding '{emb.name}': {err}") from None
    names = [f.name for f in features]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise ValueError(f"fuse_model: feature names {clash} clash; rename the Embedding layers")
    return features, calls


def _feature_spec(feature, table, layer_name, tensor) -> FeatureSpec:
    """Pooled for [B] IDs (the row itself), sequence for [B, L] IDs (static L)."""
    dtype = tf.as_dtype(tensor.dtype)
    if not dtype.is_integer:
        raise ValueError(f"fuse_model: Embedding '{layer_name}' is called on {dtype.name} "
                         "input; FusedEmbedding takes int32/int64 IDs (declare the Input with "
                         "dtype='int64')")
    shape = tuple(tensor.shape)
    dense = not (getattr(tensor, "ragged", False) or getattr(tensor, "sparse", False)) and (
        not hasattr(tensor, "type_spec") or isinstance(tensor.type_spec, tf.TensorSpec))
    if not dense or len(shape) not in (1, 2) or (len(shape) == 2 and shape[1] is None):
        raise ValueError(f"fuse_model: Embedding '{layer_name}' input shape {shape} is not "
                         "[B] or [B, L] with a static L")
    if len(shape) == 1:
        return FeatureSpec(feature, table, combiner="sum")
    return FeatureSpec(feature, table, combiner=None, max_len=int(shape[1]))


def _rewrite(config, layer, calls, dialect) -> Dict:
    """The model config with the Embeddings replaced by ``layer`` (see module docstring)."""
    order = sorted(feature for feature, _ in calls.values())  # tf.nest order of a dict
    index = {key: order.index(feature) for key, (feature, _) in calls.items()}

    def to_fused(ref):
        """A reference to an Embedding's output becomes one to the fused output."""
        return (layer.name, 0, index[ref[:2]]) if ref[:2] in index else None

    fused_conf = dict(dialect.serialize(layer), name=layer.name,
                      inbound_nodes=[dialect.fused_node(
                          {feature: ref for feature, ref in calls.values()})])
    embedding_names = {name for name, _ in calls}
    layers, placed = [], False
    for conf in config["layers"]:
        if conf["name"] in embedding_names:
            if not placed:
                layers.append(fused_conf)
                placed = True
            continue
        layers.append(dict(conf, inbound_nodes=map_references(conf["inbound_nodes"], to_fused)))
    return dict(config, layers=layers,
                output_layers=map_references(config["output_layers"], to_fused))
