"""SavedModel export of a trained model with FusedEmbedding layers, for one host.

    meta = CheckpointManager(ckpt_dir, model, opt).restore()   # in ONE process: merges shards
    export_saved_model(model, export_dir, {"C1": "scalar", ..., "history": "list"},
                       dense_features=["I1", ...])

The serving signature ``serving_default`` takes raw features: a "scalar" feature as
int64[B]; a "list" feature (multi-hot or sequence) as int64[B, L] zero-padded plus
``<name>_length`` int64[B]; dense features as float32[B]. It returns ``logits`` and
``probability`` [B, 1]. The SavedModel contains core TF ops only.
"""
from typing import Any, Dict, Mapping, Sequence

import tensorflow as tf
import tf_keras

from tf_fusedemb.inference.serving import ServingGroup
from tf_fusedemb.layers.fused_embedding import fused_embedding_layers, use_context
from tf_fusedemb.layers.lookup_context import LookupContext

KINDS = ("scalar", "list")


def serving_context(model: tf_keras.Model) -> LookupContext:
    """A LookupContext in which every FusedEmbedding group of ``model`` is looked up by
    its one-host core-TF copy (``ServingGroup``); the model itself is not changed.
    Needs a single-process model holding all rows (e.g. restored on one rank)."""
    substitutes: Dict[int, Any] = {}  # id(GroupLookup) -> its ServingGroup
    for layer in fused_embedding_layers(model):
        if layer.communicator.size != 1:
            raise ValueError("export runs in one process holding every row: restore the "
                             "checkpoint on one rank first")
        substitutes.update({id(g): ServingGroup(g) for g in layer.groups})
    return LookupContext(substitutes=substitutes)


def export_saved_model(model: tf_keras.Model, export_dir: str, feature_kinds: Mapping[str, str],
                       dense_features: Sequence[str] = ()) -> str:
    """Writes a SavedModel with a raw-feature serving signature; returns ``export_dir``.

    Args:
      model: the trained Keras model (single process); it is not changed: it trains and
        predicts afterwards as before.
      export_dir: output directory (written atomically: to a temporary name, then renamed).
      feature_kinds: {feature: "scalar" | "list"} for every FusedEmbedding feature.
      dense_features: names of float32[B] inputs passed through unchanged.
    """
    for name, kind in feature_kinds.items():
        if kind not in KINDS:
            raise ValueError(f"feature '{name}': kind {kind!r} is not one of {KINDS}")
    context = serving_context(model)
    specs = {}
    for name, kind in feature_kinds.items():
        if kind == "scalar":
            specs[name] = tf.TensorSpec([None], tf.int64, name=name)
        else:
            specs[name] = tf.TensorSpec([None, None], tf.int64, name=name)
            specs[name + "_length"] = tf.TensorSpec([None], tf.int64, name=name + "_length")
    for name in dense_features:
        specs[name] = tf.TensorSpec([None], tf.float32, name=name)

    @tf.function(input_signature=[specs])
    def serve(inputs):
        features = {}
        for name, kind in feature_kinds.items():
            features[name] = inputs[name] if kind == "scalar" else tf.RaggedTensor.from_tensor(
                inputs[name], lengths=inputs[name + "_length"])
        for name in dense_features:
            features[name] = inputs[name]
        with use_context(model, context):
            logits = model(features, training=False)
        return {"logits": logits, "probability": tf.sigmoid(logits)}

    module = tf.Module()
    # The dense weights and the serving groups (their rows and key indexes); not the
    # training tables, which the serving signature does not read.
    tables = {id(v) for layer in fused_embedding_layers(model) for g in layer.groups
              for v in g.variables}
    module.variables_ = [v for v in model.variables if id(v) not in tables]
    module.serving_groups_ = list(context.substitutes.values())
    module.serve = serve
    tmp = export_dir.rstrip("/") + ".tmp"
    tf.io.gfile.rmtree(tmp) if tf.io.gfile.exists(tmp) else None
    tf.saved_model.save(module, tmp, signatures={"serving_default": serve.get_concrete_function()})
    if tf.io.gfile.exists(export_dir):
        tf.io.gfile.rmtree(export_dir)
    tf.io.gfile.rename(tmp, export_dir)
    return export_dir
