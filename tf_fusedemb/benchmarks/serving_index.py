"""Serving-index benchmark: three ways a SavedModel can find a row by its int64 key, side by
side: load time, memory, lookup time and sizes.

    python -m tf_fusedemb.benchmarks.serving_index --json --keys 1000000,4000000

For N random keys (rows of dim 16, float32), each variant is saved as a SavedModel and
loaded in a fresh process:

* ``searchsorted``: sorted key and row variables, found with ``tf.searchsorted`` (what
  ``inference.key_index`` does): nothing is built at load;
* ``dense_hash``: a saveable ``tf.lookup.experimental.DenseHashTable`` (key -> row index),
  restored as its bucket arrays (two reserved keys; capacity a power of 2);
* ``static_at_load``: key variables, from which a ``StaticHashTable`` is built at load.

Per variant and size: ``load_s`` (``tf.saved_model.load``), ``first_call_s``,
``lookup_4096_s`` (mean of 20 lookups of 4,096 keys), ``rss_growth_mb`` (the loading
process's peak RSS growth), ``variables_mb`` and ``pb_bytes``. The last line is one JSON
object keyed ``<variant>@<N>``.
"""
import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import tensorflow as tf

VARIANTS = ("searchsorted", "dense_hash", "static_at_load")
DIM = 16


def save(variant: str, num_keys: int, path: str) -> None:
    """Writes the SavedModel of ``variant`` for ``num_keys`` random keys to ``path``."""
    rng = np.random.default_rng(0)
    keys = np.unique(rng.integers(-2**62, 2**62, num_keys, dtype=np.int64))
    m = tf.Module()
    m.rows = tf.Variable(rng.normal(size=(len(keys), DIM)).astype(np.float32),
                         shape=tf.TensorShape([None, DIM]))
    if variant == "dense_hash":
        m.table = tf.lookup.experimental.DenseHashTable(
            tf.int64, tf.int64, -1, empty_key=2**63 - 1, deleted_key=2**63 - 2)
        m.table.insert(tf.constant(keys), tf.range(len(keys), dtype=tf.int64))
    else:
        m.keys = tf.Variable(keys, shape=tf.TensorShape([None]))
    if variant == "static_at_load":
        m.table = tf.lookup.StaticHashTable(tf.lookup.KeyValueTensorInitializer(
            m.keys, tf.range(tf.size(m.keys, out_type=tf.int64))), -1)

    def lookup(q):
        if variant == "searchsorted":
            at = tf.minimum(tf.searchsorted(m.keys, q), tf.size(m.keys, out_type=tf.int32) - 1)
        else:
            at = tf.maximum(m.table.lookup(q), 0)
        return tf.gather(m.rows, at)
    m.lookup = tf.function(lookup, input_signature=[tf.TensorSpec([None], tf.int64)])
    tf.saved_model.save(m, path)


def load(path: str) -> dict:
    """Loads ``path`` in this (fresh) process and times it."""
    q = tf.constant(np.arange(4096, dtype=np.int64))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    begin = time.perf_counter()
    m = tf.saved_model.load(path)
    load_s = time.perf_counter() - begin
    begin = time.perf_counter()
    m.lookup(q)
    first = time.perf_counter() - begin
    begin = time.perf_counter()
    for _ in range(20):
        m.lookup(q)
    return {"load_s": load_s, "first_call_s": first,
            "lookup_4096_s": (time.perf_counter() - begin) / 20,
            "rss_growth_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keys", default="1000000,4000000")
    p.add_argument("--work-dir", default=None,
                   help="where the SavedModels go (default: a temporary directory, removed)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--save", nargs=3, help=argparse.SUPPRESS)  # variant, N, path (a child)
    p.add_argument("--load", help=argparse.SUPPRESS)  # path (a child)
    args = p.parse_args(argv)
    if args.save:
        save(args.save[0], int(args.save[1]), args.save[2])
        return
    if args.load:
        print("LOADED " + json.dumps(load(args.load)))
        return
    work = args.work_dir or tempfile.mkdtemp(prefix="fusedemb_serving_index_")
    out = {}
    for n in (int(k) for k in args.keys.split(",")):
        for variant in VARIANTS:
            path = os.path.join(work, f"{variant}-{n}")
            me = [sys.executable, "-m", "tf_fusedemb.benchmarks.serving_index"]
            subprocess.run(me + ["--save", variant, str(n), path], check=True,
                           capture_output=True)
            done = subprocess.run(me + ["--load", path], check=True, capture_output=True,
                                  text=True)
            res = json.loads(done.stdout.split("LOADED ", 1)[1])
            variables = os.path.join(path, "variables")
            res.update(variables_mb=sum(os.path.getsize(os.path.join(variables, f))
                                        for f in os.listdir(variables)) / 2**20,
                       pb_bytes=os.path.getsize(os.path.join(path, "saved_model.pb")))
            out[f"{variant}@{n}"] = res
            print(variant, n, res, file=sys.stderr, flush=True)
    if args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out) if args.json else out)


if __name__ == "__main__":
    main()
