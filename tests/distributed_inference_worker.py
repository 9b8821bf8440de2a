"""Rank program of tests/test_distributed_inference.py (under mpirun).

    python distributed_inference_worker.py LAGS_JSON KIND CKPT_DIR OUT_NPZ [KIND CKPT_DIR OUT_NPZ ...]

For each model KIND: builds the model for this rank (``for_rank``), restores this rank's
share of CKPT_DIR, runs sharded inference of the shared batches with the BLS alltoallv
for every lag, gathers the logits on rank 0 (in global sample order) and writes them
with each rank's stored and resident row counts to OUT_NPZ.
(Several models in one job: the ranks start TensorFlow once.)
"""
import json
import os
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import distributed_inference_models as dm  # noqa: E402
from tf_fusedemb.comm.bls_alltoallv import BLSAlltoallv  # noqa: E402
from tf_fusedemb.inference.distributed import (ShardedPredictor, for_rank,  # noqa: E402
                                               resident_rows, restore_shard, run_bounded_lag,
                                               stored_rows)


def main(kind, ckpt_dir, out_path, lags):
    comm = MPI.COMM_WORLD
    with for_rank(comm.rank, comm.size, comm):
        model = dm.build_model(kind)
    restore_shard(model, ckpt_dir, comm.rank, comm.size)
    rows = comm.gather(stored_rows(model), root=0)
    resident = comm.gather(resident_rows(model), root=0)
    batches = dm.batches(kind)
    predictor = ShardedPredictor(model, comm.rank, comm.size, exchange=None)
    capacity = predictor.capacity_bytes(max(dm.BATCH_SIZES))
    results = {}
    for lag in lags:
        predictor.exchange = BLSAlltoallv(comm, lag, capacity, timeout_s=120)
        mine = dict(run_bounded_lag(predictor, batches, lag))
        predictor.exchange.close()
        gathered = comm.gather(mine, root=0)
        if comm.rank == 0:
            results[f"lag{lag}"] = np.concatenate([
                np.concatenate([g[j] for g in gathered]) for j in range(len(batches))])
    if comm.rank == 0:
        np.savez(out_path, rows=np.array(rows), resident=np.array(resident), **results)
        print("DIST_OK " + json.dumps({"rows": rows}), flush=True)


if __name__ == "__main__":
    jobs = sys.argv[2:]
    for i in range(0, len(jobs), 3):
        main(jobs[i], jobs[i + 1], jobs[i + 2], json.loads(sys.argv[1]))
