"""Keras ``compile(loss=...)`` semantics, split into partial sums over ranks and micro-batches.

``tf_keras.Model.fit`` computes, per output o of the global batch,

    value_o = loss_o(y_o, p_o, sample_weight)     # after matching ranks and dtypes
    total   = sum_o loss_weight_o * value_o + sum(model.losses)

where ``loss_o`` reduces its weighted per-element losses ``w * l`` by its reduction:
SUM_OVER_BATCH_SIZE (and AUTO) divides their sum by their number of elements, SUM keeps
the sum, NONE keeps the vector (and ``tape.gradient`` then differentiates its sum). Its
``loss`` metric is a running ``Mean`` of ``total`` weighted by the batch's row count.

A rank (or a micro-batch) only holds a slice of the global batch. :meth:`KerasLoss.partial`
returns the additive pieces of its slice (weighted element sums, element counts, rows);
once those are summed over ranks, :meth:`KerasLoss.combine` gives the coefficients that
turn each slice's sums into its share of the global gradient, and the value Keras would
report. Summing the shares over ranks gives exactly the single-process gradient.
"""
import copy
import dataclasses
from typing import Any, Callable, List, Mapping, Optional, Sequence, Union

import tensorflow as tf
import tf_keras
# Keras's own wrapper of a loss function (what compile() builds for "mse", a function,
# ...) and its rank matching: no public export, and reusing them is what makes the loss
# exactly compile()'s.
from tf_keras.src.engine.compile_utils import match_dtype_and_rank
from tf_keras.src.losses import LossFunctionWrapper

from tf_fusedemb.training.micro_batches import rows_of

_NONE = tf_keras.losses.Reduction.NONE
_MEAN_LIKE = (tf_keras.losses.Reduction.SUM_OVER_BATCH_SIZE, tf_keras.losses.Reduction.AUTO)


@dataclasses.dataclass
class LossPartial:
    """The additive pieces of one slice of a batch.

    sums: per output, float32 scalar sum of its weighted per-element losses;
    counts: per output, float32 scalar number of those elements;
    rows: float32 scalar, rows of the slice (of the first output's labels)."""
    sums: List[tf.Tensor]
    counts: List[tf.Tensor]
    rows: tf.Tensor
    outputs: List[int] = dataclasses.field(default_factory=list)  # their output indices

    def stacked(self) -> tf.Tensor:
        """float32[2 * outputs + 1]: sums, counts, rows (one collective sums them all)."""
        return tf.concat([self.stacked_sums(), self.stacked_sizes()], 0)

    def stacked_sums(self) -> tf.Tensor:
        """float32[outputs]: the sums (they depend on the predictions)."""
        return tf.stack(list(self.sums))

    def stacked_sizes(self) -> tf.Tensor:
        """float32[outputs + 1]: counts and rows. They depend on the labels' shapes only
        (where the per-element losses have a static shape per row), so a step can sum
        them over ranks before its forward pass is done."""
        return tf.stack(list(self.counts) + [self.rows])


@dataclasses.dataclass
class LossTotals:
    """The global loss of one step, from the summed :class:`LossPartial` of all slices.

    coefficients: per output, d total / d sums_o (each slice's share of the gradient is
      ``sum_o coefficients[o] * its sums_o``); regularization: d total / d sum(model.losses);
    value, weight: what Keras's ``loss`` metric is updated with (value the step's loss).
    per_output: per output with a loss (``LossPartial.outputs``), its own loss on the
      global batch, not multiplied by its loss weight: Keras's ``<output>_loss`` metric.
    """
    coefficients: List[tf.Tensor]
    regularization: tf.Tensor
    value: tf.Tensor
    weight: tf.Tensor
    per_output: List[tf.Tensor] = dataclasses.field(default_factory=list)


def _loss_object(loss):
    """A Keras ``Loss`` for a loss name, function or object, as compile() builds it."""
    if isinstance(loss, str):
        loss = tf_keras.losses.get(loss)
    if isinstance(loss, tf_keras.losses.Loss):
        return loss
    if callable(loss):
        name = getattr(loss, "__name__", None) or type(loss).__name__
        return LossFunctionWrapper(loss, name=name)
    raise ValueError(f"loss must be a Keras loss name, function or Loss object, got {loss!r}")


# A loss in any form ``compile(loss=...)`` takes: a name, a function (y_true, y_pred) -> loss, a
# ``tf_keras.losses.Loss``, a list or dict (by output name) of those, or a KerasLoss.
LossLike = Union[str, Callable[..., Any], Sequence[Any], Mapping[str, Any], "KerasLoss"]


class KerasLoss:
    """The loss of ``compile(loss, loss_weights)``, computable slice by slice.

    Args:
      loss: a loss name, function or ``tf_keras.losses.Loss`` (any reduction,
        ``from_logits`` etc. kept), or a list / dict (by output name) of those for a
        model with several outputs.
      loss_weights: None, a list, or a dict by output name.
      output_names: the model's output names (for dict losses, weights and labels).

    Example:
      >>> loss = KerasLoss(tf_keras.losses.BinaryCrossentropy(from_logits=True))
      >>> part = loss.partial(labels, logits)           # labels [B] or [B, 1]
    """

    def __init__(self, loss: LossLike,
                 loss_weights: Optional[Union[Sequence[float], Mapping[str, float]]] = None,
                 output_names: Optional[Sequence[str]] = None):
        self.output_names = list(output_names or [])
        self._losses = self._per_output(loss, "loss")
        weights = self._per_output(loss_weights, "loss_weights") if loss_weights is not None \
            else [1.0] * len(self._losses)
        self._weights = [1.0 if w is None else float(w) for w in weights]
        self._objects = [None if l is None else _loss_object(l) for l in self._losses]
        self._reductions = [None if o is None else o.reduction for o in self._objects]
        # Per-element weighted losses: Keras's own objects with reduction NONE.
        self._elementwise = []
        for obj in self._objects:
            none = None if obj is None else copy.copy(obj)
            if none is not None:
                none.reduction = _NONE
            self._elementwise.append(none)
        if _NONE in self._reductions and len(self._losses) > 1:
            raise ValueError("a loss with reduction NONE is supported for single-output "
                             "models only (Keras then differentiates the sum of its vector)")

    def _per_output(self, value, what):
        if isinstance(value, dict):
            unknown = set(value) - set(self.output_names)
            if unknown:
                raise ValueError(f"{what} names unknown outputs {sorted(unknown)}; the "
                                 f"model's outputs are {self.output_names}")
            return [value.get(n) for n in self.output_names]
        if isinstance(value, (list, tuple)):
            return list(value)
        return [value] * max(1, len(self.output_names))

    def output_names_with_loss(self) -> List[str]:
        """The output names that have a loss, in output order."""
        return [n for i, n in enumerate(self.output_names) if self._output(i)[0] is not None]

    def _output(self, i):
        """(elementwise Loss or None, reduction, loss weight) of output ``i``."""
        j = 0 if len(self._objects) == 1 else i
        return self._elementwise[j], self._reductions[j], self._weights[j]

    def _flat(self, y_true, y_pred, sample_weight):
        preds = tf.nest.flatten(y_pred)
        if len(self._objects) not in (1, len(preds)):
            raise ValueError(f"the model has {len(preds)} outputs but {len(self._objects)} losses")
        if isinstance(y_true, Mapping):
            # As Keras: a dict of labels goes to a dict output by key (one output's too),
            # else to the outputs by their names.
            keys = sorted(y_pred) if isinstance(y_pred, Mapping) else self.output_names
            y_true = [y_true.get(k) for k in keys] if keys else tf.nest.flatten(y_true)
        trues = tf.nest.flatten(y_true) if len(preds) > 1 or isinstance(y_true, list) \
            else [y_true]
        if len(trues) != len(preds):
            raise ValueError(f"got {len(trues)} label tensors for {len(preds)} outputs")
        weights = tf.nest.flatten(sample_weight) if isinstance(sample_weight, (list, tuple, dict)) \
            else [sample_weight] * len(preds)
        return trues, preds, weights

    def partial(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> LossPartial:
        """The additive pieces of a slice: labels, predictions and sample weights of its
        rows (``y_true`` [B] or [B, 1] against ``y_pred`` [B, 1] alike, as in Keras)."""
        trues, preds, weights = self._flat(y_true, y_pred, sample_weight)
        sums, counts, rows, outputs = [], [], None, []
        for i, (y_t, y_p, sw) in enumerate(zip(trues, preds, weights)):
            obj = self._output(i)[0]
            if obj is None or y_t is None:  # Keras: an output may have no loss
                continue
            outputs.append(i)
            y_t, y_p, sw = match_dtype_and_rank(tf.convert_to_tensor(y_t), y_p,
                                                None if sw is None else tf.convert_to_tensor(sw))
            elements = tf.cast(obj(y_t, y_p, sample_weight=sw), tf.float32)
            count = _element_count(elements, y_t)
            sums.append(_checked_sum(elements, count, f"output {i}: the loss's elements per row "
                                                      "differ from its static shape"))
            counts.append(count)
            if rows is None:
                rows = _as_float(rows_of(y_t))
        if rows is None:
            raise ValueError("no output has both a loss and labels")
        return LossPartial(sums, counts, rows, outputs)

    def combine(self, partial: LossPartial, summed: tf.Tensor,
                regularization: Optional[tf.Tensor] = None) -> LossTotals:
        """Global coefficients and value from ``summed`` = the sum over all slices of
        :meth:`LossPartial.stacked` (float32[2 * outputs + 1]); ``partial`` is this
        slice's (for the output indices); ``regularization`` is ``sum(model.losses)``
        (identical on every rank) or None."""
        n = len(partial.outputs)
        return self.totals(partial, summed[n:], summed[:n], regularization)

    def coefficients(self, partial: LossPartial, sizes: tf.Tensor) -> List[tf.Tensor]:
        """Per output, d total / d sums_o, from ``sizes`` = the sum over all slices of
        :meth:`LossPartial.stacked_sizes` (the sums are not needed: a step can start its
        backward before the loss values are summed over ranks)."""
        counts = tf.unstack(sizes[:len(partial.outputs)])
        coefficients = []
        for (_, reduction, weight), count in zip(self._active(partial), counts):
            if reduction in _MEAN_LIKE:  # Keras's _safe_mean: 0 for an empty batch
                coefficients.append(tf.math.divide_no_nan(tf.constant(weight), count))
            else:
                coefficients.append(tf.constant(weight))
        return coefficients

    def regularization_coefficient(self, partial: LossPartial, sizes: tf.Tensor) -> tf.Tensor:
        """d total / d sum(model.losses), from the summed sizes (see :meth:`coefficients`)."""
        return sizes[0] if self._active(partial)[0][1] == _NONE else tf.constant(1.0)

    def totals(self, partial: LossPartial, sizes: tf.Tensor, sums: tf.Tensor,
               regularization: Optional[tf.Tensor] = None) -> LossTotals:
        """The :class:`LossTotals` from the summed :meth:`LossPartial.stacked_sizes`
        (``sizes`` float32[outputs + 1]) and :meth:`LossPartial.stacked_sums` (``sums``
        float32[outputs]) of all slices; ``regularization`` is ``sum(model.losses)``
        (identical on every rank) or None."""
        n = len(partial.outputs)
        coefficients = self.coefficients(partial, sizes)
        value = tf.add_n([c * s for c, s in zip(coefficients, tf.unstack(sums[:n]))])
        per_output = [s if reduction not in _MEAN_LIKE else tf.math.divide_no_nan(s, count)
                      for (_, reduction, _), s, count in zip(self._active(partial),
                                                             tf.unstack(sums[:n]),
                                                             tf.unstack(sizes[:n]))]
        reg = tf.constant(0.0) if regularization is None else tf.cast(regularization, tf.float32)
        rows = sizes[-1]
        if self._active(partial)[0][1] == _NONE:
            # Keras's total is the vector w*l + reg: its gradient is that of its sum, and
            # its Mean metric adds sum(vector) * rows over count * rows per batch.
            count = sizes[0]
            return LossTotals(coefficients, count, tf.math.divide_no_nan(value + count * reg, count),
                              rows * count, per_output)
        return LossTotals(coefficients, self.regularization_coefficient(partial, sizes),
                          value + reg, rows, per_output)

    def _active(self, partial: LossPartial):
        return [self._output(i) for i in partial.outputs]


def _element_count(elements: tf.Tensor, y_true: tf.Tensor) -> tf.Tensor:
    """float32 scalar, the number of per-element losses: rows of ``y_true`` times the
    elements per row where their shape per row is static, so the count does not wait for
    the forward pass (see LossPartial.stacked_sizes); else ``tf.size(elements)``."""
    per_row = elements.shape[1:]
    if elements.shape.rank is None or not per_row.is_fully_defined():
        return tf.cast(tf.size(elements), tf.float32)
    if elements.shape.rank == 0:  # a loss that reduced the batch itself
        return tf.constant(1.0)
    return _as_float(rows_of(y_true) * per_row.num_elements())


def _checked_sum(elements: tf.Tensor, count: tf.Tensor, message: str) -> tf.Tensor:
    """The sum of ``elements``, gated by a check that they are ``count`` many (the check
    gates the sum only, never the count). Checked when traced where both are static, so a
    static batch adds no assertion to the step."""
    size, want = elements.shape.num_elements(), tf.get_static_value(count)
    if size is not None and want is not None:
        if size != want:
            raise ValueError(f"{message}: {size} elements, {want} expected")
        return tf.reduce_sum(elements)
    got = tf.cast(tf.size(elements), tf.float32)
    # String data keeps the traced Assert one op (float data adds a cond and two branches).
    check = tf.debugging.Assert(tf.equal(got, count), [
        f"{message}:", tf.strings.as_string(tf.cast(got, tf.int64)), "elements,",
        tf.strings.as_string(tf.cast(count, tf.int64)), "expected"])
    with tf.control_dependencies([check]):
        return tf.reduce_sum(elements)


def _as_float(value: Union[int, tf.Tensor]) -> tf.Tensor:
    return tf.constant(float(value)) if isinstance(value, int) else tf.cast(value, tf.float32)
