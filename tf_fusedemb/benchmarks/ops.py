"""Benchmark of the four FusedRec ops against the routes one takes without them.

    python -m tf_fusedemb.benchmarks.ops --json

A Criteo-shaped fused group (26 categories, batch 4096, per-category cardinality and skew
of the packaged Criteo profile; and the real Criteo sample when it is found). Every
variant runs ``--iterations`` times in a while-loop inside one tf.function (so Python
dispatch, ~1-2 ms a call here, does not dilute the ratios); the loops are timed in one
process, interleaved, and reported per iteration (median over ``--repeats``).
Grappler's loop optimizer is turned off so nothing is hoisted out of the loops.

* segment_unique vs (a) 26 ``tf.unique`` calls, one per category, and (b) one
  ``tf.unique`` over keys hashed with their category in pure TF (the lossy strawman);
* rankwise_sort vs ``tf.argsort`` (stable) + gathers, and vs ``tf.dynamic_partition``
  (owners from the same hash, precomputed, so the routes differ only in sorting);
* recovery_gather vs TFRA's ``tf.scatter_nd`` back to unique order + ``tf.gather``.
"""
import argparse
import os

from tf_fusedemb import quiet

quiet.install()  # a command: quiet TensorFlow before it loads (tf_fusedemb/quiet.py)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tf_fusedemb import ops  # noqa: E402
from tf_fusedemb.benchmarks.lookup_data import DEFAULT_CRITEO  # noqa: E402
from tf_fusedemb.benchmarks import plots  # noqa: E402
from tf_fusedemb.benchmarks.timing import (emit, in_graph_loop, per_iteration,  # noqa: E402
                                           ratio, time_side_by_side)
from tf_fusedemb.data.criteo import CRITEO_CATEGORICAL, read_criteo  # noqa: E402
from tf_fusedemb.data.synthetic import criteo_like_batch_keys  # noqa: E402
from tf_fusedemb.ops import reference  # noqa: E402


def criteo_file_keys(path, batch_size):
    """First ``batch_size`` rows of a Criteo TSV (``read_criteo``: hex -> int64, empty ->
    MISSING_ID) as one fused group: (keys int64[26 * B], segment_splits int64[27])."""
    cols = read_criteo(path, batch_size)
    keys = np.concatenate([cols[c] for c in CRITEO_CATEGORICAL])
    return keys, np.arange(len(CRITEO_CATEGORICAL) + 1, dtype=np.int64) * len(cols["label"])


def bench_group(keys, splits, num_ranks, dim, repeats, iterations):
    """Times every variant on one fused group; returns the section of the JSON."""
    m = len(splits) - 1
    keys, splits = tf.constant(keys), tf.constant(splits)
    uniq = ops.segment_unique(keys, splits)
    owners = ops.owner_rank(uniq.unique_keys, num_ranks)
    srt = ops.rankwise_sort(uniq.unique_keys, uniq.unique_segment_splits, num_ranks)
    rows = tf.random.stateless_normal([int(uniq.unique_keys.shape[0]), dim], seed=[1, 2])
    positions = tf.math.invert_permutation(srt.indices)  # what dynamic_partition yields
    u_splits = uniq.unique_segment_splits
    def fn(body):
        return in_graph_loop(body, iterations)
    times = per_iteration(time_side_by_side({
        "segment_unique": fn(lambda: ops.segment_unique(keys, splits)),
        "per_segment_unique": fn(lambda: reference.per_segment_unique(keys, splits, m)),
        "hashed_unique": fn(lambda: reference.hashed_unique(keys, splits)),
        "rankwise_sort": fn(lambda: ops.rankwise_sort(uniq.unique_keys, u_splits, num_ranks)),
        "argsort_route": fn(lambda: reference.argsort_rankwise_sort(
            uniq.unique_keys, u_splits, num_ranks, owners)),
        "dynamic_partition_route": fn(lambda: reference.dynamic_partition_rankwise_sort(
            uniq.unique_keys, u_splits, num_ranks, owners)),
        "recovery_gather": fn(lambda: ops.recovery_gather(rows, srt.indices, uniq.inverse)),
        "scatter_nd_recovery": fn(lambda: reference.scatter_nd_recovery(
            rows, positions, uniq.inverse)),
    }, repeats, warmup=2), iterations)
    return {
        "num_keys": int(keys.shape[0]), "num_unique": int(uniq.unique_keys.shape[0]),
        "num_segments": m, "num_ranks": num_ranks, "dim": dim, "times": times,
        "segment_unique.speedup_vs_per_segment_unique":
            ratio(times["per_segment_unique"], times["segment_unique"]),
        "segment_unique.speedup_vs_hashed_unique":
            ratio(times["hashed_unique"], times["segment_unique"]),
        "rankwise_sort.speedup_vs_argsort": ratio(times["argsort_route"], times["rankwise_sort"]),
        "rankwise_sort.speedup_vs_dynamic_partition":
            ratio(times["dynamic_partition_route"], times["rankwise_sort"]),
        "recovery.speedup_vs_scatter_nd":
            ratio(times["scatter_nd_recovery"], times["recovery_gather"]),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description="FusedRec op benchmark")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--num-ranks", type=int, default=2)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--iterations", type=int, default=50,
                        help="op calls per timed in-graph loop")
    parser.add_argument("--small-batch", type=int, default=256,
                        help="also time this batch size, where per-op overhead dominates "
                             "(0 to skip)")
    parser.add_argument("--data", default=str(DEFAULT_CRITEO),
                        help="Criteo TSV also benchmarked when it exists ('' to skip)")
    parser.add_argument("--plot", metavar="PATH", help="also write a PNG of the op times")
    args = parser.parse_args(argv)

    tf.config.optimizer.set_experimental_options({"loop_optimization": False})
    keys, splits = criteo_like_batch_keys(args.batch_size, seed=0)
    result = {"benchmark": "ops", "tf_version": tf.__version__, "method": "in-graph loops",
              "iterations": args.iterations, "repeats": args.repeats,
              "intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads()}
    result["synthetic"] = bench_group(keys, splits, args.num_ranks, args.dim, args.repeats,
                                     args.iterations)
    if args.small_batch:
        keys, splits = criteo_like_batch_keys(args.small_batch, seed=0)
        result[f"synthetic_batch_{args.small_batch}"] = bench_group(
            keys, splits, args.num_ranks, args.dim, args.repeats, args.iterations)
    if args.data and os.path.exists(args.data):
        keys, splits = criteo_file_keys(args.data, args.batch_size)
        result["criteo_sample"] = bench_group(keys, splits, args.num_ranks, args.dim,
                                              args.repeats, args.iterations)
        result["criteo_sample"]["path"] = args.data
    # Headline ratios at the top level, from the synthetic (embedded default) group.
    for key, value in result["synthetic"].items():
        if "." in key:
            result[key] = value
    if args.plot:
        times = result["synthetic"]["times"]
        result["plot"] = plots.bar_chart(
            args.plot, {k: t["median_ms"] for k, t in times.items()},
            f"FusedRec ops and their baselines, {result['synthetic']['num_keys']} keys, "
            f"{args.num_ranks} ranks (median per call)", "ms per call")
    emit(result, args.json)


if __name__ == "__main__":
    main()
