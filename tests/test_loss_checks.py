"""The loss's element check on a batch whose size is known only when the step runs: a
loss that returns more elements than its labels' rows fails naming the output and both
counts; one that returns as many sums to plain TF's sum."""
import numpy as np
import pytest
import tensorflow as tf

from tf_fusedemb.training.loss import KerasLoss


def _partial_sums(loss_fn, labels, logits):
    spec = tf.TensorSpec([None, 1], tf.float32)
    step = tf.function(lambda y, p: KerasLoss(loss_fn).partial(y, p).stacked_sums())
    return step.get_concrete_function(spec, spec)(labels, logits)


def test_loss_with_extra_elements_fails_naming_both_counts():
    def one_too_many(y_true, y_pred):  # [B + 1] per-sample values: a broken custom loss
        per_sample = tf.reduce_sum(tf.square(y_true - y_pred), axis=-1)
        return tf.concat([per_sample, per_sample[:1]], 0)
    labels, logits = tf.zeros([3, 1]), tf.ones([3, 1])
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"output 0: the loss.{1,2}s elements per row differ from its static "
                             r"shape:.*4.*elements,.*3.*expected"):
        _partial_sums(one_too_many, labels, logits)


def test_loss_with_one_element_per_row_sums_like_plain_tf():
    def squared(y_true, y_pred):
        return tf.reduce_sum(tf.square(y_true - y_pred), axis=-1)
    labels = np.array([[0.0], [1.0], [0.5]], np.float32)
    logits = np.array([[1.0], [3.0], [0.0]], np.float32)
    sums = _partial_sums(squared, tf.constant(labels), tf.constant(logits)).numpy()
    np.testing.assert_allclose(sums[0], np.sum((labels - logits) ** 2), rtol=1e-6)
