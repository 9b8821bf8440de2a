"""SavedModel export benchmark: a table of N keys exported from every rank, side by side
in one job for each size and row dtype.

    python -m tf_fusedemb.benchmarks.export --json --keys 1000000,10000000 --np 2

Per size N: one dynamic table of dim 16 with Adagrad holding N keys spread over the
ranks (each rank loads the rows it owns, ``GroupLookup.load_rows``: the rows as a
trained table holds them, without the training's time), a dense head; then
``export_saved_model`` from every rank once per row dtype. Reported per size:
``pb_bytes`` (saved_model.pb), ``variables_bytes`` per row dtype, ``export_s`` per row
dtype (rank 0's wall time, every rank done), ``load_s`` (``tf.saved_model.load`` of the
float32 export in a fresh process that never imports tf_fusedemb), ``max_abs_diff`` per
row dtype (that process's served logits against the model's, on 10,000 sampled stored
keys and 1,000 never seen), ``peak_rss_bytes_per_rank`` (the largest RSS of a rank
during its exports, sampled every 5 ms), ``rss_before_export_bytes_per_rank`` and
``table_bytes_per_rank`` (the engine's bytes, the largest over the ranks).

``--parts incremental`` (in the default run): incremental checkpoints at
``--incremental-keys`` rows (default 10 M), dim 16, Adagrad, a ``FusedModel``:
``CheckpointManager(incremental=True)`` saves the table in full, ``fit`` then trains on 1%
of the rows drawn uniformly (each drawn once), and the next save writes a delta.
Reported under ``incremental``: ``full_save_s`` and ``delta_save_s`` (rank 0's wall time,
every rank done), ``full_save_bytes`` and ``delta_save_bytes`` (the checkpoint
directories), ``incremental_save_ratio`` (delta over full wall time) and
``incremental_bytes_ratio``, ``touched_rows``.

The last line (``--json``) is one JSON object: ``keys`` (the export, keyed by N) and
``incremental``.
"""
import argparse
import sys

from tf_fusedemb import quiet

quiet.install()  # a command: quiet TensorFlow before it loads (tf_fusedemb/quiet.py)

from tf_fusedemb.benchmarks.launcher import add_launch_args, benchmark_main  # noqa: E402

MARKER = "export-worker-result "


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_launch_args(p)
    p.add_argument("--parts", default="export,incremental",
                   help="what to measure, comma-separated: export (SavedModel export per "
                        "--keys), incremental (incremental checkpoints at --incremental-keys)")
    p.add_argument("--keys", default="200000,1000000",
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


def main(argv=None):
    return benchmark_main("tf_fusedemb.benchmarks.export", "tf_fusedemb.benchmarks.export_worker",
                          parse_args, MARKER, argv)


if __name__ == "__main__":
    sys.exit(main())
