"""A communicator whose collectives also occupy an emulated network link.

On one machine the Gloo collectives run over loopback: they cost well under a
millisecond per step and use the same CPU cores as the compute, so there is nothing for
a pipeline to hide and no separate resource to hide it on. NestPipe's and EmbRace's
premise is a network that moves bytes while the accelerators compute. This wrapper
emulates that: after each real collective the received tensor is released only when an
emulated link (one per process, serving one transfer at a time in arrival order) has carried its bytes at
``megabytes_per_s``; the wait sleeps in a ``tf.py_function`` and holds no CPU. Gradients
of an AlltoAll wait on the link the same way.

Benchmarks only: results labelled "emulated network" must not be read as loopback ones.
"""
import threading
import time

import numpy as np
import tensorflow as tf

from tf_fusedemb.comm.communicator import Communicator


class EmulatedNetworkCommunicator(Communicator):
    """Wraps ``base``; every AlltoAll and AllReduce also takes bytes / bandwidth of wall
    time on a per-process link (serialised), plus ``latency_ms`` per transfer."""

    def __init__(self, base: Communicator, megabytes_per_s: float, latency_ms: float = 0.0):
        if megabytes_per_s <= 0:
            raise ValueError(f"megabytes_per_s must be > 0, got {megabytes_per_s}")
        self.base = base
        self.rank, self.size = base.rank, base.size
        self.seconds_per_byte = 1.0 / (megabytes_per_s * 1e6)
        self.latency_s = latency_ms / 1e3
        # A FIFO link: transfers are served in the order they arrive (a NIC's queue), not
        # in the arbitrary order a plain lock would grant.
        self._link = threading.Condition()
        self._next_ticket = 0
        self._serving = 0
        self.busy_seconds = 0.0  # total emulated transfer time (for reports)

    def _transfer(self, nbytes):
        def occupy(n):
            with self._link:
                ticket = self._next_ticket
                self._next_ticket += 1
                self._link.wait_for(lambda: self._serving == ticket)
            seconds = self.latency_s + float(n) * self.seconds_per_byte
            time.sleep(seconds)
            with self._link:
                self.busy_seconds += seconds
                self._serving += 1
                self._link.notify_all()
            return np.int64(n)
        return tf.py_function(occupy, [tf.cast(nbytes, tf.int64)], tf.int64)

    def _after_transfer(self, tensor, nbytes):
        with tf.control_dependencies([self._transfer(nbytes)]):
            return tf.identity(tensor)

    def _link_on_gradient(self, tensor):
        @tf.custom_gradient
        def identity(x):
            def grad(dy):
                return self._after_transfer(dy, _nbytes(dy))
            return tf.identity(x), grad
        return identity(tensor)

    def alltoall(self, tensor, splits, name, counters=None):
        if tensor.dtype.is_floating:
            tensor = self._link_on_gradient(tensor)
        received, recv_splits = self.base.alltoall(tensor, splits, name, counters)
        return self._after_transfer(received, _nbytes(received)), recv_splits

    def allreduce_sum(self, tensor, name):
        reduced = self.base.allreduce_sum(tensor, name)
        return self._after_transfer(reduced, 2 * _nbytes(tensor))  # ring: ~2x the payload

    def allreduce_sum_list(self, tensors, name):
        reduced = self.base.allreduce_sum_list(tensors, name)
        if not reduced:
            return reduced
        done = self._transfer(2 * tf.add_n([_nbytes(t) for t in tensors]))
        with tf.control_dependencies([done]):
            return [tf.identity(t) for t in reduced]

    def allgather_object(self, obj):
        return self.base.allgather_object(obj)


def _nbytes(tensor):
    return tf.size(tensor, out_type=tf.int64) * tensor.dtype.size
