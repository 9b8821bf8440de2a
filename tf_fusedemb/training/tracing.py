"""tf.functions traced the same way on every rank.

Horovod matches collectives across ranks by name, and some names (grouped AllReduce)
come from the traced graph, so every rank must run the same trace. ``reduce_retracing``
retraces when a call's shapes first differ, which depends on each rank's data (rank 0
may see a new batch size while rank 1 does not): rank 0 then runs a new graph while rank
1 runs the old one, and their collectives never meet. A :class:`RankInvariantFunction`
instead traces once per input *structure* with every leading (batch or row) dimension
unknown, so the trace a call uses never depends on data shapes.
"""
from typing import Any, Callable, Optional, Set

import tensorflow as tf


def relaxed_spec(value: Any) -> Optional[tf.TypeSpec]:
    """The TypeSpec of ``value`` with its first dimension unknown (None stays None)."""
    if value is None:
        return None
    spec = tf.type_spec_from_value(value)
    shape = spec.shape if hasattr(spec, "shape") else None
    if shape is None or shape.rank in (None, 0):
        return spec
    relaxed = tf.TensorShape([None]).concatenate(shape[1:])
    if isinstance(spec, tf.RaggedTensorSpec):
        return tf.RaggedTensorSpec(relaxed, spec.dtype, spec.ragged_rank, spec.row_splits_dtype)
    if isinstance(spec, tf.SparseTensorSpec):
        return tf.SparseTensorSpec(relaxed, spec.dtype)
    return tf.TensorSpec(relaxed, spec.dtype)


class RankInvariantFunction:
    """``tf.function(fn)`` (AutoGraph off) traced once per nested input structure, with
    relaxed leading dimensions (see module doc).

    Args:
      fn: the function to trace.
      before_trace: called eagerly with a call's arguments before that call's structure
        is traced, e.g. to create the variables the trace would create
        (``step_variables.create_step_variables``: TensorFlow traces twice a function
        whose first trace creates variables).
    """

    def __init__(self, fn: Callable[..., Any],
                 before_trace: Optional[Callable[..., None]] = None):
        self._function = tf.function(fn, autograph=False)
        self._before_trace = before_trace
        self._traced: Set[str] = set()  # the input structures traced (their specs' repr)

    def __call__(self, *args: Any) -> Any:
        specs = tf.nest.map_structure(relaxed_spec, args)
        key = repr(specs)
        if key not in self._traced:
            if self._before_trace is not None:
                self._before_trace(*args)
            self._function.get_concrete_function(*specs)
            self._traced.add(key)
        return self._function(*args)

    def tracing_count(self) -> int:
        return self._function.experimental_get_tracing_count()
