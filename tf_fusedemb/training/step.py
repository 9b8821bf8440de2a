"""The synchronous training and evaluation steps of a model with FusedEmbedding layers.

Correctness contract: with N ranks each holding a slice of the global batch, one step
computes exactly what ``tf_keras.Model.fit`` computes for the global batch in one process
(the loss of ``compile``, see :mod:`tf_fusedemb.training.loss`):

* each rank computes the additive pieces of its slice's loss (weighted sums, element
  counts, rows); one AllReduce sums them, so unequal or empty slices are exact too;
* each rank differentiates its own sums scaled by the global coefficients (plus 1/N of
  the regularisation losses, which every rank holds whole): the sum over ranks is the
  global gradient;
* dense gradients are summed over ranks (one grouped AllReduce: EmbRace's hybrid scheme);
* embedding-row gradients are summed over requesting ranks by the gradient AlltoAll and
  applied by each group's row optimizer to the touched rows on their owner.
"""
import dataclasses
from typing import Optional

import tensorflow as tf

from tf_fusedemb.comm import get_communicator
from tf_fusedemb.layers.recording import dense_gradient, record_lookups, row_gradient
from tf_fusedemb.training.loss import KerasLoss, LossTotals

LOSS_STATS = "fusedemb/loss_stats"
DENSE_GRADS = "fusedemb/dense_grads"


@dataclasses.dataclass
class StepResult:
    """What a step returns: ``loss`` float32 scalar (the global batch's loss, as Keras
    reports it per batch), ``weight`` (its weight in Keras's running ``loss`` Mean: the
    global batch's rows) and this rank's ``predictions``."""
    loss: tf.Tensor
    weight: tf.Tensor
    predictions: object


def as_keras_loss(loss, model=None) -> KerasLoss:
    """``loss`` as a :class:`KerasLoss` (a loss name, function, Loss object, or already one)."""
    if isinstance(loss, KerasLoss):
        return loss
    return KerasLoss(loss, output_names=getattr(model, "output_names", None))


def regularization(model) -> Optional[tf.Tensor]:
    """Sum of the model's regularisation losses (``model.losses``), or None."""
    losses = model.losses
    return tf.add_n([tf.cast(l, tf.float32) for l in losses]) if losses else None


def loss_totals(loss: KerasLoss, partial, reg, comm) -> LossTotals:
    """Sums ``partial`` over ranks (one AllReduce) and combines it (see KerasLoss)."""
    summed = comm.allreduce_sum(partial.stacked(), LOSS_STATS)
    return loss.combine(partial, summed, reg)


def train_step(model, x, y, loss, optimizer, sample_weight=None,
               communicator=None) -> StepResult:
    """One synchronous training step on this rank's slice ``(x, y, sample_weight)``.

    Args:
      model: a Keras model containing FusedEmbedding layers.
      x, y, sample_weight: this rank's slice of the global batch (labels [B] or [B, 1]
        against outputs [B, 1] alike, as in Keras).
      loss: a :class:`KerasLoss`, or anything ``compile(loss=...)`` accepts.
      optimizer: the Keras optimizer of the dense variables.
      communicator: default ``tf_fusedemb.comm.get_communicator()``.
    """
    comm = communicator or get_communicator()
    loss = as_keras_loss(loss, model)
    with tf.GradientTape() as tape, record_lookups(tape) as records:
        y_pred = model(x, training=True)
        partial = loss.partial(y, y_pred, sample_weight)
        reg = regularization(model)
    totals = loss_totals(loss, partial, reg, comm)
    targets = list(partial.sums) + ([reg] if reg is not None else [])
    scales = list(totals.coefficients) + (
        [totals.regularization / comm.size] if reg is not None else [])
    dense_vars = list(model.trainable_variables)
    grads = tape.gradient(targets, dense_vars + [r.rows for r in records],
                          output_gradients=scales)
    if dense_vars:
        dense_grads = comm.allreduce_sum_list(
            [dense_gradient(g, v) for g, v in zip(grads[:len(dense_vars)], dense_vars)],
            DENSE_GRADS)
        optimizer.apply_gradients(zip(dense_grads, dense_vars))
    for r, g in zip(records, grads[len(dense_vars):]):
        r.table.apply_gradients(r.keys, row_gradient(g, r.rows), r.init_keys)
    return StepResult(totals.value, totals.weight, y_pred)


def test_step(model, x, y, loss, sample_weight=None, communicator=None) -> StepResult:
    """The loss of this rank's slice in the global batch, without training (Keras's
    ``evaluate``); the same collectives on every rank."""
    comm = communicator or get_communicator()
    loss = as_keras_loss(loss, model)
    y_pred = model(x, training=False)
    partial = loss.partial(y, y_pred, sample_weight)
    totals = loss_totals(loss, partial, regularization(model), comm)
    return StepResult(totals.value, totals.weight, y_pred)
