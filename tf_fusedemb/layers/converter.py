"""Switching a model with one ``tf.keras.layers.Embedding`` per feature to FusedEmbedding."""
import math
from typing import Any, Mapping, Optional, Tuple

import tf_keras

from tf_fusedemb.layers.fused_embedding import FusedEmbedding
from tf_fusedemb.specs import FeatureSpec, InitializerSpec, OptimizerSpec, TableSpec

_INITIALIZERS = {
    "RandomUniform": lambda c, fans: InitializerSpec.uniform(c.get("minval", -0.05),
                                                             c.get("maxval", 0.05)),
    "RandomNormal": lambda c, fans: InitializerSpec.normal(c.get("mean", 0.0),
                                                           c.get("stddev", 0.05)),
    "TruncatedNormal": lambda c, fans: InitializerSpec.truncated_normal(c.get("mean", 0.0),
                                                                        c.get("stddev", 0.05)),
    "Zeros": lambda c, fans: InitializerSpec.zeros(),
    "VarianceScaling": lambda c, fans: _variance_scaling(
        c.get("scale", 1.0), c.get("mode", "fan_in"), c.get("distribution", "truncated_normal"),
        fans),
}


def _scaled(scale: float, mode: str, distribution: str):
    """The converter of one of Keras's named variance-scaling initializers."""
    return lambda config, fans: _variance_scaling(scale, mode, distribution, fans)


_INITIALIZERS.update({"GlorotUniform": _scaled(1.0, "fan_avg", "uniform"),
                      "GlorotNormal": _scaled(1.0, "fan_avg", "truncated_normal"),
                      "HeUniform": _scaled(2.0, "fan_in", "uniform"),
                      "HeNormal": _scaled(2.0, "fan_in", "truncated_normal"),
                      "LecunUniform": _scaled(1.0, "fan_in", "uniform"),
                      "LecunNormal": _scaled(1.0, "fan_in", "truncated_normal")})
# A truncated normal's stddev shrinks by this factor (Keras's constant: the stddev of a
# standard normal truncated to [-2, 2]); Keras divides by it to keep the variance.
_TRUNCATION_STDDEV = 0.87962566103423978


def _variance_scaling(scale: float, mode: str, distribution: str, fans: Tuple[int, int]
                      ) -> InitializerSpec:
    """Keras's VarianceScaling of an Embedding matrix [V, dim] (fan_in V, fan_out dim) as
    the per-key initializer with the same distribution."""
    fan_in, fan_out = fans
    n = {"fan_in": fan_in, "fan_out": fan_out, "fan_avg": (fan_in + fan_out) / 2.0}[mode]
    variance = scale / max(1.0, n)
    if distribution == "uniform":
        limit = math.sqrt(3.0 * variance)
        return InitializerSpec.uniform(-limit, limit)
    if distribution == "truncated_normal":
        return InitializerSpec.truncated_normal(0.0, math.sqrt(variance) / _TRUNCATION_STDDEV)
    if distribution in ("untruncated_normal", "normal"):
        return InitializerSpec.normal(0.0, math.sqrt(variance))
    raise ValueError(f"VarianceScaling distribution {distribution!r} is not uniform, "
                     "truncated_normal or untruncated_normal")


def _initializer_spec(feature, initializer, fans):
    if isinstance(initializer, str):
        initializer = tf_keras.initializers.get(initializer)
    if isinstance(initializer, tf_keras.initializers.Initializer):
        initializer = {"class_name": type(initializer).__name__,
                       "config": initializer.get_config()}
    name = initializer.get("class_name")
    if name not in _INITIALIZERS:
        raise ValueError(f"feature '{feature}': embeddings_initializer {name!r} has no "
                         f"per-key tf_fusedemb equivalent; use one of {sorted(_INITIALIZERS)}")
    return _INITIALIZERS[name](initializer.get("config", {}), fans)


def embedding_table_spec(name: str, config: Mapping, optimizer: OptimizerSpec,
                         dynamic: bool) -> TableSpec:
    """The TableSpec of one Keras Embedding (from its ``get_config()``), named ``name``:
    ``output_dim``, initializer, and ``input_dim`` as a static vocabulary unless ``dynamic``."""
    if config.get("mask_zero"):
        raise ValueError(f"feature '{name}': mask_zero=True is not supported; pass a "
                         "RaggedTensor (or SparseTensor) of the real IDs instead")
    # Not silently dropped: the converted model would train differently.
    unsupported = [k for k in ("embeddings_regularizer", "activity_regularizer",
                               "embeddings_constraint") if config.get(k)]
    if unsupported or config.get("trainable") is False:
        raise ValueError(f"feature '{name}': Embedding with {unsupported or 'trainable=False'} "
                         "has no tf_fusedemb equivalent; remove it before converting")
    return TableSpec(name=name, dim=int(config["output_dim"]), optimizer=optimizer,
                     initializer=_initializer_spec(
                         name, config.get("embeddings_initializer", "uniform"),
                         (int(config["input_dim"]), int(config["output_dim"]))),
                     vocabulary_size=None if dynamic else int(config["input_dim"]))


def from_keras_embeddings(embeddings: Mapping[str, Any], optimizer: OptimizerSpec,
                          combiners: Optional[Mapping[str, Optional[str]]] = None,
                          max_lens: Optional[Mapping[str, int]] = None, dynamic: bool = False,
                          **layer_kwargs: Any) -> FusedEmbedding:
    """A FusedEmbedding equivalent to one Keras Embedding per feature.

    Args:
      embeddings: {feature: tf_keras.layers.Embedding, or its get_config() dict}.
      optimizer: the OptimizerSpec of the embedding tables.
      combiners: {feature: 'sum' | 'mean' | 'sqrtn' | None}; default 'sum' (for a one-hot
        [B] input 'sum' returns the row itself, like Embedding). None = sequence feature.
      max_lens: {feature: max_len} for sequence features.
      dynamic: False keeps each table's ``input_dim`` as a static vocabulary (IDs checked);
        True uses dynamic hash tables (any int64 ID).
      **layer_kwargs: passed to FusedEmbedding (plan, key_mode, name, ...).

    Example:
      >>> embs = {"user": tf_keras.layers.Embedding(1000, 16), "item": ...}
      >>> fused = from_keras_embeddings(embs, OptimizerSpec.adagrad(0.05))
      >>> outputs = fused({"user": user_ids, "item": item_ids})   # {"user": [B, 16], ...}
    """
    combiners = dict(combiners or {})
    max_lens = dict(max_lens or {})
    unknown = (set(combiners) | set(max_lens)) - set(embeddings)
    if unknown:
        raise ValueError(f"combiners/max_lens name features without an Embedding: {sorted(unknown)}")
    features = []
    for name, emb in embeddings.items():
        config = emb.get_config() if isinstance(emb, tf_keras.layers.Layer) else dict(emb)
        combiner = combiners.get(name, "sum")
        table = embedding_table_spec(name, config, optimizer, dynamic)
        features.append(FeatureSpec(name=name, table=table, combiner=combiner,
                                    max_len=max_lens.get(name) if combiner is None else None))
    return FusedEmbedding(features, **layer_kwargs)
