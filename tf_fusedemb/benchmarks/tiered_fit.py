"""Tables larger than memory as a user trains them: ``FusedModel.fit``, the whole step.

One worker process per (budget, mode): a one-feature model (dim 16, Adagrad; its dense
part a frozen sum, so the step is the embedding's) grows its table to ``rows`` keys
through ``fit``, then trains ``steps`` batches of ``batch`` unique keys drawn Zipf over the
stored keys (``storage.ZipfKeys``, 2% new), either with plain ``fit`` ("fit", the
default, no pipelining) or with the pipelined fit ("pipelined": ``compile(pipeline="dbp")``,
which routes and prefetches batch t+1 during batch t). Each step's time is the wall time
between two consecutive batch ends: the data, the prefetch, the step and the callbacks,
everything a user waits for.

Per worker: the median step, the whole machine's busy CPU seconds per step over the timed
steps (``/proc/stat``, every core: the kernel's page-cache and writeback
work count), the blocks read back from and spilled to the SSD tier, the DRAM hit rate
(the share of a step's stored keys whose block was in DRAM when the step or its prefetch
asked for it; new keys left out; in [0, 1]: the blocks read beyond one per stored key,
read back more than once in a step, are counted apart as ``rereads_per_step``), and the RSS the table added, anonymous and file-backed
apart (page cache is reclaimable; anonymous memory is what a budget bounds), and the
DRAM of the SSD tier's index per cold key (``dram_bytes_per_cold_key``).
"""
import os
import statistics
import time
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from tf_fusedemb.benchmarks.storage import DIM, ZipfKeys

BLOCK_BYTES = 28 + 2 * 4 * DIM  # a block of the table: header, row, Adagrad accumulator

NEW_FRACTION = 0.02  # of each timed batch: keys never seen before
MODES = ("fit", "pipelined")


class ProcessMemory(NamedTuple):
    """This process's resident memory in bytes (/proc/self/status)."""
    anon: int  # RssAnon: private anonymous memory (heap, arenas, mmap'd anonymous)
    file: int  # RssFile: file-backed pages mapped (libraries, mapped files)

    @staticmethod
    def now() -> "ProcessMemory":
        fields = {}
        with open("/proc/self/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in ("RssAnon", "RssFile"):
                    fields[name] = int(value.split()[0]) * 1024
        return ProcessMemory(fields["RssAnon"], fields["RssFile"])


def machine_busy_s() -> float:
    """Busy CPU seconds of every core since boot (/proc/stat's first line: user, nice,
    system, irq, softirq and steal; idle and iowait left out)."""
    with open("/proc/stat") as f:
        jiffies = [int(v) for v in f.readline().split()[1:]]
    busy = jiffies[0] + jiffies[1] + jiffies[2] + jiffies[5] + jiffies[6] + jiffies[7]
    return busy / os.sysconf("SC_CLK_TCK")


def disk_read_bytes() -> int:
    """Bytes this process has had read from storage since it started (/proc/self/io's
    read_bytes: page faults, read calls and the read-ahead they ask for; page-cache hits
    not counted)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no read_bytes line")


def hit_rate(blocks_read: float, stored_keys: int) -> Tuple[Optional[float], float]:
    """(DRAM hit rate, re-reads) of ``blocks_read`` blocks read back from the SSD tier for
    ``stored_keys`` keys found stored (over the same steps): the rate is the share of those
    keys whose block was in DRAM, in [0, 1] (None without stored keys); the blocks read
    beyond one per stored key, read back more than once (evicted again before the step's
    last call: a budget near the blocks a step pins), are the re-reads, never a rate
    below 0."""
    rereads = max(0.0, blocks_read - stored_keys)
    if not stored_keys:
        return None, rereads
    return 1.0 - (blocks_read - rereads) / stored_keys, rereads


def budget_bytes(fraction: str, rows: int) -> Optional[int]:
    """The DRAM budget of ``fraction`` of a ``rows``-row table's payload; None for "1.0"."""
    return None if fraction == "1.0" else int(float(fraction) * rows * BLOCK_BYTES)


def compile_model(model: Any, pipelined: bool) -> Any:
    """``model`` compiled as the workloads train it: SGD for the dense part, binary
    cross-entropy, the pipelined fit (``pipeline="dbp"``) or plain fit."""
    import tf_keras  # in a worker, beside TensorFlow # pylint: disable=import-outside-toplevel
    model.compile(optimizer=tf_keras.optimizers.SGD(0.01), pipeline="dbp" if pipelined else None,
                  loss=tf_keras.losses.BinaryCrossentropy(from_logits=True))
    return model


def _build(budget: Optional[int], spill_dir: str, pipelined: bool) -> Any:
    """(compiled FusedModel, its FusedEmbedding) of one dynamic table."""
    import tensorflow as tf  # in a worker: the launcher loads no TensorFlow # pylint: disable=import-outside-toplevel
    import tf_keras  # in a worker, beside TensorFlow # pylint: disable=import-outside-toplevel
    from tf_fusedemb.layers import FusedEmbedding  # loads TF: in a worker only # pylint: disable=import-outside-toplevel
    from tf_fusedemb.models import FusedModel  # loads TF: in a worker only # pylint: disable=import-outside-toplevel
    from tf_fusedemb.specs import FeatureSpec, OptimizerSpec, TableSpec  # pylint: disable=import-outside-toplevel
    table = TableSpec("c", DIM, OptimizerSpec.adagrad(0.05), memory_budget_bytes=budget,
                      spill_dir=spill_dir if budget is not None else None)
    layer = FusedEmbedding([FeatureSpec("c", table)])
    inputs = {"c": tf_keras.Input([], dtype=tf.int64, name="c")}
    logits = tf_keras.layers.Dense(1, use_bias=False, kernel_initializer="ones",
                                   trainable=False)(layer(inputs)["c"])
    return compile_model(FusedModel(inputs, logits), pipelined), layer


def as_dataset(batches: Sequence[Tuple[Dict[str, np.ndarray], np.ndarray]]) -> Any:
    """``batches`` ((features, labels float32[B, 1]) pairs) as one tf.data.Dataset of
    them in order: made before a measurement, so that its copy of the data is not counted
    in the memory the table adds."""
    import tensorflow as tf  # in a worker # pylint: disable=import-outside-toplevel
    features = {k: np.concatenate([x[k] for x, _ in batches]) for k in batches[0][0]}
    labels = np.concatenate([y for _, y in batches])
    return tf.data.Dataset.from_tensor_slices((features, labels)).batch(len(batches[0][1]))


def fit_batches(model: Any, data: Any) -> List[float]:
    """Fits ``data`` (an ``as_dataset``) for one epoch; returns the perf_counter time at
    each batch's end."""
    import tf_keras  # in a worker # pylint: disable=import-outside-toplevel
    ends: List[float] = []
    clock = tf_keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: ends.append(time.perf_counter()))
    model.fit(data, epochs=1, verbose=0, callbacks=[clock])
    return ends


def _key_batches(keys: Sequence[np.ndarray]) -> List[Tuple[Dict[str, np.ndarray], np.ndarray]]:
    """The engine workload's batches (int64[batch] keys each) as (features, labels)."""
    return [({"c": k}, np.zeros((len(k), 1), np.float32)) for k in keys]


def growth_stream(keys: ZipfKeys, rows: int) -> Any:
    """The engine workload's growth batches (half new keys each, until ``keys`` has drawn
    ``rows``) as a dataset drawing them one at a time: a 50 M-row table's keys never all in
    memory at once, which a memory limit near the budget could not hold."""
    import tensorflow as tf  # in a worker # pylint: disable=import-outside-toplevel

    def batches():
        while keys.next_id < rows:
            k = keys.next(new_fraction=0.5)
            yield {"c": k}, np.zeros((len(k), 1), np.float32)

    signature = ({"c": tf.TensorSpec([None], tf.int64)}, tf.TensorSpec([None, 1], tf.float32))
    return tf.data.Dataset.from_generator(batches, output_signature=signature)


class FitMemory(NamedTuple):
    """A layer's groups summed (``FusedEmbedding.memory()``)."""
    rows: int
    dram_bytes: int
    ssd_bytes: int
    ssd_index_bytes: int
    blocks_read: int
    blocks_spilled: int

    @staticmethod
    def of(layer: Any) -> "FitMemory":
        groups = list(layer.memory().values())
        return FitMemory(*(sum(g[name] for g in groups) for name in (
            "rows", "bytes", "ssd_bytes", "ssd_index_bytes", "ssd_blocks_read",
            "ssd_blocks_spilled")))


def timed_fit(model: Any, layer: Any, timed: Any, steps: int, stored_keys: int,
              base: ProcessMemory, mode: str) -> Dict[str, Any]:
    """Fits the ``timed`` batches (an ``as_dataset`` of ``steps + 2``, the last ``steps``
    of them timed) and measures them: ``stored_keys`` is the number of their tables' keys
    stored before their step (new keys left out of the hit rate), ``base`` the memory
    before the table grew."""
    before = FitMemory.of(layer)
    busy, read = machine_busy_s(), disk_read_bytes()
    ends = fit_batches(model, timed)
    busy, read = machine_busy_s() - busy, disk_read_bytes() - read
    after = FitMemory.of(layer)
    memory = ProcessMemory.now()
    # The first two steps (the pipeline's fill, a first timed step) are not timed; the
    # machine's CPU is the whole fit's, spread over its batches.
    step_s = [b - a for a, b in zip(ends[1:], ends[2:])]
    blocks_read = after.blocks_read - before.blocks_read
    blocks_spilled = after.blocks_spilled - before.blocks_spilled
    hits, rereads = hit_rate(blocks_read, stored_keys)
    return {"mode": mode, "rows": after.rows,
            "step_ms": round(1e3 * statistics.median(step_s), 3),
            "cpu_s_per_step": busy / (steps + 2),
            "blocks_read_per_step": blocks_read / (steps + 2),
            "blocks_spilled_per_step": blocks_spilled / (steps + 2),
            "disk_read_bytes_per_step": read / (steps + 2),
            "hit_rate": None if hits is None else round(hits, 4),
            "rereads_per_step": rereads / (steps + 2),
            "anon_rss_growth_bytes": memory.anon - base.anon,
            "file_rss_growth_bytes": memory.file - base.file,
            "rss_growth_bytes": memory.anon + memory.file - base.anon - base.file,
            "dram_bytes": after.dram_bytes, "ssd_bytes": after.ssd_bytes,
            "ssd_index_bytes": after.ssd_index_bytes,
            "cold_keys": after.ssd_bytes // BLOCK_BYTES}


def fit_worker(budget: Optional[int], rows: int, batch: int, steps: int, spill_dir: str,
               mode: str) -> Dict[str, Any]:
    """Grows a table to ``rows`` keys under ``budget`` bytes (None: all DRAM) through fit,
    then times ``steps`` Zipf batches in ``mode`` ("fit" or "pipelined")."""
    import tensorflow as tf  # in a worker # pylint: disable=import-outside-toplevel
    tf.config.threading.set_intra_op_parallelism_threads(2)
    check_mode(mode)
    model, layer = _build(budget, spill_dir, mode == "pipelined")
    keys = ZipfKeys(batch, seed=3)
    fit_batches(model, as_dataset(_key_batches([keys.next(new_fraction=1.0)[:1000]])))  # traced
    base = ProcessMemory.now()
    fit_batches(model, growth_stream(keys, rows))
    timed = as_dataset(_key_batches([keys.next(new_fraction=NEW_FRACTION)
                                     for _ in range(steps + 2)]))
    stored_keys = (steps + 2) * (batch - int(batch * NEW_FRACTION))
    return {"budget_bytes": budget,
            **timed_fit(model, layer, timed, steps, stored_keys, base, mode)}


def check_mode(mode: str) -> None:
    """Raises ValueError unless ``mode`` is one of MODES."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def fit_summary(per: Dict[str, Dict[str, Dict[str, Any]]]) -> Dict[str, Any]:
    """The whole-step figures from ``per[fraction][mode]`` (fraction "1.0": all DRAM)."""
    dram = per["1.0"]
    fastest_dram = min(dram[m]["step_ms"] for m in MODES)
    out: Dict[str, Any] = {"fit_ratio_vs_dram": {}, "pipelined_ratio_vs_dram": {},
                           "per_block_us": {}, "hit_rate": {}, "fit_rss_ratio_vs_dram": {},
                           "anon_rss_ratio_vs_dram": {}, "dram_bytes_per_cold_key": {},
                           "disk_pages_per_block_read": {}}
    for f, r in per.items():
        out["fit_ratio_vs_dram"][f] = round(r["fit"]["step_ms"] / dram["fit"]["step_ms"], 3)
        out["pipelined_ratio_vs_dram"][f] = round(r["pipelined"]["step_ms"] / fastest_dram, 3)
        out["hit_rate"][f] = r["fit"]["hit_rate"]
        out["fit_rss_ratio_vs_dram"][f] = round(
            r["fit"]["rss_growth_bytes"] / dram["fit"]["rss_growth_bytes"], 3)
        out["anon_rss_ratio_vs_dram"][f] = round(
            r["fit"]["anon_rss_growth_bytes"] / dram["fit"]["anon_rss_growth_bytes"], 3)
        if f != "1.0":
            moved = r["fit"]["blocks_read_per_step"] + r["fit"]["blocks_spilled_per_step"]
            extra_cpu = r["fit"]["cpu_s_per_step"] - dram["fit"]["cpu_s_per_step"]
            out["per_block_us"][f] = round(1e6 * extra_cpu / moved, 3) if moved else None
            read = r["fit"]["blocks_read_per_step"]
            out["disk_pages_per_block_read"][f] = (  # 4 KiB pages: page-cache misses
                round(r["fit"]["disk_read_bytes_per_step"] / 4096 / read, 3) if read else None)
            cold = r["fit"]["cold_keys"]
            out["dram_bytes_per_cold_key"][f] = (
                round(r["fit"]["ssd_index_bytes"] / cold, 2) if cold else None)
    return out
