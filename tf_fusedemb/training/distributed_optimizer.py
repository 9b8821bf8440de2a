"""``DistributedOptimizer``: the one line a plain Keras model or a custom training loop
needs to train with FusedEmbedding on several ranks.

Each rank differentiates the mean loss of its own batch. The embedding rows need nothing
more: their gradients are summed on their owner rank by the gradient AlltoAll and
averaged there (``tf_fusedemb.layers.row_update``). The dense variables are replicated,
so their gradients must be averaged over the ranks before the optimizer applies them, and
every rank must start from the same weights. The wrapper does both, in the manner of
Horovod's ``DistributedOptimizer`` (the optimizer's own class, subclassed, so Keras and
checkpoints see the optimizer they know):

* ``apply_gradients`` sums the gradients over the ranks in one grouped AllReduce and
  divides them by the number of ranks (the global batch's mean, for equal batches);
* the first time it is traced (before the first step runs), it writes rank 0's values into
  the variables it is given, so unseeded models start as one model. A loop that runs
  eagerly must start every rank from the same weights itself (it is checked: a
  difference fails there);
* the FusedEmbedding layers' row-update markers get a zero gradient (their gradient is a
  check that the dense gradients were averaged, see ``tf_fusedemb.layers.row_update``).

Works with tf_keras optimizers (new and legacy) and Keras 3 optimizers. In one process it
changes nothing. Exactness: with equal batches on every rank, N ranks train what one
process trains on the concatenated batch (tests/test_keras_paths.py).
"""
from typing import Any, Iterable, List, Optional, Tuple

import tensorflow as tf

from tf_fusedemb.comm import Communicator, get_communicator
from tf_fusedemb.layers.row_update import MARKER_NAME
from tf_fusedemb.training.replicas import broadcast_from_root, fingerprints

GRADIENTS_NAME = "fusedemb/optimizer_grads"
INITIAL_NAME = "fusedemb/optimizer_initial_state"
UNEQUAL_EAGER = ("tf_fusedemb.training.DistributedOptimizer: the ranks start from different "
                 "dense weights and this loop runs eagerly, so its first step already used "
                 "them: give every rank the same weights before training (or trace the step "
                 "with tf.function)")


class _Distributed:
    """The methods mixed into the wrapped optimizer's class (see module doc)."""
    _fusedemb_comm: Communicator
    _fusedemb_synced: bool

    def apply_gradients(self, grads_and_vars: Iterable[Tuple[Any, Any]], *args: Any,
                        **kwargs: Any) -> Any:
        pairs = [(g, v) for g, v in grads_and_vars]
        comm = self._fusedemb_comm
        if comm.size > 1:
            variables = [v for _, v in pairs]
            if not self._fusedemb_synced:
                _start_from_root(comm, variables)
                self._fusedemb_synced = True
            pairs = list(zip(_averaged(comm, [g for g, _ in pairs], variables), variables))
        return super().apply_gradients(pairs, *args, **kwargs)  # type: ignore[misc]


def DistributedOptimizer(optimizer: Any,  # noqa: N802  (a class-like factory, as Horovod's)
                         communicator: Optional[Communicator] = None) -> Any:
    """``optimizer`` (a tf_keras or Keras 3 optimizer, not yet used) as an instance of a
    subclass of its own class whose ``apply_gradients`` averages the gradients over the
    ranks (see the module doc). ``communicator``: default
    ``tf_fusedemb.comm.get_communicator()``. Use it for the dense variables of a plain
    Keras model (``model.compile(optimizer=DistributedOptimizer(opt))``) or in a custom
    loop; ``FusedModel`` needs no wrapper."""
    if isinstance(optimizer, _Distributed):
        return optimizer
    cls: Any = type(optimizer.__class__.__name__, (_Distributed, optimizer.__class__), {})
    wrapped = cls.from_config(optimizer.get_config())
    wrapped._fusedemb_comm = communicator or get_communicator()
    wrapped._fusedemb_synced = False
    return wrapped


def _averaged(comm: Communicator, grads: List[Any], variables: List[Any]) -> List[Any]:
    """Per variable: its gradient's mean over the ranks (None stays None: a variable the
    loss does not reach on any rank); markers get zeros."""
    dense = [None if g is None else tf.convert_to_tensor(g) for g in grads]
    present = [i for i, g in enumerate(dense) if g is not None]
    summed = comm.allreduce_sum_list([dense[i] for i in present], GRADIENTS_NAME)
    out: List[Any] = list(dense)
    for i, total in zip(present, summed):
        out[i] = total / tf.cast(comm.size, total.dtype)
        if MARKER_NAME in variables[i].name:
            out[i] = tf.zeros_like(total)
    return out


def _start_from_root(comm: Communicator, variables: List[Any]) -> None:
    """Rank 0's values in ``variables`` on every rank, eagerly (under a trace: before the
    first step runs). A loop running eagerly has already used its own values: it fails
    where they differed."""
    eager = tf.executing_eagerly()
    with tf.init_scope():
        before = fingerprints(variables).numpy()
        broadcast_from_root(comm, variables, INITIAL_NAME)
        changed = bool((fingerprints(variables).numpy() != before).any())
        if eager and any(comm.allgather_object(changed)):
            raise ValueError(UNEQUAL_EAGER)
