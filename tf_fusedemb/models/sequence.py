"""A DIN-style sequence model (Zhou et al., 2018, "Deep Interest Network for Click-Through
Rate Prediction") on a FusedEmbedding, with MovieLens-shaped feature specs.

    target t = emb(movie)                        float32[B, d]
    history h = emb(history)                     float32[B, L, d], zero-padded to L = max_len
    a_l = MLP([h_l, t, h_l - t, h_l * t])        (local activation unit) -> score s_l
    w = masked softmax(s) | sigmoid(s) * mask | s * mask   over the valid positions only
    interest = sum_l w_l h_l                     float32[B, d]
    logits = MLP(context ++ t ++ interest) -> Dense(1)    float32[B, 1]

The history and the target read ONE table ("movie"): two FeatureSpecs with the same
TableSpec share rows (FusedRec keys a row by (table, ID); the planner keeps a shared
table's features in one group), so a movie's embedding as a target and in a history is
the same row and both uses train it.
"""
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

import tensorflow as tf
import tf_keras

from tf_fusedemb.comm import Communicator
from tf_fusedemb.models import blocks
from tf_fusedemb.models.fused_model import register_model_class
from tf_fusedemb.specs import FeatureSpec, FusionPlan, InitializerSpec, OptimizerSpec, TableSpec

__all__ = ["ATTENTION_WEIGHTS", "LocalActivationUnit", "SequenceModel",
           "movielens_feature_specs", "sequence_lengths"]

ATTENTION_WEIGHTS = ("softmax", "sigmoid", "linear")


def movielens_feature_specs(dim: int = 16, history_len: int = 20,
                            optimizer: OptimizerSpec = OptimizerSpec.adagrad(0.05),
                            initializer: InitializerSpec = InitializerSpec(),
                            user_vocab: Optional[int] = None, movie_vocab: Optional[int] = None,
                            genre_vocab: Optional[int] = None) -> list:
    """FeatureSpecs of a MovieLens ranking model: user, movie, genres, history.

    Args:
      dim: embedding width of all tables.
      history_len: max_len of the "history" sequence (longer inputs are an error:
        truncate them in the input pipeline).
      optimizer, initializer: of every table (one spec, so one fused group).
      user_vocab, movie_vocab, genre_vocab: None for dynamic tables, or the static
        vocabulary sizes (IDs in [0, size)). All None or all ints (one fused group).

    Returns:
      ``[user, movie, genres, history]``:
        "user": int64[B] -> [B, dim], table "user";
        "movie": int64[B] -> [B, dim], table "movie" (the target item);
        "genres": RaggedTensor int64[B, None] -> mean-pooled [B, dim], table "genre";
        "history": RaggedTensor int64[B, None] (<= history_len IDs) -> [B, history_len,
        dim] zero-padded, table "movie" SHARED with "movie".
    """
    def table(name, vocab):
        return TableSpec(name, dim, optimizer, initializer, vocab)
    movie = table("movie", movie_vocab)
    return [FeatureSpec("user", table("user", user_vocab), "sum"),
            FeatureSpec("movie", movie, "sum"),
            FeatureSpec("genres", table("genre", genre_vocab), "mean"),
            FeatureSpec("history", movie, combiner=None, max_len=history_len)]


def sequence_lengths(value: Union[tf.Tensor, tf.RaggedTensor, tf.SparseTensor],
                     lengths: Optional[tf.Tensor] = None) -> tf.Tensor:
    """Valid length of each sample's sequence, int32[B].

    ``value``: the sequence feature's input. RaggedTensor [B, None] -> its row lengths;
    SparseTensor [B, L] -> the number of its entries per row (FusedEmbedding packs them
    to the front); dense [B, L] -> ``lengths`` if given, else L for every sample (a dense
    input has no padding of its own: pass lengths when it is padded).
    """
    if isinstance(value, tf.SparseTensor):
        value = tf.RaggedTensor.from_sparse(value)
    if isinstance(value, tf.RaggedTensor):
        return tf.cast(value.row_lengths(), tf.int32)
    value = tf.convert_to_tensor(value)
    if lengths is not None:
        return tf.reshape(tf.cast(lengths, tf.int32), [-1])
    return tf.fill(tf.shape(value)[:1], tf.shape(value)[1])


@tf_keras.saving.register_keras_serializable(package="tf_fusedemb")
class LocalActivationUnit(tf_keras.layers.Layer):
    """DIN's attention: weights the behaviours by their relevance to the target.

    Args:
      units: hidden widths of the attention MLP (over [h, t, h - t, h * t]), then Dense(1).
      activation: of the hidden layers (DIN uses sigmoid / PReLU / Dice).
      weighting: how scores s_l become weights w_l, always 0 at padded positions:
        "softmax": softmax over the valid positions (sum 1; all-zero for an empty history);
        "sigmoid": sigmoid(s_l), not normalised (DIN keeps the intensity of interest);
        "linear": s_l itself, not normalised (the DIN paper's unnormalised weights).
      seed: seeds the kernels; None = unseeded.

    Call:
      inputs: (history float32[B, L, d], target float32[B, d], mask bool[B, L]).
      Returns (interest float32[B, d] = sum_l w_l h_l, weights float32[B, L]). Padded
      positions never reach the output: their scores are replaced before normalisation
      and their weights are exactly 0, so extra padding leaves the result unchanged.
    """

    def __init__(self, units: Sequence[int] = (64, 32), activation: str = "sigmoid",
                 weighting: str = "softmax", seed: Optional[int] = 0, **kwargs: Any):
        super().__init__(**kwargs)
        self.units = blocks.check_units(f"LocalActivationUnit '{self.name}'", "units", units)
        blocks.check_choice(f"LocalActivationUnit '{self.name}'", "weighting", weighting,
                            ATTENTION_WEIGHTS)
        self.activation, self.weighting, self.seed = activation, weighting, seed
        self.mlp = blocks.MLP(self.units, activation=activation, seed=seed, name="mlp")
        self.score = blocks.logit_layer(seed, 50, name="score")

    def call(self, inputs: Tuple[tf.Tensor, tf.Tensor, tf.Tensor]) -> Tuple[tf.Tensor, tf.Tensor]:
        """``(history float32[B, L, d], target float32[B, d], mask bool[B, L])`` ->
        ``(interest float32[B, d], weights float32[B, L])``."""
        history, target, mask = inputs
        length = tf.shape(history)[1]
        t = tf.tile(target[:, None, :], [1, length, 1])                     # [B, L, d]
        a = tf.concat([history, t, history - t, history * t], axis=-1)      # [B, L, 4d]
        scores = tf.squeeze(self.score(self.mlp(a)), -1)                   # [B, L]
        mask = tf.cast(mask, tf.bool)
        maskf = tf.cast(mask, scores.dtype)
        if self.weighting == "softmax":
            scores = tf.where(mask, scores, tf.fill(tf.shape(scores), scores.dtype.min))
            weights = tf.nn.softmax(scores, axis=-1) * maskf  # empty row: uniform * 0 = 0
        elif self.weighting == "sigmoid":
            weights = tf.sigmoid(scores) * maskf
        else:
            weights = scores * maskf
        # Zero padded rows of h too, so a non-finite padded value cannot leak (0 * inf).
        history = tf.where(mask[:, :, None], history, tf.zeros_like(history))
        interest = tf.einsum("bl,bld->bd", weights, history)
        return interest, weights

    def get_config(self) -> Dict[str, Any]:
        config = super().get_config()
        config.update(units=list(self.units), activation=self.activation,
                      weighting=self.weighting, seed=self.seed)
        return config


@register_model_class
class SequenceModel(blocks.RecModel):
    """DIN-style ranking model: attention of the target item over a behaviour sequence.

    A FusedModel: ``compile`` + ``fit`` train the dense layers and the embedding rows.

    Args:
      features: all FeatureSpecs, e.g. :func:`movielens_feature_specs`: the target, the
        sequence, and context features (every other feature, pooled; any dims).
      target: the target item feature (pooled), default "movie".
      sequence: the behaviour sequence feature (combiner=None), default "history"; same
        dim as the target. Let it share the target's TableSpec so they share rows.
      attention_mlp: hidden widths of the local activation unit.
      attention_activation: their activation (default sigmoid, as DIN).
      attention_weights: "softmax" | "sigmoid" | "linear", see LocalActivationUnit.
      mlp: hidden widths (ReLU) of the output MLP, followed by Dense(1).
      length_key: optional name of an int [B] input with each history's valid length, for
        a DENSE padded [B, L] history (a RaggedTensor/SparseTensor history carries its
        lengths and ignores it). Without it a dense history has no padding.
      plan, key_mode, communicator: passed to the FusedEmbedding.
      seed: seeds the dense initialisers; None leaves them unseeded.

    Call:
      features: {"user": int64[B], "movie": int64[B], "genres": RaggedTensor int64[B, None],
        "history": RaggedTensor int64[B, None] (<= max_len IDs per sample; or a dense
        [B, L] with ``length_key``), [length_key: int[B]]}; other keys are ignored.
      The padding mask comes from the history's row lengths, so positions beyond them
      (zero rows from FusedEmbedding's padding to max_len, or padded IDs of a dense
      input) have weight 0 and do not change the output.
      Returns logits float32[B, 1] (``BinaryCrossentropy(from_logits=True)``).

    Raises:
      ValueError: target/sequence missing or of the wrong kind, dims differing, another
        sequence feature, invalid widths or attention_weights.
    """

    def __init__(self, features: Sequence[FeatureSpec], target: str = "movie",
                 sequence: str = "history", attention_mlp: Sequence[int] = (64, 32),
                 attention_activation: str = "sigmoid", attention_weights: str = "softmax",
                 mlp: Sequence[int] = (128, 64), length_key: Optional[str] = None,
                 plan: Optional[FusionPlan] = None, key_mode: str = "hashed",
                 seed: Optional[int] = 0, communicator: Optional[Communicator] = None,
                 name: str = "sequence_model",
                 **kwargs: Any):
        super().__init__(name=name, **kwargs)
        owner = "SequenceModel"
        self.feature_specs = blocks.check_feature_specs(owner, "features", features,
                                                        allow_sequence=True)
        by_name = {f.name: f for f in self.feature_specs}
        for field, value in (("target", target), ("sequence", sequence)):
            if value not in by_name:
                raise ValueError(f"SequenceModel: {field} feature {value!r} is not among the "
                                 f"features {sorted(by_name)}")
        if target == sequence:
            raise ValueError(f"SequenceModel: target and sequence are both {target!r}")
        if by_name[target].is_sequence:
            raise ValueError(f"SequenceModel: target feature {target!r} must be pooled (one "
                             f"item per sample), but it is a sequence feature")
        if not by_name[sequence].is_sequence:
            raise ValueError(f"SequenceModel: sequence feature {sequence!r} must be a sequence "
                             f"feature (combiner=None, max_len set), got combiner "
                             f"{by_name[sequence].combiner!r}")
        if by_name[target].dim != by_name[sequence].dim:
            raise ValueError(f"SequenceModel: target {target!r} (dim {by_name[target].dim}) and "
                             f"sequence {sequence!r} (dim {by_name[sequence].dim}) must have the "
                             f"same dim for the attention")
        others = [f.name for f in self.feature_specs if f.is_sequence and f.name != sequence]
        if others:
            raise ValueError(f"SequenceModel: only one sequence feature ({sequence!r}) is "
                             f"supported; {others} are sequence features too")
        if length_key is not None and (not isinstance(length_key, str) or length_key in by_name):
            raise ValueError(f"SequenceModel: length_key must be a name that is not a feature, "
                             f"got {length_key!r}")
        self.target, self.sequence, self.length_key = target, sequence, length_key
        self.feature_names = tuple(by_name)
        self.context_names = tuple(n for n in self.feature_names if n not in (target, sequence))
        self.attention_units = blocks.check_units(owner, "attention_mlp", attention_mlp,
                                                  allow_empty=False)
        blocks.check_choice(owner, "attention_weights", attention_weights, ATTENTION_WEIGHTS)
        self.attention_activation, self.attention_weights = attention_activation, attention_weights
        self.mlp_units = blocks.check_units(owner, "mlp", mlp)
        self.plan_arg, self.key_mode, self.seed = plan, key_mode, seed

        self.embedding = blocks.make_embedding(self.feature_specs, plan, key_mode, communicator)
        self.attention = LocalActivationUnit(self.attention_units, attention_activation,
                                             attention_weights, seed=seed, name="attention")
        self.mlp = blocks.MLP(self.mlp_units, seed=None if seed is None else seed + 100,
                              name="mlp")
        self.logit = blocks.logit_layer(seed, 200)

    def interest(self, features: Mapping[str, tf.Tensor]
                 ) -> Tuple[tf.Tensor, tf.Tensor, Dict[str, tf.Tensor]]:
        """(interest float32[B, d], attention weights float32[B, L], embeddings dict)."""
        embs = self.embedding(blocks.select_features(features, self.feature_names,
                                                     "SequenceModel"))
        history = embs[self.sequence]                                       # [B, L, d]
        lengths = None
        if self.length_key is not None and self.length_key in features:
            lengths = features[self.length_key]
        lengths = sequence_lengths(features[self.sequence], lengths)
        mask = tf.sequence_mask(lengths, maxlen=tf.shape(history)[1])       # bool[B, L]
        interest, weights = self.attention([history, embs[self.target], mask])
        return interest, weights, embs

    def call(self, features: Mapping[str, tf.Tensor],
             training: Optional[bool] = None) -> tf.Tensor:
        interest, _, embs = self.interest(features)
        h = tf.concat([embs[n] for n in self.context_names] + [embs[self.target], interest],
                      axis=1)
        return self.logit(self.mlp(h))

    def get_config(self) -> Dict[str, Any]:
        return {"name": self.name,
                "features": [f.to_dict() for f in self.feature_specs],
                "target": self.target, "sequence": self.sequence,
                "attention_mlp": list(self.attention_units),
                "attention_activation": self.attention_activation,
                "attention_weights": self.attention_weights, "mlp": list(self.mlp_units),
                "length_key": self.length_key, "seed": self.seed,
                **blocks.embedding_config(self.plan_arg, self.key_mode)}

    @classmethod
    def from_config(cls, config: Dict[str, Any],
                    custom_objects: Optional[Dict[str, Any]] = None) -> "SequenceModel":
        return cls(**blocks.specs_from_config(config, "features"))
