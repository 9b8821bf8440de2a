"""AlltoAll rounds per step and exactness of tests/keras_shapes.py's tf_keras shapes
converted by ``fuse_model``: per shape named on the command line (default the TensorFlow
Recommenders ranking model), rank 0 prints one JSON line with the rounds per step of all
its fused groups on rank 0 and the largest loss and weight differences against plain
tf_keras fit from the same weights on the global batches.

    TF_USE_LEGACY_KERAS=1 python tests/fused_groups_report.py tfrs_ranking       # one process
    TF_USE_LEGACY_KERAS=1 horovodrun -np 2 --gloo -H localhost:2 \\
        python tests/fused_groups_report.py tfrs_ranking tfrs_dcn dependent_ids  # 2 ranks

(One process makes no AlltoAll: its rounds are 0.) Rank 0 draws the initial weights and
computes the reference in its own process, as tests/keras_shapes_report.py does.
"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tf_keras  # noqa: E402

import keras_shapes as ks  # noqa: E402
from tf_fusedemb.comm import get_communicator  # noqa: E402


def main(names):
    comm = get_communicator()
    mine = np.arange(ks.ROWS).reshape(-1, comm.size, ks.BATCH)[:, comm.rank].reshape(-1)
    for name in names:
        want = ks.reference(tf_keras, name, comm.size * ks.BATCH)
        initial = comm.allgather_object(want[0])[0]  # rank 0's draw, its reference's start
        run = ks.converted_run(tf_keras, name, initial, mine, ks.BATCH)
        runs = comm.allgather_object(run)
        if comm.rank == 0:
            print(json.dumps(dict(shape=name, ranks=comm.size, rounds_per_step=run["rounds"],
                                  **ks.max_diffs(runs, want[1], want[2]))))


if __name__ == "__main__":
    main(sys.argv[1:] or ["tfrs_ranking"])
