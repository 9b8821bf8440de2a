"""How looked-up rows get their optimizer step on every Keras path: as the side effect of
their gradient.

Keras (``Model.fit`` of tf_keras or Keras 3, a ``tf.GradientTape`` loop, a ``call``
decorated with ``tf.function``) differentiates the loss with respect to the model's
trainable variables and hands the gradients to the user's optimizer. Our rows are not
variables: they live in the group's table on their owner rank, and their gradient
reaches the owner through the gradient AlltoAll. So every ``FusedEmbedding`` holds one
trainable scalar, its *row-update marker* (always 0), and the owner-side rows of a lookup
pass through :func:`through_row_update`, an identity whose forward reads the marker. The
tape therefore differentiates through the lookup whenever it differentiates the layer's
variables, and the identity's gradient function applies the rows' summed gradient with
the group's own row optimizer (``apply_gradients`` on the owner, exactly the update a
``FusedModel`` step makes) and returns the marker's gradient.

Consequences a user sees (the guides say them too):

* the rows train where the layer's variables train: ``layer.trainable = False`` freezes
  them with everything else;
* one gradient computation is one row update: computing the gradient twice in one step
  applies the rows twice (as with any optimizer called twice);
* on several ranks each rank differentiates its own batch's loss, the gradient AlltoAll
  sums the requesters' row gradients on the owner, and ``scale`` makes it the mean that
  Horovod-style dense averaging gives (``1 / ranks``); the dense gradients must be
  averaged by ``tf_fusedemb.training.DistributedOptimizer``, which is checked: there the
  marker's gradient is 1, the wrapper applies 0 instead, and a bare optimizer moves the
  marker off 0. The marker's Keras constraint (:class:`MarkerAtZero`, which both Kerases'
  optimizers apply right after their update) then fails the first step on every rank
  (the marker moves alike everywhere) with the fix named; a loop that assigns the
  variables itself, without an optimizer, is stopped by the next forward pass's check.
"""
import dataclasses
from typing import Any, Union

import tensorflow as tf

MARKER_NAME = "row_update_marker"
# The forward pass's refusal when the marker moved (an optimizer applied its gradient).
UNWRAPPED_OPTIMIZER = (
    "tf_fusedemb: FusedEmbedding on {ranks} ranks in a plain Keras model or custom loop needs "
    "the dense gradients averaged over the ranks: wrap the optimizer, "
    "optimizer = tf_fusedemb.training.DistributedOptimizer(optimizer), or use "
    "tf_fusedemb.models.FusedModel")


@dataclasses.dataclass(frozen=True)
class RowUpdate:
    """How one forward pass's rows are updated from their gradient.

    scale: the summed row gradient (over requesting ranks) is multiplied by it before the
      row optimizer applies it: 1 where the loss is already the global batch's
      (``FusedModel``'s step), ``1 / ranks`` where every rank differentiates its own
      batch's mean loss and dense gradients are averaged (plain Keras, custom loops).
    marker_gradient: the gradient returned for the layer's marker: 0 in one process and
      under FusedModel, 1 where the wrapped optimizer must intercept it (see module doc).
    """
    scale: float = 1.0
    marker_gradient: float = 0.0

    @staticmethod
    def for_ranks(ranks: int) -> "RowUpdate":
        """The plain-Keras update on ``ranks`` ranks (each rank's own mean loss)."""
        return RowUpdate(scale=1.0 / ranks, marker_gradient=0.0 if ranks == 1 else 1.0)


def row_gradient(grad: Union[None, tf.Tensor, tf.IndexedSlices], rows: tf.Tensor) -> tf.Tensor:
    """The gradient of owner rows float32[u_l, dim] as a dense float32[u_l, dim]:
    IndexedSlices (from the gather by I_l) are accumulated per row; None gives zeros."""
    if grad is None:
        return tf.zeros_like(rows)
    if isinstance(grad, tf.IndexedSlices):  # accumulation by I_l on the owner
        return tf.math.unsorted_segment_sum(grad.values, grad.indices, tf.shape(rows)[0])
    return tf.convert_to_tensor(grad)


def through_row_update(marker: tf.Tensor, rows: tf.Tensor, lookup: Any, keys: tf.Tensor,
                       init_keys: tf.Tensor, update: RowUpdate) -> tf.Tensor:
    """``rows`` float32[u_l, dim] unchanged, differentiable through ``marker`` (the layer's
    marker value, float32 scalar): the gradient of the result is applied to the owner
    rows of ``keys`` int64[u_l] (new rows from ``init_keys`` int64[u_l]) by
    ``lookup.apply_gradients``, scaled by ``update.scale``; the marker's gradient is
    ``update.marker_gradient``.

    The marker's gradient is computed from the written rows (a term that is always 0), not
    only ordered after the write: Keras 3's ``fit`` was seen to drop a write that only a
    control dependency reached."""

    @tf.custom_gradient
    def identity(marker_value, owner_rows):
        def grad(d_rows):
            summed = row_gradient(d_rows, owner_rows)
            if update.scale != 1.0:
                summed = summed * tf.constant(update.scale, summed.dtype)
            applied, written = lookup.apply_gradients(keys, summed, init_keys,
                                                      return_rows=True)
            with tf.control_dependencies([applied] if applied is not None else []):
                zero = tf.cast(tf.size(written) < 0, marker_value.dtype)  # never negative
            d_marker = tf.fill(tf.shape(marker_value),
                               tf.constant(update.marker_gradient, marker_value.dtype)) + zero
            return d_marker, None  # the table's read is not differentiated further
        return tf.identity(owner_rows), grad

    return identity(marker, rows)


class MarkerAtZero:
    """The row-update marker's Keras constraint on several ranks: Keras optimizers call
    it with the marker right after applying its gradient (tf_keras and Keras 3 alike),
    so a bare optimizer fails inside the first step's ``apply_gradients``.

    ranks: the layer's world size, named in the error."""

    def __init__(self, ranks: int):
        self.ranks = ranks

    def __call__(self, marker: Any) -> tf.Tensor:
        value = tf.convert_to_tensor(marker)
        with tf.control_dependencies([check_marker(value, self.ranks)]):
            return tf.identity(value)

    def get_config(self) -> dict:
        return {"ranks": self.ranks}


def check_marker(marker: tf.Tensor, ranks: int) -> tf.Operation:
    """Fails (on every rank alike: the marker moves the same way everywhere) when an
    optimizer applied the marker's gradient, i.e. the dense gradients were not averaged
    by the wrapped optimizer (see module doc). ``marker``: the float scalar. One Assert
    on one comparison, as ``tf.debugging.assert_equal`` adds some twenty ops to the step."""
    return tf.debugging.Assert(tf.equal(marker, tf.zeros([], marker.dtype)),
                               [UNWRAPPED_OPTIMIZER.format(ranks=ranks)])
