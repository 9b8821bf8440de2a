"""DLRM (Naumov et al., 2019, "Deep Learning Recommendation Model for Personalization and
Recommendation Systems") on a FusedEmbedding.

    dense float32[B, n_dense] --bottom MLP--> x float32[B, d]
    categorical ids --FusedEmbedding--> e_1..e_M float32[B, d]
    z = x ++ [<v_i, v_j> for i > j], v = (x, e_1, .., e_M)   float32[B, d + F(F-1)/2], F = M + 1
    z --top MLP--> Dense(1) --> logits float32[B, 1]
"""
from typing import Any, Dict, Mapping, Optional, Sequence

import numpy as np
import tensorflow as tf
import tf_keras

from tf_fusedemb.comm import Communicator
from tf_fusedemb.models import blocks
from tf_fusedemb.models.fused_model import register_model_class
from tf_fusedemb.specs import FeatureSpec, FusionPlan

__all__ = ["DLRM", "DotInteraction"]


@tf_keras.saving.register_keras_serializable(package="tf_fusedemb")
class DotInteraction(tf_keras.layers.Layer):
    """DLRM's dot interaction: pairwise dot products of F vectors, concatenated with the first.

    Call:
      inputs: a list of F >= 1 tensors float32[B, d] (all the same d); DLRM passes the
        bottom-MLP output first, then the embeddings.
    Returns:
      float32[B, d + F(F-1)/2]: ``inputs[0]`` followed by the lower triangle without the
      diagonal of the Gram matrix X X^T (X = stack(inputs) [B, F, d]) in row-major order:
      <x_1,x_0>, <x_2,x_0>, <x_2,x_1>, <x_3,x_0>, ...  (i > j, i outer, j inner).
    """

    def build(self, input_shape: Sequence[tf.TensorShape]) -> None:
        if not isinstance(input_shape, (list, tuple)) or not input_shape:
            raise ValueError(f"DotInteraction '{self.name}': expected a list of [B, d] tensors, "
                             f"got {input_shape}")
        dims = {tf.TensorShape(s)[-1] for s in input_shape}
        if len(dims) != 1:
            raise ValueError(f"DotInteraction '{self.name}': all inputs must have the same last "
                             f"dimension, got {[tf.TensorShape(s).as_list() for s in input_shape]}")
        f = len(input_shape)
        rows, cols = np.tril_indices(f, k=-1)  # row-major lower triangle, i > j
        self._num_inputs = f
        self._pair_index = tf.constant(rows * f + cols, tf.int32)
        super().build(input_shape)

    def call(self, inputs: Sequence[tf.Tensor]) -> tf.Tensor:
        inputs = list(inputs)
        f = self._num_inputs
        x = tf.stack(inputs, axis=1)                       # [B, F, d]
        gram = tf.matmul(x, x, transpose_b=True)           # [B, F, F]
        pairs = tf.gather(tf.reshape(gram, [-1, f * f]), self._pair_index, axis=1)
        return tf.concat([inputs[0], pairs], axis=1)

    def compute_output_shape(self, input_shape: Sequence[tf.TensorShape]) -> tf.TensorShape:
        f, d = len(input_shape), tf.TensorShape(input_shape[0])[-1]
        return tf.TensorShape([tf.TensorShape(input_shape[0])[0], d + f * (f - 1) // 2])


@register_model_class
class DLRM(blocks.RecModel):
    """DLRM with its embedding tables in one FusedEmbedding (fused, Horovod-sharded).

    A FusedModel: ``compile`` + ``fit`` train the dense layers and the embedding rows.

    Args:
      categorical: pooled FeatureSpecs (one-hot or multi-hot), all with the same ``dim``
        (the dot interaction needs one width). See :func:`criteo_feature_specs`.
      dense_features: names of the dense inputs, at least one (e.g. ``CRITEO_DENSE``).
      bottom_mlp: widths of the bottom MLP (all ReLU); the last must equal ``dim``.
      top_mlp: hidden widths of the top MLP (ReLU), followed by a linear Dense(1).
      plan: optional FusionPlan over ``categorical`` (default ``plan_fusion``).
      key_mode: FusedEmbedding's "hashed" or "packed".
      seed: seeds the dense initialisers (the same weights run after run); None leaves
        them unseeded. Either way every rank trains rank 0's weights (the library
        broadcasts them before the first step).
      communicator: FusedEmbedding's communicator (not part of the config).

    Call:
      features: {categorical name: int64/int32 [B] | RaggedTensor [B, None],
                 dense name: float [B] or [B, 1]}; other keys are ignored.
      Returns logits float32[B, 1] (train with ``BinaryCrossentropy(from_logits=True)``).

    Raises:
      ValueError: no categorical or dense features, a sequence feature, features of
        different dims, ``bottom_mlp[-1] != dim``, invalid MLP widths, a name used twice.

    Example::

        model = DLRM(criteo_feature_specs(16), CRITEO_DENSE, bottom_mlp=(64, 16))
        model.compile(tf_keras.optimizers.Adam(1e-3),
                      tf_keras.losses.BinaryCrossentropy(from_logits=True))
        model.fit(dataset)  # elements ({"C1": int64[B], .., "I13": float32[B]}, label[B, 1])
    """

    def __init__(self, categorical: Sequence[FeatureSpec], dense_features: Sequence[str],
                 bottom_mlp: Sequence[int] = (64, 16), top_mlp: Sequence[int] = (64, 32),
                 plan: Optional[FusionPlan] = None, key_mode: str = "hashed",
                 seed: Optional[int] = 0, communicator: Optional[Communicator] = None,
                 name: str = "dlrm", **kwargs: Any):
        super().__init__(name=name, **kwargs)
        owner = "DLRM"
        self.categorical = blocks.check_feature_specs(owner, "categorical", categorical)
        self.categorical_names = tuple(f.name for f in self.categorical)
        self.dense_features = blocks.check_dense_names(owner, dense_features,
                                                       self.categorical_names, allow_empty=False)
        dims = {f.name: f.dim for f in self.categorical}
        if len(set(dims.values())) != 1:
            raise ValueError(f"DLRM: all categorical features must share one embedding dim for "
                             f"the dot interaction, got dims {dims}")
        self.dim = self.categorical[0].dim
        self.bottom_units = blocks.check_units(owner, "bottom_mlp", bottom_mlp, allow_empty=False)
        if self.bottom_units[-1] != self.dim:
            raise ValueError(f"DLRM: bottom_mlp[-1]={self.bottom_units[-1]} must equal the "
                             f"embedding dim {self.dim} of the categorical features (the bottom "
                             f"output takes part in the dot interaction)")
        self.top_units = blocks.check_units(owner, "top_mlp", top_mlp)
        self.plan_arg, self.key_mode, self.seed = plan, key_mode, seed

        self.embedding = blocks.make_embedding(self.categorical, plan, key_mode, communicator)
        self.bottom_mlp = blocks.MLP(self.bottom_units, seed=seed, name="bottom_mlp")
        self.interaction = DotInteraction(name="interaction")
        top_seed = None if seed is None else seed + 100
        self.top_mlp = blocks.MLP(self.top_units, seed=top_seed, name="top_mlp")
        self.logit = blocks.logit_layer(seed, 200)

    @property
    def interaction_width(self) -> int:
        """Width of the top MLP's input: d + F(F-1)/2 with F = 1 + len(categorical)."""
        f = 1 + len(self.categorical)
        return self.dim + f * (f - 1) // 2

    def call(self, features: Mapping[str, tf.Tensor],
             training: Optional[bool] = None) -> tf.Tensor:
        embs = self.embedding(blocks.select_features(features, self.categorical_names, "DLRM"))
        x = self.bottom_mlp(blocks.dense_matrix(features, self.dense_features, "DLRM"))
        z = self.interaction([x] + [embs[n] for n in self.categorical_names])
        return self.logit(self.top_mlp(z))

    def get_config(self) -> Dict[str, Any]:
        return {"name": self.name,
                "categorical": [f.to_dict() for f in self.categorical],
                "dense_features": list(self.dense_features),
                "bottom_mlp": list(self.bottom_units), "top_mlp": list(self.top_units),
                "seed": self.seed, **blocks.embedding_config(self.plan_arg, self.key_mode)}

    @classmethod
    def from_config(cls, config: Dict[str, Any],
                    custom_objects: Optional[Dict[str, Any]] = None) -> "DLRM":
        return cls(**blocks.specs_from_config(config, "categorical"))
