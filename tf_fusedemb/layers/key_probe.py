"""KeyProbe: which IDs each feature lookup of a model is given, found by one pass of the
model that looks nothing up.

A model whose embeddings are looked up one feature at a time (``ShardedEmbedding``s
sharing one ``FusedEmbedding``, in a subclassed model or in separate blocks) hands each
table its IDs in its own ``call``, one table after another. A fused group exchanges all
its tables' keys at once, so those keys must be known before the first lookup. The step
runs the model once in a scratch graph with a :class:`KeyProbe` in the layers'
``LookupContext``: every feature lookup gives the probe its IDs and gets zeros of its
output's shape back (:meth:`KeyProbe.stand_in`). An ID tensor computed from an earlier
stand-in (an embedding's IDs depending on another embedding's output) cannot be computed
ahead: the probe marks it so, and that feature keeps its own exchange.

The probe is the one object written during a pass, because the IDs live inside the
user's ``call`` and leave it only through the layers; it exists for the probe pass
alone, in a graph that never runs, and ``tf_fusedemb.layers.keys_ahead`` reads it once
the pass is traced.
"""
from typing import List, NamedTuple, Optional, Set, Tuple

import tensorflow as tf

from tf_fusedemb.layers.routed_lookup import same_ids


class FeatureKey(NamedTuple):
    """One feature of one FusedEmbedding layer of a model: the layer's name and the
    feature's (``FeatureSpec.name``)."""
    layer: str
    feature: str


class ProbedIds(NamedTuple):
    """What one feature lookup of the probe pass was given.

    Fields:
      key: the feature.
      ids: its IDs, a tensor of the probe's graph (int [B] or [B, L]).
      ahead: whether the IDs depend on the model's inputs only (no other embedding's
        output), so they can be computed before the forward pass.
    """
    key: FeatureKey
    ids: tf.Tensor
    ahead: bool


class ServedFeature(NamedTuple):
    """One feature's embeddings, computed by the step before the forward pass from the
    IDs found ahead; the feature's lookup in the forward pass returns ``embedding``
    once its IDs equal ``ids``.

    Fields:
      key: the feature.
      ids: int [B] or [B, L], the IDs the embeddings are of.
      embedding: float32[B, dim] (pooled) or float32[B, L, dim] (sequence).
    """
    key: FeatureKey
    ids: tf.Tensor
    embedding: tf.Tensor

    def checked(self, ids: tf.Tensor) -> tf.Tensor:
        """``embedding``, once ``ids`` (what the forward pass gives the lookup) are the
        IDs it was computed for; an InvalidArgumentError naming the feature otherwise."""
        same = same_ids(tf.cast(ids, tf.int64), tf.cast(self.ids, tf.int64))
        check = tf.debugging.Assert(same, [
            f"feature '{self.key.feature}' of '{self.key.layer}': the forward pass gave "
            "other IDs than the ones computed ahead of it from the same inputs (IDs that "
            "change between two calls of the model cannot be fused)"])
        with tf.control_dependencies([check]):
            return tf.identity(self.embedding)


class KeyProbe:
    """Collects the IDs of every feature lookup during one probe pass (see the module
    doc). Made by ``keys_ahead`` for one pass and read by it after."""

    def __init__(self) -> None:
        self._found: List[ProbedIds] = []
        self._stand_ins: Set[tf.Operation] = set()  # the zeros each lookup returned

    @property
    def found(self) -> Tuple[ProbedIds, ...]:
        """Every feature lookup of the pass, in call order."""
        return tuple(self._found)

    def stand_in(self, key: Optional[FeatureKey], ids: tf.Tensor, shape: tf.Tensor) -> tf.Tensor:
        """Records that feature ``key`` (None: a lookup not computed ahead, e.g. a
        FusedEmbedding called on a dict) was given ``ids``; returns zeros float32
        ``shape`` in place of its embeddings."""
        if key is not None:
            ahead = isinstance(ids, tf.Tensor) and not _depends_on(ids, self._stand_ins)
            self._found.append(ProbedIds(key, ids, ahead))
        zeros = tf.zeros(shape, tf.float32)
        self._stand_ins.add(zeros.op)
        return zeros


def _depends_on(tensor: tf.Tensor, ops: Set[tf.Operation]) -> bool:
    """Whether ``tensor`` is computed from (or after) any of ``ops`` in its graph."""
    stack, seen = [tensor.op], set()
    while stack:
        op = stack.pop()
        if op in ops:
            return True
        if op in seen:
            continue
        seen.add(op)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    return False
