"""tf.functions traced the same way on every rank.

Horovod matches collectives across ranks by name, and some names (grouped AllReduce)
come from the traced graph, so every rank must run the same trace. ``reduce_retracing``
retraces when a call's shapes first differ, which depends on each rank's data (rank 0
may see a new batch size while rank 1 does not): rank 0 then runs a new graph while rank
1 runs the old one, and their collectives never meet. A :class:`RankInvariantFunction`
instead traces once per input *structure* with every leading (batch or row) dimension
unknown, so the trace a call uses never depends on data shapes.

A call finds its trace by a cheap signature of its arguments and calls that concrete
function directly: ``tf.function``'s own dispatch (trace types of every leaf) and the
specs' ``repr`` cost more than a millisecond per step of a model with dozens of inputs.
"""
from typing import Any, Callable, Dict, Hashable, Mapping, Optional

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


def call_signature(value: Any) -> Hashable:
    """What selects a :class:`RankInvariantFunction`'s trace for ``value`` (nested
    dicts, lists and tuples of tensors): its structure, and per tensor its dtype, rank and
    shape past the first dimension. Values that share a signature share one trace."""
    if isinstance(value, tf.Tensor):
        shape = value.shape
        return (value.dtype, None if shape.rank is None else (shape.rank, tuple(shape[1:])))
    if isinstance(value, Mapping):
        return (dict, tuple((k, call_signature(value[k])) for k in sorted(value)))
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(call_signature(v) for v in value))
    return repr(relaxed_spec(value))  # None, ragged, sparse, variables: rare and exact


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
        # One concrete function per call signature (see call_signature).
        self._traces: Dict[Hashable, Any] = {}

    def __call__(self, *args: Any) -> Any:
        key = call_signature(args)
        trace = self._traces.get(key)
        if trace is None:
            if self._before_trace is not None:
                self._before_trace(*args)
            specs = tf.nest.map_structure(relaxed_spec, args)
            trace = self._traces[key] = self._function.get_concrete_function(*specs)
        return trace(*args)

    def tracing_count(self) -> int:
        return self._function.experimental_get_tracing_count()
