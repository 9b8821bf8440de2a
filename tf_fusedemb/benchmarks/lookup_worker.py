"""The Horovod worker of ``python -m tf_fusedemb.benchmarks.lookup`` (see its docstring):
builds the variants in one process, times them side by side and returns rank 0's
result dict (None on other ranks)."""
import functools
import os
import statistics
import tempfile
import time
from typing import Any, Dict, List, NamedTuple

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

from tf_fusedemb.benchmarks import (lookup_comm, lookup_data, lookup_models,  # noqa: E402
                                    op_profile)
from tf_fusedemb.benchmarks.launcher import network_description  # noqa: E402
from tf_fusedemb.benchmarks.timing import step_stats, time_steps, timed_rounds  # noqa: E402
from tf_fusedemb.comm import CommCounters, get_communicator  # noqa: E402
from tf_fusedemb.layers import FusedEmbedding  # noqa: E402
from tf_fusedemb.training import train_step  # noqa: E402
from tf_fusedemb.specs import plan_fusion, unfused_plan  # noqa: E402


# The steps have no data-dependent Python control flow, so AutoGraph would only
# re-derive the same graph: it adds ~40 s of tracing per variant here, nothing to the step.
_step_function = functools.partial(tf.function, autograph=False)


class Variant:
    """One model + its tf.function step, batch cursor, losses and counters."""

    def __init__(self, name, model, step, counters, counting=None):
        self.name, self.model, self.step = name, model, step
        self._counters = counters  # () -> summed snapshot dict
        self._counting = counting  # () -> context manager around every call (TFRA shim)
        self.cursor, self.losses, self.times_ms = 0, [], []
        self.groups = 0  # embedding groups (lookups) per step, set by the variant's builder

    def next_step(self, batches):
        """One step on the variant's next batch (cycling over ``batches``); returns once
        its loss is read (the step is done)."""
        x, y = batches[self.cursor % len(batches)]
        self.cursor += 1
        if self._counting is None:
            loss = self.step(x, y)
        else:
            with self._counting():
                loss = self.step(x, y)
        self.losses.append(float(loss.numpy()))

    def run(self, batches, steps):
        """``steps`` timed steps (the timing loop's :func:`time_steps`); returns their ms."""
        return time_steps(lambda k: self.next_step(batches), steps)

    def snapshot(self):
        return self._counters()

    def concrete(self, x, y):
        if self._counting is None:
            return self.step.get_concrete_function(x, y)
        with self._counting():
            return self.step.get_concrete_function(x, y)


def build_variants(names, comm, hvd, lr):
    """{name: Variant} for the requested variant names, in a fixed order."""
    specs = lookup_models.feature_specs(lr, storage="engine")
    tfra_specs = lookup_models.feature_specs(lr, storage="tfra")
    loss = tf_keras.losses.BinaryCrossentropy(from_logits=True)
    # TFRA's step sums per-example losses itself (labels and logits are both [B, 1]).
    per_example = tf_keras.losses.BinaryCrossentropy(
        from_logits=True, reduction=tf_keras.losses.Reduction.NONE)
    out = {}

    def fused_variant(name, plan, features=specs, dense_policy=None, wire_dtype="float32"):
        layer = FusedEmbedding(features, plan=plan, name=f"{name}_embedding",
                               wire_dtype=wire_dtype)
        model = lookup_models.CriteoNet(layer, name=f"{name}_net", dense_policy=dense_policy)
        optimizer = tf_keras.optimizers.Adagrad(lr)
        model.build_variables(optimizer)

        @_step_function
        def step(x, y):
            return train_step(model, x, y, loss, optimizer, communicator=comm).loss

        def counters():
            return lookup_comm.sum_snapshots(list(layer.comm_counters().values()))
        variant = Variant(name, model, step, counters)
        variant.groups = len(layer.groups)
        return variant

    def tfra_variant(name, embedding):
        model = lookup_models.CriteoNet(embedding, name=f"{name}_net")
        optimizer = lookup_models.tfra_optimizer(lr)
        model.build_variables(optimizer)
        counters = CommCounters(name)
        lookup_comm.AlltoallShim(hvd, comm.rank)

        @_step_function
        def step(x, y):
            return lookup_models.tfra_train_step(model, x, y, per_example, optimizer, hvd)[0]
        variant = Variant(name, model, step, counters.snapshot,
                          lambda: lookup_comm.AlltoallShim.counting(counters))
        return variant

    plan = plan_fusion(specs)
    for name in names:
        if name == "fused":
            out[name] = fused_variant(name, plan)
        elif name == "fused_bf16":
            out[name] = fused_variant(name, plan, dense_policy="mixed_bfloat16",
                                      wire_dtype="bfloat16")
        elif name == "fused_tfra_backend":
            out[name] = fused_variant(name, plan_fusion(tfra_specs), tfra_specs)
        elif name == "unfused":
            out[name] = fused_variant(name, unfused_plan(specs))
        elif name == "tfra":
            out[name] = tfra_variant(name, lookup_models.TfraPerFeature(name="tfra_emb"))
            out[name].groups = len(specs)
        elif name == "tfra_fused":
            out[name] = tfra_variant(name, lookup_models.TfraFusedEmbedding(
                plan, hvd, name="tfra_fused_emb"))
            out[name].groups = plan.num_groups
    return out


def _profile(variants, batches, steps, comm):
    """{variant: StepProfile as a dict} of this rank: ``steps`` more steps of each fused
    variant under TensorFlow's profiler (every rank the same steps, in the same order)."""
    out = {}
    for name, v in variants.items():
        if not name.startswith(("fused", "unfused")):
            continue  # TFRA's ops carry no scope of ours to categorise them by
        comm.allgather_object(None)
        with tempfile.TemporaryDirectory() as logdir:
            profiler = op_profile.StepProfiler(logdir, range(steps))
            for k in range(steps):
                with profiler.step(k):
                    v.next_step(batches)
            out[name] = profiler.summary(v.model.embedding.name)._asdict()
    return out


def _to_tensors(batches):
    return [({k: tf.constant(v) for k, v in x.items()}, tf.constant(y)) for x, y in batches]


def run(args):
    """Builds the variants, warms them up, times them in interleaved rounds and returns
    rank 0's result dict (None on the other ranks)."""
    comm = get_communicator()
    import horovod.tensorflow as hvd  # optional for the package; ranks run under horovodrun # pylint: disable=import-outside-toplevel
    if not hvd.is_initialized():
        hvd.init()

    def log(msg):
        if comm.rank == 0:
            print(f"[lookup] {msg}", flush=True)

    batches, source = _batches(args, comm.size, comm.rank)
    variants = build_variants(args.variants, comm, hvd, args.lr)
    log(f"built {list(variants)}; warming up ({args.warmup} steps each, first traces)")
    first_step_s = {}  # variant -> its trace plus first step, in seconds
    for v in variants.values():
        times = v.run(batches, max(1, args.warmup))  # not kept: traces, first allocations
        first_step_s[v.name] = round(times[0] / 1e3, 3)
        log(f"  {v.name}: warm-up steps " + ", ".join(f"{t / 1e3:.2f}s" for t in times)
            + f", loss {v.losses[-1]:.4f}")
    graphs = _graph_facts(variants, batches)
    timed = _timed(variants, batches, args, comm, log)
    if comm.rank != 0:
        return None
    keys_per_step = int(sum(int(tf.size(batches[0][0][c])) for c in lookup_data.CATEGORICAL))
    result = _description(args, comm.size, source, keys_per_step, timed.wall_s)
    result["environment"]["rank_cpus"] = [e["cpus"] for e in timed.everyone]
    result["variants"] = {name: _variant_entry(v, timed, graphs, name, first_step_s[name])
                          for name, v in variants.items()}
    result.update(_comparisons(variants, result["variants"]))
    return result


def _batches(args, size, rank):
    """(this rank's slices of the global batches as tensors, the data's description):
    every rank builds the same global batches and takes its slice."""
    if args.data:
        columns = lookup_data.read_criteo(args.data, args.max_rows)
        source = {"kind": "criteo_tsv", "path": str(args.data),
                  "rows": int(len(columns["label"]))}
    else:
        columns = lookup_data.synthetic_columns(args.batch_size, size, args.num_batches,
                                                args.seed)
        source = {"kind": "synthetic", "generator": "generate_criteo_like",
                  "rows": int(len(columns["label"])), "seed": args.seed}
    return _to_tensors(lookup_data.make_batches(columns, args.batch_size, size, rank,
                                                args.num_batches)), source


class GraphFacts(NamedTuple):
    """Per variant: the AlltoAll ops of its traced step, its op count and traces."""
    alltoall_ops: Dict[str, Any]
    sizes: Dict[str, int]
    tracing: Dict[str, int]


def graph_op_count(concrete: Any) -> int:
    """The ops of a traced step (a ConcreteFunction): its graph's nodes and the nodes of
    every function it calls (their bodies run as part of the step)."""
    graph_def = concrete.graph.as_graph_def()
    return len(graph_def.node) + sum(len(f.node_def) for f in graph_def.library.function)


def _graph_facts(variants, batches) -> GraphFacts:
    ops, sizes = {}, {}
    for v in variants.values():
        concrete = v.concrete(*batches[0])
        ops[v.name] = lookup_comm.graph_alltoall_ops(concrete)
        sizes[v.name] = graph_op_count(concrete)
    return GraphFacts(ops, sizes, {v.name: int(v.step.experimental_get_tracing_count())
                                   for v in variants.values()})


class Timed(NamedTuple):
    """The timed rounds: per variant the mean step of each round, the per-step counters
    of this rank, every rank's counters, steps and profiles; the wall time."""
    round_means: Dict[str, List[float]]
    mine: Dict[str, Any]
    everyone: List[Dict[str, Any]]
    profiles: Dict[str, Any]
    steps: int
    wall_s: float


def _timed(variants, batches, args, comm, log) -> Timed:
    """Runs the variants in interleaved rounds (timing.timed_rounds) between counter
    snapshots, then the profile if asked; gathers every rank's figures."""
    before = {v.name: v.snapshot() for v in variants.values()}
    round_means: Dict[str, List[float]] = {n: [] for n in variants}

    def block(v):
        def run_block(_round):
            times = v.run(batches, args.steps)
            v.times_ms.extend(times)
            round_means[v.name].append(statistics.fmean(times))
        return run_block
    start = time.perf_counter()
    timed_rounds({n: block(v) for n, v in variants.items()}, args.rounds, args.seed,
                 barrier=lambda: comm.allgather_object(None),
                 after_round=lambda r: log(f"  round {r + 1}/{args.rounds}: " + ", ".join(
                     f"{n} {round_means[n][-1]:.1f}ms" for n in variants)))
    wall_s = time.perf_counter() - start
    steps = args.rounds * args.steps
    after = {v.name: v.snapshot() for v in variants.values()}
    profiles = _profile(variants, batches, args.profile, comm) if args.profile else {}
    mine = {n: lookup_comm.per_step(before[n], after[n], steps) for n in variants}
    raw = {n: {f: after[n][f] - before[n][f] for f in ("bytes_sent", "messages")}
           for n in variants}
    everyone = comm.allgather_object({"per_step": mine, "raw": raw, "profile": profiles,
                                      "cpus": sorted(os.sched_getaffinity(0)),
                                      "step_ms": {n: step_stats(v.times_ms)["step_ms"]
                                                  for n, v in variants.items()}})
    return Timed(round_means, mine, everyone, profiles, steps, wall_s)


def _description(args, size, source, keys_per_step, wall_s) -> Dict[str, Any]:
    """The result's environment, data, model, timing and method sections."""
    return {
        "benchmark": "lookup",
        "environment": {
            "np": size, "batch_size_per_rank": args.batch_size,
            "global_batch": args.batch_size * size, "tf_version": tf.__version__,
            "tf_keras_version": tf_keras.__version__, "horovod_version": _horovod_version(),
            "tfra_version": _tfra_version(), "cpu_count": os.cpu_count(),
            "intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads(),
            "gpus": len(tf.config.list_physical_devices("GPU")),
            "horovod_controller": "gloo",
        },
        "network": network_description(args),
        "data": source,
        "model": {"categorical_features": len(lookup_data.CATEGORICAL), "embedding_dim":
                  lookup_models.DIM, "dense_features": len(lookup_data.DENSE),
                  "mlp": list(lookup_models.HIDDEN) + [1], "loss": "bce_from_logits",
                  "embedding_optimizer": f"adagrad(lr={args.lr})",
                  "dense_optimizer": f"adagrad(lr={args.lr}) tf_keras",
                  "keys_per_rank_per_step": keys_per_step},
        "timing": {"warmup_steps": args.warmup, "rounds": args.rounds,
                   "steps_per_round": args.steps, "timed_steps_per_variant":
                   args.rounds * args.steps, "timed_wall_s": round(wall_s, 1),
                   "reported_rank": 0},
        "method": METHOD,
    }


def _variant_entry(v, timed: Timed, graphs: GraphFacts, name: str,
                   first_step_s: float) -> Dict[str, Any]:
    """One variant's figures: its step statistics on rank 0, every rank's step and
    counters, its graph facts, losses and ``first_step_s`` (rank 0's trace plus first
    step, what a short job waits for before its first result)."""
    everyone = timed.everyone
    per_rank = [e["per_step"][name] for e in everyone]
    bytes_sent = sum(e["raw"][name]["bytes_sent"] for e in everyone)
    messages = sum(e["raw"][name]["messages"] for e in everyone)
    entry: Dict[str, Any] = dict(step_stats(v.times_ms))
    entry.update({
        "round_mean_ms_median": round(statistics.median(timed.round_means[name]), 3),
        "step_ms_by_rank": [e["step_ms"][name] for e in everyone],
        "alltoall_rounds_per_step": timed.mine[name]["alltoall_rounds_per_step"],
        "graph_alltoall_ops": graphs.alltoall_ops[name],
        "groups": v.groups,
        "bytes_per_step": round(statistics.fmean(p["bytes_per_step"] for p in per_rank), 1),
        "bytes_per_step_by_rank": [round(p["bytes_per_step"], 1) for p in per_rank],
        "messages_per_step": round(statistics.fmean(p["messages_per_step"]
                                                    for p in per_rank), 2),
        "mean_message_bytes": round(bytes_sent / max(1, messages), 1),
        "loss_first": v.losses[0], "loss_last": v.losses[-1],
        "steps_run": len(v.losses), "traces": graphs.tracing[name],
        "graph_ops": graphs.sizes[name], "first_step_s": first_step_s,
    })
    if name in timed.profiles:
        entry["profile_by_rank"] = [e["profile"][name] for e in everyone]
    return entry


def _comparisons(variants, entries) -> Dict[str, Any]:
    """Step ratios between variants and their largest loss differences."""
    def ratio(a, b):
        if a in entries and b in entries:
            return round(entries[a]["step_ms"] / entries[b]["step_ms"], 3)
        return None

    def max_loss_diff(a, b):
        la, lb = variants[a].losses, variants[b].losses
        n = min(len(la), len(lb))
        return float(np.max(np.abs(np.subtract(la[:n], lb[:n]))))
    out: Dict[str, Any] = {
        "speedup_vs_tfra": ratio("tfra", "fused"),
        "speedup_vs_tfra_fused": ratio("tfra_fused", "fused"),
        # The same fused step, its tables on the TFRA backend: the storage engine's share.
        "speedup_vs_tfra_backend": ratio("fused_tfra_backend", "fused"),
        "fused_vs_unfused": ratio("unfused", "fused"),
        "bf16_speedup": ratio("fused", "fused_bf16")}
    # unfused: the same batches, seeded dense weights and plan-independent rows, so the two
    # plans must train identically (a correctness check of the comparison); bf16: the drift
    # of bf16 matmuls (no correctness check); the TFRA backend: the same step on other storage.
    for key, other in (("fused_unfused_max_loss_diff", "unfused"),
                       ("fused_bf16_max_loss_diff", "fused_bf16"),
                       ("fused_backends_max_loss_diff", "fused_tfra_backend")):
        if "fused" in variants and other in variants:
            out[key] = max_loss_diff("fused", other)
    return out


METHOD = {
    "step_ms": "median over all timed steps on rank 0; variants interleaved in rounds "
               "(shuffled order, barrier before each block of --steps steps)",
    "alltoall_rounds_per_step": "in-graph counters during the timed steps: "
                                "FusedEmbedding.comm_counters() for fused/unfused; for "
                                "TFRA a shim around horovod.tensorflow.alltoall (what "
                                "TFRA's HvdVariable calls) recording each call plus, via "
                                "an identity with a custom gradient, the gradient AlltoAll "
                                "of Horovod's registered gradient; cross-checked with "
                                "graph_alltoall_ops (HorovodAlltoall nodes of the traced "
                                "step graph incl. gradient)",
    "bytes_per_step": "payload bytes sent to other ranks by AlltoAlls per step, same "
                      "counters (rows sent to each peer x bytes per row), mean over ranks",
    "mean_message_bytes": "bytes sent / non-empty per-peer messages, all ranks pooled",
    "tfra_fused": "source-side mix64(id ^ tag(table)) in pure TF, one "
                  "tf.unique_with_counts per group, one HvdAllToAllEmbedding per group "
                  "(with_unique=False), plus an explicit hvd.alltoall of "
                  "(count << 16 | category) int64 per unique key, partitioned with "
                  "TFRA's partition_fn + make_partition (same splits as the key "
                  "AlltoAll), recorded on the owner as per-category access counts",
}


def _tfra_version():
    try:
        # optional: its version is reported when installed  pylint: disable=import-outside-toplevel
        from tensorflow_recommenders_addons import version
        return getattr(version, "__version__", None)
    except ImportError:
        return None


def _horovod_version():
    try:
        import horovod  # optional: its version is reported when installed # pylint: disable=import-outside-toplevel
        return horovod.__version__
    except ImportError:
        return None
