"""Worker of ``tf_fusedemb.benchmarks.pipeline`` (one per Horovod rank); see there for
what is measured and how."""
import os
import random
import statistics
import time

import numpy as np
import tensorflow as tf
import tf_keras

from tf_fusedemb.benchmarks import lookup_data
from tf_fusedemb.benchmarks.emulated_network import EmulatedNetworkCommunicator
from tf_fusedemb.benchmarks.lookup_models import CriteoNet, DIM, feature_specs
from tf_fusedemb.comm import LocalCommunicator, get_communicator
from tf_fusedemb.layers import FusedEmbedding
from tf_fusedemb.ops import hashing
from tf_fusedemb.pipeline import (NestedPipeline, PipelineOptions, cluster_permutation,
                                  unique_keys_per_micro_batch)

CAT = lookup_data.CATEGORICAL
REAL = {"sync": PipelineOptions(), "dbp": PipelineOptions(prefetch=True),
        "fwp2": PipelineOptions(micro_batches=2), "fwp4": PipelineOptions(micro_batches=4),
        "fwp8": PipelineOptions(micro_batches=8),
        "dbp_fwp4": PipelineOptions(prefetch=True, micro_batches=4),
        "dbp_fwp4_cluster": PipelineOptions(prefetch=True, micro_batches=4)}
# Compute-only twins (single-rank communicator): P_N of the exposed-communication ratio.
LOCAL = {"local_fwp1": PipelineOptions(), "local_fwp2": PipelineOptions(micro_batches=2),
         "local_fwp4": PipelineOptions(micro_batches=4),
         "local_fwp8": PipelineOptions(micro_batches=8)}
MICRO = (1, 2, 4, 8)


def _model(comm, args):
    model = CriteoNet(FusedEmbedding(feature_specs(args.lr), communicator=comm),
                      seed=args.seed, hidden=args.hidden)
    optimizer = tf_keras.optimizers.Adagrad(args.lr)
    model.build_variables(optimizer)
    return model, optimizer


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
        ids, feats = [], []
        for f, c in enumerate(CAT):
            u = np.unique(x[c][lo:hi])
            ids.append(u)
            feats.append(np.full(len(u), f, np.int64))
        ids, feats = np.concatenate(ids), np.concatenate(feats)
        owner = hashing.owner_rank(ids, size)
        order = np.argsort(owner, kind="stable")
        send = np.stack([ids[order], feats[order]], 1).astype(np.int64)
        splits = np.bincount(owner, minlength=size).astype(np.int32)
        plans.append((tf.constant(send), tf.constant(splits)))
    return plans


def _comm_only(comm, plans, dense_vars):
    """The collectives of one FWP step, one after another (C_N), through ``comm`` (so an
    emulated network delays them as it delays the training step's)."""
    @tf.function(autograph=False)
    def run():
        dep = []
        for i, (send, splits) in enumerate(plans):
            with tf.control_dependencies(dep):
                recv, rsplits = comm.alltoall(send, splits, f"bench/keys{i}")
            rows = tf.zeros([tf.shape(recv)[0], DIM])
            back, _ = comm.alltoall(rows, rsplits, f"bench/rows{i}")
            grad, _ = comm.alltoall(back + 0.0, splits, f"bench/grads{i}")
            dep = [grad]
        with tf.control_dependencies(dep):
            n = comm.allreduce_sum(tf.ones([]), "bench/n")
        with tf.control_dependencies([n]):
            dense = comm.allreduce_sum_list([tf.zeros_like(v) for v in dense_vars], "bench/dense")
        with tf.control_dependencies(dense):
            return comm.allreduce_sum(tf.ones([]), "bench/loss")
    return run


def _time_run(pipeline, batches, cursor, steps):
    """Times the middle steps of ``steps`` consecutive pipelined steps."""
    stream = (batches[(cursor + k) % len(batches)] for k in range(steps))
    times, begin = [], time.perf_counter()
    for k, (loss, _) in enumerate(pipeline.run(stream, steps)):
        float(loss)
        now = time.perf_counter()
        if 0 < k < steps - 1:
            times.append((now - begin) * 1e3)
        begin = now
    return times


def _median(values):
    return round(statistics.median(values), 3)


def run(args):
    emulated = None
    if args.emulate_mbps:
        # Sleeping link transfers hold inter-op threads: more threads than cores, so the
        # compute is not starved while a transfer waits.
        tf.config.threading.set_inter_op_parallelism_threads(16)
        emulated = {"megabytes_per_s": args.emulate_mbps, "latency_ms": args.emulate_latency_ms}
    comm = get_communicator()
    if emulated:
        comm = EmulatedNetworkCommunicator(comm, args.emulate_mbps, args.emulate_latency_ms)
    rank, size = comm.rank, comm.size

    def log(msg):
        if rank == 0:
            print(f"[pipeline] {msg}", flush=True)

    if args.data:
        columns = lookup_data.read_criteo_tsv(args.data, args.max_rows)
        source = {"kind": "criteo_tsv", "path": str(args.data)}
    else:
        columns = lookup_data.synthetic_columns(args.batch_size, size, args.num_batches,
                                                args.seed)
        source = {"kind": "synthetic", "generator": "generate_criteo_like", "seed": args.seed}
    raw = lookup_data.make_batches(columns, args.batch_size, size, rank, args.num_batches)

    # Clustering: unique keys per micro-batch, and its CPU cost per batch.
    clustered_raw, cluster_ms = [], []
    unique = {n: {"plain": [], "clustered": []} for n in MICRO}
    for x, y in raw:
        cats = {c: x[c] for c in CAT}
        t0 = time.perf_counter()
        perm = cluster_permutation(cats, 4)
        cluster_ms.append((time.perf_counter() - t0) * 1e3)
        clustered_raw.append(_reorder((x, y), perm))
        for n in MICRO:
            unique[n]["plain"].append(int(unique_keys_per_micro_batch(cats, n).sum()))
            perm_n = perm if n == 4 else cluster_permutation(cats, n)
            unique[n]["clustered"].append(int(unique_keys_per_micro_batch(
                {c: v[perm_n] for c, v in cats.items()}, n).sum()))

    to_tf = lambda bs: [({k: tf.constant(v) for k, v in x.items()}, tf.constant(y))  # noqa: E731
                        for x, y in bs]
    batches, clustered = to_tf(raw), to_tf(clustered_raw)
    loss_fn = tf_keras.losses.BinaryCrossentropy(from_logits=True)
    model, optimizer = _model(comm, args)
    local_model, local_optimizer = _model(LocalCommunicator(), args)
    runs = {name: (NestedPipeline(model, loss_fn, optimizer, o, communicator=comm),
                   clustered if name.endswith("_cluster") else batches)
            for name, o in REAL.items()}
    runs.update({name: (NestedPipeline(local_model, loss_fn, local_optimizer, o,
                                       communicator=LocalCommunicator()), batches)
                 for name, o in LOCAL.items()})
    comm_fns = {f"comm_fwp{n}": _comm_only(comm, _send_plan(raw[0][0], n, size),
                                           model.trainable_variables) for n in MICRO}
    lookup_fn = runs["dbp"][0]._prefetch_fn  # routing + retrieval of one batch alone

    log(f"variants {list(runs) + list(comm_fns)}; tracing")
    for name, (pipeline, data) in runs.items():
        t0 = time.perf_counter()
        _time_run(pipeline, data, 0, 3)
        log(f"  {name}: warm-up {time.perf_counter() - t0:.1f}s")
    for fn in comm_fns.values():
        fn()
    lookup_fn(batches[0][0])

    times = {name: [] for name in list(runs) + list(comm_fns) + ["lookup"]}
    order = list(times)
    rng = random.Random(args.seed)
    cursor = 0
    for r in range(args.rounds):
        rng.shuffle(order)  # same seed on every rank: same order everywhere
        for name in order:
            if name in runs:
                pipeline, data = runs[name]
                times[name] += _time_run(pipeline, data, cursor, args.steps)
                continue
            fn = comm_fns.get(name) or (lambda: lookup_fn(batches[cursor % len(batches)][0]))
            for _ in range(args.steps - 2):
                t0 = time.perf_counter()
                tf.nest.map_structure(lambda t: t.numpy(), fn())
                times[name].append((time.perf_counter() - t0) * 1e3)
        cursor += args.steps
        log(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{n} {_median(times[n]):.1f}" for n in times))
    if rank != 0:
        return None
    step = {n: _median(t) for n, t in times.items()}
    t_sync = step["sync"]
    exposed, added = {}, {}
    for n in MICRO:
        added[str(n)] = round(step["sync" if n == 1 else f"fwp{n}"] - step[f"local_fwp{n}"], 3)
        exposed[str(n)] = round(min(max(added[str(n)] / step[f"comm_fwp{n}"], 0.0), 1.0), 3)
    lookup = step["lookup"]
    exposed_lookup = {"sync": lookup,
                      "dbp": round(min(max(step["dbp"] - (t_sync - lookup), 0.0), lookup), 3)}
    plain4 = np.mean(unique[4]["plain"])
    return {
        "benchmark": "pipeline", "world_size": size, "emulated_network": emulated, "batch_size_per_rank": args.batch_size,
        "hidden": list(args.hidden), "data": source, "rounds": args.rounds,
        "timed_steps_per_variant": len(times["sync"]),
        "step_ms": {n: step[n] for n in REAL},
        "compute_only_step_ms": {n: step[f"local_fwp{n}"] for n in MICRO},
        "comm_only_ms": {n: step[f"comm_fwp{n}"] for n in MICRO},
        "speedup_vs_sync": {n: round(t_sync / step[n], 3) for n in REAL},
        "speedup_nested_vs_sync": round(t_sync / step["dbp_fwp4"], 3),
        "speedup_nested_best_vs_sync": round(t_sync / min(step[n] for n in REAL
                                                          if n.startswith("dbp_")), 3),
        "exposed_comm_ratio": exposed,
        "comm_added_ms": added,  # T_N - P_N, unclipped
        "exposed_comm_ratio_target": {str(n): round(1 / n + 0.1, 3) for n in MICRO},
        "lookup_ms": lookup, "exposed_lookup_ms": exposed_lookup,
        "lookup_hidden_fraction_dbp": round(1 - exposed_lookup["dbp"] / lookup, 3),
        "unique_keys_per_batch": {str(n): {k: round(float(np.mean(v)), 1)
                                           for k, v in unique[n].items()} for n in MICRO},
        "clustering_unique_key_reduction": round(
            1 - np.mean(unique[4]["clustered"]) / plain4, 4),
        "clustering_unique_key_reduction_by_n": {
            str(n): round(1 - np.mean(unique[n]["clustered"]) / np.mean(unique[n]["plain"]), 4)
            for n in MICRO},
        "cluster_ms_per_batch": _median(cluster_ms),
        "cpu_count": os.cpu_count(),
    }

