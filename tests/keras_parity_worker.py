"""One rank of the multi-rank Keras parity test: FusedModel.fit/evaluate/predict on this
rank's share of every global batch; rank 0 prints ``RESULT {json}`` per optimizer."""
import argparse
import json
import os
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import keras_parity as kp  # noqa: E402
from tf_fusedemb.comm import get_communicator  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--optimizers", default="sgd,adagrad,ftrl")
    p.add_argument("--shares", default="16,16", help="rows per rank in each global batch")
    p.add_argument("--rows", type=int, default=96)
    p.add_argument("--pipeline", default=None, help="compile(pipeline=...), e.g. dbp,fwp=4")
    args = p.parse_args()
    comm = get_communicator()
    shares = [int(s) for s in args.shares.split(",")]
    assert len(shares) == comm.size, (shares, comm.size)
    x, y, sw = kp.data(args.rows, 0)
    xt, yt, _ = kp.data(args.rows // 2, 1)
    train = kp.rank_dataset((x, y, sw), kp.rank_bounds(args.rows, shares, comm.rank))
    test_bounds = kp.rank_bounds(args.rows // 2, shares, comm.rank)
    test = kp.rank_dataset((xt, yt), test_bounds)
    for name in args.optimizers.split(","):
        model = kp.fused_twin(kp.plain_model(), name)
        out = kp.fit_datasets(model, kp.keras_optimizer(name), kp.LOSSES["bce_object"](),
                              train, test, test, pipeline=args.pipeline)
        # Predictions back into global row order.
        parts = comm.allgather_object((test_bounds, out["predictions"].tolist()))
        predictions = np.zeros(args.rows // 2)
        for bounds, values in parts:
            rows = np.concatenate([np.arange(lo, hi) for lo, hi in bounds])
            predictions[rows] = values
        out["predictions"] = predictions.tolist()
        if comm.rank == 0:
            print("RESULT " + json.dumps({"optimizer": name, **out}), flush=True)


if __name__ == "__main__":
    main()
