"""Bounded-lag synchronous (BLS) alltoallv on MPI one-sided communication (paper 001).

Ranks may be up to ``lag`` = k iterations apart. Every rank exposes k receive slots per
peer (one for k = 0) in an RMA window; the message of iteration j goes to slot
s = j mod k (the paper's tag). An exchange is split in two, as the paper's
initiation/completion:

  ``start(j, sends)``   Put each peer's message into its slot s at that peer, then
                        raise the peer's arrival counter of (s, me). Blocks only while
                        the peer has not yet consumed iteration j - max(k, 1) from that slot.
  ``finish(j)``         waits until every peer's message of iteration j has arrived and
                        returns them.

Consumption is eager: in every call (and while waiting) a rank copies each arrived
message out of its slot into a local inbox and raises, at the sender, the consumption
counter of (s, me), so a slot is free again as soon as its message was read, however
late the receiver's ``finish`` of that iteration comes.

A caller runs ``start(j)`` then ``finish(j - k)``: with k = 0 that is ``start(j);
finish(j)``, exactly a synchronous alltoallv (nobody leaves iteration j before every
rank entered it); with k > 0 a fast rank runs up to k iterations ahead of a slow one.

Window layout per rank (passive target, ``Lock_all`` once; no rank ever waits for
another's MPI call, only for counters in its own memory):
  data  (disp_unit 1): slot s, source p at byte ((s * N) + p) * capacity
  ctrl  (disp_unit 8, int64): arrivals[s, p] at s*N + p, sizes[s, p] at S*N + s*N + p,
        consumed[s, q] (by receiver q, of my messages in slot s) at 2*S*N + s*N + q
Counters and size headers are only changed by ``Accumulate`` and read by
``Fetch_and_op(NO_OP)``: both atomic, so a reader never sees a torn value. Data travels
by ``Put``; data and header are flushed before the arrival counter is raised (RMA
operations to different locations are not ordered otherwise).

Messages are bytes of any numpy array, of any size from 0 to ``capacity_bytes``
per (slot, peer); a larger one raises :class:`BLSCapacityError` before anything is
sent.

Deadlines: every wait has one (``timeout_s``), so a dead or stuck peer never hangs the
job. Waits for a peer's counter poll this rank's own memory and raise
:class:`BLSTimeoutError` naming the peer. The MPI calls that block inside MPI until a peer
takes part (``Win.Flush`` to a peer, window creation and release, ``Barrier``) cannot
be interrupted: on transports without asynchronous progress (Open MPI's ``osc pt2pt``,
used between hosts, see ``tf_fusedemb.testing.mpirun``) a Flush returns only once the
target rank enters MPI again, so a peer stalled outside MPI, or dead without mpirun
noticing, would block it for ever. A watchdog thread (:class:`_BlockingCallDeadline`)
bounds them: past the deadline it writes the same BLSTimeoutError message to stderr
and ends the process with status :data:`TIMEOUT_EXIT_STATUS` (MPI cannot be used again
after an abandoned call), and mpirun then stops the job. Flushes to this rank itself
need no peer and are not watched.
"""
import os
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["BLSAlltoallv", "BLSCapacityError", "BLSTimeoutError", "TIMEOUT_EXIT_STATUS"]

TIMEOUT_EXIT_STATUS = 124  # a rank whose blocking MPI call passed its deadline (as timeout(1))


class BLSTimeoutError(RuntimeError):
    """A peer did not deliver or consume a message before the deadline."""


class BLSCapacityError(ValueError):
    """A message is larger than the slot capacity fixed at construction."""


def timeout_message(rank: int, timeout_s: float, what: str, peer: Optional[int]) -> str:
    """The text of a BLS deadline, naming the rank waited for (``peer``; None: several)."""
    who = "a rank" if peer is None else f"rank {peer}"
    return (f"BLS alltoallv on rank {rank}: waited {timeout_s:.0f}s for {what}; {who} died, "
            "hangs or runs more than the lag behind")


class _BlockingCallDeadline:
    """Bounds the MPI calls that cannot time out by themselves (see the module doc).

    ``call(fn, *args, what=..., peer=...)`` runs ``fn(*args)`` while a daemon thread
    watches the clock; if it has not returned ``timeout_s`` later, the thread writes
    ``BLSTimeoutError: <timeout_message>`` to stderr and ends the process with
    :data:`TIMEOUT_EXIT_STATUS`. Costs two attribute writes per call."""

    def __init__(self, rank: int, timeout_s: float):
        self._rank, self._timeout_s = rank, timeout_s
        # (deadline, what, peer) of the call in progress
        self._current: Optional[Tuple[float, str, Optional[int]]] = None
        self._stop = threading.Event()
        period = min(0.25, max(timeout_s / 20, 0.005))
        self._thread = threading.Thread(target=self._watch, args=(period,), daemon=True,
                                        name=f"bls-deadline-rank{rank}")
        self._thread.start()

    def call(self, fn, *args, what: str, peer: Optional[int]):
        self._current = (time.monotonic() + self._timeout_s, what, peer)
        try:
            return fn(*args)
        finally:
            self._current = None

    def stop(self):
        self._stop.set()

    def _watch(self, period):
        while not self._stop.wait(period):
            current = self._current
            if current is not None and time.monotonic() > current[0]:
                _, what, peer = current
                text = (f"BLSTimeoutError: {timeout_message(self._rank, self._timeout_s, what, peer)}"
                        f" (blocked inside MPI, which cannot be interrupted: rank {self._rank} "
                        f"exits with status {TIMEOUT_EXIT_STATUS})\n")
                os.write(2, text.encode())
                os._exit(TIMEOUT_EXIT_STATUS)


class BLSAlltoallv:
    """Bounded-lag alltoallv over the ranks of an mpi4py communicator (collective ctor).

    Args:
      comm: an ``mpi4py.MPI.Intracomm`` (e.g. ``MPI.COMM_WORLD``).
      lag: k >= 0; k = 0 is the synchronous collective.
      capacity_bytes: largest message per (slot, peer); every rank must pass the same.
      timeout_s: deadline of every wait for a peer (see the module doc).

    Raises:
      BLSTimeoutError: a peer did not deliver or consume in time (from any method).
      RuntimeError: MPI could not create the windows (the message says which transport
        settings work between hosts).
    """

    def __init__(self, comm: Any, lag: int, capacity_bytes: int, timeout_s: float = 60.0):
        # mpi4py is optional: only bounded-lag inference (mpirun) needs it.
        from mpi4py import MPI  # pylint: disable=import-outside-toplevel
        if not isinstance(lag, int) or lag < 0:
            raise ValueError(f"lag must be an int >= 0, got {lag!r}")
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self._mpi, self.comm = MPI, comm
        self.rank, self.size, self.lag = comm.Get_rank(), comm.Get_size(), lag
        self.slots = max(lag, 1)
        self.capacity = int(-(-capacity_bytes // 8) * 8)  # 8-byte aligned slots
        self.timeout_s = float(timeout_s)
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self._blocking = _BlockingCallDeadline(self.rank, self.timeout_s)
        n, s = self.size, self.slots
        collective = "every rank to create the BLS windows (collective)"
        try:
            self._data = self._blocking.call(MPI.Win.Allocate, s * n * self.capacity, 1,
                                             MPI.INFO_NULL, comm, what=collective, peer=None)
            self._ctrl = self._blocking.call(MPI.Win.Allocate, 3 * s * n * 8, 8,
                                             MPI.INFO_NULL, comm, what=collective, peer=None)
        except MPI.Exception as e:
            self._blocking.stop()
            raise RuntimeError(
                f"BLS alltoallv on rank {self.rank}: MPI could not create an RMA window "
                f"({e}). Between hosts Open MPI 4.1 needs its pt2pt one-sided component and a "
                "thread level below MPI_THREAD_MULTIPLE: --mca osc pt2pt and "
                "MPI4PY_RC_THREAD_LEVEL=serialized (tf_fusedemb.testing.mpirun --hosts sets "
                "both)") from e
        np.frombuffer(self._ctrl.tomemory(), np.int64)[:] = 0
        # Every counter is zero before anyone may raise one.
        self._blocking.call(comm.Barrier, what=collective, peer=None)
        self._data.Lock_all(MPI.MODE_NOCHECK)
        self._ctrl.Lock_all(MPI.MODE_NOCHECK)
        self._one = np.ones(1, np.int64)
        self._started = self._finished = 0
        # iteration -> {source rank: uint8[bytes]}, copied out of the slots
        self._inbox: Dict[int, Dict[int, np.ndarray]] = {}
        self._next_from = [0] * self.size  # next iteration expected from each rank
        self._closed = False

    # ---- public API ---------------------------------------------------------------------
    def start(self, j: int, sends: Sequence[np.ndarray]) -> None:
        """Initiates iteration ``j`` (iterations start in order 0, 1, ...).

        Args:
          j: the iteration; ``finish(j - lag)`` must have run before ``start(j + 1)``.
          sends: N arrays, ``sends[q]`` goes to rank q (any dtype, any size, may be empty).
        """
        self._check_open()
        if j != self._started:
            raise ValueError(f"BLS start: expected iteration {self._started}, got {j}")
        if self._started - self._finished > self.lag:
            raise ValueError(f"BLS start({j}): iteration {self._finished} must be finished "
                             f"first (lag {self.lag})")
        if len(sends) != self.size:
            raise ValueError(f"BLS start({j}): need {self.size} messages, got {len(sends)}")
        payloads = [np.ascontiguousarray(m).reshape(-1).view(np.uint8) for m in sends]
        for q, p in enumerate(payloads):
            if p.nbytes > self.capacity:
                raise BLSCapacityError(
                    f"BLS start({j}) on rank {self.rank}: message to rank {q} has {p.nbytes} "
                    f"bytes, more than the slot capacity {self.capacity}; build BLSAlltoallv "
                    "with a larger capacity_bytes")
        slot, uses = j % self.slots, j // self.slots
        self._inbox.setdefault(j, {})[self.rank] = payloads[self.rank].copy()
        for step in range(1, self.size):  # staggered order: no peer is everyone's first
            q = (self.rank + step) % self.size
            index = self._counter_index("consumed", slot, q)
            self._wait(lambda i=index, u=uses: self._read(i) >= u,
                       f"rank {q} to consume iteration {j - self.slots} (slot {slot})", q)
            self._put(q, slot, payloads[q])
        self._started += 1
        self._drain()

    def finish(self, j: int) -> List[np.ndarray]:
        """Completes iteration ``j``: returns N uint8 arrays, ``[p]`` the bytes rank p sent
        (view them with ``.view(dtype)``)."""
        self._check_open()
        if j != self._finished or j >= self._started:
            raise ValueError(f"BLS finish: expected iteration {self._finished} (started "
                             f"{self._started}), got {j}")
        for step in range(1, self.size):
            p = (self.rank - step) % self.size
            self._wait(lambda p=p: self._next_from[p] > j,
                       f"rank {p}'s message of iteration {j} (slot {j % self.slots})", p)
        self._finished += 1
        got = self._inbox.pop(j)
        return [got[p] for p in range(self.size)]

    def close(self) -> None:
        """Collective: waits (with the deadline) for every rank, then frees the windows."""
        if self._closed:
            return
        request = self.comm.Ibarrier()
        deadline = time.monotonic() + self.timeout_s
        while not request.Test():
            self._drain()  # a peer may still wait for a slot this rank has not read
            if time.monotonic() > deadline:
                raise BLSTimeoutError(f"BLS close on rank {self.rank}: not every rank "
                                      f"reached close within {self.timeout_s:.0f}s")
            time.sleep(1e-3)
        self._closed = True
        for win in (self._data, self._ctrl):
            self._blocking.call(win.Unlock_all, what="its RMA operations to complete", peer=None)
            self._blocking.call(win.Free, what="every rank to free the BLS windows", peer=None)
        self._blocking.stop()

    def __enter__(self) -> "BLSAlltoallv":
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()

    # ---- internals ----------------------------------------------------------------------
    def _counter_index(self, kind, slot, peer):
        base = {"arrivals": 0, "sizes": 1, "consumed": 2}[kind] * self.slots * self.size
        return base + slot * self.size + peer

    def _read(self, index):
        """Atomic read of int64 ctrl[index] of this rank."""
        mpi, out = self._mpi, np.zeros(1, np.int64)
        self._ctrl.Fetch_and_op([self._one, mpi.INT64_T], [out, mpi.INT64_T], self.rank,
                                index, op=mpi.NO_OP)
        self._ctrl.Flush(self.rank)
        return int(out[0])

    def _wait(self, ready, what, peer):
        """Drains arrived messages until ``ready()``; backs off so oversubscribed ranks
        still get the CPU; raises after the deadline."""
        deadline, pause = time.monotonic() + self.timeout_s, 1e-5
        while not ready():
            self._drain()
            if ready():
                return
            if time.monotonic() > deadline:
                raise BLSTimeoutError(timeout_message(self.rank, self.timeout_s, what, peer))
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def _drain(self):
        """Copies every arrived message out of its slot and frees the slot at once (the
        sender may reuse it): consumption never waits for ``finish``, so two ranks that
        both wait in ``start`` for each other's consumption cannot deadlock."""
        mpi = self._mpi
        for step in range(1, self.size):
            p = (self.rank - step) % self.size
            while True:
                it = self._next_from[p]
                slot = it % self.slots
                if self._read(self._counter_index("arrivals", slot, p)) < it // self.slots + 1:
                    break
                self._inbox.setdefault(it, {})[p] = self._take(p, slot)
                self._next_from[p] = it + 1
                self._ctrl.Accumulate([self._one, mpi.INT64_T], p, target=(
                    self._counter_index("consumed", slot, self.rank), 1, mpi.INT64_T),
                    op=mpi.SUM)
                self._blocking.call(self._ctrl.Flush, p, peer=p,
                                    what=f"rank {p} to take our consumption of iteration {it}")

    def _put(self, q, slot, payload):
        self._blocking.call(self._put_and_flush, q, slot, payload, peer=q,
                            what=f"rank {q} to take our message (slot {slot})")

    def _put_and_flush(self, q, slot, payload):
        mpi = self._mpi
        if payload.nbytes:
            self._data.Put([payload, mpi.BYTE], q,
                           target=((slot * self.size + self.rank) * self.capacity,
                                   payload.nbytes, mpi.BYTE))
        size = np.array([payload.nbytes], np.int64)
        self._ctrl.Accumulate([size, mpi.INT64_T], q, target=(
            self._counter_index("sizes", slot, self.rank), 1, mpi.INT64_T), op=mpi.REPLACE)
        self._data.Flush(q)  # data and size complete at q before the arrival is counted
        self._ctrl.Flush(q)
        self._ctrl.Accumulate([self._one, mpi.INT64_T], q,
                              target=(self._counter_index("arrivals", slot, self.rank), 1,
                                      mpi.INT64_T), op=mpi.SUM)
        self._ctrl.Flush(q)

    def _take(self, p, slot):
        """Copy of rank p's message in ``slot`` of this rank's window (uint8[bytes])."""
        mpi = self._mpi
        nbytes = self._read(self._counter_index("sizes", slot, p))
        out = np.empty(nbytes, np.uint8)
        if nbytes:
            self._data.Get([out, mpi.BYTE], self.rank,
                           target=((slot * self.size + p) * self.capacity, nbytes, mpi.BYTE))
            self._data.Flush(self.rank)
        return out

    def _check_open(self):
        if self._closed:
            raise ValueError("BLSAlltoallv is closed")
