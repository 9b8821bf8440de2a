"""``micro_batches="auto"`` and ``exchange="auto"``: the schedule and the exchange chosen by
measuring them.

FWP helps only when a micro-batch's communication can hide behind another's compute;
with fast links or small batches its extra collectives and smaller kernels make the step
slower, and DBP's buffer synchronisation costs more than it hides when the key routing
is cheap. :class:`AutoPipeline` trains the first batches with the candidate schedules
(they are ordinary, exact training steps): N in ``candidates`` micro-batches with the
requested prefetch, and the synchronous step itself when prefetch was requested. It
times them and keeps the fastest for the rest of training, so a user who turns
pipelining on never gets a step slower than the synchronous one.

Each candidate runs in blocks of three steps: the first starts afresh, the middle one
trains on a prefetched batch while it prefetches the next (the steady state of a
pipelined run), the last is given no next batch (it prefetches an empty one), so the
next block starts clean. The first block of every candidate traces its steps and is not
timed; then ``rounds`` rounds each run one block of every candidate, the order rotated
each round, and time the middle steps. Interleaved rounds matter: a job's first steps
are slower than its later ones (its tables still fill with new keys), and candidates
timed one after another favoured whichever came last. A few timed steps on a shared
machine are noisy, so a more pipelined candidate must win by ``margin`` (default 3%):
the first candidate (sync first, then fewer micro-batches) within that margin of the
fastest is kept. Every rank takes the same decision (the slowest rank's median per
candidate decides), so all ranks keep running the same graph. With one candidate there
is nothing to measure: it is kept from the first step.

With ``exchange="auto"`` each schedule is tried with the flat and the hierarchical
exchange (TawPipe), flat first: on a cluster of several nodes of several ranks the cost
model (``tf_fusedemb.comm.cost_model``) predicts from bytes and link speeds, but ranks
waiting for each other at the hierarchical exchange's extra stages can cost more than
its saved bytes (seen with 8 ranks on 2 cores); measuring sees that. On one node, or one
rank per node, there is nothing to choose and the flat exchange is used.
"""
import dataclasses
import time
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence, Union

import numpy as np
import tensorflow as tf
import tf_keras

from tf_fusedemb.comm import Communicator
from tf_fusedemb.layers.exchange import EXCHANGES
from tf_fusedemb.layers.model_embeddings import ModelEmbeddings
from tf_fusedemb.pipeline.nested import NestedPipeline
from tf_fusedemb.pipeline.options import PipelineOptions
from tf_fusedemb.training.loss import LossLike
from tf_fusedemb.training.step import StepResult

CANDIDATES = (1, 2, 4)
MARGIN = 0.03  # how much faster a more pipelined schedule must measure to be chosen
BLOCK = 3  # steps of a candidate's block; the middle one is its steady state (module doc)
ROUNDS = 3  # timed blocks per candidate


class PlannedStep(NamedTuple):
    """One measuring step: the candidate's label, its place in its block, whether timed."""
    label: str
    position: int
    timed: bool


def measuring_plan(labels: Sequence[str], rounds: int = ROUNDS) -> List[PlannedStep]:
    """The measuring steps, in order: one untimed block of every candidate, then
    ``rounds`` rounds of one block of every candidate (the order rotated by one each
    round), each block's middle step timed. Nothing to measure for one candidate."""
    if len(labels) < 2:
        return []
    plan = [PlannedStep(label, i, False) for label in labels for i in range(BLOCK)]
    for r in range(rounds):
        order = list(labels[r % len(labels):]) + list(labels[:r % len(labels)])
        plan += [PlannedStep(label, i, i == BLOCK // 2) for label in order for i in range(BLOCK)]
    return plan


def candidate_options(options: PipelineOptions, micro_batches: Sequence[int] = CANDIDATES,
                      exchanges: Sequence[str] = EXCHANGES) -> List[PipelineOptions]:
    """The schedules an auto pipeline measures, simplest first.

    With ``micro_batches="auto"``: the synchronous step (when ``options`` asks for
    prefetch; without it N = 1 is the synchronous step), then ``options`` with each N of
    ``micro_batches``; otherwise ``options``' own N. With ``exchange="auto"`` each of
    them with every kind of ``exchanges`` (flat first); pass ``exchanges=("flat",)``
    where the topology has no hierarchy."""
    if options.micro_batches == "auto":
        tried = [dataclasses.replace(options, micro_batches=n) for n in micro_batches]
        schedules = ([PipelineOptions(exchange=options.exchange)] if options.prefetch
                     else []) + tried
    else:
        schedules = [options]
    if options.exchange != "auto":
        return schedules
    return [dataclasses.replace(s, exchange=kind) for s in schedules for kind in exchanges]


class AutoPipeline:
    """A NestedPipeline whose schedule is measured (see module doc).

    Args: as NestedPipeline; ``options.micro_batches`` or ``options.exchange`` is "auto".
      candidates: the N tried. rounds: timed blocks per candidate (see module doc).
        margin: the first candidate whose time is within ``(1 + margin)`` of the fastest
        is chosen.
    Attributes:
      chosen: the chosen schedule's label (``PipelineOptions.label``, e.g. "sync" or
        "dbp,fwp=4"), None while measuring; ``chosen_options`` its PipelineOptions.
      timings: {label: seconds per step}.
      schedules: {label: PipelineOptions} of the candidates measured, in order.
    """

    def __init__(self, model: tf_keras.Model, loss: LossLike,
                 optimizer: tf_keras.optimizers.Optimizer,
                 options: PipelineOptions, communicator: Optional[Communicator] = None,
                 embeddings: Optional[ModelEmbeddings] = None,
                 candidates: Sequence[int] = CANDIDATES, rounds: int = ROUNDS,
                 margin: float = MARGIN):
        if margin < 0:
            raise ValueError(f"AutoPipeline: margin must be >= 0, got {margin}")
        if rounds < 1:
            raise ValueError(f"AutoPipeline: rounds must be >= 1, got {rounds}")
        embeddings = embeddings or ModelEmbeddings.of(model, communicator)
        self.comm = embeddings.communicator
        self.options, self.margin = options, margin
        exchanges = EXCHANGES if self.comm.topology.is_hierarchical else ("flat",)
        self.schedules = {o.label: o for o in candidate_options(options, candidates, exchanges)}
        self._pipelines = {label: NestedPipeline(model, loss, optimizer, o, self.comm,
                                                         embeddings)
                           for label, o in self.schedules.items()}
        self._plan = measuring_plan(list(self.schedules), rounds)
        self._times: Dict[str, List[float]] = {label: [] for label in self.schedules}
        only = next(iter(self.schedules))  # kept unmeasured when it is the one candidate
        self.chosen: Optional[str] = None if self._plan else only
        self.chosen_options: Optional[PipelineOptions] = (None if self._plan
                                                          else self.schedules[only])
        self.timings: Dict[str, float] = {}  # schedule label -> slowest rank's median step (s)
        self._done = 0

    def step(self, x: Mapping[str, tf.Tensor], y: tf.Tensor,
             next_x: Optional[Mapping[str, tf.Tensor]] = None,
             sample_weight: Optional[tf.Tensor] = None) -> StepResult:
        """One training step (see NestedPipeline.step)."""
        if self.chosen is not None:
            return self._pipelines[self.chosen].step(x, y, next_x, sample_weight)
        planned = self._plan[self._done]
        last_of_block = planned.position == BLOCK - 1
        pipeline = self._pipelines[planned.label]
        begin = time.perf_counter()
        # A block's last step is given no next batch: the next block starts afresh.
        result = pipeline.step(x, y, None if last_of_block else next_x, sample_weight)
        float(result.loss)  # wait for the step
        if planned.timed:
            self._times[planned.label].append(time.perf_counter() - begin)
        if last_of_block:
            pipeline.flush()
        self._done += 1
        if self._done == len(self._plan):
            self._choose()
        return result

    def _choose(self):
        mine = {label: float(np.median(t)) for label, t in self._times.items()}
        everyone = self.comm.allgather_object(mine)
        self.timings = {label: max(t[label] for t in everyone) for label in mine}
        fastest = min(self.timings.values())
        self.chosen = next(label for label, t in self.timings.items()
                           if t <= fastest * (1 + self.margin))
        self.chosen_options = self.schedules[self.chosen]

    def flush(self) -> None:
        """Applies pending delayed row updates of the pipeline in use."""
        for pipeline in self._pipelines.values():
            pipeline.flush()

    # The same loop over (x, y) batches: it only calls step and flush.
    run = NestedPipeline.run


def make_pipeline(model: tf_keras.Model, loss: LossLike, optimizer: tf_keras.optimizers.Optimizer,
                  options: PipelineOptions, communicator: Optional[Communicator] = None,
                  embeddings: Optional[ModelEmbeddings] = None
                  ) -> Union[NestedPipeline, "AutoPipeline"]:
    """A NestedPipeline, or an AutoPipeline for ``micro_batches="auto"`` or
    ``exchange="auto"``; ``embeddings``: the model's ``ModelEmbeddings`` (default: found)."""
    if options.is_measured:
        return AutoPipeline(model, loss, optimizer, options, communicator, embeddings)
    return NestedPipeline(model, loss, optimizer, options, communicator, embeddings)
