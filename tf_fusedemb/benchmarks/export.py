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
``table_bytes_per_rank`` (the engine's bytes, the largest over the ranks). The last line
(``--json``) is one JSON object keyed by N.
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
    p.add_argument("--keys", default="200000,1000000",
                   help="table sizes (keys in all), comma-separated")
    p.add_argument("--row-dtypes", default="float32,bfloat16,int8")
    p.add_argument("--work-dir", default=None,
                   help="where the exports go (shared by the ranks; default: a temporary "
                        "directory, removed afterwards)")
    args = p.parse_args(argv)
    args.keys = [int(k) for k in args.keys.split(",")]
    args.row_dtypes = args.row_dtypes.split(",")
    if "float32" not in args.row_dtypes:
        p.error("--row-dtypes must include float32 (the reference)")
    return args


def main(argv=None):
    return benchmark_main("tf_fusedemb.benchmarks.export", "tf_fusedemb.benchmarks.export_worker",
                          parse_args, MARKER, argv)


if __name__ == "__main__":
    sys.exit(main())
