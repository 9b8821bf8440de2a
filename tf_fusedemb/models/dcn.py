"""DCN-v2 (Wang et al., 2021, "DCN V2: Improved Deep & Cross Network and Practical Lessons
for Web-scale Learning to Rank Systems") on a FusedEmbedding.

    x0 = e_1 ++ .. ++ e_M ++ dense                      float32[B, d0], d0 = sum(dims) + n_dense
    cross layer:  x_{l+1} = x0 * (W_l x_l + b_l) + x_l  (W_l full d0 x d0, or U_l V_l^T, rank r)
    stacked:  x0 -> cross x L -> deep MLP -> Dense(1)
    parallel: (cross x L)(x0) ++ deep(x0) -> Dense(1)   -> logits float32[B, 1]
"""
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import tensorflow as tf
import tf_keras

from tf_fusedemb.comm import Communicator
from tf_fusedemb.models import blocks
from tf_fusedemb.models.fused_model import register_model_class
from tf_fusedemb.specs import FeatureSpec, FusionPlan

__all__ = ["CrossLayer", "DCNv2", "STRUCTURES"]

STRUCTURES = ("stacked", "parallel")


@tf_keras.saving.register_keras_serializable(package="tf_fusedemb")
class CrossLayer(tf_keras.layers.Layer):
    """One DCN-v2 cross layer: ``x_{l+1} = x0 * (W x_l + b) + x_l`` (elementwise ``*``).

    Args:
      low_rank: None for a full W [d, d]; an int r > 0 for W = U V^T (U, V [d, r]).
      seed: seeds the Glorot-uniform kernels; None = unseeded.

    Weights (row-vector convention, ``x_l W^T = x_l @ kernel``):
      full: ``kernel`` [d, d] = W^T, ``bias`` [d] = b.
      low rank: ``kernel_v`` [d, r] = V, ``kernel_u`` [r, d] = U^T, ``bias`` [d];
      so ``W x_l + b = (x_l @ kernel_v) @ kernel_u + bias``.

    Call:
      inputs: (x0, x_l), float32[B, d] each. Returns float32[B, d].
    """

    def __init__(self, low_rank: Optional[int] = None, seed: Optional[int] = 0, **kwargs: Any):
        super().__init__(**kwargs)
        if low_rank is not None and (not isinstance(low_rank, int) or isinstance(low_rank, bool)
                                     or low_rank <= 0):
            raise ValueError(f"CrossLayer '{self.name}': low_rank must be None or an int > 0, "
                             f"got {low_rank!r}")
        self.low_rank, self.seed = low_rank, seed

    def _init(self, offset):
        return tf_keras.initializers.GlorotUniform(
            seed=None if self.seed is None else self.seed + offset)

    def build(self, input_shape: Tuple[tf.TensorShape, tf.TensorShape]) -> None:
        if not isinstance(input_shape, (list, tuple)) or len(input_shape) != 2:
            raise ValueError(f"CrossLayer '{self.name}': expected inputs (x0, x_l), got "
                             f"{input_shape}")
        d0, dl = (tf.TensorShape(s)[-1] for s in input_shape)
        if d0 is None or d0 != dl:
            raise ValueError(f"CrossLayer '{self.name}': x0 and x_l must have the same known "
                             f"width, got {d0} and {dl}")
        if self.low_rank is None:
            self.kernel = self.add_weight("kernel", [d0, d0], initializer=self._init(0))
        else:
            self.kernel_v = self.add_weight("kernel_v", [d0, self.low_rank],
                                            initializer=self._init(0))
            self.kernel_u = self.add_weight("kernel_u", [self.low_rank, d0],
                                            initializer=self._init(1))
        self.bias = self.add_weight("bias", [d0], initializer="zeros")
        super().build(input_shape)

    def call(self, inputs: Tuple[tf.Tensor, tf.Tensor]) -> tf.Tensor:
        """``(x0, x_l)``, float32[B, d] each -> x_{l+1} float32[B, d]."""
        x0, xl = inputs
        if self.low_rank is None:
            proj = tf.matmul(xl, self.kernel)
        else:
            proj = tf.matmul(tf.matmul(xl, self.kernel_v), self.kernel_u)
        return x0 * (proj + self.bias) + xl

    def compute_output_shape(self, input_shape: Tuple[tf.TensorShape, tf.TensorShape]
                             ) -> tf.TensorShape:
        return tf.TensorShape(input_shape[1])

    def get_config(self) -> Dict[str, Any]:
        config = super().get_config()
        config.update(low_rank=self.low_rank, seed=self.seed)
        return config


@register_model_class
class DCNv2(blocks.RecModel):
    """DCN-v2 with its embedding tables in one FusedEmbedding (fused, Horovod-sharded).

    A FusedModel: ``compile`` + ``fit`` train the dense layers and the embedding rows.

    Args:
      categorical: pooled FeatureSpecs; dims may differ (x0 concatenates them).
      dense_features: names of dense inputs, float [B] (or [B, 1]) each; may be empty.
      num_cross_layers: L >= 0 cross layers.
      deep: widths of the deep MLP (ReLU); may be empty.
      low_rank: None (full W) or the rank r > 0 of W = U V^T in every cross layer.
      structure: "stacked" (cross then deep) or "parallel" (cross ++ deep).
      plan, key_mode, communicator: passed to the FusedEmbedding.
      seed: seeds the dense initialisers; None leaves them unseeded.

    Call:
      features: {categorical name: int64/int32 [B] | RaggedTensor [B, None],
                 dense name: float [B] or [B, 1]}; other keys are ignored.
      Returns logits float32[B, 1] (``BinaryCrossentropy(from_logits=True)``).

    Raises:
      ValueError: sequence features, names used twice, L < 0, bad widths or rank, an
        unknown structure, or neither a cross nor a deep part.
    """

    def __init__(self, categorical: Sequence[FeatureSpec], dense_features: Sequence[str] = (),
                 num_cross_layers: int = 3, deep: Sequence[int] = (128, 64),
                 low_rank: Optional[int] = None, structure: str = "stacked",
                 plan: Optional[FusionPlan] = None, key_mode: str = "hashed",
                 seed: Optional[int] = 0, communicator: Optional[Communicator] = None,
                 name: str = "dcn_v2", **kwargs: Any):
        super().__init__(name=name, **kwargs)
        owner = "DCNv2"
        self.categorical = blocks.check_feature_specs(owner, "categorical", categorical)
        self.categorical_names = tuple(f.name for f in self.categorical)
        self.dense_features = blocks.check_dense_names(owner, dense_features,
                                                       self.categorical_names)
        if (not isinstance(num_cross_layers, int) or isinstance(num_cross_layers, bool)
                or num_cross_layers < 0):
            raise ValueError(f"DCNv2: num_cross_layers must be an int >= 0, got "
                             f"{num_cross_layers!r}")
        self.deep_units = blocks.check_units(owner, "deep", deep)
        if low_rank is not None and (not isinstance(low_rank, int) or isinstance(low_rank, bool)
                                     or low_rank <= 0):
            raise ValueError(f"DCNv2: low_rank must be None (full-rank W) or an int > 0, got "
                             f"{low_rank!r}")
        blocks.check_choice(owner, "structure", structure, STRUCTURES)
        if num_cross_layers == 0 and not self.deep_units:
            raise ValueError("DCNv2: num_cross_layers=0 and deep=() leave neither a cross nor a "
                             "deep network")
        self.num_cross_layers, self.low_rank, self.structure = num_cross_layers, low_rank, structure
        self.plan_arg, self.key_mode, self.seed = plan, key_mode, seed
        self.input_width = sum(f.dim for f in self.categorical) + len(self.dense_features)

        self.embedding = blocks.make_embedding(self.categorical, plan, key_mode, communicator)
        self.cross_layers = [
            CrossLayer(low_rank, seed=None if seed is None else seed + 10 * i, name=f"cross_{i}")
            for i in range(num_cross_layers)]
        self.deep = blocks.MLP(self.deep_units, seed=None if seed is None else seed + 100,
                               name="deep")
        self.logit = blocks.logit_layer(seed, 200)

    def x0(self, features: Mapping[str, tf.Tensor]) -> tf.Tensor:
        """The cross network's input: embeddings ++ dense features, float32[B, d0]."""
        embs = self.embedding(blocks.select_features(features, self.categorical_names, "DCNv2"))
        parts = [embs[n] for n in self.categorical_names]
        if self.dense_features:
            parts.append(blocks.dense_matrix(features, self.dense_features, "DCNv2"))
        return tf.concat(parts, axis=1)

    def cross(self, x0: tf.Tensor) -> tf.Tensor:
        """The cross network: float32[B, d0] -> float32[B, d0] (identity for L = 0)."""
        x = x0
        for layer in self.cross_layers:
            x = layer([x0, x])
        return x

    def call(self, features: Mapping[str, tf.Tensor],
             training: Optional[bool] = None) -> tf.Tensor:
        x0 = self.x0(features)
        if self.structure == "stacked":
            h = self.deep(self.cross(x0))
        else:
            h = tf.concat([self.cross(x0), self.deep(x0)], axis=1)
        return self.logit(h)

    def get_config(self) -> Dict[str, Any]:
        return {"name": self.name,
                "categorical": [f.to_dict() for f in self.categorical],
                "dense_features": list(self.dense_features),
                "num_cross_layers": self.num_cross_layers, "deep": list(self.deep_units),
                "low_rank": self.low_rank, "structure": self.structure, "seed": self.seed,
                **blocks.embedding_config(self.plan_arg, self.key_mode)}

    @classmethod
    def from_config(cls, config: Dict[str, Any],
                    custom_objects: Optional[Dict[str, Any]] = None) -> "DCNv2":
        return cls(**blocks.specs_from_config(config, "categorical"))
