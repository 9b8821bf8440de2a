"""TFRA's CPU hash tables insert on one thread (imported before any table is built).

Why: TFRA 0.8.1 splits one insert over TensorFlow's intra-op threads (``Shard``) into its
vendored copy of libcuckoo, and libcuckoo's concurrent resize has a race
(efficient/libcuckoo#157, open): a thread that misses a resize writes its row into the
bucket array being discarded, so the row is counted by ``size()`` but gone. Measured on
TFRA's header with 8 threads inserting 324,382 random keys from an empty table: rows lost
in 3 of 200 runs; 0 of 200 when the table was pre-sized (no resize), never on one
thread (docs/tfra_cuckoo_race/). After a loss TFRA's ``export`` returns uninitialised
memory as its last key: the main job's intermittent "stored keys have no recorded
(table, ID)" (issue 9).

TFRA's insert kernel reads ``TFRA_NUM_WORKER_THREADS_FOR_LOOKUP_TABLE_INSERT`` at every
launch and passes it to ``Shard`` as the maximum parallelism; 1 runs the whole insert on
the calling thread. Setting it here covers every insert path: our upserts, bulk loads,
and TFRA's own checkpoint restore (``ImportValues``). Lookups stay parallel (they never
resize). The cost is the insert's share of a step: about 13k rows per table per step in
the main job, a few milliseconds.
"""
import os
import warnings

INSERT_THREADS_ENV = "TFRA_NUM_WORKER_THREADS_FOR_LOOKUP_TABLE_INSERT"


def make_inserts_serial() -> None:
    """Sets TFRA's insert parallelism to 1 for this process (idempotent); warns when it
    overrides another value the user set."""
    current = os.environ.get(INSERT_THREADS_ENV)
    if current not in (None, "", "1"):
        warnings.warn(f"{INSERT_THREADS_ENV}={current} overridden with 1: TFRA's parallel "
                      "insert can lose rows when a table resizes (efficient/libcuckoo#157)",
                      RuntimeWarning, stacklevel=2)
    os.environ[INSERT_THREADS_ENV] = "1"


make_inserts_serial()
