"""Worker of ``tf_fusedemb.benchmarks.topology`` (one per Horovod rank); see there for
what is measured and how."""
import argparse
import dataclasses
import os
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import tensorflow as tf
import tf_keras

from tf_fusedemb.benchmarks import lookup_data
from tf_fusedemb.benchmarks.launcher import network_description, request_link_rate
from tf_fusedemb.benchmarks.lookup_models import DIM, CriteoNet, feature_specs
from tf_fusedemb.benchmarks.timing import median_ms, time_steps, timed_rounds
from tf_fusedemb.comm import Communicator, LocalCommunicator, get_communicator
from tf_fusedemb.comm import cost_model
from tf_fusedemb.comm.cost_model import TrafficHints, measure_link_costs, node_dedup_ratio
from tf_fusedemb.layers import FusedEmbedding
from tf_fusedemb.layers.exchange import EXCHANGES
from tf_fusedemb.models import train_step
from tf_fusedemb.pipeline import AutoPipeline, PipelineOptions
from tf_fusedemb.training.tracing import RankInvariantFunction

CAT = lookup_data.CATEGORICAL
COUNTED_STEPS = 2  # steps whose counters give the bytes per step


# (model, loss, optimizer) of one benchmark model
Pieces = Tuple[CriteoNet, tf_keras.losses.Loss, tf_keras.optimizers.Optimizer]


def _build(comm: Communicator, args: argparse.Namespace, exchange: str) -> Pieces:
    """(model, loss, optimizer) of the benchmark's CriteoNet with ``exchange``."""
    layer = FusedEmbedding(feature_specs(args.lr), communicator=comm, exchange=exchange)
    model = CriteoNet(layer, seed=args.seed, hidden=args.hidden)
    optimizer = tf_keras.optimizers.Adagrad(args.lr)
    model.build_variables(optimizer)
    return model, tf_keras.losses.BinaryCrossentropy(from_logits=True), optimizer


def _model(comm: Communicator, args: argparse.Namespace,
           exchange: str) -> Tuple[RankInvariantFunction, CriteoNet]:
    """(step function, model) of the benchmark's CriteoNet with ``exchange``."""
    model, loss_fn, optimizer = _build(comm, args, exchange)
    step = RankInvariantFunction(lambda x, y: train_step(model, x, y, loss_fn, optimizer,
                                                         communicator=comm).loss)
    return step, model


def _measured_choice(comm: Communicator, pieces: Pieces, batches: List[Any],
                     cursor: List[int]) -> Tuple[str, Dict[Optional[str], float]]:
    """The exchange ``PipelineOptions(exchange="auto")`` keeps, trained on ``pieces``
    (model, loss, optimizer) from the next batches: (kind, {kind: its probe's ms per step,
    the slowest rank's})."""
    auto = AutoPipeline(*pieces, PipelineOptions(exchange="auto"), comm)
    while auto.chosen is None:
        x, y = batches[cursor[0] % len(batches)]
        cursor[0] += 1
        float(auto.step(x, y).loss)
    auto.flush()
    timings = {auto_options.exchange: round(auto.timings[label] * 1e3, 3)
               for label, auto_options in auto.schedules.items()}
    assert auto.chosen_options is not None and auto.chosen_options.exchange is not None  # chosen
    return auto.chosen_options.exchange, timings


def _tensors(batches):
    return [({k: tf.constant(v) for k, v in x.items()}, tf.constant(y)) for x, y in batches]


def _on_batches(step, batches):
    """``step(x, y)`` on batch k as a step of ``timing.time_steps``, its loss read."""
    return lambda k: float(step(*batches[k % len(batches)]))


def _counters(model):
    """This rank's counters summed over the model's groups."""
    snaps = list(model.embedding.comm_counters().values())
    return {k: sum(s.get(k, 0) for s in snaps) for k in snaps[0]}


def _bytes_per_step(comm, step, model, batches):
    """Inter- and intra-node bytes sent per step, summed over all ranks."""
    before = _counters(model)
    for x, y in batches[:COUNTED_STEPS]:
        float(step(x, y))
    after = _counters(model)
    mine = {k: (after[k] - before[k]) / COUNTED_STEPS
            for k in ("inter_bytes_sent", "intra_bytes_sent", "rounds")}
    every = comm.allgather_object(mine)
    return {k: sum(e[k] for e in every) for k in ("inter_bytes_sent", "intra_bytes_sent")} | {
        "rounds": mine["rounds"]}


def _fused_keys(x):
    """(IDs int64[n], table indices int64[n]) of one batch's 26 features."""
    return (np.concatenate([x[c] for c in CAT]),
            np.concatenate([np.full(len(x[c]), i) for i, c in enumerate(CAT)]))


def _dedup_bound(comm, raw):
    """(inter-node keys with perfect node dedup over without, from the keys alone (numpy),
    mean over the batches measured by the counters; unique keys per rank and batch, mean
    over ranks and those batches)."""
    ratios, unique = [], []
    for x, _ in raw[:COUNTED_STEPS]:
        every = comm.allgather_object(_fused_keys(x))
        ratios.append(node_dedup_ratio([e[0] for e in every], [e[1] for e in every],
                                       comm.topology))
        unique += [len(np.unique(np.stack([t, i], 1), axis=0)) for i, t in every]
    return float(np.mean(ratios)), float(np.mean(unique))


def _real_ratio(comm: Communicator, args: argparse.Namespace,
                steps: Dict[str, Tuple[RankInvariantFunction, CriteoNet]]) -> Dict[str, Any]:
    """Inter-node bytes ratio (hierarchical / flat) and dedup bound on the real sample."""
    if not args.real_data or not os.path.exists(args.real_data):
        return {"inter_node_bytes_ratio_real": None,
                "real_note": f"real Criteo sample not found at {args.real_data}"}
    columns = lookup_data.read_criteo(args.real_data, None)
    raw = lookup_data.make_batches(columns, args.real_batch_size, comm.size, comm.rank,
                                   COUNTED_STEPS)
    batches = _tensors(raw)
    got = {k: _bytes_per_step(comm, *steps[k], batches) for k in EXCHANGES}
    bound, _ = _dedup_bound(comm, raw)
    return {"inter_node_bytes_ratio_real": round(got["hierarchical"]["inter_bytes_sent"] /
                                                 got["flat"]["inter_bytes_sent"], 4),
            "dedup_bound_real": round(bound, 4),
            "real_data": {"path": str(args.real_data), "batch_size_per_rank":
                          args.real_batch_size, "bytes_per_step": got}}


def _byte_figures(comm: Communicator, args: argparse.Namespace,
                  steps: Dict[str, Tuple[RankInvariantFunction, CriteoNet]],
                  batches: List[Any], bound: float, unique_per_rank: float) -> Dict[str, Any]:
    """The byte figures of the result (synthetic batches, and the real sample)."""
    counted = {k: _bytes_per_step(comm, *steps[k], batches) for k in EXCHANGES}
    flat, hier = (counted[k]["inter_bytes_sent"] for k in EXCHANGES)
    result = {"benchmark": "topology", "world_size": comm.size,
              "network": network_description(args), "topology": comm.topology.describe(),
              "batch_size_per_rank": args.batch_size,
              "inter_node_bytes_ratio": round(hier / flat, 4), "dedup_bound": round(bound, 4),
              "unique_keys_per_rank": round(unique_per_rank, 1), "bytes_per_step": counted}
    result.update(_real_ratio(comm, args, steps))
    return result


def _point(times, diffs, planner_kind, measured_kind):
    step = {n: median_ms(t) for n, t in times.items()}
    flat, hier = step["flat"], step["hierarchical"]
    comm_ms = median_ms(diffs)
    return {"step_ms": step, "flat_comm_ms": round(comm_ms, 3),
            "hier_comm_share": round(min(max(comm_ms / flat, 0.0), 1.0), 4),
            "speedup_hier_vs_flat": round(flat / hier, 3), "planner_choice": planner_kind,
            "planner_vs_best": round(step[planner_kind] / min(flat, hier), 3),
            "measured_choice": measured_kind,
            "measured_vs_best": round(step[measured_kind] / min(flat, hier), 3)}


def _time_rounds(comm, fns, batches, args, cursor, label, log):
    """Times ``fns`` ({name: step function}) in interleaved rounds of ``args.steps``
    steps; returns ({name: [ms]}, [per-round flat - twin ms])."""
    times: Dict[str, List[float]] = {n: [] for n in fns}
    diffs: List[float] = []

    def block(name):
        def step(k):
            float(fns[name](*batches[(cursor[0] + k) % len(batches)]))
        return lambda _round: times[name].extend(time_steps(step, args.steps))

    def after_round(r):
        cursor[0] += args.steps
        diffs.append(median_ms(times["flat"][-args.steps:]) -
                     median_ms(times["twin"][-args.steps:]))
        log(f"{label} round {r + 1}: " + ", ".join(
            f"{n} {median_ms(t):.1f}" for n, t in times.items()))
    timed_rounds({n: block(n) for n in fns}, args.rounds, args.seed,
                 barrier=lambda: comm.allgather_object(None), after_round=after_round)
    return times, diffs


def run(args):
    comm = get_communicator()
    rank, size, topo = comm.rank, comm.size, comm.topology

    def log(msg):
        if rank == 0:
            print(f"[topology] {msg}", flush=True)
    if not topo.is_hierarchical:
        raise RuntimeError(f"the topology benchmark needs several hosts of several ranks, "
                           f"got {topo.describe()}")
    columns = lookup_data.synthetic_columns(args.batch_size, size, args.num_batches, args.seed)
    raw = lookup_data.make_batches(columns, args.batch_size, size, rank, args.num_batches)
    batches = _tensors(raw)
    bound, unique_per_rank = _dedup_bound(comm, raw)
    steps = {k: _model(comm, args, k) for k in EXCHANGES}
    twin = _model(LocalCommunicator(), args, "flat")
    t0 = time.perf_counter()
    for name, (step, _) in list(steps.items()) + [("twin", twin)]:
        time_steps(_on_batches(step, batches), min(2, len(batches)))  # warm-up, not kept
        log(f"{name} traced and warm ({time.perf_counter() - t0:.0f}s)")
    result = _byte_figures(comm, args, steps, batches, bound, unique_per_rank)
    log(f"bytes per step {result['bytes_per_step']}, dedup bound {bound:.4f}")
    if args.bytes_only:
        return result if rank == 0 else None

    rates = args.sweep_mbit if args.sweep else [args.link_mbit]
    measured = measure_link_costs(comm, args.link_mbit, keys_per_rank=int(unique_per_rank),
                                  dim=DIM)
    log(f"measured: intra-node {measured.intra_mbit:.0f} Mbit/s per node, round latency "
        f"{measured.round_latency_s * 1e3:.2f} ms, node stage "
        f"{measured.dedup_s_per_key * 1e9:.0f} ns per key")
    points, cursor = {}, [0]
    measured_model = _build(comm, args, "flat")  # trained with either exchange in turn
    for mbit in rates:
        if args.sweep:
            request_link_rate(comm, mbit)
        # What FusedEmbedding(exchange="auto", traffic=...) decides for the one group of
        # 26 alike features.
        estimate = cost_model.estimate("criteo", DIM, topo, TrafficHints(
            unique_per_rank, bound, dataclasses.replace(measured, inter_mbit=mbit)))
        fns = {"flat": steps["flat"][0], "hierarchical": steps["hierarchical"][0],
               "twin": twin[0]}
        measured_kind, probe = _measured_choice(comm, measured_model, batches, cursor)
        log(f"{mbit:g} Mbit/s: exchange='auto' measured {probe}, kept {measured_kind}")
        times, diffs = _time_rounds(comm, fns, batches, args, cursor, f"{mbit:g} Mbit/s", log)
        points[f"{mbit:g}"] = dict(_point(times, diffs, estimate.kind, measured_kind),
                                   planner_predicted_ms={
                                       "flat": round(estimate.flat_s * 1e3, 3),
                                       "hierarchical": None if estimate.hierarchical_s is None
                                       else round(estimate.hierarchical_s * 1e3, 3)},
                                   measured_probe_ms=probe)
    if rank != 0:
        return None
    chosen = _pick(points)
    result.update({"planner_links": dataclasses.asdict(measured),
                   "hidden": list(args.hidden), "rounds": args.rounds,
                   "steps_per_block": args.steps, "link_mbit": float(chosen), "sweep": points})
    result.update({k: points[chosen][k] for k in ("speedup_hier_vs_flat", "hier_comm_share",
                                                  "planner_vs_best", "planner_choice",
                                                  "measured_choice", "measured_vs_best")})
    return result


def _pick(points):
    """The fastest link whose flat step spends >= 50% in collectives (else the largest
    share): where the issue's speedup target is stated."""
    over = [m for m in points if points[m]["hier_comm_share"] >= 0.5]
    if over:
        return max(over, key=float)
    return max(points, key=lambda m: points[m]["hier_comm_share"])
