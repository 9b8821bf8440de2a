"""SavedModel export benchmark: a table of N keys exported from every rank, side by side
in one job for each size and row dtype.

    python -m tf_fusedemb.benchmarks.export --json --np 2   # 1 M, 10 M and 50 M keys

Per size N: one dynamic table of dim 16 with Adagrad holding N keys spread over the
ranks (each rank loads the rows it owns, ``GroupStore.load_rows``: the rows as a
trained table holds them, without the training's time), a dense head; then
``export_saved_model`` from every rank once per row dtype. Reported per size:
``pb_bytes`` (saved_model.pb), ``variables_bytes`` per row dtype, ``export_s`` per row
dtype (rank 0's wall time, every rank done), ``load_s`` (``tf.saved_model.load`` of the
float32 export in a fresh process that never imports tf_fusedemb), ``max_abs_diff`` per
row dtype (that process's served logits against the model's, on 10,000 sampled stored
keys and 1,000 never seen), ``peak_rss_bytes_per_rank`` (the largest RSS of a rank
during its exports, sampled every 5 ms), ``rss_before_export_bytes_per_rank`` and
``table_bytes_per_rank`` (the engine's bytes, the largest over the ranks).

Each size runs in a job of its own (no rank holds an earlier size's table), and so
does, first, the same export of an empty table (``empty_table``): it gives the fixed
overhead of a rank's export, ``export_overhead_bytes_per_rank`` (its peak RSS). Each
size's ``peak_rss_over_table`` is (peak RSS - that overhead) / the table's bytes on the
rank: the export's peak stays within ``1.15 x table + overhead`` where it is <= 1.15.
``pb_bytes_ratio`` is ``pb_bytes`` of the largest size over the smallest's.

``--parts incremental`` (in the default run): incremental checkpoints at
``--incremental-keys`` rows (default 10 M), dim 16, Adagrad, a ``FusedModel``:
``CheckpointManager(incremental=True)`` saves the table in full, ``fit`` then trains on 1%
of the rows drawn uniformly (each drawn once), and the next save writes a delta.
Reported under ``incremental``: ``full_save_s`` and ``delta_save_s`` (rank 0's wall time,
every rank done), ``full_save_bytes`` and ``delta_save_bytes`` (the checkpoint
directories), ``incremental_save_ratio`` (delta over full wall time) and
``incremental_bytes_ratio``, ``touched_rows``.

The last line (``--json``) is one JSON object: ``keys`` (the export, keyed by N),
``empty_table``, ``export_overhead_bytes_per_rank``, ``peak_rss_over_table`` (keyed by
N), ``pb_bytes_ratio`` and ``incremental``.
"""
import argparse
import os
import sys
from typing import Any, Dict, List, Tuple

from tf_fusedemb import quiet

quiet.install()  # a command: quiet TensorFlow before it loads (tf_fusedemb/quiet.py)

from tf_fusedemb.benchmarks.launcher import (add_launch_args, benchmark_main, emit,  # noqa: E402
                                             launch_cluster, launch_local)

MODULE, WORKER = "tf_fusedemb.benchmarks.export", "tf_fusedemb.benchmarks.export_worker"
MARKER = "export-worker-result "
# A job's own flags, which the driver sets for each job it launches.
JOB_FLAGS = ("--keys", "--parts")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_launch_args(p)
    p.add_argument("--parts", default="export,incremental",
                   help="what to measure, comma-separated: export (SavedModel export per "
                        "--keys), incremental (incremental checkpoints at --incremental-keys)")
    p.add_argument("--keys", default="1000000,10000000,50000000",
                   help="table sizes (keys in all), comma-separated")
    p.add_argument("--incremental-keys", type=int, default=10_000_000,
                   help="rows of the incremental checkpoint measurement (default 10 M)")
    p.add_argument("--touched", type=float, default=0.01,
                   help="share of the rows trained between the full save and the delta")
    p.add_argument("--row-dtypes", default="float32,bfloat16,int8")
    p.add_argument("--work-dir", default=None,
                   help="where the exports go (shared by the ranks; default: a temporary "
                        "directory, removed afterwards)")
    args = p.parse_args(argv)
    args.keys = [int(k) for k in args.keys.split(",")]
    args.row_dtypes = args.row_dtypes.split(",")
    args.parts = args.parts.split(",")
    if not args.parts or set(args.parts) - {"export", "incremental"}:
        p.error(f"--parts takes export and/or incremental, got {','.join(args.parts)}")
    if "float32" not in args.row_dtypes:
        p.error("--row-dtypes must include float32 (the reference)")
    return args


def _common_argv(argv: List[str]) -> List[str]:
    """``argv`` without the flags the driver sets per job (``JOB_FLAGS``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in JOB_FLAGS:
            skip = True
        elif not a.startswith(tuple(f + "=" for f in JOB_FLAGS)):
            out.append(a)
    return out


def _job(argv: List[str], args) -> Dict[str, Any]:
    """Rank 0's result of one job of ``argv``; SystemExit when it fails."""
    if args.hosts is not None:
        code, result = launch_cluster(MODULE, argv, MARKER, args)
    else:
        code, result = launch_local(MODULE, args.np, argv, MARKER, args.timeout, args.pin)
    if code != 0 or result is None:
        raise SystemExit(f"{MODULE} failed ({' '.join(argv)}): exit code {code}")
    return result


def rss_bounds(empty: Dict[str, Any], sizes: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """Each size's peak RSS per rank against the bound ``1.15 x table + overhead``, the
    overhead being the peak RSS of the export of an empty table (``empty``) in a job
    of its own: ``peak_rss_over_table`` = (peak - overhead) / table bytes, at most 1.15
    to meet it."""
    overhead = empty["peak_rss_bytes_per_rank"]
    return {"export_overhead_bytes_per_rank": overhead,
            "peak_rss_over_table": {n: (r["peak_rss_bytes_per_rank"] - overhead)
                                    / max(1, r["table_bytes_per_rank"])
                                    for n, r in sizes.items()}}


def drive(argv: List[str]) -> Tuple[int, Dict[str, Any]]:
    """Launches one job per size (an empty table first), so that no size's RSS holds
    another's, then one for the incremental checkpoints; returns the combined result."""
    args = parse_args(argv)
    common = _common_argv(argv)
    result: Dict[str, Any] = {"keys": {}, "incremental": None}
    jobs: Dict[int, Dict[str, Any]] = {}
    if "export" in args.parts:
        jobs = {n: _job(common + ["--parts", "export", "--keys", str(n)], args)
                for n in [0] + args.keys}
        result["empty_table"] = jobs[0]["keys"]["0"]
        del jobs[0]
        result["keys"] = {str(n): r["keys"][str(n)] for n, r in jobs.items()}
        result.update(rss_bounds(result["empty_table"], result["keys"]))
        sizes = [str(n) for n in args.keys]
        result["pb_bytes_ratio"] = (result["keys"][sizes[-1]]["pb_bytes"]
                                    / result["keys"][sizes[0]]["pb_bytes"])
    if "incremental" in args.parts:
        jobs[-1] = _job(common + ["--parts", "incremental", "--keys", "0"], args)
        result["incremental"] = jobs[-1]["incremental"]
    any_job = next(iter(jobs.values()))
    result.update(world_size=any_job["world_size"], dim=any_job["dim"])
    return 0, result


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "HOROVOD_RANK" in os.environ:  # a rank of one job
        return benchmark_main(MODULE, WORKER, parse_args, MARKER, argv)
    code, result = drive(argv)
    emit(result, parse_args(argv).json)
    return code


if __name__ == "__main__":
    sys.exit(main())
