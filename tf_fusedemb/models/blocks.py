"""Small blocks shared by the models (MLP, input helpers, validation) and the Criteo specs.

Everything here is built from public tf_keras layers. The models' dense layers take a
``seed``: every rank of a Horovod job then starts from the same dense weights without a
broadcast, and a model rebuilt from its config starts from the same weights (the
embedding rows are seeded by their key already, see ``tf_fusedemb.storage``).
"""
from typing import Any, Dict, Mapping, Optional, Sequence

import tensorflow as tf
import tf_keras

from tf_fusedemb.comm import Communicator
from tf_fusedemb.data.criteo import CRITEO_CATEGORICAL, CRITEO_DENSE
from tf_fusedemb.layers.fused_embedding import FusedEmbedding
from tf_fusedemb.models.fused_model import FusedModel
from tf_fusedemb.specs import FeatureSpec, FusionPlan, InitializerSpec, OptimizerSpec, TableSpec

__all__ = ["CRITEO_CATEGORICAL", "CRITEO_DENSE", "MLP", "RecModel", "criteo_feature_specs",
           "dense_matrix", "select_features"]



def criteo_feature_specs(dim: int = 16, optimizer: OptimizerSpec = OptimizerSpec.adagrad(0.05),
                         initializer: InitializerSpec = InitializerSpec(),
                         names: Sequence[str] = CRITEO_CATEGORICAL,
                         vocabulary_size: Optional[int] = None) -> list:
    """One-hot FeatureSpecs of the Criteo categorical columns, one table per column.

    Args:
      dim: embedding width of every table (DLRM needs one shared width).
      optimizer: the sparse optimizer of every table (one spec: the planner fuses all
        26 features into one group, 3 AlltoAll rounds per step instead of 78).
      initializer: initial row distribution, default uniform(-0.05, 0.05).
      names: the feature (and table) names, default "C1".."C26".
      vocabulary_size: None (default) for dynamic hash tables (raw hashed Criteo IDs);
        an int for static tables with IDs in [0, vocabulary_size).

    Returns:
      ``[FeatureSpec(name, TableSpec(name, dim, ...), combiner="sum")]``: input int64[B]
      per feature, output float32[B, dim].
    """
    return [FeatureSpec(n, TableSpec(n, dim, optimizer, initializer, vocabulary_size), "sum")
            for n in names]


def _initializer(seed: Optional[int], offset: int):
    return tf_keras.initializers.GlorotUniform(seed=None if seed is None else seed + offset)


def check_units(owner: str, field: str, units: Any, allow_empty: bool = True) -> tuple:
    """``units`` as a tuple of ints > 0; ValueError naming ``owner`` and ``field`` otherwise."""
    try:
        units = tuple(units)
    except TypeError:
        raise ValueError(f"{owner}: {field} must be a sequence of ints > 0, "
                         f"got {units!r}") from None
    if not all(isinstance(u, int) and not isinstance(u, bool) and u > 0 for u in units):
        raise ValueError(f"{owner}: {field} must be a sequence of ints > 0, got {units!r}")
    if not units and not allow_empty:
        raise ValueError(f"{owner}: {field} must have at least one layer, got {units!r}")
    return units


def check_choice(owner: str, field: str, value: Any, choices: Sequence[Any]) -> None:
    if value not in choices:
        raise ValueError(f"{owner}: {field} must be one of {tuple(choices)}, got {value!r}")


def check_feature_specs(owner: str, field: str, specs: Any,
                        allow_sequence: bool = False) -> tuple:
    """A non-empty tuple of FeatureSpecs with unique names; pooled only unless allowed."""
    specs = tuple(specs)
    if not specs:
        raise ValueError(f"{owner}: {field} must have at least one FeatureSpec")
    seen = set()
    for f in specs:
        if not isinstance(f, FeatureSpec):
            raise ValueError(f"{owner}: {field} must hold FeatureSpecs, got {f!r}")
        if f.name in seen:
            raise ValueError(f"{owner}: feature {f.name!r} appears twice in {field}")
        seen.add(f.name)
        if f.is_sequence and not allow_sequence:
            raise ValueError(f"{owner}: feature {f.name!r} is a sequence feature (combiner=None); "
                             f"{field} must be pooled features (combiner sum/mean/sqrtn)")
    return specs


def check_dense_names(owner: str, names: Any, taken: Sequence[str],
                      allow_empty: bool = True) -> tuple:
    """Dense feature names: unique non-empty strs, none of them a categorical feature."""
    if isinstance(names, str):
        raise ValueError(f"{owner}: dense_features must be a sequence of names, got the str "
                         f"{names!r}")
    names = tuple(names)
    if not names and not allow_empty:
        raise ValueError(f"{owner}: dense_features must name at least one dense feature")
    for n in names:
        if not isinstance(n, str) or not n:
            raise ValueError(f"{owner}: dense feature names must be non-empty strs, got {n!r}")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{owner}: dense features {dup} appear twice in dense_features")
    clash = sorted(set(names) & set(taken))
    if clash:
        raise ValueError(f"{owner}: {clash} are both dense and categorical features")
    return names


def select_features(features: Mapping, names: Sequence[str], owner: str) -> dict:
    """``{n: features[n] for n in names}``; ValueError naming the missing features."""
    if not isinstance(features, Mapping):
        raise ValueError(f"{owner}: expected a dict of features, got {type(features).__name__}")
    missing = [n for n in names if n not in features]
    if missing:
        raise ValueError(f"{owner}: missing input features {missing}; got {sorted(features)}")
    return {n: features[n] for n in names}


def dense_matrix(features: Mapping, names: Sequence[str], owner: str = "model") -> tf.Tensor:
    """Dense features float[B] (or [B, 1]) each -> float32[B, len(names)], in ``names`` order."""
    columns = select_features(features, names, owner)
    out, batch = [], None
    for n in names:
        try:
            x = tf.convert_to_tensor(columns[n])
        except (TypeError, ValueError) as e:
            raise ValueError(f"{owner}: dense feature {n!r} is not a numeric tensor ({e})") from e
        if not (x.dtype.is_floating or x.dtype.is_integer or x.dtype == tf.bool):
            raise ValueError(f"{owner}: dense feature {n!r} must be numeric, got {x.dtype.name}")
        if x.shape.rank not in (None, 1, 2) or (x.shape.rank == 2 and x.shape[1] not in (None, 1)):
            raise ValueError(f"{owner}: dense feature {n!r} must be [B] or [B, 1], got shape "
                             f"{x.shape}")
        if x.shape.rank and x.shape[0] is not None:
            if batch is not None and x.shape[0] != batch[1]:
                raise ValueError(f"{owner}: dense feature {n!r} has batch size {x.shape[0]} but "
                                 f"dense feature {batch[0]!r} has {batch[1]}")
            batch = batch or (n, x.shape[0])
        out.append(tf.reshape(tf.cast(x, tf.float32), [-1, 1]))
    return tf.concat(out, axis=1)


def make_embedding(specs: Sequence[FeatureSpec], plan: Optional[FusionPlan], key_mode: str,
                   communicator: Optional[Communicator]) -> FusedEmbedding:
    """The model's one FusedEmbedding layer (named "fused_embedding")."""
    return FusedEmbedding(specs, plan=plan, key_mode=key_mode, communicator=communicator,
                          name="fused_embedding")


def embedding_config(plan: Optional[FusionPlan], key_mode: str) -> dict:
    """The JSON-able config entries of a model's FusedEmbedding."""
    return {"plan": None if plan is None else plan.to_dict(), "key_mode": key_mode}


def specs_from_config(config: dict, *fields: str) -> dict:
    """Turns the FeatureSpec / FusionPlan dicts of a model config back into objects."""
    config = dict(config)
    for field in fields:
        value = config.get(field)
        if isinstance(value, (list, tuple)):
            config[field] = [FeatureSpec.from_dict(f) if isinstance(f, Mapping) else f
                             for f in value]
    if isinstance(config.get("plan"), Mapping):
        config["plan"] = FusionPlan.from_dict(config["plan"])
    return config


@tf_keras.saving.register_keras_serializable(package="tf_fusedemb")
class MLP(tf_keras.layers.Layer):
    """A stack of Dense layers: float32[..., d_in] -> float32[..., units[-1]].

    Args:
      units: output widths of the Dense layers, in order; empty = the identity.
      activation: activation of every layer (Keras name), default "relu".
      activate_last: False leaves the last layer linear.
      seed: seeds the Glorot-uniform kernels (layer i gets seed + i); None = unseeded.
    """

    def __init__(self, units: Sequence[int], activation: str = "relu", activate_last: bool = True,
                 seed: Optional[int] = 0, **kwargs: Any):
        super().__init__(**kwargs)
        self.units = check_units(f"MLP '{self.name}'", "units", units)
        self.activation = activation
        self.activate_last = activate_last
        self.seed = seed
        last = len(self.units) - 1
        self.dense_layers = [
            tf_keras.layers.Dense(u, activation=activation if (i < last or activate_last) else None,
                                  kernel_initializer=_initializer(seed, i),
                                  bias_initializer="zeros", name=f"dense_{i}")
            for i, u in enumerate(self.units)]

    def call(self, inputs: tf.Tensor) -> tf.Tensor:
        x = inputs
        for layer in self.dense_layers:
            x = layer(x)
        return x

    def compute_output_shape(self, input_shape: tf.TensorShape) -> tf.TensorShape:
        shape = tf.TensorShape(input_shape)
        return shape if not self.units else shape[:-1].concatenate([self.units[-1]])

    def get_config(self) -> Dict[str, Any]:
        config = super().get_config()
        config.update(units=list(self.units), activation=self.activation,
                      activate_last=self.activate_last, seed=self.seed)
        return config


def logit_layer(seed: Optional[int], offset: int, name: str = "logit") -> tf_keras.layers.Dense:
    """The final Dense(1) of a model: float[B, d] -> logits float32[B, 1]. Always float32,
    whatever the dtype policy of the layers before it (Keras's mixed-precision guide: the
    loss and the sigmoid want a float32 logit)."""
    return tf_keras.layers.Dense(1, kernel_initializer=_initializer(seed, offset),
                                 bias_initializer="zeros", name=name, dtype="float32")


class RecModel(FusedModel):
    """FusedModel base of the built-in models: steps traced without AutoGraph, and no
    build config.

    ``tf_keras`` is not on AutoGraph's do-not-convert list (``keras`` is), so when
    ``fit`` traces FusedModel.train_step, AutoGraph rewrites the whole tf_keras layer
    ``__call__``, the Keras optimizer and the lookup/table code below it: 30-150 s for
    the first model of a process (measured: DLRM on Criteo shapes, 2 CPU cores), against
    ~8 s without. The steps and the models' ``call`` have no data-dependent Python control
    flow (every ``if`` is on Python values), so plain tracing builds the same graph.

    The models are built by their first call on real features (int IDs, ragged
    multi-hot): Keras' ``build(input_shape)`` would make float placeholders, so
    ``get_build_config`` returns None and a deserialized model is built lazily.
    """

    @tf.autograph.experimental.do_not_convert
    def train_step(self, data: Any) -> Dict[str, tf.Tensor]:
        return super().train_step(data)

    @tf.autograph.experimental.do_not_convert
    def test_step(self, data: Any) -> Dict[str, tf.Tensor]:
        return super().test_step(data)

    @tf.autograph.experimental.do_not_convert
    def predict_step(self, data: Any) -> Any:
        return super().predict_step(data)

    def get_build_config(self) -> None:
        return None
