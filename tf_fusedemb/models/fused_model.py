"""The synchronous training step of a model with FusedEmbedding layers, and FusedModel.

Correctness contract: with N ranks each holding a slice of the global batch, one step
computes exactly the global-batch-mean loss and its update, as a single process would:
* each rank's loss is its per-example SUM divided by the GLOBAL batch size (an
  AllReduce), so unequal or empty per-rank batches are exact too;
* dense gradients are summed over ranks (one grouped AllReduce: EmbRace's hybrid scheme);
* embedding-row gradients are summed over requesting ranks by the gradient AlltoAll and
  applied by each group's row optimizer to the touched rows on their owner.
"""
import tensorflow as tf
import tf_keras

from tf_fusedemb.comm import get_communicator
from tf_fusedemb.layers.recording import dense_gradient, record_lookups, row_gradient


def per_example_loss(loss):
    """A callable (y_true, y_pred) -> float[B] from a Keras loss name, object or function."""
    if isinstance(loss, str):
        loss = tf_keras.losses.get(loss)
    if isinstance(loss, tf_keras.losses.Loss):
        config = loss.get_config()
        config["reduction"] = tf_keras.losses.Reduction.NONE
        return type(loss).from_config(config)
    if callable(loss):
        return loss
    raise ValueError(f"loss must be a Keras loss name, object or function, got {loss!r}")


def train_step(model, x, y, loss_fn, optimizer, sample_weight=None, communicator=None):
    """One synchronous training step; returns (global mean loss, this rank's predictions).

    Args:
      model: a Keras model containing FusedEmbedding layers.
      x, y: this rank's slice of the global batch.
      loss_fn: per-example loss (see :func:`per_example_loss`).
      optimizer: the Keras optimizer of the dense variables.
    """
    comm = communicator or get_communicator()
    local_n = tf.cast(tf.shape(y)[0], tf.float32)
    global_n = tf.maximum(comm.allreduce_sum(local_n, "fusedemb/global_batch"), 1.0)
    with tf.GradientTape() as tape, record_lookups(tape) as records:
        y_pred = model(x, training=True)
        per_example = loss_fn(y, y_pred)
        if sample_weight is not None:
            per_example = per_example * tf.cast(sample_weight, per_example.dtype)
        local_sum = tf.reduce_sum(per_example)
        loss = local_sum / global_n
    dense_vars = list(model.trainable_variables)
    grads = tape.gradient(loss, dense_vars + [r.rows for r in records])
    dense_grads = comm.allreduce_sum_list(
        [dense_gradient(g, v) for g, v in zip(grads[:len(dense_vars)], dense_vars)],
        "fusedemb/dense_grads") if dense_vars else []
    optimizer.apply_gradients(zip(dense_grads, dense_vars))
    updates = [r.table.apply_gradients(r.keys, row_gradient(g, r.rows), r.init_keys)
               for r, g in zip(records, grads[len(dense_vars):])]
    with tf.control_dependencies([u for u in updates if u is not None]):
        global_loss = comm.allreduce_sum(local_sum, "fusedemb/loss_sum") / global_n
    return global_loss, y_pred


class SparseTrainingMixin:
    """``compile`` and ``train_step`` of FusedModel, shared by its subclassed and functional
    forms (a mixin, so the functional form need not inherit from FusedModel; see there)."""

    def compile(self, optimizer="rmsprop", loss=None, metrics=None, **kwargs):
        super().compile(optimizer=optimizer, loss=loss, metrics=metrics, **kwargs)
        self._per_example_loss = per_example_loss(loss) if loss is not None else None

    # AutoGraph would rewrite all of tf_keras under this step (10x slower first traces,
    # measured by the models' tests); the step has no tensor-dependent Python control flow.
    @tf.autograph.experimental.do_not_convert
    def train_step(self, data):
        x, y, sample_weight = tf_keras.utils.unpack_x_y_sample_weight(data)
        if getattr(self, "_per_example_loss", None) is None:
            raise ValueError("FusedModel.compile() needs a loss")
        loss, y_pred = train_step(self, x, y, self._per_example_loss, self.optimizer,
                                  sample_weight)
        self.compiled_metrics.update_state(y, y_pred, sample_weight)
        results = self.get_metrics_result()
        results["loss"] = loss
        return results


class FusedModel(SparseTrainingMixin, tf_keras.Model):
    """A Keras Model whose ``fit`` trains FusedEmbedding tables with sparse owner updates.

    Build it like any functional (``FusedModel(inputs, outputs)``) or subclassed model;
    ``compile(optimizer, loss, metrics)`` as usual (the optimizer is for dense variables;
    each embedding group has its own optimizer in its TableSpec). Under horovodrun each
    rank feeds its own slice.

    ``FusedModel(inputs, outputs)`` returns a functional model with the same training
    step (class ``FunctionalFusedModel``): Keras makes a Model subclass used functionally
    functional by rewriting its base classes IN PLACE, recursively, which would turn every
    later subclass of FusedModel (DLRM, ...) functional too.
    """

    def __new__(cls, *args, **kwargs):
        if cls is FusedModel and _functional_args(args, kwargs):
            return FunctionalFusedModel(*args, **kwargs)
        return super().__new__(cls, *args, **kwargs)


class FunctionalFusedModel(SparseTrainingMixin, tf_keras.Model):
    """A functional model with FusedModel's training step (see FusedModel)."""


def _functional_args(args, kwargs):
    """True for the arguments of a functional model: (inputs, outputs)."""
    return len(args) == 2 or (len(args) == 1 and "outputs" in kwargs) or (
        "inputs" in kwargs and "outputs" in kwargs)
