"""How the lookup benchmark counts AlltoAll rounds and bytes, for every variant alike.

Two independent counts, reported side by side:

* **Static** (``graph_alltoall_ops``): the ``HorovodAlltoall`` nodes of the traced
  training-step graph, gradient included (the tape runs inside the ``tf.function``, so
  the backward AlltoAlls are nodes of the same graph), plus those of any function in the
  graph's library. The step has no data-dependent control flow, so every node runs once
  per step: nodes = rounds per step.
* **Run time** (counters): ``tf_fusedemb.comm.CommCounters`` variables updated inside the
  graph. FusedEmbedding counts its own rounds (``layer.comm_counters()``). TFRA has no
  counters, so :class:`AlltoallShim` wraps ``horovod.tensorflow.alltoall`` -- the
  attribute TFRA's ``HvdVariable`` calls (``self.hvd.alltoall``) -- while a TFRA step is
  traced. The shim calls the real op unchanged and adds, after it, ``counters.record``
  (sent and received row counts per peer x bytes per row) and, for a float tensor, an
  identity whose gradient records the gradient AlltoAll that Horovod's registered
  ``HorovodAlltoall`` gradient then issues: it sends ``dy`` (``recv_splits`` rows to each
  peer) and receives ``splits`` rows. The collectives, their order, names and payloads
  are exactly TFRA's; only small counter updates are added (as FusedEmbedding has).

Bytes are payload bytes sent to OTHER ranks (the slice a rank keeps is not counted);
``messages`` are non-empty per-peer messages to other ranks.
"""
import contextlib
import threading

import tensorflow as tf

from tf_fusedemb.comm.counters import FIELDS as COUNTER_FIELDS

_state = threading.local()


class AlltoallShim:
    """Installs a counting wrapper around ``horovod.tensorflow.alltoall`` (once per
    process). It counts only inside :meth:`counting` blocks; elsewhere it is the plain
    Horovod call. Every call of a TFRA variant's step function runs inside such a block,
    so a (re)trace of it is always counted into that variant's counters."""

    _installed = None
    _rank = 0  # this process's rank (the constructor sets it)

    def __init__(self, hvd, rank):
        self.hvd, self.rank = hvd, rank
        if AlltoallShim._installed is None:
            AlltoallShim._installed = hvd.alltoall
            original = hvd.alltoall

            def counted(tensor, splits=None, name=None, ignore_name_scope=False, **kwargs):
                out = original(tensor, splits=splits, name=name,
                               ignore_name_scope=ignore_name_scope, **kwargs)
                active = getattr(_state, "counters", None)
                if active is None or splits is None:
                    return out
                return _record(active, AlltoallShim._rank, tensor, splits, *out)
            hvd.alltoall = counted
        AlltoallShim._rank = rank

    @staticmethod
    @contextlib.contextmanager
    def counting(counters):
        """Within the block, traced ``hvd.alltoall`` calls record into ``counters``."""
        previous = getattr(_state, "counters", None)
        _state.counters = counters
        try:
            yield
        finally:
            _state.counters = previous


def _record(counters, rank, tensor, splits, received, recv_splits):
    tensor = tf.convert_to_tensor(tensor)
    splits = tf.cast(splits, tf.int32)
    with tf.control_dependencies([counters.record(splits, recv_splits, tensor, rank)]):
        received = tf.identity(received)
    if not tensor.dtype.is_floating:
        return received, recv_splits

    @tf.custom_gradient
    def tap(x):
        def grad(dy):
            dy = tf.convert_to_tensor(dy)
            # Horovod's gradient sends dy back with splits=recv_splits, receives splits.
            with tf.control_dependencies([counters.record(recv_splits, splits, dy, rank)]):
                return tf.identity(dy)
        return tf.identity(x), grad
    return tap(received), recv_splits


def graph_alltoall_ops(concrete_function):
    """Number of ``HorovodAlltoall`` nodes in a concrete function's graph and library."""
    graph_def = concrete_function.graph.as_graph_def()
    count = sum(1 for n in graph_def.node if n.op == "HorovodAlltoall")
    for fn in graph_def.library.function:
        count += sum(1 for n in fn.node_def if n.op == "HorovodAlltoall")
    return count


def per_step(before, after, steps):
    """Counter snapshots (dicts of CommCounters fields, possibly summed over groups) ->
    per-step rounds, bytes sent/received, messages and the mean message size."""
    d = {f: after[f] - before[f] for f in COUNTER_FIELDS}
    return {
        "alltoall_rounds_per_step": d["rounds"] / steps,
        "bytes_per_step": d["bytes_sent"] / steps,
        "bytes_received_per_step": d["bytes_received"] / steps,
        "messages_per_step": d["messages"] / steps,
        "mean_message_bytes": d["bytes_sent"] / max(1, d["messages"]),
    }


def sum_snapshots(snapshots):
    """Field-wise sum of several counter snapshots (e.g. the groups of a layer)."""
    return {f: sum(s[f] for s in snapshots) for f in COUNTER_FIELDS}
