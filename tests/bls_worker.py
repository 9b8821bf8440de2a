"""Rank program of tests/test_bls_alltoallv.py (run under mpirun).

Every message is a pure function of (iteration, sender, receiver, seed), so each rank
checks what it received against messages it regenerates with numpy alone.

  python bls_worker.py exchange LAGS ITERS SLOW_RANK   -> "BLS_OK <json>" per lag
  python bls_worker.py stall                           -> "BLS_TIMEOUT_OK" on live ranks
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


if __name__ == "__main__":
    if sys.argv[1] == "exchange":
        for k in json.loads(sys.argv[2]):
            exchange(k, int(sys.argv[3]), int(sys.argv[4]), seed=1234 + k)
    else:
        stall()
