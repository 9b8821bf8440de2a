"""Recording of the owner-side rows a forward pass looked up, for the sparse update.

A training step opens ``record_lookups(tape)``; every FusedEmbedding call inside it
watches the rows it looked up on the owner and appends a :class:`LookupRecord`. After
``tape.gradient(loss, [r.rows for r in records])`` the gradients of those rows, already
summed over all requesting ranks by the gradient AlltoAll, go to the group's optimizer.
"""
import contextlib
import dataclasses
import threading

import tensorflow as tf

_state = threading.local()


@dataclasses.dataclass
class LookupRecord:
    """Owner-side rows of one group in one forward pass.

    rows: float32[u_l, dim], watched by the tape; keys: int64[u_l] storage keys;
    init_keys: int64[u_l] plan-independent keys seeding new rows; table: the GroupTable;
    layer: the FusedEmbedding; group: the group's name."""
    rows: object
    keys: object
    init_keys: object
    table: object
    layer: object
    group: str


@contextlib.contextmanager
def record_lookups(tape):
    """Within the block, FusedEmbedding calls watch their rows on ``tape`` and record them.
    Yields the list of :class:`LookupRecord` it fills."""
    previous = getattr(_state, "active", None)
    records = []
    _state.active = (tape, records)
    try:
        yield records
    finally:
        _state.active = previous


def active():
    """(tape, records) of the innermost ``record_lookups`` block, or None."""
    return getattr(_state, "active", None)


def dense_gradient(grad, var):
    """A dense variable's gradient as a tensor; zeros for None, so every rank's
    collectives stay identical."""
    return tf.zeros_like(var) if grad is None else tf.convert_to_tensor(grad)


def row_gradient(grad, rows):
    """The gradient of recorded owner rows as float32[u_l, dim]: IndexedSlices (from the
    gather by I_l) are accumulated per row; None gives zeros."""
    if grad is None:
        return tf.zeros_like(rows)
    if isinstance(grad, tf.IndexedSlices):  # accumulation by I_l on the owner
        return tf.math.unsorted_segment_sum(grad.values, grad.indices, tf.shape(rows)[0])
    return grad
