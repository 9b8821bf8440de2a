"""Rank side of ``python -m tf_fusedemb.benchmarks.export`` (see there)."""
import ctypes
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict

import numpy as np
import tensorflow as tf
import tf_keras

from tf_fusedemb.benchmarks.storage import rss_bytes
from tf_fusedemb.comm import Communicator, get_communicator
from tf_fusedemb.inference import export_saved_model
from tf_fusedemb.layers import FusedEmbedding
from tf_fusedemb.models import FusedModel
from tf_fusedemb.ops import hashing
from tf_fusedemb.specs import FeatureSpec, OptimizerSpec, TableSpec
from tf_fusedemb.training import CheckpointManager

DIM = 16
CHUNK = 1 << 18
KNOWN, UNSEEN = 10_000, 1_000
# Loads and serves an export in a process that never imports tf_fusedemb.
SERVE = """
import json, sys, time, numpy as np, tensorflow as tf
begin = time.perf_counter()
m = tf.saved_model.load(sys.argv[1])
load_s = time.perf_counter() - begin
ids = np.load(sys.argv[2])
out = m.signatures["serving_default"](c=tf.constant(ids))["logits"].numpy()
np.save(sys.argv[3], out)
assert not any(n.startswith("tf_fusedemb") for n in sys.modules)
print("SERVED " + json.dumps({"load_s": load_s}))
"""


class PeakRss:
    """The largest RSS of this process while in the ``with`` block, sampled every 5 ms."""

    def __enter__(self):
        self.peak, self._stop = rss_bytes(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def release_freed_heap() -> None:
    """Returns the memory glibc's malloc holds free to the kernel (``malloc_trim(0)``)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def build(num_keys: int, comm: Communicator, model_class: Any = tf_keras.Model):
    """The model (a ``model_class``) and its table of ``num_keys`` keys (IDs 0..N-1), each
    rank loading the rows it owns a chunk at a time (rows drawn from a generator seeded
    per chunk)."""
    tf_keras.backend.clear_session()
    layer = FusedEmbedding([FeatureSpec("c", TableSpec("c", DIM, OptimizerSpec.adagrad(0.05)))],
                           name="emb")
    inputs = {"c": tf_keras.Input([], dtype=tf.int64, name="c")}
    head = tf_keras.layers.Dense(1, kernel_initializer=tf_keras.initializers.GlorotUniform(1))
    model = model_class(inputs, head(layer(inputs)["c"]), name="exported")
    group, = layer.groups
    for start in range(0, num_keys, CHUNK):
        ids = np.arange(start, min(start + CHUNK, num_keys), dtype=np.int64)
        rows = np.random.default_rng(start).normal(0, 0.1, (len(ids), DIM)).astype(np.float32)
        mine = hashing.owner_rank(ids, comm.size) == comm.rank  # load_rows keeps these
        group.store.load_rows("c", ids[mine], rows[mine])
    return model, layer


def one_size(num_keys: int, args, comm: Communicator, work: str) -> Dict[str, Any]:
    model, layer = build(num_keys, comm)
    rng = np.random.default_rng(7)
    known = rng.integers(0, num_keys, KNOWN) if num_keys else np.zeros([0], np.int64)
    ids = np.concatenate([known, num_keys + np.arange(UNSEEN)])
    # A collective: rank 0 asks for every sampled ID, the others for none.
    x = ids if comm.rank == 0 else ids[:0]
    want = tf.function(lambda x: model(x, training=False))({"c": tf.constant(x)}).numpy()
    # What the table's loading freed goes back to the kernel first (glibc keeps freed heap
    # resident): the peak is then the table, the process's fixed part and the export's own.
    release_freed_heap()
    before = rss_bytes()
    out: Dict[str, Any] = {"export_s": {}, "variables_bytes": {}, "max_abs_diff": {}}
    with PeakRss() as peak:
        for row_dtype in args.row_dtypes:
            path = os.path.join(work, f"n{num_keys}-{row_dtype}")
            begin = time.perf_counter()
            export_saved_model(model, path, {"c": "scalar"}, row_dtype=row_dtype)
            out["export_s"][row_dtype] = time.perf_counter() - begin
    every = comm.allgather_object((peak.peak, before, sum(m["bytes"] for m in layer.memory().values())))
    out.update(peak_rss_bytes_per_rank=max(e[0] for e in every),
               rss_before_export_bytes_per_rank=max(e[1] for e in every),
               table_bytes_per_rank=max(e[2] for e in every))
    # The tables go before rank 0 serves: the serving process holds every row at once.
    del model, layer
    tf_keras.backend.clear_session()
    gc.collect()
    release_freed_heap()
    out["rss_after_release_bytes_per_rank"] = max(comm.allgather_object(rss_bytes()))
    if comm.rank == 0:
        np.save(os.path.join(work, "ids.npy"), ids)
        for row_dtype in args.row_dtypes:
            path = os.path.join(work, f"n{num_keys}-{row_dtype}")
            out["variables_bytes"][row_dtype] = sum(
                os.path.getsize(os.path.join(path, "variables", f))
                for f in os.listdir(os.path.join(path, "variables")))
            served = serve_fresh(path, work)
            out["max_abs_diff"][row_dtype] = float(np.max(np.abs(served["logits"] - want)))
            if row_dtype == "float32":
                out["load_s"] = served["load_s"]
                out["pb_bytes"] = os.path.getsize(os.path.join(path, "saved_model.pb"))
            shutil.rmtree(path)
    comm.allgather_object(0)  # rank 0 served before any rank builds the next size
    return out


def serve_fresh(path: str, work: str) -> Dict[str, Any]:
    """The export at ``path`` served in a fresh process (no tf_fusedemb, no PYTHONPATH)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and
           not k.startswith(("HOROVOD", "OMPI", "PMI"))}
    logits = os.path.join(work, "logits.npy")
    done = subprocess.run([sys.executable, "-c", SERVE, path, os.path.join(work, "ids.npy"),
                           logits], capture_output=True, text=True, env=env, cwd=work,
                          timeout=1800)
    lines = [l for l in done.stdout.splitlines() if l.startswith("SERVED ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"serving {path} failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(lines[-1][len("SERVED "):]), logits=np.load(logits))


def directory_bytes(path: str) -> int:
    """Bytes of the files under ``path``."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path)
               for f in files)


def incremental(args, comm: Communicator, work: str) -> Dict[str, Any]:
    """A full save of ``args.incremental_keys`` rows, ``fit`` on ``args.touched`` of them
    (drawn uniformly, each once; every rank feeds its slice), then a delta save."""
    num_keys = args.incremental_keys
    model, _ = build(num_keys, comm, FusedModel)
    model.compile(optimizer=tf_keras.optimizers.Adagrad(0.01),
                  loss=tf_keras.losses.BinaryCrossentropy(from_logits=True))
    manager = CheckpointManager(os.path.join(work, "ckpt"), model, model.optimizer,
                                incremental=True)

    def timed_save(step: int) -> float:
        comm.allgather_object(0)  # every rank starts together
        begin = time.perf_counter()
        manager.save(step)
        return time.perf_counter() - begin

    full_s = timed_save(1)
    rng = np.random.default_rng(11)
    touched = rng.choice(num_keys, int(num_keys * args.touched), replace=False)
    mine = touched[comm.rank::comm.size]
    labels = rng.integers(0, 2, (len(touched), 1)).astype(np.float32)[comm.rank::comm.size]
    model.fit({"c": mine}, labels, batch_size=8192, epochs=1, verbose=0, shuffle=False)
    delta_s = timed_save(2)
    out: Dict[str, Any] = {"rows": num_keys, "touched_rows": len(touched),
                           "full_save_s": full_s, "delta_save_s": delta_s,
                           "incremental_save_ratio": delta_s / full_s}
    if comm.rank == 0:
        full = directory_bytes(os.path.join(work, "ckpt", "ckpt-1"))
        delta = directory_bytes(os.path.join(work, "ckpt", "ckpt-2"))
        out.update(full_save_bytes=full, delta_save_bytes=delta,
                   incremental_bytes_ratio=delta / full)
        shutil.rmtree(os.path.join(work, "ckpt"))
    comm.allgather_object(0)
    return out


def run(args):
    """One job's part: the export of each of ``args.keys`` (a size per job, as the
    launcher runs it) and/or the incremental checkpoints."""
    comm = get_communicator()
    work = args.work_dir or (tempfile.mkdtemp(prefix="fusedemb_export_bench_")
                             if comm.rank == 0 else None)
    # Every rank uses rank 0's directory: the export directory must be shared.
    work = comm.allgather_object(work)[0]
    exports = {str(n): one_size(n, args, comm, work) for n in args.keys} \
        if "export" in args.parts else {}
    increments = incremental(args, comm, work) if "incremental" in args.parts else None
    if comm.rank == 0:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
        return {"keys": exports, "world_size": comm.size, "dim": DIM,
                "incremental": increments}
    return None
