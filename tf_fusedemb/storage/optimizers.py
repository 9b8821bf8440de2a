"""Row-wise sparse optimizers: the update of the touched rows of one fused group.

An owner rank gathers the rows of the unique keys a batch touched, with their optimizer
slots, and calls :meth:`RowOptimizer.apply`, a pure function of tensors; the table then
writes the results back. Untouched rows and their slots never change (lazy semantics).

The math equals tf_keras 2.16's optimizers applied with ``tf.IndexedSlices`` gradients
to the same rows, operation for operation in float32, so results agree to rounding:

* sgd:      ``var += -g * lr`` (``tf_keras.optimizers.SGD``, no momentum).
* adagrad:  ``acc += g^2; var += -lr * g / sqrt(acc + eps)`` with ``eps = 1e-7`` inside
  the square root (``tf_keras.optimizers.Adagrad``; OptimizerSpec has no epsilon for
  adagrad, so the tf_keras default is used).
* ftrl:     ``tf_keras.optimizers.Ftrl`` with l2_shrinkage = 0 and beta = 0:
  ``new_acc = acc + g^2;
  linear += g - (new_acc^-p - acc^-p) / lr * var;
  var = (clip(linear, -l1, l1) - linear) / (new_acc^-p / lr + 2 l2); acc = new_acc``
  with ``p = learning_rate_power``. (tf_keras densifies an IndexedSlices gradient for
  Ftrl, which rewrites never-touched rows to the closed form (0 for linear = 0); here,
  as in TF's sparse Ftrl kernel, only touched rows change.)
* adam:     lazy Adam (tensorflow_addons LazyAdam): only touched rows' m, v change;
  ``m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
  lr_t = lr sqrt(1-b2^t) / (1-b1^t); var -= lr_t m / (sqrt(v) + eps)``, ``t`` = step.

Shapes: ``rows``, ``grads`` and each slot are float32[u, dim], one row per UNIQUE key
(gradients already summed per key).
"""
from typing import Dict, Tuple, Union

import tensorflow as tf

from tf_fusedemb.specs import OptimizerSpec

__all__ = ["RowOptimizer", "ADAGRAD_EPSILON"]

ADAGRAD_EPSILON = 1e-7  # tf_keras.optimizers.Adagrad's default epsilon


def _f32(x):
    return tf.constant(x, tf.float32)


class RowOptimizer:
    """Sparse optimizer of one group, built from its OptimizerSpec.

    Example::

        opt = RowOptimizer.from_spec(OptimizerSpec.adagrad(0.1))
        slots = opt.initial_slots(u, dim)             # {"accumulator": float32[u, dim]}
        rows, slots = opt.apply(rows, slots, grads, step)
    """

    def __init__(self, spec: OptimizerSpec):
        self.spec = spec
        self.hparams = spec.hparams
        self.learning_rate = spec.learning_rate

    @classmethod
    def from_spec(cls, spec: OptimizerSpec) -> "RowOptimizer":
        impl = {"sgd": _Sgd, "adagrad": _Adagrad, "ftrl": _Ftrl, "adam": _LazyAdam}[spec.name]
        return impl(spec)

    @property
    def slot_names(self) -> tuple:
        """Names of the per-row slots, ``spec.slot_names`` (e.g. ("m", "v") for adam)."""
        return self.spec.slot_names

    @property
    def initial_slot_values(self) -> Dict[str, float]:
        """Slot name -> the value every element of a new row's slot starts at."""
        return {}

    def initial_slots(self, num_rows: Union[int, tf.Tensor], dim: int) -> Dict[str, tf.Tensor]:
        """Slots of ``num_rows`` new rows.

        Args:
            num_rows: int or int scalar tensor, u.
            dim: int, row width.

        Returns:
            dict slot name -> float32[u, dim].
        """
        shape = tf.stack([tf.cast(num_rows, tf.int32), dim])
        return {n: tf.fill(shape, _f32(v)) for n, v in self.initial_slot_values.items()}

    def apply(self, rows: tf.Tensor, slots: Dict[str, tf.Tensor], grads: tf.Tensor,
              step: tf.Tensor) -> Tuple[tf.Tensor, Dict[str, tf.Tensor]]:
        """One optimizer step on touched rows.

        Args:
            rows: float32[u, dim], current values of the unique touched keys.
            slots: dict slot name -> float32[u, dim], their slots.
            grads: float32[u, dim], gradient summed per key.
            step: int64 scalar, this group's optimizer step, 1 on the first update.

        Returns:
            (new_rows float32[u, dim], new_slots dict name -> float32[u, dim]).
        """
        raise NotImplementedError


class _Sgd(RowOptimizer):
    def apply(self, rows, slots, grads, step):
        # tf_keras SGD: variable.scatter_add(-g * lr).
        return rows + (-grads * _f32(self.learning_rate)), {}


class _Adagrad(RowOptimizer):
    @property
    def initial_slot_values(self):
        return {"accumulator": self.hparams["initial_accumulator_value"]}

    def apply(self, rows, slots, grads, step):
        lr = _f32(self.learning_rate)
        acc = slots["accumulator"] + grads * grads
        # Same order as tf_keras Adagrad: (-lr * g) / sqrt(acc + eps).
        new_rows = rows + -lr * grads / tf.sqrt(acc + _f32(ADAGRAD_EPSILON))
        return new_rows, {"accumulator": acc}


class _Ftrl(RowOptimizer):
    @property
    def initial_slot_values(self):
        return {"accumulator": self.hparams["initial_accumulator_value"], "linear": 0.0}

    def apply(self, rows, slots, grads, step):
        lr = _f32(self.learning_rate)
        power = _f32(-self.hparams["learning_rate_power"])
        l1, l2 = _f32(self.hparams["l1"]), _f32(self.hparams["l2"])
        acc, linear = slots["accumulator"], slots["linear"]
        new_acc = acc + tf.pow(grads, 2.0)
        linear = linear + (grads - (tf.pow(new_acc, power) - tf.pow(acc, power)) / lr * rows)
        quadratic = tf.pow(new_acc, power) / lr + 2.0 * l2
        new_rows = (tf.clip_by_value(linear, -l1, l1) - linear) / quadratic
        return new_rows, {"accumulator": new_acc, "linear": linear}


class _LazyAdam(RowOptimizer):
    @property
    def initial_slot_values(self):
        return {"m": 0.0, "v": 0.0}

    def apply(self, rows, slots, grads, step):
        b1, b2 = _f32(self.hparams["beta1"]), _f32(self.hparams["beta2"])
        t = tf.cast(step, tf.float32)
        lr_t = _f32(self.learning_rate) * tf.sqrt(1.0 - tf.pow(b2, t)) / (1.0 - tf.pow(b1, t))
        m = b1 * slots["m"] + (1.0 - b1) * grads
        v = b2 * slots["v"] + (1.0 - b2) * tf.square(grads)
        new_rows = rows - lr_t * m / (tf.sqrt(v) + _f32(self.hparams["epsilon"]))
        return new_rows, {"m": m, "v": v}
