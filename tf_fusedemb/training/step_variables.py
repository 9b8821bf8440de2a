"""A training step's variables, made before the step is first traced.

TensorFlow traces a ``tf.function`` twice when its first trace creates variables: that
trace only initialises them, and the calls after it use a second trace made without
creating any. A training step creates them on its first call unless they exist: the
model's (a subclassed model is built by its first call), the dense optimizer's (its
slots, made by its first ``apply_gradients``, ``tf.init_scope`` or not) and the
library's own (``replicas_of(model)``'s step counter). So the whole step is
traced twice on every rank: for a pipelined step of thousands of ops, seconds
of CPU. :func:`create_step_variables` makes them eagerly first, with the values the
first trace would have given them (an optimizer's slots start from its constants), so
the step is traced once. The step functions of ``SynchronousStep``, ``NestedPipeline``
and ``FusedModel`` call it before each trace (``RankInvariantFunction(before_trace=)``).
"""
from typing import Any, Callable, Sequence

import tensorflow as tf
import tf_keras

from tf_fusedemb.training.replicas import build_by_tracing, replicas_of

__all__ = ["build_optimizer", "create_step_variables", "step_variables_first"]


def build_optimizer(optimizer: tf_keras.optimizers.Optimizer,
                    variables: Sequence[tf.Variable]) -> None:
    """Creates ``optimizer``'s variables for ``variables`` now (its step counter and slots),
    as its first ``apply_gradients`` would; nothing for those it has already."""
    if hasattr(optimizer, "_create_all_weights"):  # tf_keras.optimizers.legacy: no public
        optimizer._create_all_weights(variables)  # pylint: disable=protected-access
    else:
        optimizer.build(variables)


def create_step_variables(model: tf_keras.Model, optimizer: tf_keras.optimizers.Optimizer,
                          x: Any) -> None:
    """Makes, eagerly, the variables a training step's first trace on ``x`` would make:
    the model's (built on ``x``'s structure if not built), its dense replicas' step
    counter (``replicas_of``) and ``optimizer``'s for its trainable variables; the trace
    then makes none (see the module doc). Call it outside any ``tf.function``."""
    replicas_of(model)
    if not model.built:
        build_by_tracing(model, x)
    build_optimizer(optimizer, model.trainable_variables)


def step_variables_first(model: tf_keras.Model, optimizer: tf_keras.optimizers.Optimizer
                         ) -> Callable[..., None]:
    """The ``before_trace`` of a step function whose first argument is the features ``x``
    (``RankInvariantFunction``): ``create_step_variables(model, optimizer, x)``."""
    return lambda x, *_: create_step_variables(model, optimizer, x)
