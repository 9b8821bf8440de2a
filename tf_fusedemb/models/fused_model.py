"""FusedModel: a Keras Model whose fit/evaluate/predict train FusedEmbedding tables.

``fit`` gives what plain ``tf_keras.Model.fit`` gives for the same model on the global
batch (loss of ``compile`` with any reduction, label/prediction rank matching, sample and
class weights, compiled metrics, the epoch's running-mean ``loss``, validation,
callbacks), with the embedding rows updated sparsely on their owner ranks. The step is
:mod:`tf_fusedemb.training.step`; metrics see the global batch (labels, predictions and
sample weights are gathered from all ranks), so every rank reports the same history.

Every collective of a step runs inside a :class:`RankInvariantFunction`, traced once per
input structure with unknown batch dimensions: Keras traces its own step functions with
``reduce_retracing``, which would let ranks with different batch shapes run different
graphs whose collectives never meet.
"""
import inspect
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Type, TypeVar, Union

import tensorflow as tf
import tf_keras

from tf_fusedemb.comm import Communicator
from tf_fusedemb.layers.model_embeddings import ModelEmbeddings
from tf_fusedemb.pipeline import (AutoPipeline, NestedPipeline, PipelineOptions, make_pipeline,
                                  refuse_policies_when_looking_ahead)
from tf_fusedemb.training import step as steps
from tf_fusedemb.training.loop import TrainLoop
from tf_fusedemb.training.loss import KerasLoss, LossLike
from tf_fusedemb.training.progress import fit_verbosity
from tf_fusedemb.training.rank_batches import RankBatches, agree_on_steps
from tf_fusedemb.training.replicas import replicas_of
from tf_fusedemb.training.step_variables import step_variables_first
from tf_fusedemb.training.tracing import RankInvariantFunction

METRICS_GATHER = "fusedemb/metrics_inputs"

if TYPE_CHECKING:
    class _KerasModel(tf_keras.Model):
        """What SparseTrainingMixin is mixed into, to the type checker: its methods call and
        override tf_keras.Model's."""
else:
    _KerasModel = object


class SparseTrainingMixin(_KerasModel):
    """``compile``, the steps and ``metrics`` of FusedModel, shared by its subclassed and
    functional forms (a mixin, so the functional form need not inherit from FusedModel;
    see there)."""

    # Keras's step functions (None until made), which the make_*_function below build.
    train_function: Optional[Callable[[Any], Any]]
    test_function: Optional[Callable[[Any], Any]]
    predict_function: Optional[Callable[[Any], Any]]

    def compile(self, optimizer: Any = "rmsprop", loss: Optional[LossLike] = None,
                metrics: Any = None, loss_weights: Any = None, weighted_metrics: Any = None,
                pipeline: Union[None, str, PipelineOptions] = None,
                replica_check_every: Optional[int] = None, **kwargs: Any) -> None:
        """Keras ``compile``, plus ``pipeline``: a ``tf_fusedemb.pipeline.PipelineOptions``
        (or its string form, e.g. "dbp,fwp=4") making ``fit`` run NestPipe's dual-buffer
        prefetch and micro-batches with EmbRace's vertical scheduling. Pipelining changes
        when work happens, never what is computed: ``fit`` gives the same history and
        weights as without it. With prefetch, a step's delayed row updates and the
        bottom half of its dense update are applied during the next step; they are
        applied at the end of each pass over the data and before ``evaluate``/``predict``
        (a per-batch callback that reads weights calls ``flush_pipeline`` first).

        Every rank starts from rank 0's dense weights (taken at the first step, see
        ``tf_fusedemb.training.replicas``), and a fingerprint of the dense weights is
        compared across ranks at the first training step, and every
        ``replica_check_every`` steps when given (a mismatch fails naming the variable)."""
        super().compile(optimizer=optimizer, loss=loss, metrics=metrics,
                        loss_weights=loss_weights, weighted_metrics=weighted_metrics, **kwargs)
        self._fused_compile = {"loss": loss, "loss_weights": loss_weights,
                               "gather": bool(metrics or weighted_metrics),
                               "pipeline": _pipeline_options(pipeline)}
        if self._fused_compile["pipeline"] is not None and kwargs.get("steps_per_execution", 1) != 1:
            raise ValueError("compile(pipeline=...) needs steps_per_execution=1")
        replicas_of(self).check_every = replica_check_every
        self._fused_loss: Optional[KerasLoss] = None  # built at the first step (output names)
        self._loss_tracker = tf_keras.metrics.Mean(name="loss")
        self._output_loss_trackers: Dict[str, tf_keras.metrics.Mean] = {}
        self._fused_steps: Dict[str, RankInvariantFunction] = {}
        self._pipeline: Optional[Union[NestedPipeline, AutoPipeline]] = None
        self._loop: Optional[TrainLoop] = None  # the pipeline's: one batch ahead

    @property
    def metrics(self) -> List[tf_keras.metrics.Metric]:
        tracker = getattr(self, "_loss_tracker", None)
        outputs = list(getattr(self, "_output_loss_trackers", {}).values())
        others = [m for m in super().metrics if m is not tracker and
                  all(m is not o for o in outputs)]
        return ([tracker] if tracker is not None else []) + outputs + others

    @property
    def fused_embeddings(self) -> ModelEmbeddings:
        """The model's FusedEmbedding layers, their group lookups and communicator
        (``ModelEmbeddings``): found once the model is built (a subclassed model may make
        layers as it builds) and handed to its steps, pipeline and checkpoints."""
        found = getattr(self, "_fused_embeddings_found", None)
        if found is None:
            found = ModelEmbeddings.of(self)
            if self.built:
                self._fused_embeddings_found = found
        return found

    @property
    def communicator(self) -> Communicator:
        """The communicator the model's FusedEmbedding layers run over (all of them must
        share one: a model trains over one set of ranks); the process's default
        (``tf_fusedemb.comm.get_communicator()``) for a model without such a layer."""
        return self.fused_embeddings.communicator

    def fit(self, *args: Any, **kwargs: Any) -> tf_keras.callbacks.History:
        """Keras ``fit``; without ``verbose``: no output off rank 0, the bar on a terminal,
        one line per epoch on a pipe (horovodrun), see ``training.progress``.

        A collective: every rank calls it. Ranks may hold different numbers of batches:
        every rank trains on the steps all ranks have and the batches left over are
        reported once (``tf_fusedemb.training.rank_batches``)."""
        call = _bound(tf_keras.Model.fit, self, args, kwargs)
        if "verbose" not in call:
            call["verbose"] = fit_verbosity(self.communicator.rank)
        if call.get("steps_per_epoch") is None and call.get("x") is not None:
            agreed = agree_on_steps(self.communicator, "shortest", "fit", call["x"],
                                    call.get("y"), call.get("sample_weight"),
                                    call.get("batch_size"))
            call.update(x=agreed.x, y=agreed.y, sample_weight=agreed.sample_weight)
            self.unused_batches = agreed.unused
        if call.get("validation_data") is not None and call.get("validation_steps") is None:
            call["validation_data"], call["validation_steps"] = _agreed_validation(
                self.communicator, call["validation_data"],
                call.get("validation_batch_size") or call.get("batch_size"))
        return super().fit(**call)

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        """Keras ``evaluate``; a collective: every rank calls it. Ranks may hold
        different numbers of batches: every sample of every rank is evaluated (ranks
        that are out take part with empty batches), and the results are the global
        batch's on every rank."""
        self.flush_pipeline()
        return super().evaluate(**self._agreed("evaluate", tf_keras.Model.evaluate, args, kwargs))

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        """Keras ``predict`` of this rank's samples; a collective: every rank calls it
        (the lookups are), with data of any length (see ``evaluate``)."""
        self.flush_pipeline()
        return super().predict(**self._agreed("predict", tf_keras.Model.predict, args, kwargs))

    def _agreed(self, what, method, args, kwargs):
        """The call's arguments with the steps every rank runs (the longest rank's)."""
        call = _bound(method, self, args, kwargs)
        if call.get("steps") is None and not call.get("_use_cached_eval_dataset"):
            agreed = agree_on_steps(self.communicator, "longest", what, call.get("x"),
                                    batch_size=call.get("batch_size"))
            call.update(x=agreed.x, steps=agreed.steps)
        return call

    @property
    def training_pipeline(self) -> Optional[Union[NestedPipeline, AutoPipeline]]:
        """The pipeline ``fit`` runs (NestedPipeline or AutoPipeline), None when synchronous
        or before the first pipelined step."""
        return getattr(self, "_pipeline", None)

    def flush_pipeline(self) -> None:
        """Applies the pipeline's delayed row updates (before reading or saving tables)."""
        pipeline = self.training_pipeline
        if pipeline is not None:
            pipeline.flush()

    def make_train_function(self, force: bool = False) -> Callable[[Any], Dict[str, Any]]:
        """One step per call (``steps_per_execution`` steps), each on a batch all ranks
        agreed on (``RankBatches``): the synchronous step, or the pipelined one (looking
        one batch ahead) with ``compile(pipeline=...)``; eviction after every step."""
        if self.train_function is not None and not force:
            return self.train_function
        embeddings = self.fused_embeddings
        evicting = [layer for layer in embeddings.layers if layer.has_eviction]
        pipelined = getattr(self, "_fused_compile", {}).get("pipeline") is not None
        if pipelined:  # every pipelined fit looks one batch ahead (TrainLoop)
            refuse_policies_when_looking_ahead(embeddings.stores,
                                               "FusedModel.fit", "compile without pipeline=")
        step = self._pipelined_step if pipelined else self._synchronous_step
        batches = RankBatches(self.communicator, "shortest", "fit")

        def train_function(iterator):
            logs = None
            for _ in range(int(self._steps_per_execution.numpy())):
                try:
                    logs = step(iterator, batches)
                except StopIteration:
                    if logs is None:
                        raise
                    break
                for layer in evicting:
                    layer.enforce_policies()
                self._train_counter.assign_add(1)
            return logs
        self.train_function = train_function
        return train_function

    def make_test_function(self, force: bool = False) -> Callable[[Any], Dict[str, Any]]:
        """One evaluation step per call on the ranks' agreed batches (see ``evaluate``)."""
        if self.test_function is None or force:
            self.test_function = self._agreed_steps("evaluate", self._test_counter,
                                                    self.test_step)
        return self.test_function

    def make_predict_function(self, force: bool = False) -> Callable[[Any], Any]:
        """One prediction step per call on the ranks' agreed batches (see ``predict``)."""
        if self.predict_function is None or force:
            self.predict_function = self._agreed_steps("predict", self._predict_counter,
                                                       self.predict_step)
        return self.predict_function

    def _agreed_steps(self, what: str, counter: tf.Variable,
                      step: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``f(iterator)``: ``step`` on the next batch all ranks agreed on, counted."""
        batches = RankBatches(self.communicator, "longest", what)

        def run(iterator):
            outputs = step(batches.next(iterator))
            counter.assign_add(1)
            return outputs
        return run

    def _synchronous_step(self, iterator, batches):
        return self.train_step(batches.next(iterator))

    def _pipelined_step(self, iterator, batches):
        """One pipelined step through the pipeline's ``TrainLoop``, which looks one batch
        ahead in Keras's iterator (DBP needs the next batch's features), each batch agreed
        by the ranks (``batches``); at the end of the data the delayed updates are applied
        and the next call ends the epoch (StopIteration)."""
        if self._loop is None:
            self._pipeline = make_pipeline(self, self._keras_loss(), self.optimizer,
                                           self._fused_compile["pipeline"], self.communicator,
                                           self.fused_embeddings)
            self._loop = TrainLoop(self._pipeline, draw=batches.next)
        result, batch = self._loop.progress(iterator)
        _, y, sample_weight = tf_keras.utils.unpack_x_y_sample_weight(batch)
        gathered = None
        if self._fused_compile["gather"]:
            gathered = self._traced("gather", self._gather)(y, result.predictions, sample_weight)
        return self._report(result.loss, result.weight, gathered, result.per_output)

    # ---------------------------------------------------------------- Keras steps
    @tf.autograph.experimental.do_not_convert
    def train_step(self, data: Any) -> Dict[str, Any]:
        x, y, sample_weight = tf_keras.utils.unpack_x_y_sample_weight(data)
        loss, weight, per_output, gathered = self._traced("train", self._train_core)(
            x, y, sample_weight)
        return self._report(loss, weight, gathered, per_output)

    @tf.autograph.experimental.do_not_convert
    def test_step(self, data: Any) -> Dict[str, Any]:
        x, y, sample_weight = tf_keras.utils.unpack_x_y_sample_weight(data)
        loss, weight, per_output, gathered = self._traced("test", self._test_core)(
            x, y, sample_weight)
        return self._report(loss, weight, gathered, per_output)

    @tf.autograph.experimental.do_not_convert
    def predict_step(self, data: Any) -> Any:
        x, _, _ = tf_keras.utils.unpack_x_y_sample_weight(data)
        return self._traced("predict", self._predict_core)(x)

    # ---------------------------------------------------------------- traced cores
    def _train_core(self, x, y, sample_weight):
        result = steps.train_step(self, x, y, self._keras_loss(), self.optimizer,
                                  sample_weight, embeddings=self.fused_embeddings)
        return result.loss, result.weight, result.per_output, \
            self._gather(y, result.predictions, sample_weight)

    def _test_core(self, x, y, sample_weight):
        result = steps.test_step(self, x, y, self._keras_loss(), sample_weight,
                                 embeddings=self.fused_embeddings)
        return result.loss, result.weight, result.per_output, \
            self._gather(y, result.predictions, sample_weight)

    def _predict_core(self, x):
        replicas_of(self).synchronize(self.communicator, x=x)  # before any training step
        return self(x, training=False)

    def _traced(self, kind, fn):
        if not hasattr(self, "_fused_steps") and kind == "predict":
            self._fused_steps = {}  # predict needs no compile, as in Keras
        if not hasattr(self, "_fused_steps"):
            raise ValueError(f"{type(self).__name__}: call compile() before fit/evaluate")
        if kind not in self._fused_steps:
            # A training step's variables before its trace (one trace, not two).
            before = step_variables_first(self, self.optimizer) if kind == "train" else None
            self._fused_steps[kind] = RankInvariantFunction(fn, before_trace=before)
        return self._fused_steps[kind]

    def _keras_loss(self):
        if self._fused_loss is None:
            if self._fused_compile["loss"] is None:
                raise ValueError(f"{type(self).__name__}.compile() needs a loss")
            self._fused_loss = KerasLoss(self._fused_compile["loss"],
                                         self._fused_compile["loss_weights"], self.output_names)
        return self._fused_loss

    def _gather(self, y, y_pred, sample_weight):
        """(y, y_pred, sample_weight) of the global batch for the compiled metrics, or
        None when there are none (no collective then)."""
        if not self._fused_compile["gather"]:
            return None
        comm = self.communicator
        values = tf.nest.flatten((y, y_pred, sample_weight))
        gathered = [None if v is None else comm.allgather(v, f"{METRICS_GATHER}/{i}")
                    for i, v in enumerate(values)]
        return tf.nest.pack_sequence_as((y, y_pred, sample_weight), gathered)

    def _report(self, loss, weight, gathered, per_output=()):
        self._loss_tracker.update_state(loss, sample_weight=weight)
        # Keras's "<output>_loss" of a model with several outputs (eager: made on first use)
        names = self._keras_loss().output_names_with_loss() \
            if len(self.output_names or []) > 1 else []
        for name, value in zip(names, per_output):
            if name not in self._output_loss_trackers:
                self._output_loss_trackers[name] = tf_keras.metrics.Mean(name=f"{name}_loss")
            self._output_loss_trackers[name].update_state(value, sample_weight=weight)
        if gathered is not None:
            self.compiled_metrics.update_state(*gathered)
        return self.get_metrics_result()


_ModelClass = TypeVar("_ModelClass", bound=type)


def register_model_class(cls: _ModelClass) -> _ModelClass:
    """Class decorator: registers a model class as "tf_fusedemb>Name" and by its bare name,
    the only name ``Model.to_json`` writes, so ``tf_keras.models.model_from_json`` finds it
    without custom_objects."""
    cls = tf_keras.saving.register_keras_serializable(package="tf_fusedemb")(cls)
    tf_keras.saving.get_custom_objects()[cls.__name__] = cls
    return cls


@register_model_class
class FusedModel(SparseTrainingMixin, tf_keras.Model):
    """A Keras Model whose ``fit`` trains FusedEmbedding tables with sparse owner updates.

    Build it like any functional (``FusedModel(inputs, outputs)``) or subclassed model;
    ``compile(optimizer, loss, metrics, loss_weights, weighted_metrics)`` as usual (the
    optimizer is for dense variables; each embedding group has its own row optimizer in
    its TableSpec). Under horovodrun each rank feeds its own slice of every global batch;
    ``fit``/``evaluate`` then equal plain Keras on the global batch in one process.

    ``FusedModel(inputs, outputs)`` returns a functional model with the same training
    step (class ``FunctionalFusedModel``): Keras makes a Model subclass used functionally
    functional by rewriting its base classes IN PLACE, recursively, which would turn every
    later subclass of FusedModel (DLRM, ...) functional too.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> "FusedModel":
        if cls is FusedModel and _functional_args(args, kwargs):
            return FunctionalFusedModel(*args, **kwargs)
        return super().__new__(cls, *args, **kwargs)


@register_model_class
class FunctionalFusedModel(SparseTrainingMixin, tf_keras.Model):
    """A functional model with FusedModel's training step (see FusedModel)."""


def _pipeline_options(pipeline):
    """PipelineOptions from compile's ``pipeline`` argument; None when synchronous."""
    if pipeline is None:
        return None
    if isinstance(pipeline, str):
        pipeline = PipelineOptions.parse(pipeline)
    if not isinstance(pipeline, PipelineOptions):
        raise ValueError(f"compile(pipeline=...) takes PipelineOptions or a string like "
                         f"'dbp,fwp=4', got {pipeline!r}")
    return None if pipeline == PipelineOptions() else pipeline


def _bound(method, model, args, kwargs) -> dict:
    """``method``'s arguments as given (by name; defaults not filled in)."""
    call = dict(inspect.signature(method).bind(model, *args, **kwargs).arguments)
    call.pop("self")
    call.update(call.pop("kwargs", {}))
    return call


def _agreed_validation(comm, data, batch_size):
    """(validation data, validation_steps): the longest rank's steps (see evaluate)."""
    if isinstance(data, tf.data.Dataset):
        agreed = agree_on_steps(comm, "longest", "validation", data)
        return agreed.x, agreed.steps
    x, y, sample_weight = tf_keras.utils.unpack_x_y_sample_weight(tuple(data))
    agreed = agree_on_steps(comm, "longest", "validation", x, y, sample_weight,
                            batch_size)
    return tuple(d for d in (agreed.x, agreed.y, agreed.sample_weight) if d is not None), \
        agreed.steps


def _functional_args(args, kwargs):
    """True for the arguments of a functional model: (inputs, outputs)."""
    return len(args) == 2 or (len(args) == 1 and "outputs" in kwargs) or (
        "inputs" in kwargs and "outputs" in kwargs)
