"""Collectives for tf_fusedemb: Horovod under horovodrun, the identity in one process.

Every collective gets a deterministic name built by the caller from the group and its
role ("<group>/keys", "<group>/rows"), so all ranks build identical graphs.

Horovod matches a collective across ranks by its graph node name, which TensorFlow
prefixes with the name scopes it was built in, and those hold Keras's per-process layer
names (``fused_embedding_2``, ``dense_7``): a rank that built one more unnamed model
before training would name its collectives differently and every rank would wait
forever. So each collective is built in an absolute name scope of its own
(``<name>.<k>/``, k counting that name's collectives in the graph being traced, the
same on every rank), and its inputs are renamed there, so nothing a rank did before
enters the names.
"""
import collections
import contextlib
import os
import sys
import weakref
from typing import Any, Callable, ContextManager, Iterator, List, Optional, Sequence, Tuple

import tensorflow as tf

from tf_fusedemb.comm import watchdog as _watchdog
from tf_fusedemb.comm.counters import CommCounters
from tf_fusedemb.comm.topology import Topology, init_horovod


class Communicator:
    """Interface: ``rank``, ``size``, ``topology``, ``alltoall``, ``allreduce_sum``,
    ``allgather``, ``allgather_object``, ``broadcast``."""
    rank = 0
    size = 1
    topology = Topology.single()

    def alltoall(self, tensor: tf.Tensor, splits: tf.Tensor, name: str,
                 counters: Optional[CommCounters] = None,
                 members: Optional[Sequence[int]] = None) -> Tuple[tf.Tensor, tf.Tensor]:
        """Differentiable AlltoAll of ``tensor`` among ``members`` (sorted global ranks,
        default all; e.g. a node or a rail of ``topology``), rows split by int32[k]
        ``splits`` in member order. Returns ``(received, received_splits int32[k])``; the
        gradient of ``received`` travels back in one AlltoAll named ``name + "_grad"``.
        Both rounds are recorded in ``counters`` (a :class:`CommCounters`, by link class)
        when given."""
        raise NotImplementedError

    def allreduce_sum(self, tensor: tf.Tensor, name: str) -> tf.Tensor:
        raise NotImplementedError

    def allreduce_sum_list(self, tensors: Sequence[tf.Tensor], name: str) -> List[tf.Tensor]:
        """Sums of a list of tensors over ranks, as few collective rounds as possible."""
        raise NotImplementedError

    def allgather(self, tensor: tf.Tensor, name: str) -> tf.Tensor:
        """Concatenation over ranks (in rank order) of ``tensor`` along its first
        dimension; each rank may hold a different number of rows. Not differentiable."""
        raise NotImplementedError

    def allgather_object(self, obj: Any) -> List[Any]:
        raise NotImplementedError

    def broadcast(self, tensor: tf.Tensor, root: int, name: str) -> tf.Tensor:
        """``tensor`` as rank ``root`` holds it, on every rank (same shape and dtype on
        every rank). Not differentiable."""
        raise NotImplementedError

    def watch(self, activity: str) -> ContextManager[None]:
        """Context manager: runs its body as ``activity`` (e.g. "training step 31"). When
        a peer rank dies meanwhile, an error of the body becomes a
        :class:`~tf_fusedemb.comm.watchdog.PeerLostError` naming the lost rank and the
        activity (see :mod:`tf_fusedemb.comm.watchdog`). A no-op in one process."""
        del activity
        return contextlib.nullcontext()

    def end_job(self) -> None:
        """Collective, once, after this rank's last collective of the job: returns when
        every rank has called it (or exited normally). Each rank's exit then shuts
        Horovod down at once instead of waiting for the other ranks to exit (see
        :mod:`tf_fusedemb.comm.watchdog`, "The end of a job"); no collective may follow.
        A no-op in one process."""


class LocalCommunicator(Communicator):
    """World size 1: collectives are identities and nothing is counted as sent."""

    def alltoall(self, tensor: tf.Tensor, splits: tf.Tensor, name: str,
                 counters: Optional[CommCounters] = None,
                 members: Optional[Sequence[int]] = None) -> Tuple[tf.Tensor, tf.Tensor]:
        del name, counters
        if members is not None and list(members) != [0]:
            raise ValueError(f"a single process has no ranks {list(members)}")
        return tf.identity(tensor), tf.identity(tf.cast(splits, tf.int32))

    def allreduce_sum(self, tensor: tf.Tensor, name: str) -> tf.Tensor:
        del name
        return tensor

    def allreduce_sum_list(self, tensors: Sequence[tf.Tensor], name: str) -> List[tf.Tensor]:
        del name
        return list(tensors)

    def allgather(self, tensor: tf.Tensor, name: str) -> tf.Tensor:
        del name
        return tf.identity(tensor)

    def allgather_object(self, obj: Any) -> List[Any]:
        return [obj]

    def broadcast(self, tensor: tf.Tensor, root: int, name: str) -> tf.Tensor:
        del name
        if root != 0:
            raise ValueError(f"a single process has no rank {root}")
        return tf.identity(tensor)


class HorovodCommunicator(Communicator):
    """Horovod collectives (Gloo or MPI controller, CPU or GPU), initialised on demand."""

    def __init__(self) -> None:
        import horovod.tensorflow as hvd  # optional: one process needs no Horovod  pylint: disable=import-outside-toplevel
        self._hvd = hvd
        # Static process sets (one per node and rail) exist only if made at hvd.init.
        with tf.init_scope():
            self.topology, self._process_sets = init_horovod(hvd)
        self.rank = hvd.rank()
        self.size = hvd.size()
        # A killed peer is named and cannot leave this rank hanging (comm/watchdog.py).
        # Set up eagerly even when the first communicator is made while tracing.
        with tf.init_scope():
            self._watchdog = _watchdog.start_watchdog(
                self.rank, self.size,
                lambda obj: hvd.allgather_object(obj, name="fusedemb/watchdog_addresses"),
                wait_at_exit=bool(self._process_sets))

    @property
    def process_sets(self) -> List[List[int]]:
        """Members of the static process sets made at ``hvd.init`` (sorted lists)."""
        return sorted(list(m) for m in self._process_sets)

    def watch(self, activity: str) -> ContextManager[None]:
        if self._watchdog is None:
            return contextlib.nullcontext()
        return self._watchdog.watch(activity)

    def end_job(self) -> None:
        if self._watchdog is not None:
            self._watchdog.end_of_job()
            return
        with tf.init_scope():  # no watchdog: a global collective is the agreement
            self._hvd.allreduce(tf.constant(0, tf.int32), op=self._hvd.Sum,
                                name="fusedemb/end_of_job")

    def _collective(self, members):
        """``f(x, send int32[k], name) -> (received, recv int32[k])`` among ``members``:
        the process set's AlltoAll, or, without one, a world AlltoAll whose splits are
        zero outside the set (the same messages; see comm.topology)."""
        hvd = self._hvd
        if len(members) == self.size:
            return lambda x, send, name: hvd.alltoall(x, splits=send, name=name)
        pset = self._process_sets.get(members)
        if pset is not None:
            return lambda x, send, name: hvd.alltoall(x, splits=send, name=name,
                                                      process_set=pset)
        where = tf.constant(members, tf.int32)[:, None]

        def world(x, send, name):
            received, recv = hvd.alltoall(x, splits=tf.scatter_nd(where, send, [self.size]),
                                          name=name)
            return received, tf.gather(recv, where[:, 0])
        return world

    def alltoall(self, tensor: tf.Tensor, splits: tf.Tensor, name: str,
                 counters: Optional[CommCounters] = None,
                 members: Optional[Sequence[int]] = None) -> Tuple[tf.Tensor, tf.Tensor]:
        members = tuple(range(self.size)) if members is None else tuple(members)
        if self.rank not in members:
            raise ValueError(f"rank {self.rank} is not among the AlltoAll's ranks {members}")
        collective = self._collective(members)
        node = self.topology.cross_rank
        same_node = [self.topology.node_of(m) == node for m in members]
        index = members.index(self.rank)
        splits = tf.cast(splits, tf.int32)

        def count(send, recv, like):
            if counters is not None:
                counters.record(send, recv, like, index, same_node)

        # Counter updates are not made control inputs of the received tensors: they run
        # anyway (stateful ops in a tf.function, or eagerly), and gating on them would
        # chain every collective of a group behind the previous one's counter update in
        # program order, which serialises pipelined micro-batches (tf_fusedemb.pipeline).
        def scoped(x, send, collective_name):
            with collective_scope(collective_name):
                if x.dtype == tf.bfloat16:  # Horovod's ops take no bf16: its bits travel
                    out, recv = collective(tf.identity(tf.bitcast(x, tf.uint16), "x"),
                                           tf.identity(send, "splits"), collective_name)
                    return tf.bitcast(out, tf.bfloat16), recv
                return collective(tf.identity(x, "x"), tf.identity(send, "splits"),
                                  collective_name)

        @tf.custom_gradient
        def exchange(x):
            received, recv_splits = scoped(x, splits, name)
            count(splits, recv_splits, x)

            def grad(dy):
                back, _ = scoped(dy, recv_splits, name + "_grad")
                count(recv_splits, splits, dy)
                return back
            return (tf.identity(received), tf.identity(recv_splits)), \
                lambda dy, _dsplits: grad(dy)
        if not tensor.dtype.is_floating:  # keys: no gradient, plain collective
            received, recv_splits = scoped(tensor, splits, name)
            count(splits, recv_splits, tensor)
            return received, recv_splits
        return exchange(tensor)

    def allreduce_sum(self, tensor: tf.Tensor, name: str) -> tf.Tensor:
        with collective_scope(name):
            return self._hvd.allreduce(tf.identity(tensor, "x"), op=self._hvd.Sum, name=name)

    def allreduce_sum_list(self, tensors: Sequence[tf.Tensor], name: str) -> List[tf.Tensor]:
        # One grouped collective for all dense gradients (EmbRace's dense AllReduce).
        # Horovod names it after its first and last inputs: renamed in the scope.
        with collective_scope(name):
            inputs = [tf.identity(t, f"x{i}") for i, t in enumerate(tensors)]
            if self.size > GATHER_SUM_MAX_RANKS:
                return self._hvd.grouped_allreduce(inputs, op=self._hvd.Sum)
            return gather_sum(inputs, self.size,
                              lambda parts: self._hvd.grouped_allgather(parts, name="gathered"))

    def allgather(self, tensor: tf.Tensor, name: str) -> tf.Tensor:
        with collective_scope(name):
            return self._hvd.allgather(tf.stop_gradient(tensor, "x"), name=name)

    def broadcast(self, tensor: tf.Tensor, root: int, name: str) -> tf.Tensor:
        with collective_scope(name):
            return self._hvd.broadcast(tf.stop_gradient(tensor, "x"), root, name=name)

    def allgather_object(self, obj: Any) -> List[Any]:
        with self.watch("allgather_object"):
            return self._hvd.allgather_object(obj)


# With at most this many ranks, the sum of a list over ranks (allreduce_sum_list: the
# dense gradients) is an allgather and a local sum (gather_sum), not Horovod's ring
# allreduce. Why: on 2 pinned ranks of a 2-core VM, Horovod's Gloo allreduce of the lookup
# benchmark's 573 KB of dense gradients took 4.3-5.1 ms, an allgather of them and the sum
# 1.8-2.0 ms. With two ranks each rank receives the same bytes either way (the ring's
# 2(N-1)/N buffers are N-1 buffers only for N = 2) and a + b is the ring's sum bit for bit
# (addition commutes); with more the ring moves fewer bytes and keeps Horovod's order.
# The tensors must share a dtype, as for Horovod's grouped allreduce.
GATHER_SUM_MAX_RANKS = 2


def gather_sum(tensors: Sequence[tf.Tensor], ranks: int,
               allgather: Callable[[List[tf.Tensor]], List[tf.Tensor]]) -> List[tf.Tensor]:
    """Each of ``tensors`` summed over ``ranks`` ranks with one grouped allgather:
    ``allgather(parts)`` gives, for each part, every rank's part concatenated along the
    first axis in rank order; the ``ranks`` slices of each are added up in rank order. A
    scalar travels as a vector of one. Few ops: the step's graph holds each of them."""
    parts = [tf.reshape(t, [1]) if t.shape.rank == 0 else t for t in tensors]
    axis = tf.constant(0)
    out = []
    for t, part, gathered in zip(tensors, parts, allgather(parts)):
        rows = tf.split(gathered, ranks, axis=axis)
        total = rows[0]
        for other in rows[1:]:
            total = total + other
        total.set_shape(part.shape)  # the gather's first axis is not static
        out.append(tf.reshape(total, []) if t.shape.rank == 0 else total)
    return out


_NAMES_IN_GRAPH: "weakref.WeakKeyDictionary[Any, collections.Counter]" = \
    weakref.WeakKeyDictionary()


def collective_scope(name: str) -> ContextManager[Any]:
    """An absolute name scope ``<name>.<k>/`` for one collective built in a traced graph
    (k: how many collectives of that name the graph has so far); nothing when eager.
    The scope replaces the caller's (layer) name scopes, see the module doc."""
    if tf.executing_eagerly():
        return contextlib.nullcontext()
    counts = _NAMES_IN_GRAPH.setdefault(tf.compat.v1.get_default_graph(),
                                        collections.Counter())
    k = counts[name]
    counts[name] += 1
    return tf.name_scope(f"{name}.{k}/")


_COMMUNICATOR: Optional[Communicator] = None


@contextlib.contextmanager
def communicator_scope(communicator: Communicator) -> Iterator[Communicator]:
    """Inside the block, :func:`get_communicator` returns ``communicator``; the previous
    one is back afterwards. For code that builds layers without a communicator argument
    (e.g. ``tf_fusedemb.job.make_model``) on a world that is not Horovod's, such as sharded
    inference (``tf_fusedemb.inference.distributed.for_rank``)."""
    global _COMMUNICATOR
    previous, _COMMUNICATOR = _COMMUNICATOR, communicator
    try:
        yield communicator
    finally:
        _COMMUNICATOR = previous


def get_communicator() -> Communicator:
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
