"""SavedModel export of a trained model with FusedEmbedding layers, served on one host.

    # on every rank of the job (or in one process), after fit or a restore:
    export_saved_model(model, export_dir, {"C1": "scalar", ..., "history": "list"},
                       dense_features=["I1", ...], row_dtype="float32")

The serving signature ``serving_default`` takes raw features: a "scalar" feature as
int64[B]; a "list" feature (multi-hot or sequence) as int64[B, L] zero-padded plus
``<name>_length`` int64[B]; dense features as float32[B]. It returns the model's outputs
as they are, by name (a dict output keeps its keys; a list its ``output_names``; a single
tensor its output name): any number, any activation. Where the head is a single logit
(one output of width 1 whose last layer has no activation), it also returns ``logits``
and ``probability`` = sigmoid(logits), [B, 1]. The SavedModel contains core TF ops only;
its graph holds no key and no row (they are variables), so its size does not depend on
the tables'.
"""
from typing import Any, Dict, Mapping, Optional, Sequence

import tensorflow as tf
import tf_keras

from tf_fusedemb.inference.row_codec import check_row_dtype
from tf_fusedemb.inference.serving import ServingGroup
from tf_fusedemb.inference.export_writer import ExportWriter
from tf_fusedemb.layers.lookup_context import LookupContext
from tf_fusedemb.layers.model_embeddings import ModelEmbeddings

KINDS = ("scalar", "list")


def serving_context(model: tf_keras.Model, row_dtype: str = "float32",
                    with_rows: bool = True,
                    embeddings: Optional[ModelEmbeddings] = None) -> LookupContext:
    """A LookupContext in which every FusedEmbedding group of ``model`` is looked up by
    its one-host core-TF copy (``ServingGroup``, rows in ``row_dtype``); the model itself
    is not changed. ``with_rows`` (serving in this process) needs a single-process model
    holding all rows; without rows (an export, whose ranks write them) any model.
    ``embeddings``: the model's ``ModelEmbeddings`` (default: found in ``model``)."""
    embeddings = embeddings or ModelEmbeddings.of(model)
    if with_rows and any(layer.communicator.size != 1 for layer in embeddings.layers):
        raise ValueError("serving in this process needs every row in it: restore the "
                         "checkpoint on one rank, or export (export_saved_model) from every rank")
    return LookupContext(substitutes={
        name: ServingGroup(g.group, g.key_mode, g.store, row_dtype, with_rows)
        for name, g in embeddings.named})


def named_outputs(model: Any, outputs: Any) -> Dict[str, tf.Tensor]:
    """The model's ``outputs`` by name: a dict as it is, a list or tuple by the model's
    ``output_names`` (else ``output_<i>``), one tensor by its output name."""
    if isinstance(outputs, Mapping):
        return dict(outputs)
    flat = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    names = list(getattr(model, "output_names", None) or [])
    if len(names) != len(flat):
        names = [f"output_{i}" for i in range(len(flat))]
    return dict(zip(names, flat))


def _single_logit(model: Any, outputs: Mapping[str, tf.Tensor]) -> bool:
    """One output of width 1 (float[B] or float[B, 1]) whose producing layer, where the
    model says which it is, has a linear activation (or none)."""
    if len(outputs) != 1:
        return False
    out, = outputs.values()
    if out.shape.rank not in (1, 2) or (out.shape.rank == 2 and out.shape[-1] != 1):
        return False
    try:
        layer = model.outputs[0]._keras_history.layer  # functional models
    except (AttributeError, IndexError, TypeError, ValueError):
        return True  # subclassed: width 1 is taken as a logit (binary_logit= overrides)
    activation = getattr(layer, "activation", None)
    return activation is None or getattr(activation, "__name__", "") == "linear"


def export_saved_model(model: tf_keras.Model, export_dir: str, feature_kinds: Mapping[str, str],
                       dense_features: Sequence[str] = (),
                       binary_logit: Optional[bool] = None, row_dtype: str = "float32") -> str:
    """Writes a SavedModel with a raw-feature serving signature; returns ``export_dir``.

    Every rank of the model's job calls it (one process: just call it). Each rank writes
    its own rows, read from its tables a chunk at a time, and rank 0 the graph
    (``export_writer``): no process holds another rank's rows.

    Args:
      model: the trained Keras model; it is not changed: it trains and predicts
        afterwards as before.
      export_dir: output directory, shared by every rank (written atomically: to a
        temporary name, then renamed).
      feature_kinds: {feature: "scalar" | "list"} for every FusedEmbedding feature.
      dense_features: names of float32[B] inputs passed through unchanged.
      binary_logit: add ``logits``/``probability`` outputs (a single logit head); default
        None: where the model's head is one output of width 1 with a linear last layer.
      row_dtype: how the embedding rows are stored: "float32" (exact), "bfloat16" or
        "int8" (a float32 scale per row), decoded to float32 in the serving graph.
    """
    for name, kind in feature_kinds.items():
        if kind not in KINDS:
            raise ValueError(f"feature '{name}': kind {kind!r} is not one of {KINDS}")
    check_row_dtype(row_dtype)
    embeddings = ModelEmbeddings.of(model)
    context = serving_context(model, row_dtype, with_rows=False, embeddings=embeddings)
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
        with embeddings.use_context(context):
            outputs = named_outputs(model, model(features, training=False))
        if binary_logit if binary_logit is not None else _single_logit(model, outputs):
            logits, = outputs.values()
            outputs.update(logits=logits, probability=tf.sigmoid(logits))
        return outputs

    module = tf.Module()
    # The dense weights and the serving groups (their key and row variables, which the
    # ranks fill: ExportWriter); not the training tables, which serving does not read.
    tables = {id(v) for g in embeddings.lookups for v in g.variables}
    module.variables_ = [v for v in model.variables if id(v) not in tables]
    module.serving_groups_ = list(context.substitutes.values())
    module.serve = serve

    def save_graph(directory):
        tf.saved_model.save(module, directory,
                            signatures={"serving_default": serve})
    # embeddings.stores are in the order of serving_groups_
    return ExportWriter(export_dir, embeddings.communicator).write(embeddings.stores, row_dtype,
                                                                   save_graph)
