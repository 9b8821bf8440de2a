"""Ranks with different numbers of batches: every step is agreed by all ranks.

Sharded input files of unequal length are the normal case, and every step of a model
with FusedEmbedding layers is collective (the lookups' AlltoAlls), so a rank that runs
out of data must not simply stop: the others would wait for it for ever.

* Training (``until="shortest"``): an epoch ends on every rank as soon as one rank runs
  out; every rank trains on the steps all ranks have, and the batches some ranks were
  left with are reported once (Horovod's ``join`` semantics without its padding: a
  padded step would change the global batch and so the result).
* Evaluation and prediction (``until="longest"``): they go on until every rank is out;
  a rank that is out takes part with an EMPTY batch (zero rows: a valid input whose loss
  terms and lookups are empty), so every sample of every rank is evaluated or predicted
  exactly once and nothing is dropped.

Two mechanisms, both collective:

* :func:`agree_on_steps`, once per ``fit``/``evaluate``/``predict`` call: the ranks
  exchange their per-epoch batch counts (one ``allgather_object``) so that Keras's own
  loop runs the same number of steps on every rank (training data is cut to the
  shortest rank's; evaluation and prediction run the longest rank's steps);
* :class:`RankBatches`, once per step: one tiny AllGather of "I have a batch" flags (for
  data whose length is not known ahead, e.g. files read line by line).
"""
import logging
import math
from typing import Any, Dict, List, Optional, Sequence

import tensorflow as tf

from tf_fusedemb.comm import Communicator

__all__ = ["RankBatches", "StepsAgreement", "agree_on_steps", "empty_batch"]

AGREEMENT = "fusedemb/batch_agreement"
UNTIL = ("shortest", "longest")
UNKNOWN = -2  # tf.data's UNKNOWN_CARDINALITY
_log = logging.getLogger("tf_fusedemb")


def empty_batch(spec: Any) -> Any:
    """A batch of zero rows with ``spec``'s structure (a nest of TensorSpec,
    RaggedTensorSpec, SparseTensorSpec with a leading batch dimension)."""
    def empty(s):
        if s is None:
            return None
        inner = [0 if d is None else d for d in s.shape[1:]]
        if isinstance(s, tf.RaggedTensorSpec):
            flat = tf.zeros([0] + inner[s.ragged_rank:], s.dtype)
            return tf.RaggedTensor.from_nested_row_lengths(
                flat, [tf.zeros([0], s.row_splits_dtype)] * s.ragged_rank)
        if isinstance(s, tf.SparseTensorSpec):
            rank = s.shape.rank
            return tf.SparseTensor(tf.zeros([0, rank], tf.int64), tf.zeros([0], s.dtype),
                                   [0] + inner)
        return tf.zeros([0] + inner, s.dtype)
    return tf.nest.map_structure(empty, spec)


class RankBatches:
    """Draws each step's batch from an iterator once every rank has said whether it
    has one (one AllGather of a flag per step; nothing in one process).

    Args:
      comm: the Communicator.
      until: "shortest" (training: the step runs only when every rank has a batch) or
        "longest" (evaluation, prediction: ranks that are out take part with empty
        batches until every rank is out).
      what: "fit", "evaluate" or "predict", for the report.
    """

    def __init__(self, comm: Communicator, until: str, what: str):
        if until not in UNTIL:
            raise ValueError(f"until must be one of {UNTIL}, got {until!r}")
        self.comm, self.until, self.what = comm, until, what

    def next(self, iterator: tf.data.Iterator) -> Any:
        """This step's batch (or an empty one, see ``until``); raises StopIteration on
        every rank together when the ranks agree the data is over."""
        optional = iterator.get_next_as_optional()
        have = optional.has_value()
        if self.comm.size == 1:
            if not bool(have):
                raise StopIteration
            return optional.get_value()
        flags = self.comm.allgather(tf.reshape(tf.cast(have, tf.int32), [1]), AGREEMENT)
        flags = flags.numpy()
        if self.until == "shortest" and not flags.all():
            if flags.any() and self.comm.rank == 0:
                _log.warning("%s: the epoch ended for every rank when rank(s) %s ran out of "
                             "data; rank(s) %s had at least one batch more, left unused",
                             self.what, _ranks(flags == 0), _ranks(flags == 1))
            raise StopIteration
        if not flags.any():
            raise StopIteration
        return optional.get_value() if bool(have) else empty_batch(iterator.element_spec)


class StepsAgreement:
    """What :func:`agree_on_steps` decided: ``batches`` per rank (None: unknown),
    ``steps`` every rank runs per epoch (None: found by :class:`RankBatches`), and the
    data each rank should feed (``x``, ``y``, ``sample_weight``)."""

    def __init__(self, batches: List[Optional[int]], steps: Optional[int], x: Any, y: Any,
                 sample_weight: Any):
        self.batches, self.steps = batches, steps
        self.x, self.y, self.sample_weight = x, y, sample_weight

    @property
    def unused(self) -> Dict[int, int]:
        """{rank: batches per epoch it does not train on} (training, known lengths)."""
        steps = self.steps
        if steps is None or any(b is None for b in self.batches):
            return {}
        return {r: b - steps for r, b in enumerate(self.batches) if b is not None and b > steps}


def agree_on_steps(comm: Communicator, until: str, what: str, x: Any, y: Any = None,
                   sample_weight: Any = None,
                   batch_size: Optional[int] = None) -> StepsAgreement:
    """Makes Keras's loop run the same number of steps on every rank (a collective:
    one ``allgather_object``; nothing in one process).

    Args:
      comm: the Communicator.
      until: "shortest" (training: a dataset is cut to the shortest rank's batches,
        arrays to its rows) or "longest" (evaluation, prediction: every rank runs the
        longest rank's number of steps; :class:`RankBatches` feeds empty batches).
      what: "fit", "evaluate" or "predict", for messages.
      x, y, sample_weight: the call's data: a ``tf.data.Dataset`` or arrays (a nest of
        numpy arrays or tensors [n, ...]); other kinds (generators) are left to
        :class:`RankBatches`.
      batch_size: arrays' batch size (Keras's default 32).

    Returns:
      a StepsAgreement; ``steps`` is the number of steps to pass to Keras (None: leave
      Keras's own), ``x``/``y``/``sample_weight`` the data to pass on.
    """
    mine = _batches_of(x, batch_size)
    if comm.size == 1:
        return StepsAgreement([mine], None, x, y, sample_weight)
    batches = comm.allgather_object(mine)
    if any(b is None for b in batches):
        if isinstance(x, tf.data.Dataset):  # Keras must not stop on its own count
            x = x.filter(lambda *_: True)
        elif mine is not None:
            raise ValueError(f"{what}: rank(s) {_ranks([b is None for b in batches])} feed "
                             f"data of unknown length while this rank feeds arrays; feed "
                             "a tf.data.Dataset on every rank")
        return StepsAgreement(batches, None, x, y, sample_weight)
    if len(set(batches)) == 1:
        return StepsAgreement(batches, None, x, y, sample_weight)
    if until == "longest":
        return StepsAgreement(batches, max(batches), x, y, sample_weight)
    steps = min(batches)
    agreed = StepsAgreement(batches, steps, *_cut(x, y, sample_weight, steps, batch_size))
    if comm.rank == 0:
        _log.warning("%s: the ranks have %s batches per epoch; every rank trains on %d per "
                     "epoch (unused per epoch: %s)", what, batches, steps,
                     ", ".join(f"rank {r}: {n}" for r, n in agreed.unused.items()))
    return agreed


def _batches_of(x, batch_size) -> Optional[int]:
    """Batches per epoch of ``x``, or None when not known ahead."""
    if isinstance(x, tf.data.Dataset):
        n = int(x.cardinality().numpy())
        return n if n >= 0 else None
    leaves = tf.nest.flatten(x)
    if leaves and all(hasattr(a, "shape") and len(a.shape) > 0 for a in leaves):
        return math.ceil(int(leaves[0].shape[0]) / (batch_size or 32))
    return None


def _cut(x, y, sample_weight, steps: int, batch_size):
    """The first ``steps`` batches of the data."""
    if isinstance(x, tf.data.Dataset):
        return x.take(steps), y, sample_weight
    rows = steps * (batch_size or 32)
    cut = lambda data: None if data is None else tf.nest.map_structure(lambda a: a[:rows], data)
    return cut(x), cut(y), cut(sample_weight)


def _ranks(mask: Sequence[bool]) -> str:
    return ", ".join(str(r) for r, m in enumerate(mask) if m)
