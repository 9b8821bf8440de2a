"""RoutedLookup: one group's lookup of one batch between its steps, as a typed record.

``GroupLookup.route`` returns it (the requester's and the owner's side of the key
exchange), ``retrieve`` adds nothing to it but returns the rows, and a pipeline that
prepares a batch ahead (NestPipe's DBP) keeps it with its ``rows`` until the forward pass
serves them. It is a NamedTuple, so it crosses ``tf.function`` boundaries (arguments and
results) as the tensors it holds, and a field cannot be overwritten by another's name.

Shapes: n fused IDs of this rank, u unique per feature, u_l unique keys on the owner,
m key messages received by the owner.
"""
from typing import Any, NamedTuple, Optional

import tensorflow as tf


class RoutedLookup(NamedTuple):
    """One group's routed lookup.

    Fields:
      ids: int64[n], the requester's fused IDs (checked against the layer's input when
        the lookup was prepared ahead).
      unique_inverse: int32[n], I_u (each ID's unique key in its feature segment).
      keys: int64[u_l], the owner's storage keys.
      init_keys: int64[u_l], plan-independent keys seeding new rows.
      inverse: int32[m], I_l (each received key message's key among ``keys``).
      route: the exchange's own record of what it sent (``exchange.FlatRoute``,
        ``hierarchical_exchange.HierarchicalRoute``), which brings the rows back.
      rows: float32[u_l, dim] once retrieved ahead of the forward pass, else None.
    """
    ids: tf.Tensor
    unique_inverse: tf.Tensor
    keys: tf.Tensor
    init_keys: tf.Tensor
    inverse: tf.Tensor
    route: Any
    rows: Optional[tf.Tensor] = None

    def with_rows(self, rows: tf.Tensor) -> "RoutedLookup":
        """This lookup with its owner rows float32[u_l, dim]."""
        return self._replace(rows=rows)


def same_ids(got: tf.Tensor, want: tf.Tensor) -> tf.Tensor:
    """bool scalar: whether IDs ``got`` and ``want`` (any shapes, same dtype) hold the
    same values in the same order, their sizes equal (a lookup's check that it was called
    with the IDs its rows were routed for)."""
    return tf.cond(tf.equal(tf.size(got), tf.size(want)),
                   lambda: tf.reduce_all(tf.equal(tf.reshape(got, [-1]), tf.reshape(want, [-1]))),
                   lambda: tf.constant(False))
