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
  averaged by ``tf_fusedemb.training.DistributedOptimizer`` (not yet checked: a bare
  optimizer there trains each rank's dense copy on its own gradients).
"""
import dataclasses
from typing import Any, NamedTuple, Union

import tensorflow as tf

MARKER_NAME = "row_update_marker"


@dataclasses.dataclass(frozen=True)
class RowUpdate:
    """How one forward pass's rows are updated from their gradient.

    scale: the summed row gradient (over requesting ranks) is multiplied by it before the
      row optimizer applies it: 1 where the loss is already the global batch's
      (``FusedModel``'s step), ``1 / ranks`` where every rank differentiates its own
      batch's mean loss and dense gradients are averaged (plain Keras, custom loops).
    marker_gradient: the gradient returned for the layer's marker (0: it stays 0).
    """
    scale: float = 1.0
    marker_gradient: float = 0.0

    @staticmethod
    def for_ranks(ranks: int) -> "RowUpdate":
        """The plain-Keras update on ``ranks`` ranks (each rank's own mean loss)."""
        return RowUpdate(scale=1.0 / ranks)


class Marker(NamedTuple):
    """A layer's row-update marker in one forward pass: its ``variable`` (float32 scalar,
    trainable, 0) and the ``value`` read from it (float32 scalar tensor)."""
    variable: Any
    value: tf.Tensor


def row_gradient(grad: Union[None, tf.Tensor, tf.IndexedSlices], rows: tf.Tensor) -> tf.Tensor:
    """The gradient of owner rows float32[u_l, dim] as a dense float32[u_l, dim]:
    IndexedSlices (from the gather by I_l) are accumulated per row; None gives zeros."""
    if grad is None:
        return tf.zeros_like(rows)
    if isinstance(grad, tf.IndexedSlices):  # accumulation by I_l on the owner
        return tf.math.unsorted_segment_sum(grad.values, grad.indices, tf.shape(rows)[0])
    return tf.convert_to_tensor(grad)


def through_row_update(marker: Marker, rows: tf.Tensor, lookup: Any, keys: tf.Tensor,
                       init_keys: tf.Tensor, update: RowUpdate) -> tf.Tensor:
    """``rows`` float32[u_l, dim] unchanged, differentiable through ``marker.value``: the
    gradient of the result is applied to the owner rows of ``keys`` int64[u_l] (new rows
    from ``init_keys`` int64[u_l]) by ``lookup.apply_gradients``, scaled by
    ``update.scale``; the marker's gradient is ``update.marker_gradient``, available once
    the rows are written.

    The write is followed by an assignment of 0 to the marker variable, which the
    gradient waits for: Keras 3's ``fit`` keeps a layer's own variable writes but was seen
    to drop a write to another resource that only a control dependency reaches."""

    @tf.custom_gradient
    def identity(marker_value, owner_rows):
        def grad(d_rows):
            summed = row_gradient(d_rows, owner_rows)
            if update.scale != 1.0:
                summed = summed * tf.constant(update.scale, summed.dtype)
            applied = lookup.apply_gradients(keys, summed, init_keys)
            with tf.control_dependencies([applied]):
                written = marker.variable.assign(tf.zeros_like(marker_value))
            with tf.control_dependencies([written]):
                d_marker = tf.fill(tf.shape(marker_value),
                                   tf.constant(update.marker_gradient, marker_value.dtype))
            return d_marker, None  # the table's read is not differentiated further
        return tf.identity(owner_rows), grad

    return identity(marker.value, rows)
