"""Collectives for tf_fusedemb: Horovod under horovodrun, the identity in one process.

Every collective gets a deterministic name built by the caller from the group and its
role ("<group>/keys", "<group>/rows"), so all ranks build identical graphs.
"""
import contextlib
import os
import sys

import tensorflow as tf

from tf_fusedemb.comm import watchdog as _watchdog


def _row_bytes(tensor):
    """Bytes of one row (first dimension) of ``tensor``, as an int64 tensor."""
    row_elems = tf.reduce_prod(tf.shape(tensor, out_type=tf.int64)[1:])
    return row_elems * tensor.dtype.size


class Communicator:
    """Interface: ``rank``, ``size``, ``alltoall``, ``allreduce_sum``, ``allgather_object``."""
    rank = 0
    size = 1

    def alltoall(self, tensor, splits, name, counters=None):
        """Differentiable AlltoAll of ``tensor`` (rows split by int32[N] ``splits``).
        Returns ``(received, received_splits)``; the gradient of ``received`` travels
        back in one AlltoAll named ``name + "_grad"``. Both rounds are recorded in
        ``counters`` (a :class:`CommCounters`) when given."""
        raise NotImplementedError

    def allreduce_sum(self, tensor, name):
        raise NotImplementedError

    def allreduce_sum_list(self, tensors, name):
        """Sums of a list of tensors over ranks, as few collective rounds as possible."""
        raise NotImplementedError

    def allgather(self, tensor, name):
        """Concatenation over ranks (in rank order) of ``tensor`` along its first
        dimension; each rank may hold a different number of rows. Not differentiable."""
        raise NotImplementedError

    def allgather_object(self, obj):
        raise NotImplementedError

    def watch(self, activity):
        """Context manager: runs its body as ``activity`` (e.g. "training step 31"). When
        a peer rank dies meanwhile, an error of the body becomes a
        :class:`~tf_fusedemb.comm.watchdog.PeerLostError` naming the lost rank and the
        activity (see :mod:`tf_fusedemb.comm.watchdog`). A no-op in one process."""
        del activity
        return contextlib.nullcontext()


class LocalCommunicator(Communicator):
    """World size 1: collectives are identities and nothing is counted as sent."""

    def alltoall(self, tensor, splits, name, counters=None):
        del name, counters
        return tf.identity(tensor), tf.identity(tf.cast(splits, tf.int32))

    def allreduce_sum(self, tensor, name):
        del name
        return tensor

    def allreduce_sum_list(self, tensors, name):
        del name
        return list(tensors)

    def allgather(self, tensor, name):
        del name
        return tf.identity(tensor)

    def allgather_object(self, obj):
        return [obj]


class HorovodCommunicator(Communicator):
    """Horovod collectives (Gloo or MPI controller, CPU or GPU), initialised on demand."""

    def __init__(self):
        import horovod.tensorflow as hvd  # pylint: disable=import-outside-toplevel
        if not hvd.is_initialized():
            hvd.init()
        self._hvd = hvd
        self.rank = hvd.rank()
        self.size = hvd.size()
        # A killed peer is named and cannot leave this rank hanging (comm/watchdog.py).
        # Set up eagerly even when the first communicator is made while tracing.
        with tf.init_scope():
            self._watchdog = _watchdog.start_watchdog(
                self.rank, self.size,
                lambda obj: hvd.allgather_object(obj, name="fusedemb/watchdog_addresses"))

    def watch(self, activity):
        if self._watchdog is None:
            return contextlib.nullcontext()
        return self._watchdog.watch(activity)

    def alltoall(self, tensor, splits, name, counters=None):
        hvd, rank = self._hvd, self.rank
        splits = tf.cast(splits, tf.int32)

        # Counter updates are not made control inputs of the received tensors: they run
        # anyway (stateful ops in a tf.function, or eagerly), and gating on them would
        # chain every collective of a group behind the previous one's counter update in
        # program order, which serialises pipelined micro-batches (tf_fusedemb.pipeline).
        @tf.custom_gradient
        def exchange(x):
            received, recv_splits = hvd.alltoall(x, splits=splits, name=name)
            if counters is not None:
                counters.record(splits, recv_splits, _row_bytes(x), rank)

            def grad(dy):
                back, _ = hvd.alltoall(dy, splits=recv_splits, name=name + "_grad")
                if counters is not None:
                    counters.record(recv_splits, splits, _row_bytes(dy), rank)
                return back
            return (tf.identity(received), tf.identity(recv_splits)), \
                lambda dy, _dsplits: grad(dy)
        if not tensor.dtype.is_floating:  # keys: no gradient, plain collective
            received, recv_splits = hvd.alltoall(tensor, splits=splits, name=name)
            if counters is not None:
                counters.record(splits, recv_splits, _row_bytes(tensor), rank)
            return received, recv_splits
        return exchange(tensor)

    def allreduce_sum(self, tensor, name):
        return self._hvd.allreduce(tensor, op=self._hvd.Sum, name=name)

    def allreduce_sum_list(self, tensors, name):
        # One grouped collective for all dense gradients (EmbRace's dense AllReduce).
        del name  # grouped_allreduce names its ops after the graph's node names
        return self._hvd.grouped_allreduce(list(tensors), op=self._hvd.Sum)

    def allgather(self, tensor, name):
        return self._hvd.allgather(tf.stop_gradient(tensor), name=name)

    def allgather_object(self, obj):
        with self.watch("allgather_object"):
            return self._hvd.allgather_object(obj)


_COMMUNICATOR = None


def get_communicator():
    """The process's communicator: Horovod when launched by horovodrun (HOROVOD_RANK set)
    or when Horovod is already initialised, else the single-process one."""
    global _COMMUNICATOR
    if _COMMUNICATOR is None:
        hvd = sys.modules.get("horovod.tensorflow")  # already imported by the user?
        hvd_ready = hvd is not None and hvd.is_initialized()
        if hvd_ready or "HOROVOD_RANK" in os.environ:
            _COMMUNICATOR = HorovodCommunicator()
        else:
            _COMMUNICATOR = LocalCommunicator()
    return _COMMUNICATOR
