"""Storage benchmark: the embedding engine against the TFRA backend, side by side.

    python -m tf_fusedemb.benchmarks.storage --json

One group table of dim 16 with Adagrad (and its access statistics: EngineGroupTable +
EngineStatistics against DynamicGroupTable + AccessStatistics), fed batches of 100k
unique keys: a Zipf mix of hits (ranks of the stored keys, exponent 1.05) and new keys.

* Throughput, per thread count (1 and 2; TF's intra-op pool is fixed per process, so each
  count runs in its own worker process): both backends in one process grow to
  ``--throughput-rows`` rows on the same batches, then ``--repeats`` rounds time one
  update batch (90% hits), one lookup batch and one statistics record per backend, in a
  shuffled order per round (time_side_by_side). rows/s = keys / median wall time; also
  per CPU second (keys / median process CPU time of the call, all threads): on a shared
  machine the wall time measures the load as much as the code.
* Memory, per backend (RSS is per process): a worker grows the table to ``--rows``
  (10M) with batches of 50% new keys, recording statistics, and reads the process's RSS
  at checkpoints: bytes per row = (RSS - RSS before the table) / stored rows; for the
  engine also ``bytes_held`` (what ``memory()`` reports) against the RSS growth. The
  engine runs twice: float32 rows, and bfloat16 rows (``TableSpec.row_dtype``;
  ``bf16_rows_memory_ratio`` is its RSS per row over float32's).
* Memory through a training step (``engine_fit``): a FusedModel with one feature on a
  table of the same spec is trained with ``FusedModel.fit`` on new IDs (one per example,
  ``--fit-batch`` examples per step, fed as a ``tf.data`` pipeline) up to ``--fit-rows``
  rows; the process's RSS growth per stored row and ``layer.memory()``'s bytes per row
  at 1M, 3M and 6M rows (those within ``--fit-rows``). Its base is read after a warm
  start of full-size steps on other IDs, so that the step's own buffers, which malloc
  keeps for the next step, are in it (``fit_warm_start_bytes``: what the warm start
  grew RSS by beyond memory()).
The last line (``--json``) is one JSON object; ``--plot`` writes a PNG.
"""
import argparse
import collections
import json
import os
import subprocess
import sys
import time
from typing import Any, Dict, List

from tf_fusedemb import quiet

quiet.install()  # a command: quiet TensorFlow before it loads (tf_fusedemb/quiet.py)

import numpy as np  # noqa: E402

from tf_fusedemb.benchmarks import plots  # noqa: E402
from tf_fusedemb.benchmarks.timing import emit, time_side_by_side  # noqa: E402
from tf_fusedemb.specs import InitializerSpec, OptimizerSpec  # noqa: E402

BACKENDS = ("engine", "tfra")
# engine_bf16: the engine, bfloat16 rows; engine_fit: the engine through FusedModel.fit
MEMORY_KINDS = ("engine", "engine_bf16", "tfra", "engine_fit")
FIT_CHECKPOINTS = (1_000_000, 3_000_000, 6_000_000)
FIT_WARM_STEPS = 8  # full-size steps of the warm start (engine_fit)
DIM = 16


# ------------------------------------------------------------------ workload
class ZipfKeys:
    """Batches of unique keys: hits on the keys stored so far plus fresh keys. Hits are
    Zipf-distributed ranks (probability ~ r^-a over insertion order; keys are mix64 of
    the rank, so hot keys spread over shards); the heavy tail yields few distinct ranks,
    so a batch's remaining hits are drawn uniformly among the stored keys.

    Args:
      batch: keys per batch. seed: generator seed. exponent: Zipf exponent a > 1.
    """

    def __init__(self, batch: int, seed: int = 0, exponent: float = 1.05):
        self.batch, self.exponent = batch, exponent
        self.rng = np.random.default_rng(seed)
        self.next_id = 0

    def _key(self, ids):
        # Spread ids over int64 (mix64 as the unified keys are): hot keys are not adjacent.
        # tf_fusedemb.ops loads TensorFlow: only the workers draw keys, never the launcher.
        from tf_fusedemb.ops import hashing  # pylint: disable=import-outside-toplevel
        return hashing.mix64(np.asarray(ids, np.int64)).view(np.int64)

    def next(self, new_fraction: float) -> np.ndarray:
        """int64[batch] unique keys, ``new_fraction`` of them never seen before."""
        need = min(self.batch - int(self.batch * new_fraction), self.next_id)
        hits = self._hits(need)
        fresh = np.arange(self.next_id, self.next_id + self.batch - len(hits), dtype=np.int64)
        self.next_id += len(fresh)
        return self.rng.permutation(self._key(np.concatenate([hits, fresh])))

    def _hits(self, need: int) -> np.ndarray:
        """``need`` distinct stored ids: Zipf ranks first; when the heavy tail yields too
        few distinct ones, the rest uniformly among the stored ids."""
        hits = np.empty(0, np.int64)
        for _ in range(4):
            if len(hits) >= need:
                break
            ranks = self.rng.zipf(self.exponent, 2 * need) - 1
            hits = np.unique(np.concatenate([hits, ranks[ranks < self.next_id]]))
        while len(hits) < need:
            hits = np.union1d(hits, self.rng.integers(0, self.next_id, need - len(hits)))
        return self.rng.permutation(hits)[:need]


# ------------------------------------------------------------------ one backend's ops
class Backend:
    """A group table and its statistics of one backend, and tf.functions over them."""

    def __init__(self, kind: str):
        # In a worker: the launching process loads no TensorFlow; its ranks do.
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
        from tf_fusedemb.ops.category_hash import CategoryHashResult  # pylint: disable=import-outside-toplevel
        from tf_fusedemb.storage.statistics import AccessStatistics  # pylint: disable=import-outside-toplevel
        from tf_fusedemb.storage.engine_table import EngineGroupTable, EngineStatistics  # pylint: disable=import-outside-toplevel
        from tf_fusedemb.storage.tables import DynamicGroupTable  # pylint: disable=import-outside-toplevel
        args = (f"bench_{kind}", DIM, InitializerSpec(), OptimizerSpec.adagrad(0.05))
        if kind.startswith("engine"):
            self.table = EngineGroupTable(
                *args, row_dtype="bfloat16" if kind == "engine_bf16" else "float32")
            self.stats = EngineStatistics("bench", ["c"], self.table.engine)
        else:
            self.table = DynamicGroupTable(*args)
            self.stats = AccessStatistics("bench", ["c"])
        self.kind = kind
        grads = tf.fill([1, DIM], 1e-3)

        @tf.function(input_signature=[tf.TensorSpec([None], tf.int64)])
        def update(keys):
            g = tf.tile(grads, [tf.size(keys), 1])
            return self.table.apply_gradients(keys, g, return_rows=True)[1][:1]

        @tf.function(input_signature=[tf.TensorSpec([None], tf.int64)])
        def lookup(keys):
            return self.table.lookup(keys)[:1]

        @tf.function(input_signature=[tf.TensorSpec([None], tf.int64)])
        def record(keys):
            n = tf.size(keys)
            # Every key its own (table 0, ID key) pair, seen once: no collision.
            hashed = CategoryHashResult(keys, keys, tf.zeros([n], tf.int32), tf.range(n),
                                        tf.ones([n], tf.int32), tf.constant(0, tf.int64))
            self.stats.record(hashed, tf.ones([n], tf.int64), self.table.step)
            return n

        self.update, self.lookup, self.record = update, lookup, record

    def train(self, keys):
        """Records the accesses of ``keys`` int64[b], then updates their rows."""
        self.record(keys)
        self.update(keys).numpy()

    def rows(self) -> int:
        return int(self.table.size().numpy())


def rss_bytes() -> int:
    """Resident set size of this process (/proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ------------------------------------------------------------------ workers
def throughput_worker(threads: int, rows: int, batch: int, repeats: int) -> dict:
    """Both backends in this process, intra-op pool of ``threads``: grow to ``rows``,
    then time update / lookup / record batches side by side."""
    import tensorflow as tf  # in a worker: the launching process loads no TensorFlow; its ranks do # pylint: disable=import-outside-toplevel
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    backends = {k: Backend(k) for k in BACKENDS}
    keys = ZipfKeys(batch, seed=1)
    grow_s = dict.fromkeys(BACKENDS, 0.0)
    while keys.next_id < rows:
        b = tf.constant(keys.next(new_fraction=0.5))
        for k, backend in backends.items():
            start = time.perf_counter()
            backend.train(b)
            grow_s[k] += time.perf_counter() - start
    warmup = 3
    batches = [tf.constant(keys.next(new_fraction=0.1)) for _ in range(repeats + warmup)]
    probes = [tf.constant(keys.next(new_fraction=0.0)) for _ in range(repeats + warmup)]
    variants: Dict[str, Any] = {}
    cpu: Dict[str, List[float]] = collections.defaultdict(list)  # CPU seconds per variant
    for k, backend in backends.items():
        for op, fn, data in (("update", backend.update, batches), ("lookup", backend.lookup, probes),
                             ("record", backend.record, probes)):
            variants[f"{k}_{op}"] = _cpu_timed(fn, iter(data), cpu[f"{k}_{op}"])
    times = time_side_by_side(variants, repeats, warmup=warmup)
    out: Dict[str, Dict[str, Any]] = {k: {} for k in BACKENDS}
    for k in BACKENDS:
        for op in ("update", "lookup", "record"):
            name = f"{k}_{op}"
            out[k][f"{op}s_per_s"] = round(batch / (times[name]["median_ms"] / 1e3))
            out[k][f"{op}s_per_cpu_s"] = round(batch / float(np.median(cpu[name][warmup:])))
    for k in BACKENDS:
        out[k]["rows"] = backends[k].rows()
        out[k]["grow_s"] = round(grow_s[k], 2)
    for op in ("update", "lookup", "record"):
        for unit in ("s", "cpu_s"):
            key = f"{op}s_per_{unit}"
            out[f"{op}_speedup" + ("_cpu" if unit == "cpu_s" else "")] = round(
                out["engine"][key] / out["tfra"][key], 2)
    out["timings_ms"] = times
    return out


def _cpu_timed(fn, batches, cpu_seconds):
    """A zero-argument call of ``fn`` on the next batch that appends its process CPU time
    (all threads) to ``cpu_seconds``."""
    def run():
        start = time.process_time()
        fn(next(batches)).numpy()
        cpu_seconds.append(time.process_time() - start)
    return run


def memory_worker(kind: str, rows: int, batch: int, checkpoints) -> dict:
    """One backend grows to ``rows`` (50% new keys per batch, statistics recorded);
    RSS and (engine) bytes_held at each checkpoint."""
    import tensorflow as tf  # in a worker: the launching process loads no TensorFlow; its ranks do # pylint: disable=import-outside-toplevel
    tf.config.threading.set_intra_op_parallelism_threads(2)
    backend = Backend(kind)
    keys = ZipfKeys(batch, seed=2)
    backend.train(tf.constant(keys.next(0.5)[:1000]))  # kernels and functions loaded
    base = rss_bytes()
    points, todo = [], sorted(checkpoints)
    start = time.perf_counter()
    while todo:
        backend.train(tf.constant(keys.next(new_fraction=0.5)))
        stored = backend.rows()
        if stored >= todo[0]:
            todo.pop(0)
            point = {"rows": stored, "rss_growth_bytes": rss_bytes() - base,
                     "seconds": round(time.perf_counter() - start, 1)}
            point["bytes_per_row_rss"] = round(point["rss_growth_bytes"] / stored, 1)
            if kind.startswith("engine"):
                held = int(backend.table.bytes_held().numpy())
                point["bytes_held_per_row"] = round(held / stored, 1)
                point["bytes_held_vs_rss"] = round(held / point["rss_growth_bytes"], 3)
            points.append(point)
            print(f"{kind}: {point}", file=sys.stderr, flush=True)
    return {"points": points}


def fit_memory_worker(batch: int, checkpoints) -> dict:
    """RSS growth per stored row through ``FusedModel.fit`` (see the module docstring):
    the training step's memory, not only the engine's calls. One feature, one table
    (dim 16, Adagrad, statistics recorded by fit); ``batch`` new IDs per step."""
    # In a worker: the launching process loads no TensorFlow (nor Keras); its ranks do.
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import tf_keras  # pylint: disable=import-outside-toplevel
    from tf_fusedemb.layers import FusedEmbedding  # pylint: disable=import-outside-toplevel
    from tf_fusedemb.models import FusedModel  # pylint: disable=import-outside-toplevel
    from tf_fusedemb.specs import FeatureSpec, TableSpec  # pylint: disable=import-outside-toplevel
    tf.config.threading.set_intra_op_parallelism_threads(2)
    layer = FusedEmbedding([FeatureSpec("c", TableSpec("c", DIM, OptimizerSpec.adagrad(0.05)))])
    inputs = {"c": tf_keras.Input([], dtype=tf.int64, name="c")}
    model = FusedModel(inputs, tf_keras.layers.Dense(1)(layer(inputs)["c"]))
    model.compile(optimizer="adagrad", loss=tf_keras.losses.BinaryCrossentropy(from_logits=True))

    def examples(lo, hi):
        """IDs lo..hi-1, one per example, label 0: a pipeline, so no array of all the
        IDs sits in memory beside the table."""
        return tf.data.Dataset.range(lo, hi).batch(batch).map(
            lambda ids: ({"c": ids}, tf.zeros(tf.shape(ids), tf.float32)))

    def memory():
        (group,) = layer.memory().values()
        return group["rows"], group["bytes"]

    warm_ids = -FIT_WARM_STEPS * batch  # the warm start's IDs are negative: never new later
    start_rss = rss_bytes()
    model.fit(examples(warm_ids, 0), verbose=0)
    model.fit(examples(warm_ids, 0), verbose=0)  # the same IDs again: the step's steady state
    # One fit call over the new IDs; its first step is the base (so its iterator and
    # threads are in it), then the points at the steps that reach each checkpoint.
    todo = sorted(checkpoints)
    points: List[dict] = []
    state: Dict[str, Any] = {}

    class Measure(tf_keras.callbacks.Callback):
        """Reads RSS and memory() after the steps that reach the checkpoints."""

        def on_train_batch_end(self, step, logs=None):
            del logs
            if not state:
                rows, held = memory()
                state.update(base=rss_bytes(), rows0=rows, held0=held, warm=rss_bytes() -
                             start_rss - held, start=time.perf_counter())
                return
            if not todo or step * batch < todo[0]:  # rows stored since the base
                return
            todo.pop(0)
            rows, held = memory()
            stored, growth = rows - state["rows0"], rss_bytes() - state["base"]
            point = {"rows": stored, "rss_growth_bytes": growth,
                     "bytes_per_row_rss": round(growth / stored, 1),
                     "bytes_held_per_row": round((held - state["held0"]) / stored, 1),
                     "bytes_held_vs_rss": round((held - state["held0"]) / growth, 3),
                     "seconds": round(time.perf_counter() - state["start"], 1)}
            points.append(point)
            print(f"engine_fit: {point}", file=sys.stderr, flush=True)

    model.fit(examples(0, max(checkpoints) + 2 * batch), verbose=0, callbacks=[Measure()])
    return {"points": points, "batch": batch, "fit_warm_start_bytes": state["warm"]}


def run_worker(args) -> dict:
    """A worker in a fresh process (its own TF thread pool and RSS); its JSON result."""
    cmd = [sys.executable, "-m", "tf_fusedemb.benchmarks.storage", "--worker", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"worker {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ main
def plot(result: dict, path: str) -> str:
    fig, (mem_ax, thr_ax) = plots.new_figure(12, 5, ncols=2)
    for kind, mem in result["memory"].items():
        pts = mem["points"]
        mem_ax.plot([p["rows"] for p in pts], [p["bytes_per_row_rss"] for p in pts], "o-",
                    label=f"{kind} (RSS)")
        if kind.startswith("engine"):
            mem_ax.plot([p["rows"] for p in pts], [p["bytes_held_per_row"] for p in pts], "x--",
                        label=f"{kind} memory() (bytes_held)")
    mem_ax.axhline(170, color="gray", linestyle=":", label="target 170")
    mem_ax.set_xscale("log")
    mem_ax.set(xlabel="stored rows", ylabel="bytes per row", title="memory, dim 16 Adagrad + statistics")
    mem_ax.legend(fontsize=8)
    mem_ax.grid(True, alpha=0.3)
    labels, x = [], 0
    for threads, res in sorted(result["throughput"].items()):
        for op in ("update", "lookup", "record"):
            for i, kind in enumerate(BACKENDS):
                thr_ax.bar(x + 0.4 * i, res[kind][f"{op}s_per_s"] / 1e6, 0.4,
                           color=f"C{i}", label=kind if x == 0 else None)
            labels.append(f"{op}\n{threads}")
            x += 1
    thr_ax.set_xticks(np.arange(x) + 0.2)
    thr_ax.set_xticklabels(labels, fontsize=7)
    thr_ax.set(ylabel="M rows/s", title="100k-key batches (median)")
    thr_ax.legend(fontsize=8)
    return plots.write_figure(fig, path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=10_000_000, help="memory: rows to grow to")
    p.add_argument("--fit-rows", type=int, default=None,
                   help="engine_fit: rows to grow to (default: --rows, at most 6M)")
    p.add_argument("--fit-batch", type=int, default=65_536, help="engine_fit: examples per step")
    p.add_argument("--memory-kinds", nargs="+", choices=MEMORY_KINDS, default=list(MEMORY_KINDS))
    p.add_argument("--throughput-rows", type=int, default=2_000_000)
    p.add_argument("--batch", type=int, default=100_000)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--plot", default="storage_benchmark.png")
    p.add_argument("--parts", nargs="+", choices=("throughput", "memory"),
                   default=["throughput", "memory"])
    p.add_argument("--json", action="store_true")
    p.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        kind, *rest = args.worker
        if kind == "throughput":
            res = throughput_worker(int(rest[0]), args.throughput_rows, args.batch, args.repeats)
        elif kind == "engine_fit":
            fit_rows = args.fit_rows or min(args.rows, FIT_CHECKPOINTS[-1])
            res = fit_memory_worker(args.fit_batch,
                                    [c for c in FIT_CHECKPOINTS if c < fit_rows] + [fit_rows])
        else:
            checkpoints = [c for c in (500_000, 1_000_000, 2_000_000, 5_000_000, args.rows)
                           if c <= args.rows]
            res = memory_worker(kind, args.rows, args.batch, checkpoints)
        print(json.dumps(res))
        return
    common = ["--rows", str(args.rows), "--throughput-rows", str(args.throughput_rows),
              "--batch", str(args.batch), "--repeats", str(args.repeats),
              "--fit-batch", str(args.fit_batch)]
    if args.fit_rows:
        common += ["--fit-rows", str(args.fit_rows)]
    result = {"dim": DIM, "optimizer": "adagrad", "batch": args.batch, "throughput": {},
              "memory": {}}
    if "throughput" in args.parts:
        result["throughput"] = {f"threads_{t}": run_worker(["throughput", str(t)] + common)
                                for t in args.threads}
    if "memory" in args.parts:
        result["memory"] = {k: run_worker([k] + common) for k in args.memory_kinds}
        last = {k: m["points"][-1] for k, m in result["memory"].items()}
        result["bytes_per_row_at_max"] = {k: v["bytes_per_row_rss"] for k, v in last.items()}
        if "engine" in last:
            result["engine_bytes_held_vs_rss"] = last["engine"].get("bytes_held_vs_rss")
        if "engine" in last and "engine_bf16" in last:
            result["bf16_rows_memory_ratio"] = round(
                last["engine_bf16"]["bytes_per_row_rss"] / last["engine"]["bytes_per_row_rss"], 3)
        if "engine_fit" in result["memory"]:
            fit = result["memory"]["engine_fit"]["points"]
            # Through a training step: RSS growth and memory() per stored row, by rows.
            result["fit_bytes_per_row"] = {p["rows"]: p["bytes_per_row_rss"] for p in fit}
            result["fit_bytes_held_vs_rss"] = {p["rows"]: p["bytes_held_vs_rss"] for p in fit}
    if args.plot:
        result["plot"] = plot(result, args.plot)
    emit(result, args.json)


if __name__ == "__main__":
    main()
