"""The training loop's one-batch lookahead: :class:`TrainLoop` owns the data iterator.

A pipelined step t routes and retrieves batch t+1's rows while batch t trains (NestPipe's
dual-buffer prefetch), so whoever drives it must hold the next batch before running the
current one. :class:`TrainLoop` is that driver, as torchrec's
``TrainPipeline.progress(dataloader_iter)``: ``progress(iterator)`` draws what it needs
(one batch ahead), runs one step and returns its result with the batch it trained on;
after the last batch it applies the step object's pending updates (``flush``) and the
next call raises ``StopIteration``. ``FusedModel.fit``, ``NestedPipeline.run`` /
``AutoPipeline.run``, ``python -m tf_fusedemb.train`` and the pipeline benchmark all
step through it.

The step objects it drives (:class:`LookaheadStep`) are the pipelines of
``tf_fusedemb.pipeline`` and :class:`SynchronousStep` (the plain step, for which the
lookahead changes nothing).
"""
import itertools
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Optional, Protocol

import tf_keras

from tf_fusedemb.comm import Communicator

from tf_fusedemb.training.loss import LossLike
from tf_fusedemb.training.step import StepResult, as_keras_loss, train_step
from tf_fusedemb.training.step_variables import step_variables_first
from tf_fusedemb.training.tracing import RankInvariantFunction

__all__ = ["LookaheadStep", "Progress", "SynchronousStep", "TrainLoop"]


class LookaheadStep(Protocol):
    """What :class:`TrainLoop` drives: one training step told the next batch's features,
    and a flush of whatever the steps left pending."""

    def step(self, x: Any, y: Any, next_x: Any = None, sample_weight: Any = None) -> StepResult:
        """Trains on this rank's batch ``(x, y, sample_weight)``; ``next_x``: the next
        batch's features (None at the last step), the next call's ``x``."""

    def flush(self) -> None:
        """Applies pending updates (delayed rows, a deferred dense update); a collective."""


class Progress(NamedTuple):
    """What :meth:`TrainLoop.progress` returns: the step's ``result`` (a StepResult) and
    the ``batch`` it trained on, as the iterator gave it (``(x, y)`` or
    ``(x, y, sample_weight)``)."""
    result: StepResult
    batch: Any


class TrainLoop:
    """Owns a data iterator and the one-batch lookahead of the steps it drives.

    Args:
      steps: a :class:`LookaheadStep` (a NestedPipeline, AutoPipeline or
        SynchronousStep).
      draw: ``draw(iterator) -> batch``, raising StopIteration when the data is over
        (default ``next``; ``FusedModel.fit`` gives ``RankBatches.next``, so the ranks
        agree on each batch).
    """

    def __init__(self, steps: LookaheadStep,
                 draw: Callable[[Iterator], Any] = next):
        self.steps = steps
        self._draw = draw
        self._iterator: Optional[Iterator] = None
        self._next: Any = None  # the batch drawn ahead (None: the data is over)

    def progress(self, iterator: Iterator) -> Progress:
        """One step on the next batch of ``iterator``, the batch after it (if any) passed
        on as the step's ``next_x``; after the last batch the steps are flushed.

        An iterator other than the previous call's starts afresh on it (Keras gives
        ``fit`` a new iterator per epoch). Raises StopIteration when ``iterator`` has no
        batch left: at once when it is empty, else at the call after its last batch.
        """
        if iterator is not self._iterator:
            self._iterator, self._next = iterator, None
            current = self._draw(iterator)  # StopIteration: nothing to train on
        elif self._next is None:
            self._iterator = None
            raise StopIteration
        else:
            current = self._next
        try:
            self._next = self._draw(iterator)
        except StopIteration:
            self._next = None
        x, y, sample_weight = tf_keras.utils.unpack_x_y_sample_weight(current)
        next_x = None if self._next is None else \
            tf_keras.utils.unpack_x_y_sample_weight(self._next)[0]
        result = self.steps.step(x, y, next_x, sample_weight)
        if next_x is None:
            self.steps.flush()
        return Progress(result, current)

    def run(self, batches: Iterable, steps: Optional[int] = None) -> Iterator[Progress]:
        """Trains on ``batches`` (at most ``steps`` of them), one :class:`Progress` per
        step; the steps are flushed after the last one."""
        iterator = iter(batches) if steps is None else itertools.islice(batches, steps)
        while True:
            try:
                yield self.progress(iterator)
            except StopIteration:
                return


class SynchronousStep:
    """The synchronous training step (``tf_fusedemb.training.train_step``, traced once
    per input structure) as a :class:`LookaheadStep`: ``next_x`` is not needed, nothing
    is ever pending.

    Args: model, loss (anything ``compile(loss=...)`` accepts), optimizer (the dense
      variables'), communicator (default ``tf_fusedemb.comm.get_communicator()``).
    """

    def __init__(self, model: tf_keras.Model, loss: LossLike,
                 optimizer: tf_keras.optimizers.Optimizer,
                 communicator: Optional[Communicator] = None):
        self.model, self.optimizer, self.comm = model, optimizer, communicator
        self.loss = as_keras_loss(loss, model)
        # No AutoGraph (RankInvariantFunction): the step has no tensor-dependent Python
        # control flow, and converting all of tf_keras under it slows the first trace ~10x.
        self._step_fn = RankInvariantFunction(
            self._step, before_trace=step_variables_first(model, optimizer))

    def _step(self, x, y, sample_weight):
        return train_step(self.model, x, y, self.loss, self.optimizer, sample_weight,
                          self.comm)

    def step(self, x: Any, y: Any, next_x: Any = None, sample_weight: Any = None) -> StepResult:
        """One synchronous step on ``(x, y, sample_weight)``; ``next_x`` is ignored."""
        del next_x
        return self._step_fn(x, y, sample_weight)

    def flush(self) -> None:
        """Nothing is pending after a synchronous step."""

