"""``micro_batches="auto"``: the number of micro-batches chosen by measuring it.

FWP helps only when a micro-batch's communication can hide behind another's compute;
with fast links or small batches its extra collectives and smaller kernels make the step
slower. :class:`AutoPipeline` trains the first batches with each candidate N in turn
(they are ordinary, exact training steps), times them, and keeps the fastest for the
rest of training: a user who turns pipelining on never gets a step slower than the
fastest candidate, N = 1 (no micro-batches) included. Every rank takes the same decision
(the slowest rank's time per candidate decides), so all ranks keep running the same graph.
"""
import dataclasses
import time
from typing import Optional, Sequence

import numpy as np

from tf_fusedemb.comm import get_communicator
from tf_fusedemb.pipeline.nested import NestedPipeline
from tf_fusedemb.pipeline.options import PipelineOptions

CANDIDATES = (1, 2, 4)


class AutoPipeline:
    """A NestedPipeline whose number of micro-batches is measured (see module doc).

    Args: as NestedPipeline; ``options.micro_batches`` is "auto".
      candidates: the N tried, in order. warmup, timed: steps per candidate (the first
        ``warmup`` include tracing and are not timed).
    Attributes:
      chosen: the N kept, None while measuring. timings: {N: seconds per step}.
    """

    def __init__(self, model, loss, optimizer, options: PipelineOptions, communicator=None,
                 candidates: Sequence[int] = CANDIDATES, warmup: int = 2, timed: int = 3):
        self.comm = communicator or get_communicator()
        self.options = options
        self._pipelines = {n: NestedPipeline(model, loss, optimizer,
                                             dataclasses.replace(options, micro_batches=n),
                                             self.comm) for n in candidates}
        self._plan = [(n, i) for n in candidates for i in range(warmup + timed)]
        self._warmup = warmup
        self._times = {n: [] for n in candidates}
        self.chosen: Optional[int] = None
        self.timings = {}
        self._done = 0

    def step(self, x, y, next_x=None, sample_weight=None):
        """One training step (see NestedPipeline.step)."""
        if self.chosen is not None:
            return self._pipelines[self.chosen].step(x, y, next_x, sample_weight)
        n, i = self._plan[self._done]
        last_of_candidate = self._done + 1 == len(self._plan) or self._plan[self._done + 1][0] != n
        pipeline = self._pipelines[n]
        begin = time.perf_counter()
        # A candidate's last step prefetches nothing: the next candidate starts afresh.
        result = pipeline.step(x, y, None if last_of_candidate else next_x, sample_weight)
        float(result.loss)  # wait for the step
        if i >= self._warmup:
            self._times[n].append(time.perf_counter() - begin)
        if last_of_candidate:
            pipeline.flush()
        self._done += 1
        if self._done == len(self._plan):
            self._choose()
        return result

    def _choose(self):
        mine = {n: float(np.median(t)) for n, t in self._times.items()}
        everyone = self.comm.allgather_object(mine)
        self.timings = {n: max(t[n] for t in everyone) for n in mine}
        self.chosen = min(self.timings, key=self.timings.get)

    def flush(self):
        """Applies pending delayed row updates of the pipeline in use."""
        for pipeline in self._pipelines.values():
            pipeline.flush()


def make_pipeline(model, loss, optimizer, options: PipelineOptions, communicator=None):
    """A NestedPipeline, or an AutoPipeline for ``micro_batches="auto"``."""
    if options.micro_batches == "auto":
        return AutoPipeline(model, loss, optimizer, options, communicator)
    return NestedPipeline(model, loss, optimizer, options, communicator)
