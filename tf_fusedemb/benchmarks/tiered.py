"""Tiered-storage benchmark: one engine table trained under DRAM budgets, side by side.

    python -m tf_fusedemb.benchmarks.tiered --json --plot docs/plots/tiered.png
    python -m tf_fusedemb.benchmarks.tiered --rows 1000000 --json   # a small machine
    python -m tf_fusedemb.benchmarks.tiered --workloads dlrm --json  # the DLRM alone

One group table of dim 16 with Adagrad and its access statistics (EngineGroupTable +
EngineStatistics, the storage benchmark's ``Backend`` workload), grown to ``--rows``
rows, then trained on batches of ``--batch`` unique keys drawn Zipf (exponent 1.05,
Criteo-like popularity) over the stored keys, 2% new. Each budget fraction of the
table's payload (``rows * (28 + 2 * 4 * 16)`` bytes: header, row, accumulator) runs in
its own worker process (its own RSS); "1.0" is the engine without a budget (all DRAM).

Per budget: the median step (record + update of one batch) without prefetch, and with
the batch prefetched first (``EngineGroupTable.prefetch``: in the pipelined fit it runs
during the previous step's compute, so it is timed apart and not counted in the step);
the DRAM hit rate (1 - blocks read back from SSD per key of a step, in [0, 1]; blocks read
back more than once in a step, beyond one per key, are ``rereads_per_step``); SSD bytes read and
written per step; the RSS the table adds; the wall time of a checkpoint as
training/checkpoint.py writes it (``EngineGroupTable.write_checkpoint``: a new RocksDB database of every block, tiered:
the SSD tier's blocks read out of its file with the DRAM tier's in their place;
all-DRAM: straight from the engine).

The exposed SSD wait is the step's time over the all-DRAM step's: with prefetch, what
the step still waits for (spills of victims, index work) once its blocks are in DRAM.
The prefetch's own wall time is reported too (``prefetch_ms``, and
``prefetch_ratio_vs_dram_step``: it over the all-DRAM step): the prefetch hides only
behind as much compute, on other cores, so a ratio above 1 means that a pipelined step
of the all-DRAM step's length waits for the prefetch anyway.
Then the whole step as a user runs it (``benchmarks.tiered_fit``): per budget, one
``FusedModel.fit`` worker of plain fit and one of the pipelined fit (prefetch included),
reported under ``fit`` and summed up as ``fit_ratio_vs_dram``, ``pipelined_ratio_vs_dram``
(against the faster all-DRAM mode), ``per_block_us`` (the machine's extra CPU per block
read back or spilled), ``hit_rate`` (of the plain fit's stored keys),
``fit_rss_ratio_vs_dram``, ``anon_rss_ratio_vs_dram``, ``dram_bytes_per_cold_key``
(the SSD tier's DRAM index per key it holds) and ``disk_pages_per_block_read`` (4 KiB
pages the process read from the disk per block read back: the share of the SSD tier's
reads that missed the page cache); ``keys`` names the key generator's parameters.

The DLRM workload (``--workloads dlrm``, ``benchmarks.tiered_dlrm``): the lookup
benchmark's model (26 features, batch ``--dlrm-batch`` = 4096 on one rank), its largest
tables tiered at each budget fraction of their payload, the rest in DRAM, through the same
plain and pipelined fit workers; its figures go under ``dlrm`` in the same keys
(``fit_ratio_vs_dram``, ``pipelined_ratio_vs_dram``, ``per_block_us``, ``hit_rate``,
``anon_rss_ratio_vs_dram``, ...), with its key generator's parameters under ``dlrm.keys``.

With ``--memory-limit-mb``, every tiered fit worker (both workloads) runs inside a memory
cgroup of that limit (``testing.memory_limit``, root only), and reports the cgroup's peak
charge and OOM kills under ``cgroup``; a worker the OOM killer ends fails the run, naming it:

    python -m tf_fusedemb.benchmarks.tiered --json --fractions 0.1 --memory-limit-mb 2048

The last line (``--json``) is one JSON object with ``step_ratio_vs_dram``,
``rss_ratio_vs_dram`` (each keyed by the budget fraction as a string),
``exposed_ssd_ms`` ({"prefetch", "no_prefetch"} at 10%) and ``checkpoint_ratio`` (the
10% budget's checkpoint wall time over the all-DRAM engine's).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

from tf_fusedemb import quiet

quiet.install()  # a command: quiet TensorFlow before it loads (tf_fusedemb/quiet.py)

import numpy as np  # noqa: E402

from tf_fusedemb.benchmarks import plots, tiered_dlrm  # noqa: E402
from tf_fusedemb.benchmarks.storage import DIM, ZipfKeys, rss_bytes  # noqa: E402
from tf_fusedemb.benchmarks.tiered_fit import (MODES, NEW_FRACTION, budget_bytes,  # noqa: E402
                                               fit_summary, fit_worker, hit_rate)
from tf_fusedemb.benchmarks.timing import emit, time_steps  # noqa: E402
from tf_fusedemb.specs import InitializerSpec, OptimizerSpec  # noqa: E402
from tf_fusedemb.testing.memory_limit import MemoryLimit  # noqa: E402

FRACTIONS = ("1.0", "0.5", "0.2", "0.1", "0.05")
WORKLOADS = ("engine", "dlrm")
WORKER_TIMEOUT_S = 3600  # one worker inside a memory cgroup: a 50 M-row table grows for long


class TieredTable:
    """An engine group table (tiered at ``budget`` bytes, or not) with its statistics,
    and tf.functions of one training step and of a prefetch."""

    def __init__(self, budget: Optional[int], spill_dir: str):
        # In a worker: the launching process loads no TensorFlow; its workers do.
        import tensorflow as tf  # in a worker only # pylint: disable=import-outside-toplevel
        from tf_fusedemb.ops.category_hash import CategoryHashResult  # loads TF: in a worker only # pylint: disable=import-outside-toplevel
        from tf_fusedemb.storage.engine_table import EngineGroupTable, EngineStatistics  # loads TF: in a worker only # pylint: disable=import-outside-toplevel
        from tf_fusedemb.storage.spill_dir import make_spill_path  # in a worker only: beside the TF imports # pylint: disable=import-outside-toplevel
        path = None if budget is None else make_spill_path("bench", ["bench"], spill_dir)
        self.table = EngineGroupTable("bench", DIM, InitializerSpec(), OptimizerSpec.adagrad(0.05),
                                      memory_budget_bytes=budget, spill_path=path)
        self.stats = EngineStatistics("bench", ["c"], self.table.engine)
        grads = tf.fill([1, DIM], 1e-3)

        @tf.function(input_signature=[tf.TensorSpec([None], tf.int64)])
        def step(keys):
            n = tf.size(keys)
            hashed = CategoryHashResult(keys, keys, tf.zeros([n], tf.int32), tf.range(n),
                                        tf.ones([n], tf.int32), tf.constant(0, tf.int64))
            with tf.control_dependencies([self.stats.record(hashed, tf.ones([n], tf.int64),
                                                            self.table.step + 1)]):
                g = tf.tile(grads, [n, 1])
                return self.table.apply_gradients(keys, g, return_rows=True)[1][:1]

        @tf.function(input_signature=[tf.TensorSpec([None], tf.int64)])
        def prefetch(keys):
            self.table.prefetch(keys)
            return tf.size(keys)

        self.step, self.prefetch = step, prefetch

    def io(self) -> np.ndarray:
        """int64[4]: blocks read from SSD, bytes read, blocks spilled, bytes spilled."""
        return self.table.engine.size().ssd_io.numpy()

    def checkpoint_s(self, directory: str) -> float:
        """Wall seconds of the table's checkpoint as CheckpointManager writes it into
        ``directory`` (``write_checkpoint``)."""
        start = time.perf_counter()
        self.table.write_checkpoint(os.path.join(directory, "blocks"))
        return time.perf_counter() - start


def timed_steps(t: TieredTable, keys: ZipfKeys, steps: int, prefetch: bool) -> Dict[str, float]:
    """Median step ms over ``steps`` batches (prefetched first when ``prefetch``), with
    SSD blocks read and bytes read/written per step."""
    import tensorflow as tf  # in a worker: the launching process loads no TensorFlow # pylint: disable=import-outside-toplevel
    batches = [tf.constant(keys.next(new_fraction=0.02)) for _ in range(steps + 1)]
    before, times, fetch_times = t.io(), [], []
    for b in batches[1:]:  # each batch's prefetch and step timed apart, one after the other
        if prefetch:
            fetch_times += time_steps(lambda _: t.prefetch(b).numpy(), 1)
        times += time_steps(lambda _: t.step(b).numpy(), 1)
    io = (t.io() - before) / steps
    out = {"step_ms": float(np.median(times)), "blocks_read": float(io[0]),
           "read_bytes": float(io[1]), "written_bytes": float(io[3])}
    if prefetch:
        out["prefetch_ms"] = float(np.median(fetch_times))
    return out


def worker(fraction: str, rows: int, batch: int, steps: int, spill_dir: str) -> dict:
    """Grows the table to ``rows`` under ``fraction`` of its payload (1.0: no budget),
    then times steps without and with prefetch; RSS and checkpoint time."""
    import tensorflow as tf  # in a worker: the launching process loads no TensorFlow # pylint: disable=import-outside-toplevel
    tf.config.threading.set_intra_op_parallelism_threads(2)
    budget = budget_bytes(fraction, rows)
    t = TieredTable(budget, spill_dir)
    keys = ZipfKeys(batch, seed=3)
    t.step(tf.constant(keys.next(0.5)[:1000])).numpy()  # kernels and functions loaded
    base = rss_bytes()
    while keys.next_id < rows:
        t.step(tf.constant(keys.next(new_fraction=0.5))).numpy()
    t.step(tf.constant(keys.next(new_fraction=0.02))).numpy()  # the first Zipf step
    plain = timed_steps(t, keys, steps, prefetch=False)
    fetched = timed_steps(t, keys, steps, prefetch=True)
    hits, rereads = hit_rate(plain["blocks_read"], batch)
    return {"budget_bytes": budget, "rss_growth_bytes": rss_bytes() - base,
            "no_prefetch": plain, "prefetch": fetched, "hit_rate": hits,
            "rereads_per_step": rereads, "checkpoint_s": checkpoint_s(t, spill_dir),
            "ssd_bytes": int(t.table.ssd_bytes().numpy())}


def checkpoint_s(t: TieredTable, parent: str) -> float:
    """``t.checkpoint_s`` into a fresh directory under ``parent``, removed afterwards."""
    directory = tempfile.mkdtemp(prefix="bench_ckpt_", dir=parent)
    try:
        return t.checkpoint_s(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def run_worker(args: List[str], spill_parent: str, limit_bytes: Optional[int] = None) -> dict:
    """Runs one worker of this module with ``args``, spilling into a fresh directory under
    ``spill_parent`` that is removed when the worker ends, however it ends (a worker
    killed for memory cannot remove its own store); its JSON result. With
    ``limit_bytes``, inside a memory cgroup of that limit (``testing.memory_limit``), its
    peak charge and OOM kills added under ``cgroup``."""
    with tempfile.TemporaryDirectory(prefix="tiered_worker_", dir=spill_parent,
                                     ignore_cleanup_errors=True) as spill_dir:
        cmd = [sys.executable, "-m", "tf_fusedemb.benchmarks.tiered", *args,
               "--spill-dir", spill_dir]
        if limit_bytes is None:
            out = subprocess.run(cmd, capture_output=True, text=True, check=False)
            returncode, stdout, stderr, cgroup = out.returncode, out.stdout, out.stderr, None
        else:
            with MemoryLimit(limit_bytes) as limit:
                run = limit.run(cmd, timeout=WORKER_TIMEOUT_S)
            returncode, stdout, stderr = run.returncode, run.stdout, run.stderr
            cgroup = {"limit_bytes": limit_bytes, "peak_bytes": run.peak_bytes,
                      "oom_kills": run.oom_kills}
    if returncode != 0:
        killed = f" (OOM kills in its memory cgroup: {cgroup})" if cgroup else ""
        raise RuntimeError(f"worker {' '.join(args)} failed{killed}:\n{stderr[-3000:]}")
    result = json.loads(stdout.strip().splitlines()[-1])
    if cgroup is not None:
        result["cgroup"] = cgroup
    return result


def fit_runs(fractions: List[str], worker_args: List[str], spill_parent: str,
             limit_bytes: Optional[int]) -> Dict[str, Dict[str, dict]]:
    """{fraction: {mode: fit worker result}}: one worker per budget and mode, the tiered
    ones inside ``limit_bytes`` (None: no limit; the all-DRAM run never has one)."""
    return {f: {m: run_worker(["--worker", f, "--fit-worker", m] + worker_args, spill_parent,
                              None if f == "1.0" else limit_bytes)
                for m in MODES}
            for f in fractions}


def dlrm_result(fractions: List[str], args: argparse.Namespace, spill_dir: str,
                limit_bytes: Optional[int]) -> dict:
    """The DLRM workload's figures (``tiered_dlrm``), keyed as the engine workload's."""
    worker_args = ["--workload", "dlrm", "--dlrm-batch", str(args.dlrm_batch),
                   "--dlrm-growth", str(args.dlrm_growth), "--steps", str(args.steps)]
    fit = fit_runs(fractions, worker_args, spill_dir, limit_bytes)
    return {"batch": args.dlrm_batch, "ranks": 1, "tiered_tables": list(tiered_dlrm.TIERED),
            "tiered_rows": fit["1.0"]["fit"]["tiered_rows"],
            "keys": {"generator": "generate_criteo_like", "profile": "criteo",
                     "seed": tiered_dlrm.SEED, "growth_batches": args.dlrm_growth,
                     "timed_batches": args.steps + 2},
            "fit": fit, **fit_summary(fit)}


def summary(per: Dict[str, dict]) -> dict:
    """The issue's figures from the per-budget results (keyed by fraction)."""
    dram = per["1.0"]
    out: Dict[str, Any] = {"step_ratio_vs_dram": {}, "rss_ratio_vs_dram": {},
                           "engine_hit_rate": {}, "prefetch_ratio_vs_dram_step": {}}
    for f, r in per.items():
        out["step_ratio_vs_dram"][f] = round(r["prefetch"]["step_ms"] / dram["prefetch"]["step_ms"], 3)
        out["rss_ratio_vs_dram"][f] = round(r["rss_growth_bytes"] / dram["rss_growth_bytes"], 3)
        out["engine_hit_rate"][f] = round(r["hit_rate"], 4)
        out["prefetch_ratio_vs_dram_step"][f] = round(
            r["prefetch"]["prefetch_ms"] / dram["prefetch"]["step_ms"], 3)
    if "0.1" in per:
        ten = per["0.1"]
        out["exposed_ssd_ms"] = {
            mode: round(max(0.0, ten[mode]["step_ms"] - dram[mode]["step_ms"]), 2)
            for mode in ("prefetch", "no_prefetch")}
        out["checkpoint_ratio"] = round(ten["checkpoint_s"] / dram["checkpoint_s"], 3)
    return out


def plot(result: dict, path: str) -> str:
    fig, (step_ax, io_ax) = plots.new_figure(12, 5, ncols=2)
    fr = [f for f in FRACTIONS if f in result["budgets"]]
    x = np.arange(len(fr))
    bars = {"step, no prefetch": [result["budgets"][f]["no_prefetch"]["step_ms"] for f in fr],
            "step, prefetched": [result["budgets"][f]["prefetch"]["step_ms"] for f in fr],
            "the prefetch itself": [result["budgets"][f]["prefetch"]["prefetch_ms"] for f in fr]}
    for i, (label, ms) in enumerate(bars.items()):
        step_ax.bar(x + 0.27 * i, ms, 0.27, label=label)
    step_ax.set_xticks(x + 0.27)
    step_ax.set_xticklabels(fr)
    step_ax.set(xlabel="DRAM budget (fraction of the table)", ylabel="median step ms",
                title=f"{result['rows']} rows, {result['batch']}-key Zipf batches")
    step_ax.legend(fontsize=8)
    io_ax.plot(fr, [result["hit_rate"][f] for f in fr], "o-", label="DRAM hit rate")
    io_ax.plot(fr, [result["rss_ratio_vs_dram"][f] for f in fr], "x--", label="RSS vs all-DRAM")
    io_ax.set(xlabel="DRAM budget (fraction of the table)", title="hit rate and RSS")
    io_ax.legend(fontsize=8)
    return plots.write_figure(fig, path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=50_000_000)
    p.add_argument("--batch", type=int, default=100_000)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--fractions", nargs="+", default=list(FRACTIONS), choices=FRACTIONS)
    p.add_argument("--spill-dir", default=None,
                   help="parent of the SSD tiers' directories (default: the system temp dir)")
    p.add_argument("--plot", default=None)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS,
                   help="engine: one table, its step alone and through fit; dlrm: the "
                        "lookup benchmark's DLRM through fit (under the 'dlrm' key)")
    p.add_argument("--dlrm-batch", type=int, default=4096)
    p.add_argument("--dlrm-growth", type=int, default=100,
                   help="DLRM batches that grow the tables before the timed ones")
    p.add_argument("--memory-limit-mb", type=float, default=None, metavar="MB",
                   help="run each tiered fit worker inside a memory cgroup of this limit "
                        "(needs root; the all-DRAM run has none); its peak and OOM kills "
                        "are reported under 'cgroup'")
    p.add_argument("--json", action="store_true")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--fit-worker", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--workload", choices=WORKLOADS, default="engine", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    spill_dir = args.spill_dir or tempfile.gettempdir()
    if args.memory_limit_mb is not None and args.memory_limit_mb <= 0:
        p.error(f"--memory-limit-mb must be positive, got {args.memory_limit_mb}")
    limit = None if args.memory_limit_mb is None else int(args.memory_limit_mb * 2**20)
    if args.worker and args.fit_worker and args.workload == "dlrm":
        print(json.dumps(tiered_dlrm.dlrm_fit_worker(args.worker, args.dlrm_batch,
                                                     args.dlrm_growth, args.steps, spill_dir,
                                                     args.fit_worker)))
        return
    if args.worker and args.fit_worker:
        print(json.dumps(fit_worker(budget_bytes(args.worker, args.rows), args.rows,
                                    args.batch, args.steps, spill_dir, args.fit_worker)))
        return
    if args.worker:
        print(json.dumps(worker(args.worker, args.rows, args.batch, args.steps, spill_dir)))
        return
    common = ["--rows", str(args.rows), "--batch", str(args.batch), "--steps", str(args.steps)]
    fractions = ["1.0"] + [f for f in args.fractions if f != "1.0"]
    result: Dict[str, Any] = {"rows": args.rows, "batch": args.batch, "dim": DIM,
                              "optimizer": "adagrad"}
    if "engine" in args.workloads:
        per = {f: run_worker(["--worker", f] + common, spill_dir) for f in fractions}
        fit = fit_runs(fractions, common, spill_dir, limit)
        result.update({"keys": {"generator": "ZipfKeys", "exponent": ZipfKeys(1).exponent,
                                "timed_new_fraction": NEW_FRACTION, "seed": 3},
                       "budgets": per, **summary(per), "fit": fit, **fit_summary(fit)})
        if args.plot:
            result["plot"] = plot(result, args.plot)
    if "dlrm" in args.workloads:
        result["dlrm"] = dlrm_result(fractions, args, spill_dir, limit)
    emit(result, args.json)


if __name__ == "__main__":
    main()
