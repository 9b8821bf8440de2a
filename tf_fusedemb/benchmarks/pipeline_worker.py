"""Worker of ``tf_fusedemb.benchmarks.pipeline`` (one per Horovod rank); see there for
what is measured and how."""
import itertools
import os
import time
from typing import Any, Dict, List, Tuple

import numpy as np
import tensorflow as tf
import tf_keras

from tf_fusedemb.benchmarks import lookup_data
from tf_fusedemb.benchmarks.launcher import network_description, request_link_rate
from tf_fusedemb.benchmarks.lookup_models import CriteoNet, DIM, feature_specs
from tf_fusedemb.benchmarks.timing import median_ms, time_steps, timed_rounds
from tf_fusedemb.comm import LocalCommunicator, get_communicator
from tf_fusedemb.data.criteo import CRITEO_CATEGORICAL, criteo_dataset
from tf_fusedemb.layers import FusedEmbedding
from tf_fusedemb.ops import hashing
from tf_fusedemb.pipeline import (NestedPipeline, PipelineOptions, cluster_permutation,
                                  make_pipeline, unique_keys_per_micro_batch)
from tf_fusedemb.training.loop import TrainLoop

CAT = lookup_data.CATEGORICAL
MICRO = (1, 2, 4, 8)
NESTED = "dbp_fwp4"  # the mode of speedup_nested_vs_sync (DBP + FWP with 4 micro-batches)
REAL = {"sync": PipelineOptions(), "dbp": PipelineOptions(prefetch=True),
        "fwp2": PipelineOptions(micro_batches=2), "fwp4": PipelineOptions(micro_batches=4),
        "fwp8": PipelineOptions(micro_batches=8),
        "dbp_fwp4": PipelineOptions(prefetch=True, micro_batches=4),
        "dbp_fwp4_cluster": PipelineOptions(prefetch=True, micro_batches=4)}
CLUSTERED_OF = {"dbp_fwp4_cluster": "dbp_fwp4"}  # same pipeline, clustered batches
# Twins of the modes, on a single-rank communicator (no collective; the rank owns every
# key): the same lookups, pooling, dense compute and updates. P of the figures.
TWINNED = ("sync", "fwp2", "fwp4", "fwp8", "dbp_fwp4")
REAL_OF_N = {1: "sync", 2: "fwp2", 4: "fwp4", 8: "fwp8"}
ALONE = (1, 4)  # micro-batch counts whose collectives are also timed alone
AUTO_NOTE = ("micro_batches='auto' is not in tf_fusedemb.pipeline yet (PipelineOptions "
             "and make_pipeline): auto_vs_sync is null; best_vs_sync is the best pipelined "
             "mode per link speed")
AUTO_MAX_STEPS = 60  # steps an auto pipeline may take to choose before timing starts


def _auto_factory():
    """``options -> pipeline`` for micro_batches="auto" (``tf_fusedemb.pipeline.make_pipeline``)
    where the pipeline has it, else None."""
    try:
        options = PipelineOptions(prefetch=True, micro_batches="auto")
    except (ImportError, TypeError, ValueError):
        return None
    return lambda model, loss, optimizer, comm: make_pipeline(model, loss, optimizer, options,
                                                              comm)


def build_model(comm, args):
    """The benchmark's CriteoNet on ``comm`` with its Adagrad optimizer, variables built."""
    model = CriteoNet(FusedEmbedding(feature_specs(args.lr), communicator=comm),
                      seed=args.seed, hidden=args.hidden)
    optimizer = tf_keras.optimizers.Adagrad(args.lr)
    model.build_variables(optimizer)
    return model, optimizer


def load_batches(args, size, rank):
    """This rank's numpy batches ``[(x, y)]`` of ``--data`` (or synthetic rows) and a
    description of the source."""
    if args.data:
        columns = lookup_data.read_criteo(args.data, args.max_rows)
        source = {"kind": "criteo_tsv", "path": str(args.data)}
    else:
        columns = lookup_data.synthetic_columns(args.batch_size, size, args.num_batches,
                                                args.seed)
        source = {"kind": "synthetic", "generator": "generate_criteo_like", "seed": args.seed}
    return lookup_data.make_batches(columns, args.batch_size, size, rank,
                                    args.num_batches), source


def as_tensors(batches):
    """numpy ``[(x, y)]`` batches as tensors."""
    return [({k: tf.constant(v) for k, v in x.items()}, tf.constant(y)) for x, y in batches]


def _reorder(batch, perm):
    x, y = batch
    return {k: v[perm] for k, v in x.items()}, y[perm]


def _send_plan(x, n, size):
    """Per micro-batch: the key AlltoAll payload int64[k, 2] and its int32[size] splits,
    as the fused lookup builds them (unique per feature, sorted by owner)."""
    plans = []
    b = len(x[CAT[0]])
    for i in range(n):
        lo, hi = i * b // n, (i + 1) * b // n
        id_parts, feat_parts = [], []
        for f, c in enumerate(CAT):
            u = np.unique(x[c][lo:hi])
            id_parts.append(u)
            feat_parts.append(np.full(len(u), f, np.int64))
        ids, feats = np.concatenate(id_parts), np.concatenate(feat_parts)
        owner = hashing.owner_rank(ids, size)
        order = np.argsort(owner, kind="stable")
        send = np.stack([ids[order], feats[order]], 1).astype(np.int64)
        splits = np.bincount(owner, minlength=size).astype(np.int32)
        plans.append((tf.constant(send), tf.constant(splits)))
    return plans


def _collectives_alone(comm, plans, dense_vars):
    """A zero-argument callable running the collectives of one synchronous FWP step with
    len(plans) micro-batches, one after another, with their real payloads: per micro-batch
    the key AlltoAll, the row AlltoAll back and the row-gradient AlltoAll, then the
    loss-statistics and the grouped dense-gradient AllReduce.

    Every payload is an ARGUMENT of the tf.function and every later collective depends on a
    runtime value of the previous one: grappler folds a collective whose input is a
    constant (``tf.zeros``/``tf.ones``, ``zeros_like`` of a variable) while optimising the
    graph, so it never runs in the timed call (checked on a 2-host 100 Mbit/s cluster: an
    AllReduce of ``tf.zeros([400000])`` took 0.2 ms, the same with the zeros passed as an
    argument takes the link's time). The former measurement built its AllReduces that way,
    one reason it read 0.2-0.6 ms where the collectives add 70-190 ms to a step."""
    sends = [s for s, _ in plans]
    splits = [s for _, s in plans]
    dense = [tf.zeros_like(v) for v in dense_vars]

    @tf.function(autograph=False)
    def run(sends, splits, dense):
        dep = tf.zeros([])
        for i, (send, split) in enumerate(zip(sends, splits)):
            with tf.control_dependencies([dep]):
                recv, rsplits = comm.alltoall(tf.identity(send), split, f"bench/keys{i}")
            rows = tf.zeros([tf.shape(recv)[0], DIM]) + tf.cast(recv[:1, :1], tf.float32) * 0.0
            back, _ = comm.alltoall(rows, rsplits, f"bench/rows{i}")
            grad, _ = comm.alltoall(back + 1.0, split, f"bench/grads{i}")
            dep = tf.reduce_sum(grad[:1])
        stats = comm.allreduce_sum(tf.stack([dep * 0.0 + 1.0, dep]), "bench/loss_stats")
        with tf.control_dependencies([stats]):
            reduced = comm.allreduce_sum_list([d + stats[0] * 0.0 for d in dense], "bench/dense")
        return tf.add_n([tf.reduce_sum(tf.reshape(r, [-1])[:1]) for r in reduced]) + stats[0]
    return lambda: run(sends, splits, dense).numpy()


def step_loss(result):
    """The loss of a pipeline step's result (a StepResult, or a (loss, predictions) pair)
    as a float: reading it waits for the step."""
    return float(result.loss if hasattr(result, "loss") else result[0])


def time_run(pipeline, batches, cursor, steps):
    """Runs ``steps`` consecutive steps from batch ``cursor`` through a ``TrainLoop``
    (each prefetching the next, the last none, then flushed) and returns the times of the
    middle ones in ms: the first includes the prologue prefetch, the last has no next
    batch to prefetch."""
    loop = TrainLoop(pipeline)
    data = iter([batches[(cursor + k) % len(batches)] for k in range(steps)])
    return time_steps(lambda k: step_loss(loop.progress(data).result), steps,
                      keep=slice(1, steps - 1))


def _settle_auto(pipeline, batches):
    """Trains an auto pipeline until it has chosen its schedule (its measurement at the
    start of training); returns (the chosen schedule's label or None, steps taken)."""
    loop = TrainLoop(pipeline)
    data = (batches[k % len(batches)] for k in itertools.count())
    k = 0
    while getattr(pipeline, "chosen", None) is None and k < AUTO_MAX_STEPS:
        step_loss(loop.progress(data).result)
        k += 1
    pipeline.flush()
    return getattr(pipeline, "chosen", None), k


def _clustering_counts(batches_cats):
    """Summed unique (feature, ID) keys over the N micro-batches of each batch, unclustered
    vs clustered, for N in MICRO; and the CPU cost of clustering a batch for N = 4."""
    unique: Dict[int, Dict[str, List[int]]] = {n: {"plain": [], "clustered": []} for n in MICRO}
    cost_ms = []
    for cats in batches_cats:
        for n in MICRO:
            t0 = time.perf_counter()
            perm = cluster_permutation(cats, n)
            if n == 4:
                cost_ms.append((time.perf_counter() - t0) * 1e3)
            unique[n]["plain"].append(int(unique_keys_per_micro_batch(cats, n).sum()))
            unique[n]["clustered"].append(int(unique_keys_per_micro_batch(
                {c: v[perm] for c, v in cats.items()}, n).sum()))
    return unique, cost_ms


def _reduction(unique, n):
    return round(1 - float(np.mean(unique[n]["clustered"])) / float(np.mean(unique[n]["plain"])),
                 4)


def _real_clustering(path, batch_size):
    """Clustering on the real Criteo sample read with the project's reader
    (``tf_fusedemb.data.criteo.criteo_dataset``, one shard, file order): every batch of
    ``batch_size`` lines (the last one may be smaller)."""
    if not path or not os.path.exists(path):
        return {"clustering_unique_key_reduction_real": None,
                "clustering_real_note": f"real Criteo sample not found at {path}"}
    cats = [{c: x[c].numpy() for c in CRITEO_CATEGORICAL}
            for x, _ in criteo_dataset(path, batch_size)]
    cats = [c for c in cats if len(c[CRITEO_CATEGORICAL[0]]) >= 2 * max(MICRO)]
    unique, _ = _clustering_counts(cats)
    return {"clustering_unique_key_reduction_real": _reduction(unique, 4),
            "clustering_unique_key_reduction_real_by_n": {str(n): _reduction(unique, n)
                                                          for n in MICRO},
            "clustering_real_data": {"path": str(path), "reader": "tf_fusedemb.data.criteo."
                                     "criteo_dataset", "batch_size": batch_size,
                                     "batches": len(cats),
                                     "rows": int(sum(len(c[CRITEO_CATEGORICAL[0]])
                                                     for c in cats))}}


def _summarize(step, diffs, alone):
    """The figures of one link speed.

    Args:
      step: {block: median ms} of every mode, twin and call.
      diffs: {mode: median over paired blocks of (T_mode - P_mode)} ms.
      alone: {N: median ms of the collectives alone}.
    """
    t_sync = step["sync"]
    comm_ms = round(diffs["sync"], 3)  # C: what the collectives add to the synchronous step
    share = round(min(max(comm_ms / t_sync, 0.0), 1.0), 4)
    real = [n for n in step if not n.startswith("local_") and n != "lookup"]
    added = {str(n): round(diffs[m], 3) for n, m in REAL_OF_N.items() if m in diffs}
    if NESTED in diffs:
        added[NESTED] = round(diffs[NESTED], 3)
    measurable = comm_ms > 1.0 and share >= 0.02

    def exposed(a):
        return round(min(max(a / comm_ms, 0.0), 1.0), 3) if measurable else None

    def vs_sync(mode):
        return round(t_sync / step[mode], 3) if mode in step else None
    pipelined = {n: step[n] for n in real if n != "sync"}
    best = min(pipelined, key=lambda n: pipelined[n]) if pipelined else None
    out = {
        "step_ms": {n: step[n] for n in real},
        "compute_only_step_ms": {n: step[n] for n in step if n.startswith("local_")},
        "comm_ms": comm_ms,
        "sync_comm_share": share,
        "collectives_alone_ms": {str(n): alone[n] for n in alone},
        "comm_added_ms": added,
        "exposed_comm_ratio": {str(n): exposed(added[str(n)]) for n, m in REAL_OF_N.items()
                               if m in step},
        "exposed_comm_ratio_nested": exposed(added[NESTED]) if NESTED in added else None,
        "speedup_vs_sync": {n: vs_sync(n) for n in real},
        "speedup_nested_vs_sync": vs_sync(NESTED),
        "best_mode": best,
        "best_vs_sync": vs_sync(best) if best else None,
        "auto_vs_sync": vs_sync("auto"),
    }
    if not measurable:
        out["exposed_comm_ratio_note"] = ("the collectives add < 2% (or < 1 ms) to the "
                                          "synchronous step: no communication to expose")
    if "lookup" in step and "dbp" in step:
        lookup = step["lookup"]
        hidden = min(max(step["dbp"] - (t_sync - lookup), 0.0), lookup)
        out.update({"lookup_ms": lookup,
                    "exposed_lookup_ms": {"sync": lookup, "dbp": round(hidden, 3)},
                    "lookup_hidden_fraction_dbp": round(1 - hidden / lookup, 3)})
    return out


def _pick(points):
    """The link speed whose synchronous step spends closest to 40% in collectives."""
    return min(points, key=lambda m: abs(points[m]["sync_comm_share"] - 0.4))


class Variants:
    """What one run times: the pipelines by mode, each with its batches (``runs``; a
    mode's single-rank twin under ``local_<mode>``), the calls timed alone (``calls``:
    collectives of one step, one batch's lookup), and ``cursor``, the first batch of the
    current round (every block of a round starts there).

    Args:
      args: the worker's arguments. comm: this rank's communicator.
      raw, clustered_raw: this rank's batches as numpy arrays, as drawn and clustered.
    """

    def __init__(self, args, comm, raw, clustered_raw):
        self.args, self.comm, self.cursor = args, comm, 0
        self.batches, clustered = as_tensors(raw), as_tensors(clustered_raw)
        self.loss_fn = tf_keras.losses.BinaryCrossentropy(from_logits=True)
        self.model, self.optimizer = build_model(comm, args)
        self.modes = {m: REAL[m] for m in args.modes if m != "auto"}
        self.auto: Any = _auto_factory() if "auto" in args.modes else None
        self.runs: Dict[str, Tuple[Any, List]] = {}  # block -> (its pipeline, its batches)
        for name, options in self.modes.items():
            shared = self.runs.get(CLUSTERED_OF.get(name, ""))
            pipeline = shared[0] if shared else NestedPipeline(
                self.model, self.loss_fn, self.optimizer, options, communicator=comm)
            self.runs[name] = (pipeline, clustered if name.endswith("_cluster") else self.batches)
        self._add_twins(args)
        self.calls = {f"alone_fwp{n}": _collectives_alone(
            comm, _send_plan(raw[0][0], n, comm.size), self.model.trainable_variables)
            for n in ALONE}
        if "dbp" in self.runs:  # routing + retrieval of one batch alone (NestedPipeline.prefetch)
            prefetch = self.runs["dbp"][0].prefetch
            self.calls["lookup"] = lambda: tf.nest.map_structure(
                lambda t: t.numpy(), prefetch(self.batches[self.cursor % len(self.batches)][0]))

    def _add_twins(self, args):
        local = LocalCommunicator()
        model, optimizer = build_model(local, args)
        for name in TWINNED:
            if name in self.modes:
                self.runs[f"local_{name}"] = (NestedPipeline(
                    model, self.loss_fn, optimizer, REAL[name], communicator=local), self.batches)

    def trace(self, log) -> float:
        """Runs every pipeline and call once (tracing); returns the seconds it took."""
        start = time.perf_counter()
        for name, (pipeline, data) in self.runs.items():
            if name in CLUSTERED_OF and CLUSTERED_OF[name] in self.runs:
                continue  # traced with its unclustered twin
            t0 = time.perf_counter()
            time_run(pipeline, data, 0, 3)
            log(f"  {name}: warm-up {time.perf_counter() - t0:.1f}s")
        for fn in self.calls.values():
            fn()
        return time.perf_counter() - start

    def block_names(self) -> List[str]:
        """The blocks of a round: modes (a twin runs in its mode's block), auto, calls."""
        return ([n for n in self.runs if not n.startswith("local_")]
                + (["auto"] if self.auto else []) + list(self.calls))

    def timed_block(self, name, times, diffs):
        """``block(round)`` timing ``name``: its steps go to ``times[name]``; a mode with a
        twin runs back to back with it (alternating which goes first, so the load of this
        shared machine is alike for both) and adds the block's T - P to ``diffs[name]``."""
        steps = self.args.steps
        if name in self.calls:
            return lambda _round: times[name].extend(
                time_steps(lambda k: self.calls[name](), steps - 2))
        twin = f"local_{name}"
        if twin not in self.runs:
            return lambda _round: times[name].extend(time_run(*self.runs[name], self.cursor, steps))

        def paired_block(round_index):
            order = (twin, name) if round_index % 2 else (name, twin)
            block = {n: time_run(*self.runs[n], self.cursor, steps) for n in order}
            for n, t in block.items():
                times[n].extend(t)
            diffs[name].append(median_ms(block[name]) - median_ms(block[twin]))
        return paired_block

    def settle_auto(self, log, label) -> dict:
        """A fresh auto pipeline (it chooses from what it measures at this link speed)."""
        t0 = time.perf_counter()
        self.runs["auto"] = (self.auto(self.model, self.loss_fn, self.optimizer, self.comm),
                             self.batches)
        choice, k = _settle_auto(self.runs["auto"][0], self.batches)
        log(f"{label} Mbit/s: auto chose {choice} after {k} steps")
        return {"auto_choice": choice, "auto_settle_steps": k,
                "auto_settle_s": round(time.perf_counter() - t0, 1)}


def _measure_at(variants: Variants, mbit, log) -> dict:
    """The figures at one link speed (None: the loopback as it is): every block timed in
    ``args.rounds`` shuffled rounds, summarized."""
    args, comm = variants.args, variants.comm
    label = "loopback" if mbit is None else f"{mbit:g}"
    if args.sweep:
        request_link_rate(comm, mbit)
    settled = variants.settle_auto(log, label) if variants.auto is not None else {}
    times: Dict[str, List[float]] = {n: [] for n in list(variants.runs) + list(variants.calls)}
    diffs: Dict[str, List[float]] = {n: [] for n in variants.runs
                                     if f"local_{n}" in variants.runs}

    def after_round(r):
        variants.cursor += args.steps
        log(f"{label} Mbit/s round {r + 1}/{args.rounds}: " + ", ".join(
            f"{n} {median_ms(t):.1f}" for n, t in times.items()))
    timed_rounds({n: variants.timed_block(n, times, diffs) for n in variants.block_names()},
                 args.rounds, args.seed, barrier=lambda: comm.allgather_object(None),
                 after_round=after_round)
    step = {n: median_ms(t) for n, t in times.items()}
    alone = {n: step.pop(f"alone_fwp{n}") for n in ALONE}
    point = _summarize(step, {n: median_ms(d) for n, d in diffs.items()}, alone)
    point["timed_steps_per_variant"] = len(times["sync"])
    point.update(settled)
    log(f"{label}: sync {step['sync']:.1f} ms, sync_comm_share {point['sync_comm_share']}, "
        f"nested {point['speedup_nested_vs_sync']}x")
    return point


def run(args):
    """This rank's part of the benchmark; rank 0 returns the result (the others None)."""
    comm = get_communicator()
    load_start = os.getloadavg()

    def log(msg):
        if comm.rank == 0:
            print(f"[pipeline] {msg}", flush=True)

    raw, source = load_batches(args, comm.size, comm.rank)
    # Clustering of this rank's batches: unique keys per micro-batch and the CPU cost.
    cats = [{c: x[c] for c in CAT} for x, _ in raw]
    unique, cluster_ms = _clustering_counts(cats)
    variants = Variants(args, comm, raw, [_reorder(b, cluster_permutation(c, 4))
                                          for b, c in zip(raw, cats)])
    log(f"variants {list(variants.runs) + list(variants.calls)}; tracing")
    trace_s = variants.trace(log)
    rates = args.sweep_mbit if args.sweep else [args.link_mbit if args.hosts else None]
    t_timed = time.perf_counter()
    points = {"loopback" if m is None else f"{m:g}": _measure_at(variants, m, log)
              for m in rates}
    timed_s = time.perf_counter() - t_timed
    if comm.rank != 0:
        return None
    result = _result(args, comm.size, source, points, variants)
    result.update({
        "unique_keys_per_batch": {str(n): {k: round(float(np.mean(v)), 1)
                                           for k, v in unique[n].items()} for n in MICRO},
        "clustering_unique_key_reduction": _reduction(unique, 4),
        "clustering_unique_key_reduction_by_n": {str(n): _reduction(unique, n) for n in MICRO},
        "cluster_ms_per_batch": median_ms(cluster_ms),
        "tracing_s": round(trace_s, 1), "timed_s": round(timed_s, 1),
        "loadavg_start": [round(v, 2) for v in load_start],
    })
    result.update(_real_clustering(args.real_data, args.batch_size))
    return result


def _result(args, size, source, points, variants: Variants) -> dict:
    """The JSON result: the configuration, the figures at the chosen link speed, the
    sweep, and the machine."""
    chosen = _pick(points)
    auto = variants.auto
    result = {"benchmark": "pipeline", "world_size": size, "network": network_description(args),
              "batch_size_per_rank": args.batch_size, "hidden": list(args.hidden),
              "data": source, "rounds": args.rounds, "steps_per_block": args.steps,
              "link_mbit": None if chosen == "loopback" else float(chosen)}
    result.update({k: v for k, v in points[chosen].items() if k != "auto_vs_sync"})
    result.update({
        "auto_vs_sync": ({m: p["auto_vs_sync"] for m, p in points.items()}
                         if auto is not None else None),
        "best_vs_sync": {m: p["best_vs_sync"] for m, p in points.items()},
        "sweep": points,
        "exposed_comm_ratio_target": {str(n): round(1 / n + 0.1, 3) for n in MICRO},
        "modes": list(variants.modes) + (["auto"] if auto else []),
        "cpu_count": os.cpu_count(), "rank_cpus": os.environ.get("TF_FUSEDEMB_CPUS"),
        "intra_op_threads": (tf.config.threading.get_intra_op_parallelism_threads()
                             or os.environ.get("TF_NUM_INTRAOP_THREADS")),
        "inter_op_threads": (tf.config.threading.get_inter_op_parallelism_threads()
                             or os.environ.get("TF_NUM_INTEROP_THREADS")),
        "loadavg_end": [round(v, 2) for v in os.getloadavg()],
    })
    if auto is None:
        result["auto_vs_sync_note"] = (AUTO_NOTE if "auto" in args.modes else
                                       "auto was not among --modes")
    return result
