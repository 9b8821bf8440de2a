"""Distributed bounded-lag inference from a training checkpoint (paper 001).

    mpirun --allow-run-as-root --oversubscribe -np 4 python -m tf_fusedemb.serve \\
        --checkpoint-dir runs/main/ckpt --data criteo --data-path test.txt --lag 2 \\
        --output predictions.tsv

On emulated hosts (network namespaces; root), e.g. 2 hosts x 1 rank::

    python -m tf_fusedemb.testing.mpirun --hosts 2 --ranks-per-host 1 -- \\
        python -m tf_fusedemb.serve --checkpoint-dir ... --output predictions.tsv

Every rank builds the model for its rank (static tables allocate only their own rows)
and restores only the embedding rows it owns (about 1/N of them, never merged),
reads every global batch, pushes partial pooled embeddings of its own keys to the
samples' owner ranks over the BLS alltoallv (k = ``--lag``; 0 is synchronous) and
predicts its samples (tf_fusedemb/inference/distributed.py). Build options (--model,
--dim) must be those of training. Rank 0 shows a progress bar and ends with the
throughput and a ``RESULT {json}`` line; the output TSV has ``sample, probability,
label`` in input order. Runs single-process without mpirun too.
"""
import argparse
import json
import os
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from tf_fusedemb import quiet

quiet.install()  # a command: quiet TensorFlow before it loads (tf_fusedemb/quiet.py)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

from tf_fusedemb import job  # noqa: E402
from tf_fusedemb.comm.bls_alltoallv import (BLSAlltoallv, BLSCapacityError,  # noqa: E402
                                            BLSTimeoutError)
from tf_fusedemb.data import criteo  # noqa: E402
from tf_fusedemb.inference.distributed import (ShardedPredictor, for_rank,  # noqa: E402
                                               restore_shard, run_bounded_lag, sample_bounds)

DATASETS = job.DATASETS
MODELS = job.MODELS


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--data", required=True, choices=DATASETS)
    p.add_argument("--data-path", default=None, help="file or folder of the dataset")
    p.add_argument("--model", default="dlrm", choices=MODELS, help="as in training")
    p.add_argument("--dim", type=int, default=16, help="embedding dim, as in training")
    p.add_argument("--row-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="how the tables store their rows, as in training (a key never "
                        "trained reads its initial row rounded the same way)")
    p.add_argument("--lag", type=int, default=2, help="BLS bound k (0 = synchronous)")
    p.add_argument("--batch-size", type=int, default=1024, help="global batch")
    p.add_argument("--max-batches", type=int, default=None)
    p.add_argument("--output", required=True, help="predictions TSV")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds to wait for a peer before failing")
    args = p.parse_args(argv)
    if args.lag < 0:
        p.error("--lag must be >= 0")
    if args.batch_size < 1:
        p.error("--batch-size must be >= 1")
    if args.data != "synthetic" and not args.data_path:
        p.error(f"--data {args.data} needs --data-path")
    return args


def check_checkpoint(directory: str) -> None:
    """Fails early, on every rank, with what is missing."""
    if not os.path.isdir(directory):
        raise SystemExit(f"serve: checkpoint directory {directory!r} does not exist")
    if not os.path.exists(os.path.join(directory, "latest")):
        raise SystemExit(f"serve: no complete checkpoint in {directory!r} (no 'latest' "
                         "pointer); train with --checkpoint-dir first")


def global_batches(args: argparse.Namespace
                   ) -> Tuple[tf.data.Dataset, Dict[str, str], Sequence[str]]:
    """(dataset of (features, label) global batches, feature kinds, dense names)."""
    if args.data == "criteo":
        path = args.data_path
        if os.path.isdir(path):
            path = os.path.join(path, "test.txt")
        if not os.path.exists(path):
            raise SystemExit(f"serve: no Criteo file at {path!r}")
        kinds = {c: "scalar" for c in criteo.CRITEO_CATEGORICAL}
        return criteo.criteo_dataset(path, args.batch_size), kinds, criteo.CRITEO_DENSE
    # Other sources: their held-out split, read whole by every rank (shard 0 of 1).
    _, evaluation, kinds, dense = job.make_data(args.data, args.data_path, args.batch_size, 0, 1)
    return evaluation, kinds, dense


def build(args: argparse.Namespace, rank: int, size: int,
          comm: Any = None) -> Tuple[tf_keras.Model, tf.data.Dataset, Dict[str, Any]]:
    """The model built for rank ``rank`` of ``size`` (``comm``: the mpi4py communicator)
    with this rank's shard restored, and the batches."""
    data, kinds, dense = global_batches(args)
    with for_rank(rank, size, comm):  # tables of this rank's rows only (static ones too)
        model = job.make_model(args.model, kinds, dense, dim=args.dim,
                               storage=job.TableStorage(row_dtype=args.row_dtype))
    first, _ = next(iter(data))
    model(tf.nest.map_structure(lambda t: t[:0], first))  # variables, no key recorded
    try:
        meta = restore_shard(model, args.checkpoint_dir, rank, size)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"serve: {e} (--model {args.model} --dim {args.dim})") from e
    return model, data, meta


def write_tsv(path: str, logits: np.ndarray, labels: np.ndarray) -> None:
    """Writes per sample its probability sigmoid(logit) and label (float[n] each) as TSV."""
    prob = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("sample\tprobability\tlabel\n")
        for i, (p, y) in enumerate(zip(prob, labels)):
            f.write(f"{i}\t{p:.8f}\t{y:g}\n")
    os.replace(tmp, path)


def serve(args: argparse.Namespace) -> Optional[Dict[str, Any]]:
    """Sharded inference of ``args`` on this MPI rank; rank 0 returns the result."""
    check_checkpoint(args.checkpoint_dir)  # before a model is built: fail fast
    # mpi4py is an optional dependency (requirements.txt), needed by this command alone.
    from mpi4py import MPI  # pylint: disable=import-outside-toplevel
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    model, data, meta = build(args, rank, size, comm)
    predictor = ShardedPredictor(model, rank, size, exchange=None)
    exchange = predictor.exchange = BLSAlltoallv(
        comm, args.lag, predictor.capacity_bytes(args.batch_size), timeout_s=args.timeout)
    labels, logits, counted = {}, {}, {}
    bar = tf_keras.utils.Progbar(None, unit_name="batch", stateful_metrics=["samples/s"]) \
        if rank == 0 else None

    def features(stream):
        for j, (x, y) in enumerate(stream):
            if args.max_batches is not None and j >= args.max_batches:
                return
            y = y.numpy().reshape(-1)
            lo, hi = sample_bounds(len(y), size)[rank:rank + 2]
            labels[j], counted[j] = y[lo:hi], len(y)
            yield x

    start = time.perf_counter()
    seen, first_done = 0, None
    for j, out in run_bounded_lag(predictor, features(data), args.lag):
        logits[j] = out
        seen += counted[j]
        first_done = first_done or (time.perf_counter(), seen)  # after tracing
        if bar is not None:
            bar.update(j + 1, [("samples/s", seen / (time.perf_counter() - start))])
    exchange.close()
    wall = time.perf_counter() - start
    order = sorted(logits)
    parts = comm.gather([(j, logits[j], labels[j]) for j in order], root=0)
    rows = comm.gather(predictor.stored_rows(), root=0)
    resident = comm.gather(predictor.resident_rows(), root=0)
    if rank != 0:
        return None
    assert parts is not None  # gathered at rank 0
    # Samples of batch j: rank 0's block, then rank 1's, ... (contiguous sample owners).
    by_batch: Dict[int, List[Tuple[np.ndarray, np.ndarray]]] = {}  # j -> (logits, labels) per rank
    for part in parts:
        for j, lg, lb in part:
            by_batch.setdefault(j, []).append((lg, lb))
    batches = [by_batch[j] for j in sorted(by_batch)]
    all_logits = np.concatenate([x for b in batches for x, _ in b]) if batches else np.zeros(0)
    all_labels = np.concatenate([y for b in batches for _, y in b]) if batches else np.zeros(0)
    write_tsv(args.output, all_logits, all_labels)
    result = {"ranks": size, "lag": args.lag, "samples": int(len(all_logits)),
              "batches": len(by_batch), "seconds": round(wall, 3),
              "samples_per_s": round(len(all_logits) / wall, 1) if wall > 0 else None,
              "samples_per_s_after_first_batch": _rate(first_done, len(all_logits), start + wall),
              "checkpoint_step": meta["step"], "rows_per_rank": rows,
              "resident_rows_per_rank": resident, "output": args.output}
    print(f"\nserved {result['samples']} samples in {wall:.2f}s on {size} ranks "
          f"(lag {args.lag}): {result['samples_per_s']} samples/s", flush=True)
    print("RESULT " + json.dumps(result), flush=True)
    return result


def _rate(first_done, total, end):
    """Samples per second after the first completed batch (which traced the dense part)."""
    if first_done is None or total == first_done[1] or end <= first_done[0]:
        return None
    return round((total - first_done[1]) / (end - first_done[0]), 1)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The command line (see the module doc)."""
    args = parse_args(argv)
    try:
        serve(args)
    except (BLSTimeoutError, BLSCapacityError, ValueError) as e:
        # One line naming the rank instead of a traceback; mpirun then stops the others.
        rank = os.environ.get("OMPI_COMM_WORLD_RANK", "0")
        raise SystemExit(f"serve (rank {rank}): {type(e).__name__}: {e}") from e


if __name__ == "__main__":
    main()
