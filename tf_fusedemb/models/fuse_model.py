"""``fuse_model``: a functional tf_keras model with N ``Embedding`` layers becomes the same
model with one FusedEmbedding, the Embeddings' weights carried into the tables.

The rewrite works on the model's config (the documented functional format): the Embedding
layers are replaced by one FusedEmbedding layer whose input is a dict {feature: the tensor
the Embedding was called on} and whose dict output feeds every former consumer; the model
is rebuilt with ``FusedModel.from_config`` and every weight is copied over. So the result
shares no layer or variable with the original, and predicts the same before training.
"""
from typing import Any, Dict, List, Tuple

import tensorflow as tf
import tf_keras

from tf_fusedemb.layers.converter import embedding_table_spec
from tf_fusedemb.layers.fused_embedding import FusedEmbedding
from tf_fusedemb.models.fused_model import FusedModel
from tf_fusedemb.specs import FeatureSpec, OptimizerSpec

__all__ = ["fuse_model"]


def fuse_model(model: tf_keras.Model, optimizer: OptimizerSpec, dynamic: bool = False,
               name: str = "fused_embedding", **layer_kwargs: Any) -> FusedModel:
    """The same model with its top-level Embedding layers fused into one FusedEmbedding.

    Each call of an Embedding becomes one feature (named after the layer; a second call of
    the same layer is ``"<layer>_1"`` etc. and shares its table): an int [B] input gives a
    pooled feature (``[B, dim]``, the row itself, as Embedding gives), an int [B, L] input
    (static L) a sequence feature (``[B, L, dim]``). Tables take the Embedding's name,
    ``output_dim``, initializer and (unless ``dynamic``) ``input_dim`` as a static vocabulary.

    Args:
      model: a functional ``tf_keras.Model`` (built from ``tf_keras.Input``s).
      optimizer: the row optimizer of every table (the dense layers keep the Keras
        optimizer given to ``compile``).
      dynamic: True for dynamic hash tables (any int64 ID) instead of static vocabularies.
      name: the FusedEmbedding layer's name.
      **layer_kwargs: passed to FusedEmbedding (``plan``, ``key_mode``).
    Returns:
      A functional FusedModel (not compiled) whose predictions equal ``model``'s; it shares
      no weights with ``model``. Under horovodrun every rank calls this with the same model
      and keeps the rows it owns.
    Raises:
      ValueError: not a functional model, no Embedding, a nested model holding Embeddings,
        float or ragged Embedding inputs, ``mask_zero=True``, or a name clash.
    """
    config = _functional_config(model)
    embeddings = [l for l in model.layers if isinstance(l, tf_keras.layers.Embedding)]
    _check_convertible(model, embeddings, name)
    features, calls = _features(config, embeddings, optimizer, dynamic)
    layer = FusedEmbedding(features, name=name, **layer_kwargs)
    fused = FusedModel.from_config(_rewrite(config, layer, calls),
                                   custom_objects={"FusedEmbedding": FusedEmbedding})
    for old in model.layers:
        if not isinstance(old, (tf_keras.layers.Embedding, tf_keras.layers.InputLayer)):
            fused.get_layer(old.name).set_weights(old.get_weights())
    fused.get_layer(name).set_embedding_weights({e.name: e.get_weights()[0] for e in embeddings})
    return fused


def _functional_config(model) -> Dict:
    if not isinstance(model, tf_keras.Model):
        keras3 = type(model).__module__.startswith("keras")
        raise ValueError(
            f"fuse_model needs a functional tf_keras.Model; got {type(model).__name__} "
            f"({'a Keras 3 model' if keras3 else type(model).__module__}). "
            + ("For Keras 3, use tf_fusedemb.keras3.FusedEmbedding in the model in place of "
               "its Embedding layers (it trains in Keras 3's fit and loops)" if keras3 else
               "Use tf_fusedemb.layers.FusedEmbedding in the model directly"))
    config = None
    if not isinstance(model, tf_keras.Sequential):
        try:
            config = model.get_config()
        except NotImplementedError:
            config = None
    if not isinstance(config, dict) or "layers" not in config or "input_layers" not in config:
        raise ValueError(
            f"fuse_model needs a functional tf_keras.Model (Model(inputs, outputs)); got "
            f"{type(model).__name__}, whose layers it cannot rewire. Convert it in place with "
            "tf_fusedemb.models.shard_embeddings(model, optimizer) (each Embedding sharded, "
            "not fused), or put tf_fusedemb.layers.FusedEmbedding in the model in place of "
            "its Embedding layers (it trains in a plain tf_keras.Model, subclassed or not), or "
            "wrap a Sequential model as tf_keras.Model(inputs, sequential(inputs))")
    return config


def _check_convertible(model, embeddings, name):
    nested = [l.name for l in model.layers if isinstance(l, tf_keras.Model) and any(
        isinstance(s, tf_keras.layers.Embedding) for s in l.submodules)]
    if nested:
        raise ValueError(f"fuse_model: the nested models {nested} hold Embedding layers; only "
                         "the top-level Embeddings of a functional model are converted")
    if not embeddings:
        raise ValueError(f"fuse_model: model '{model.name}' has no top-level Embedding layer")
    if name in {l.name for l in model.layers}:
        raise ValueError(f"fuse_model: the model already has a layer named {name!r}; pass "
                         "name=... for the FusedEmbedding layer")


def _features(config, embeddings, optimizer, dynamic) -> Tuple[List[FeatureSpec], Dict]:
    """FeatureSpecs, one per Embedding call, and {(layer name, node index): (feature name,
    the call's input reference in the config)}."""
    nodes = {l["name"]: l["inbound_nodes"] for l in config["layers"]}
    features, calls = [], {}
    for emb in embeddings:
        table = embedding_table_spec(emb.name, emb.get_config(), optimizer, dynamic)
        if len(nodes[emb.name]) != len(emb.inbound_nodes):
            raise ValueError(f"fuse_model: Embedding '{emb.name}' is also used outside this "
                             "model; convert a model whose Embeddings are its own")
        for k, node in enumerate(nodes[emb.name]):
            feature = emb.name if k == 0 else f"{emb.name}_{k}"
            features.append(_feature_spec(feature, table, emb, k))
            calls[(emb.name, k)] = (feature, _single_input(emb.name, node))
    names = [f.name for f in features]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise ValueError(f"fuse_model: feature names {clash} clash; rename the Embedding layers")
    return features, calls


def _feature_spec(feature, table, emb, k) -> FeatureSpec:
    """Pooled for [B] IDs (the row itself), sequence for [B, L] IDs (static L)."""
    tensor = emb.get_input_at(k)
    if not tensor.dtype.is_integer:
        raise ValueError(f"fuse_model: Embedding '{emb.name}' is called on {tensor.dtype.name} "
                         "input; FusedEmbedding takes int32/int64 IDs (declare the Input with "
                         "dtype='int64')")
    shape = tuple(tensor.shape)
    if not isinstance(tensor.type_spec, tf.TensorSpec) or len(shape) not in (1, 2) or (
            len(shape) == 2 and shape[1] is None):
        raise ValueError(f"fuse_model: Embedding '{emb.name}' input shape {shape} is not "
                         "[B] or [B, L] with a static L")
    if len(shape) == 1:
        return FeatureSpec(feature, table, combiner="sum")
    return FeatureSpec(feature, table, combiner=None, max_len=int(shape[1]))


def _single_input(layer_name, node):
    """The config reference [src, node, tensor, kwargs] of an Embedding call's one input."""
    ref = node[0] if len(node) == 1 and isinstance(node[0], list) else node
    if len(ref) not in (3, 4) or not isinstance(ref[0], str) or (len(ref) == 4 and ref[3]):
        raise ValueError(f"fuse_model: Embedding '{layer_name}' call {node} is not a plain "
                         "call on one tensor")
    return [ref[0], ref[1], ref[2], {}]


def _rewrite(config, layer, calls) -> Dict:
    """The model config with the Embeddings replaced by ``layer`` (see module docstring)."""
    order = sorted(feature for feature, _ in calls.values())  # tf.nest order of a dict
    index = {key: order.index(feature) for key, (feature, _) in calls.items()}

    def swap(obj):
        if (isinstance(obj, list) and len(obj) in (3, 4) and isinstance(obj[0], str)
                and isinstance(obj[1], int) and (obj[0], obj[1]) in index):
            return [layer.name, 0, index[(obj[0], obj[1])], *[swap(o) for o in obj[3:]]]
        if isinstance(obj, list):
            return [swap(o) for o in obj]
        if isinstance(obj, dict):
            return {k: swap(v) for k, v in obj.items()}
        return obj

    fused_conf = dict(tf_keras.layers.serialize(layer), name=layer.name,
                      inbound_nodes=[{feature: ref for feature, ref in calls.values()}])
    embedding_names = {name for name, _ in calls}
    layers, placed = [], False
    for conf in config["layers"]:
        if conf["name"] in embedding_names:
            if not placed:
                layers.append(fused_conf)
                placed = True
            continue
        layers.append(dict(conf, inbound_nodes=swap(conf["inbound_nodes"])))
    return dict(config, layers=layers, output_layers=swap(config["output_layers"]))
