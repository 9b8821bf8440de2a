"""Rank program of tests/test_bls_alltoallv.py (run under mpirun).

Every message is a pure function of (iteration, sender, receiver, seed), so each rank
checks what it received against messages it regenerates with numpy alone.

  python bls_worker.py exchange LAGS ITERS SLOW_RANK   -> "BLS_OK <json>" per lag
  python bls_worker.py stall                           -> "BLS_TIMEOUT_OK" on live ranks
  python bls_worker.py die                            -> rank 1 dies (os._exit) mid-run

Under a transport without asynchronous progress (osc pt2pt) a live rank of ``stall`` may
instead block in a Flush to the stalled rank: the deadline thread then writes
"BLSTimeoutError: ..." to stderr and ends it (status 124).
"""
import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI

from tf_fusedemb.comm.bls_alltoallv import BLSAlltoallv, BLSCapacityError, BLSTimeoutError

MAX_ROWS = 40


def message(j, src, dst, seed):
    """float64[r, 3] (r random in 0..MAX_ROWS, a quarter of them empty)."""
    rng = np.random.default_rng([seed, j, src, dst])
    rows = 0 if rng.random() < 0.25 else int(rng.integers(1, MAX_ROWS + 1))
    return rng.standard_normal((rows, 3))


def exchange(lag, iters, slow_rank, seed):
    comm = MPI.COMM_WORLD
    me, n = comm.rank, comm.size
    times = {"start_in": [], "start_out": [], "finish_in": [], "finish_out": []}
    bls = BLSAlltoallv(comm, lag, capacity_bytes=MAX_ROWS * 3 * 8, timeout_s=60)
    for j in range(iters + lag):
        if j < iters:
            if me == slow_rank:
                time.sleep(0.02)  # the deliberately slow rank
            times["start_in"].append(time.time())
            bls.start(j, [message(j, me, q, seed) for q in range(n)])
            times["start_out"].append(time.time())
        i = j - lag
        if i >= 0:
            times["finish_in"].append(time.time())
            got = bls.finish(i)
            times["finish_out"].append(time.time())
            for p in range(n):
                want = message(i, p, me, seed)
                np.testing.assert_array_equal(got[p].view(np.float64).reshape(-1, 3), want)
    try:  # a message over the capacity is refused before anything is sent
        bls.start(iters, [np.zeros(MAX_ROWS * 3 + 1)] * n)
        raise AssertionError("capacity not enforced")
    except (BLSCapacityError, ValueError):
        pass
    bls.close()
    all_times = comm.allgather(times)
    if me == 0:
        print("BLS_OK " + json.dumps({"lag": lag, "times": all_times}), flush=True)


def stall():
    """Rank 1 never takes part: the others must fail with BLSTimeoutError, not hang."""
    comm = MPI.COMM_WORLD
    # The live ranks' own communicator, made while rank 1 still takes part: they meet on
    # it after reporting, because mpirun kills every rank once one exits without
    # MPI_Finalize, and a rank whose deadline fires later would be killed unreported.
    live = comm.Split(MPI.UNDEFINED if comm.rank == 1 else 0, comm.rank)
    bls = BLSAlltoallv(comm, 1, capacity_bytes=64, timeout_s=3)
    if comm.rank == 1:  # far past the others' 3 s deadline, even on a loaded machine;
        time.sleep(60)  # mpirun ends it once the live ranks have reported and exited
    else:
        try:
            for j in range(3):
                bls.start(j, [np.zeros(2)] * comm.size)
                if j >= 1:
                    bls.finish(j - 1)
        except BLSTimeoutError as e:
            sys.stdout.write(f"BLS_TIMEOUT_OK rank {comm.rank}: {e}\n")  # one write per line
            sys.stdout.flush()
        live.Barrier()
    sys.stdout.flush()
    os._exit(0)  # the windows cannot be freed collectively without rank 1


def die():
    """Rank 1 exchanges two iterations, then dies with no goodbye in the middle of the
    run; the others go on exchanging (they must fail, not hang)."""
    comm = MPI.COMM_WORLD
    bls = BLSAlltoallv(comm, 1, capacity_bytes=64, timeout_s=5)
    for j in range(1000):
        if comm.rank == 1 and j == 2:
            sys.stdout.write(f"BLS_DYING rank 1 at iteration {j}\n")
            sys.stdout.flush()
            os._exit(3)
        bls.start(j, [np.zeros(2)] * comm.size)
        if j >= 1:
            bls.finish(j - 1)
        time.sleep(0.01)
    sys.stdout.write(f"BLS_DIE_NOT_NOTICED rank {comm.rank}\n")  # must never print
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    if sys.argv[1] == "exchange":
        for k in json.loads(sys.argv[2]):
            exchange(k, int(sys.argv[3]), int(sys.argv[4]), seed=1234 + k)
    elif sys.argv[1] == "die":
        die()
    else:
        stall()
