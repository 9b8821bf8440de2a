"""Rank side of ``python -m tf_fusedemb.benchmarks.inference``: sharded DLRM inference
(inference/distributed.py) over the BLS alltoallv (under mpirun) or over a synchronous
Horovod alltoall (under horovodrun), with injected per-rank delays.

Every condition (lag k, delay mode) is a block of ``--iters`` global batches, one timed
pass (timing.time_steps); the blocks run interleaved in a shuffled order per round
(timing.timed_rounds, a barrier before each). Each rank runs on a core of its own
(pinned by ``benchmarks.inference`` before TensorFlow starts), with one TensorFlow
thread per pool. Delay modes, as in paper 001: "none"; "random": every rank sleeps
uniform(0, max_delay) before each of its iterations (independent per rank and
iteration); "straggler": the last rank sleeps max_delay / 2 (the same mean) every
iteration, which no bound can mask.
"""
import os
import time
from typing import Callable

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tf_fusedemb import models  # noqa: E402
from tf_fusedemb.benchmarks.timing import time_steps, timed_rounds  # noqa: E402
from tf_fusedemb.comm.bls_alltoallv import BLSAlltoallv  # noqa: E402
from tf_fusedemb.inference.distributed import (PushExchange, ShardedPredictor,  # noqa: E402
                                               run_bounded_lag)
from tf_fusedemb.specs import FeatureSpec, OptimizerSpec, TableSpec  # noqa: E402

MODES = ("none", "random", "straggler")


def build_model(args):
    """DLRM over ``--features`` one-hot dynamic tables (never-trained rows: each lookup
    computes initial rows, as a table with misses would), and ``--iters`` global batches."""
    opt = OptimizerSpec.adagrad(0.05)
    names = [f"C{i}" for i in range(args.features)]
    dense = [f"I{i}" for i in range(4)]
    specs = [FeatureSpec(n, TableSpec(n, args.dim, opt), "sum") for n in names]
    model = models.DLRM(specs, dense, bottom_mlp=(64, args.dim), top_mlp=(128, 64))
    rng = np.random.default_rng(args.seed)
    batches = []
    for _ in range(args.iters):
        batch = {n: tf.constant(rng.zipf(1.2, args.batch_size) % 1_000_000, tf.int64)
                 for n in names}
        batch.update({n: tf.constant(rng.standard_normal(args.batch_size), tf.float32)
                      for n in dense})
        batches.append(batch)
    model(tf.nest.map_structure(lambda t: t[:0], batches[0]))
    return model, batches


class Delay:
    """before_push hook of one block: sleeps as the delay mode says and adds up the time
    actually slept (``slept_s``: a sleep overshoots its request by tens of microseconds,
    which no lag can mask, so the ideal time counts what was slept)."""

    def __init__(self, mode, max_delay_s, rank, size, seed: tuple):
        self.slept_s = 0.0
        self._draw = None
        if mode == "straggler" and rank == size - 1 and max_delay_s > 0:
            self._draw = lambda: max_delay_s / 2
        elif mode == "random" and max_delay_s > 0:
            rng = np.random.default_rng([*seed, rank])
            self._draw = lambda: rng.uniform(0, max_delay_s)

    def __call__(self, j):
        del j
        if self._draw is not None:
            start = time.perf_counter()
            time.sleep(self._draw())
            self.slept_s += time.perf_counter() - start


def timed_block(predictor, batches, lag, delay):
    """(wall seconds, per-batch latencies in ms, seconds slept) of one pass over
    ``batches``."""
    pushed: dict = {}
    latencies: list = []

    def before(j):
        delay(j)
        pushed[j] = time.perf_counter()

    def one_pass(_):
        latencies.extend((time.perf_counter() - pushed[j]) * 1e3
                         for j, _ in run_bounded_lag(predictor, batches, lag, before))
    wall_ms, = time_steps(one_pass, 1)
    return wall_ms / 1e3, latencies, delay.slept_s


class HorovodExchange:
    """The synchronous baseline: one ``hvd.alltoall`` per batch at ``finish``."""

    def __init__(self, hvd):
        self._hvd, self._out = hvd, {}

    def start(self, j, sends):
        self._out[j] = sends

    def finish(self, j):
        sends = self._out.pop(j)
        splits = tf.constant([len(s) for s in sends], tf.int32)
        data = tf.constant(np.concatenate(sends) if sends else np.zeros(0, np.uint8))
        recv, recv_splits = self._hvd.alltoall(data, splits=splits, name=f"bench_infer_{j % 2}")
        return np.split(recv.numpy(), np.cumsum(recv_splits.numpy())[:-1])


class Ranks:
    """What the timing loop needs of the launcher's ranks: rank, size, barrier, gather
    (a list on rank 0) and broadcast (rank 0's value), over MPI or Horovod."""

    def __init__(self, exchange):
        if exchange == "horovod":
            # Horovod (optional) only for the baseline job; the BLS job runs under mpirun.
            import horovod.tensorflow as hvd  # pylint: disable=import-outside-toplevel
            hvd.init()
            self.rank, self.size = hvd.rank(), hvd.size()
            self.barrier = lambda: hvd.allreduce(tf.constant(0.0), name="bench_barrier").numpy()
            self.gather = hvd.allgather_object
            self.bcast = lambda v: hvd.broadcast_object(v, root_rank=0)
            baseline = HorovodExchange(hvd)
            # (lag, capacity bytes, timeout s) -> the exchange of one timed block
            self.make_exchange: Callable[[int, int, float], PushExchange] = \
                lambda k, capacity, timeout: baseline
        else:
            # mpi4py (optional) only for the BLS job; the baseline runs under horovodrun.
            from mpi4py import MPI  # pylint: disable=import-outside-toplevel
            comm = MPI.COMM_WORLD
            self.rank, self.size = comm.rank, comm.size
            self.barrier = comm.Barrier
            self.gather = lambda v: comm.gather(v, root=0)
            self.bcast = lambda v: comm.bcast(v, root=0)
            self.make_exchange = lambda k, capacity, timeout: BLSAlltoallv(comm, k, capacity,
                                                                          timeout)


def run_block(predictor, batches, ranks, lag, delay, capacity, timeout):
    """One timed pass with a fresh exchange of lag ``lag``: (wall s, latencies ms,
    slept s)."""
    predictor.exchange = ranks.make_exchange(lag, capacity, timeout)
    try:
        return timed_block(predictor, batches, lag, delay)
    finally:
        if hasattr(predictor.exchange, "close"):
            predictor.exchange.close()


def summarise(samples, rounds, iters, batch_size):
    """{condition: iteration time, throughput, latency p50/p99, delay slept per rank and
    iteration} from every rank's samples (a condition's wall time is the slowest
    rank's)."""
    stats = {}
    for name in samples[0]:
        walls = [max(g[name][i][0] for g in samples) for i in range(rounds)]
        lat = np.concatenate([np.array(s[1]) for g in samples for s in g[name]])
        wall = float(np.median(walls))
        stats[name] = {"iter_ms": round(wall / iters * 1e3, 3),
                       "samples_per_s": round(batch_size * iters / wall, 1),
                       "latency_p50_ms": round(float(np.percentile(lat, 50)), 3),
                       "latency_p99_ms": round(float(np.percentile(lat, 99)), 3),
                       "slept_ms": round(float(np.mean([s[2] for g in samples for s in g[name]]))
                                         / iters * 1e3, 3)}
    return stats


def run(args):
    """The worker's entry point: rank 0 returns its result dict, others None."""
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    ranks = Ranks(args.exchange)
    model, batches = build_model(args)
    predictor = ShardedPredictor(model, ranks.rank, ranks.size, exchange=None)
    capacity = predictor.capacity_bytes(args.batch_size)
    for _ in range(2):  # warm-up (traces the dense part); the second pass calibrates
        ranks.barrier()
        wall, _, _ = run_block(predictor, batches, ranks, 0, Delay("none", 0, 0, 1, ()),
                               capacity, args.timeout)
    walls = ranks.gather(wall)
    max_delay_s = None
    if ranks.rank == 0:  # twice the no-delay iteration time, unless given
        max_delay_s = (args.max_delay_ms / 1e3 if args.max_delay_ms is not None
                       else 2 * max(walls) / args.iters)
    max_delay_s = ranks.bcast(max_delay_s)
    lags = [0] if args.exchange == "horovod" else args.lags

    def block(k, mode):
        def go(r):
            delay = Delay(mode, max_delay_s, ranks.rank, ranks.size, (args.seed, r))
            return run_block(predictor, batches, ranks, k, delay, capacity, args.timeout)
        return go
    samples = timed_rounds({f"k{k}/{mode}": block(k, mode) for k in lags for mode in MODES},
                           args.rounds, seed=args.seed, barrier=ranks.barrier)
    gathered = ranks.gather(samples)
    cpus = ranks.gather(sorted(os.sched_getaffinity(0)))
    if ranks.rank != 0:
        return None
    return {"exchange": args.exchange, "ranks": ranks.size, "rank_cpus": cpus,
            "max_delay_ms": round(max_delay_s * 1e3, 3),
            "conditions": summarise(gathered, args.rounds, args.iters, args.batch_size)}
