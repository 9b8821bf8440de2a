"""One model on every rank: the dense state replicated from rank 0 by the library.

Embedding rows need nothing (they start from a deterministic function of table and ID),
but a model's dense variables start from each rank's own random draw when the user did
not seed their initializers, and the summed gradients would then be applied to
different weights for ever. So before a model's first step (training, evaluation or
prediction) every rank takes rank 0's dense variables and the dense optimizer's
variables that exist then: one broadcast per dtype of all of them packed together
(not one collective per variable).

The guard: at the first training step, and every ``check_every`` steps when set, a
fingerprint of every dense variable (a hash of its bytes) is gathered from every rank;
a difference fails the step on every rank with an error naming the first differing
variable and the ranks that differ (e.g. weights changed on one rank only), instead of
training several models silently.

Non-trainable state that a training forward pass updates from the rank's own batch
(BatchNormalization's moving statistics) is averaged over the ranks after every step
(:meth:`DenseReplicas.average_forward_state`), so it stays one model too.

Both run when the first step is traced (or run, eagerly), on every rank: every rank
traces its first step, so every rank runs the same collectives. They run eagerly even
then (``tf.init_scope``), so the traced step holds neither: its graph stays the step's
own. Only a periodic guard (``check_every``) is part of the traced step, in a ``tf.cond``
on a step counter that is equal on every rank. A checkpoint restore re-arms the
broadcast for the next trace (:meth:`DenseReplicas.resync`): the restored values are read
on every rank from the same files, and the broadcast makes them rank 0's bit for bit
anyway.

Usage: nothing; ``train_step``, ``test_step`` and ``FusedModel`` call
``replicas_of(model).synchronize(...)``. One :class:`DenseReplicas` exists per model.
"""
import weakref
from typing import Any, List, Optional

import numpy as np
import tensorflow as tf
import tf_keras

from tf_fusedemb.comm import Communicator
from tf_fusedemb.layers.model_embeddings import ModelEmbeddings, fused_embedding_layers

__all__ = ["DenseReplicas", "ReplicaMismatchError", "broadcast_from_root", "build_by_tracing",
           "dense_variables", "replicas_of"]

BROADCAST_NAME = "fusedemb/dense_state"
FINGERPRINT_NAME = "fusedemb/dense_fingerprints"
FORWARD_STATE_NAME = "fusedemb/forward_state"
ROOT_RANK = 0
# The guard's error, eager and traced alike: the first differing variable, the ranks.
MISMATCH = ("tf_fusedemb: the ranks hold different dense variables: {} differs on rank(s) {} "
            "from rank 0. Something changed weights on some ranks only (set_weights, "
            "load_weights or an assign on one rank); make such a change on every rank, or "
            "call tf_fusedemb.training.replicas_of(model).resync() after it.")


class ReplicaMismatchError(ValueError):
    """Raised (eagerly) by :meth:`DenseReplicas.verify` when ranks hold different dense
    variables."""


def dense_variables(model: tf_keras.Model) -> List[tf.Variable]:
    """The model's variables that are not state of its FusedEmbedding layers (those are
    per rank: shards, counters, statistics), in the model's order."""
    # By identity: a Keras 3 variable has no ``ref()``, and both Kerases hand out the
    # same variable objects through the model and through its layers.
    own = {id(v) for layer in fused_embedding_layers(model) for v in layer.variables}
    return [v for v in model.variables if id(v) not in own]


def _optimizer_variables(optimizer) -> List[tf.Variable]:
    if optimizer is None:
        return []
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


def broadcast_from_root(comm: Communicator, variables: List[Any],
                        name: str = BROADCAST_NAME) -> List[Any]:
    """Writes rank 0's values into ``variables`` on every rank: one broadcast per dtype of
    all of them packed together. Returns the writes (eager: done)."""
    writes = []
    for dtype in sorted({tf.as_dtype(v.dtype) for v in variables}, key=lambda d: d.name):
        same = [v for v in variables if tf.as_dtype(v.dtype) == dtype]
        packed = tf.concat([tf.reshape(tf.convert_to_tensor(v), [-1]) for v in same], 0)
        received = comm.broadcast(packed, ROOT_RANK, f"{name}/{dtype.name}")
        parts = tf.split(received, [int(np.prod(v.shape)) for v in same])
        writes += [v.assign(tf.reshape(p, v.shape)) for v, p in zip(same, parts)]
    return writes


def fingerprints(variables: List[tf.Variable]) -> tf.Tensor:
    """int64[V]: a hash of each variable's dtype, shape and bytes."""
    if not variables:
        return tf.zeros([0], tf.int64)
    return tf.stack([tf.strings.to_hash_bucket_fast(tf.io.serialize_tensor(v), 2 ** 62)
                     for v in variables])


class DenseReplicas:
    """The dense state of one model across ranks: the one-time broadcast from rank 0 and
    the fingerprint guard (see module doc). Not a Keras-tracked object: its counters are
    no part of the model's weights or checkpoints.

    Args:
      model: a Keras model (its FusedEmbedding layers' state is left alone).
      check_every: also compare fingerprints every this many training steps (None: at
        the first step only).
    """

    def __init__(self, model: tf_keras.Model, check_every: Optional[int] = None):
        if check_every is not None and (not isinstance(check_every, int) or check_every < 1):
            raise ValueError(f"check_every must be an int >= 1 or None, got {check_every!r}")
        self._model = weakref.ref(model)
        self.check_every = check_every
        self._synced = False  # rank 0's dense state broadcast since the last resync
        self._checked = False  # the first training step's guard has run
        self._optimizer: Optional[Any] = None  # the last step's, for resync's broadcast
        with tf.init_scope():
            self._steps = tf.Variable(0, dtype=tf.int64, trainable=False,
                                      name="fusedemb_dense_steps")

    def _live_model(self) -> tf_keras.Model:
        """The model, held weakly (``_REPLICAS`` maps it to this object, so it outlives it)."""
        model = self._model()
        if model is None:
            raise RuntimeError("DenseReplicas: its model was garbage collected")
        return model

    def resync(self, now: bool = True) -> None:
        """Broadcasts rank 0's dense state again (after weights were set on some ranks
        only): now, a collective every rank calls (eager, over the model's communicator),
        or with ``now=False`` when the next step is traced. A restore takes the latter:
        every rank read the same values, so it needs no collective (sharded inference
        restores with no collective at all); a step traced before keeps them as read."""
        self._synced = False
        model = self._live_model()
        if now and model.built:
            comm = ModelEmbeddings.of(model).communicator
            if comm.size > 1:
                self._broadcast_now(comm)

    def synchronize(self, comm: Communicator,
                    optimizer: Optional[tf_keras.optimizers.Optimizer] = None, x: Any = None,
                    training: bool = False) -> tf.Tensor:
        """Broadcasts rank 0's dense state if not done yet and, in training, runs the
        guard when due; returns a bool scalar (True) to depend on. Called while a step is
        traced, the broadcast and the first step's guard run then, eagerly: the traced
        step holds only the periodic guard (``check_every``).

        Args:
          comm: the step's Communicator (nothing happens in one process).
          optimizer: the dense Keras optimizer; its existing variables are broadcast too.
          x: the step's features, to build a model whose variables do not exist yet
            (a subclassed model before its first call), by tracing it without running.
          training: count a training step (the guard runs at the first and every
            ``check_every``-th).
        """
        if comm.size == 1:
            return tf.constant(True)
        model = self._live_model()
        if x is not None and not model.built:
            build_by_tracing(model, x)
        self._optimizer = optimizer or self._optimizer
        with tf.init_scope():  # eager, also while the step is traced
            if not self._synced:
                self._broadcast_now(comm)
                self._checked = self._checked or training  # equal now: nothing to check
            elif training and not self._checked:
                self.verify(comm)  # synced by an evaluation, changed since on some rank?
                self._checked = True
        if not training or self.check_every is None:
            return tf.constant(True)
        step = self._steps.assign_add(1)
        return tf.cond(tf.equal(step % self.check_every, 0),
                       lambda: self._check(comm, dense_variables(model)),
                       lambda: tf.constant(True))

    def average_forward_state(self, comm: Communicator) -> List[tf.Tensor]:
        """Averages over ranks the non-trainable float variables a training forward pass
        updates from its own batch (BatchNormalization's moving statistics), so every
        rank keeps one model; returns the writes. One grouped AllReduce, none when the
        model has no such variables. For equal slices the moving mean is the global
        batch's; the moving variance is the mean of the ranks' (a synchronised batch
        norm gives the global batch's)."""
        state = [v for v in dense_variables(self._live_model())
                 if not v.trainable and v.dtype.is_floating]
        if comm.size == 1 or not state:
            return []
        sums = comm.allreduce_sum_list([tf.identity(v) for v in state], FORWARD_STATE_NAME)
        return [v.assign(s / comm.size) for v, s in zip(state, sums)]

    def verify(self, comm: Communicator) -> None:
        """Compares the dense variables across ranks now (eager, a collective: every rank
        calls it); raises :class:`ReplicaMismatchError` naming the first differing
        variable and the ranks."""
        if comm.size == 1:
            return
        variables = dense_variables(self._live_model())
        gathered = comm.allgather(fingerprints(variables)[None, :], FINGERPRINT_NAME).numpy()
        for j, v in enumerate(variables):
            ranks = [r for r in range(comm.size) if gathered[r, j] != gathered[ROOT_RANK, j]]
            if ranks:
                raise ReplicaMismatchError(MISMATCH.format(v.name, ", ".join(map(str, ranks))))

    def _broadcast_now(self, comm: Communicator) -> None:
        """Rank 0's dense state, and the optimizer's variables that exist, on every rank
        (eager)."""
        model = self._live_model()
        for layer in fused_embedding_layers(model):  # ranks whose specs differ fail clearly
            layer.agree_across_ranks()  # first, not inside a broadcast of unequal shapes
        broadcast_from_root(comm, dense_variables(model) + _optimizer_variables(self._optimizer))
        self._synced = True

    # ---------------------------------------------------------------- traced part
    def _check(self, comm, variables) -> tf.Tensor:
        gathered = comm.allgather(fingerprints(variables)[None, :], FINGERPRINT_NAME)
        differs = tf.not_equal(gathered, gathered[ROOT_RANK:ROOT_RANK + 1])  # bool[N, V]
        first = tf.argmax(tf.cast(tf.reduce_any(differs, 0), tf.int32), output_type=tf.int32)
        names = tf.constant([v.name for v in variables] or [""])
        ranks = tf.strings.reduce_join(tf.strings.as_string(
            tf.where(differs[:, first])[:, 0]), separator=", ")
        before, between, after = MISMATCH.split("{}")  # tf.strings.format quotes strings
        message = tf.strings.join([before, tf.gather(names, first), between, ranks, after])
        check = tf.debugging.Assert(tf.logical_not(tf.reduce_any(differs)), [message])
        with tf.control_dependencies([check]):
            return tf.constant(True)


_REPLICAS: "weakref.WeakKeyDictionary[tf_keras.Model, DenseReplicas]" = weakref.WeakKeyDictionary()


def replicas_of(model: tf_keras.Model, check_every: Optional[int] = None) -> DenseReplicas:
    """The one :class:`DenseReplicas` of ``model`` (made on first use; ``check_every``
    applies when given). It holds a variable: made inside a ``tf.function``'s first
    trace (a custom loop's first ``train_step``), it makes TensorFlow trace once more;
    call this before tracing to avoid it (``FusedModel.compile``, ``NestedPipeline`` and
    ``train.py`` do)."""
    replicas = _REPLICAS.get(model)
    if replicas is None:
        replicas = _REPLICAS[model] = DenseReplicas(model, check_every)
    elif check_every is not None:
        replicas.check_every = check_every
    return replicas


def build_by_tracing(model: Any, x: Any) -> None:
    """Creates a model's variables by tracing one inference call on ``x``'s structure;
    nothing runs (no collective, no statistics)."""
    specs = tf.nest.map_structure(tf.type_spec_from_value, x)
    tf.function(lambda inputs: model(inputs, training=False),
                autograph=False).get_concrete_function(specs)

