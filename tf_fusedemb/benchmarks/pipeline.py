"""Nested-pipelining benchmark: synchronous fused training vs. NestPipe's DBP and FWP
(with EmbRace's vertical scheduling) and key-centric clustering, side by side, on an
emulated multi-host network.

    python -m tf_fusedemb.benchmarks.pipeline --json --hosts 2 --ranks-per-host 1 \\
        --link-mbit 300                                  # one link speed
    python -m tf_fusedemb.benchmarks.pipeline --json --hosts 2 --ranks-per-host 1 \\
        --sweep --plot sweep.png                         # M in 100,300,1000,3000,10000
    python -m tf_fusedemb.benchmarks.pipeline --json     # loopback, 2 local workers

On a machine shared with other jobs, give the workers their cores' time (root; see
``tf_fusedemb.benchmarks.launcher``): ``TF_FUSEDEMB_BENCH_NICE=-15
TF_FUSEDEMB_COMM_THREAD_NICE=-20 python -m tf_fusedemb.benchmarks.pipeline ...``. Where the
step's time goes, collective by collective: ``tf_fusedemb.benchmarks.pipeline_trace``
(Horovod timeline + TensorFlow profiler; findings in docs/timelines/).

Run plainly, it re-launches itself on Horovod workers (``tf_fusedemb.benchmarks.launcher``):
with ``--hosts H`` on an emulated cluster (``tf_fusedemb.testing.cluster``: H network
namespaces, each host's link limited to ``--link-mbit`` Mbit/s per direction with ``tc
tbf``, ``--ranks-per-host`` ranks per host, each pinned to its own core; needs root),
otherwise on ``--np`` local workers over loopback, where the collectives cost well under
a millisecond and nothing here is worth hiding. Rank 0's JSON is the LAST line.

Model: the lookup benchmark's Criteo net (26 one-hot features, dim 16, one fused group,
Adagrad) with a larger dense part, ``--hidden`` (512,256,128), so there is compute to
overlap; ``--batch-size`` samples per rank. Every variant trains through
``tf_fusedemb.pipeline.NestedPipeline`` on the same batches, in the same processes.

Variants (``step_ms``): ``sync`` (N=1, no prefetch: the fused synchronous step), ``dbp``
(prefetch + vertical scheduling), ``fwp2``, ``fwp4``, ``fwp8``, ``dbp_fwp4``,
``dbp_fwp4_cluster`` (the batches reordered by ``cluster_permutation`` for 4 micro-batches
beforehand, as the tf.data stage would), and ``auto``, the pipeline of ``"dbp,fwp=auto"``
(``tf_fusedemb.pipeline.make_pipeline``: it measures sync, DBP and DBP with 2 and 4
micro-batches): a fresh auto pipeline at every link speed is trained until it has chosen
(``auto_choice``, after ``auto_settle_steps`` steps), then timed like the others. Twins
on a single-rank communicator in the same worker
(``compute_only_step_ms``): ``local_sync``, ``local_fwp2/4/8``, ``local_dbp_fwp4``: the
same lookups, pooling, dense compute and updates with no collective (the rank owns
every key).

Timing: ``--rounds`` rounds; a round runs every block once (order shuffled per round, the
same on every rank, a barrier before each block). A block of a mode is ``--steps``
consecutive steps through ``NestedPipeline.run``, of which the first (prologue prefetch)
and the last (no next batch) are not timed and the rest are timed one by one (loss read
back); a mode with a twin runs its twin's steps in the same block, right before or after
(alternating), so both see the same load of the shared machine. ``step_ms`` and
``compute_only_step_ms`` are medians over all timed steps. With ``--sweep`` the job sets
every host's link to each speed in turn (``--sweep-mbit``, default 100,300,1000,3000,10000)
and runs the rounds at each: every function is traced once, and the twins are re-timed
beside the real steps at every speed.

How each figure is computed (T = a mode's step, P = its twin's; ms):

* ``comm_added_ms[N]`` = median over blocks of (median T_N - median P_N) in the block (N
  micro-batches of FWP, N = 1 being ``sync``; ``dbp_fwp4`` with its own twin): the time the
  collectives add to the step, i.e. the communication the schedule leaves exposed.
* ``comm_ms`` C = ``comm_added_ms[1]``: what the collectives add to the synchronous step.
* ``sync_comm_share`` = C / T_sync: the share of the synchronous step spent in
  collectives (what pipelining can at best hide).
* ``exposed_comm_ratio[N]`` = clip(``comm_added_ms[N]`` / C, 0, 1) (NestPipe's metric,
  ideal 1/N; 1 at N = 1 by construction); ``exposed_comm_ratio_nested`` the same for
  DBP+FWP4. Null where C < 1 ms or C < 2% of T_sync (loopback): nothing to expose.
* ``collectives_alone_ms[N]``: a cross-check of C: the step's collectives with their real
  payloads (per micro-batch key, row and row-gradient AlltoAlls, then the loss-statistics
  and grouped dense AllReduces), run one after another in a tf.function whose inputs are
  arguments, so grappler cannot fold any of them at trace time (it does fold a collective
  of a constant). On the cluster it agrees with C within ~25%; they differ because the
  real step's collectives share the rank's core with its compute and wait on each
  other's data dependencies, which the chain alone does not.
* ``speedup_vs_sync[v]`` = T_sync / T_v; ``speedup_nested_vs_sync`` = T_sync / T_dbp_fwp4;
  ``best_vs_sync[M]`` = T_sync / min over the pipelined modes (``best_mode``);
  ``auto_vs_sync[M]`` = T_sync / T_auto, null while the pipeline has no ``auto``.
* ``lookup_ms`` = routing + retrieval of one batch alone (the prefetch function);
  ``exposed_lookup_ms[dbp]`` = clip(T_dbp - (T_sync - lookup_ms), 0, lookup_ms).

The top-level figures are those of ``link_mbit``: the one speed without ``--sweep``; with
it, the speed whose ``sync_comm_share`` is closest to 0.4. ``sweep`` holds every speed's
figures. ``--plot PATH`` (with ``--sweep``) draws step time per mode against link speed.

Clustering: summed unique (feature, ID) keys over the N micro-batches of a rank's batch
(what the AlltoAlls carry), unclustered vs clustered (``cluster_permutation``), mean over
rank 0's batches of the benchmark data (``clustering_unique_key_reduction``, N = 4) and
over the batches of ``--batch-size`` lines of the real Criteo sample ``--real-data`` read
with ``tf_fusedemb.data.criteo.criteo_dataset`` (``clustering_unique_key_reduction_real``);
``cluster_ms_per_batch`` is the cost per batch on the CPU (off the step's path).
"""
import argparse
import os
import sys

from tf_fusedemb import quiet

quiet.install()  # a command (and its workers): quiet TensorFlow before it loads

from tf_fusedemb.benchmarks import plots
from tf_fusedemb.benchmarks.launcher import (add_launch_args, add_workload_args, benchmark_main,
                                             check_launch_args)
from tf_fusedemb.benchmarks.lookup_data import DEFAULT_CRITEO

RESULT_MARKER = "PIPELINE_BENCHMARK_RESULT "
VARIANTS = ("sync", "dbp", "fwp2", "fwp4", "fwp8", "dbp_fwp4", "dbp_fwp4_cluster", "auto")
SWEEP_MBIT = (100, 300, 1000, 3000, 10000)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="NestPipe / EmbRace pipelining benchmark")
    add_launch_args(p)
    add_workload_args(p, batch_size=4096, steps=5, rounds=3, num_batches=8)
    p.add_argument("--hidden", default="512,256,128", help="dense layer widths")
    p.add_argument("--modes", default=",".join(VARIANTS),
                   help="comma-separated pipelining modes to time (sync is always timed; "
                        "sync and the fwp/dbp_fwp4 modes get their single-rank twins; auto "
                        "only where the pipeline has micro_batches='auto')")
    p.add_argument("--sweep", action="store_true",
                   help="time every mode at each link speed of --sweep-mbit (needs --hosts)")
    p.add_argument("--sweep-mbit", default=",".join(str(m) for m in SWEEP_MBIT),
                   help="link speeds of --sweep, Mbit/s, comma-separated")
    p.add_argument("--plot", default=None,
                   help="PNG of step time per mode against link speed (with --sweep; "
                        "default pipeline_sweep.png)")
    p.add_argument("--real-data", default=str(DEFAULT_CRITEO),
                   help="real Criteo TSV for clustering_unique_key_reduction_real")
    args = p.parse_args(argv)
    args.hidden = tuple(int(h) for h in args.hidden.split(",") if h)
    args.modes = ["sync"] + [m for m in args.modes.split(",") if m and m != "sync"]
    unknown = set(args.modes) - set(VARIANTS)
    if unknown:
        p.error(f"unknown modes {sorted(unknown)}; choose from {VARIANTS}")
    args.sweep_mbit = [float(m) for m in args.sweep_mbit.split(",") if m]
    if args.batch_size < 16 or args.steps < 3 or args.rounds < 1:
        p.error("--batch-size >= 16, --steps >= 3 and --rounds >= 1 are required")
    if args.sweep and args.hosts is None:
        p.error("--sweep changes the link speed of emulated hosts: give --hosts")
    if args.sweep and (not args.sweep_mbit or min(args.sweep_mbit) <= 0):
        p.error("--sweep-mbit needs speeds > 0")
    if args.sweep and args.plot is None:
        args.plot = "pipeline_sweep.png"
    return check_launch_args(p, args)


def plot_sweep(result, path):
    """Writes a PNG: median step time of every mode (and of the synchronous step's twin
    without collectives) against the link speed, log-scaled, with each speed's
    sync_comm_share; returns ``path``."""
    points = result["sweep"]
    speeds, x = plots.sweep_speeds(points)
    fig, ax = plots.new_figure()
    for mode in points[speeds[0]]["step_ms"]:
        ax.plot(x, [points[m]["step_ms"][mode] for m in speeds], marker="o",
                linewidth=2.5 if mode in ("sync", "dbp_fwp4") else 1.2, label=mode)
    ax.plot(x, [points[m]["compute_only_step_ms"]["local_sync"] for m in speeds], "k--",
            label="sync without collectives (twin)")
    plots.annotate_shares(ax, x, [points[m]["step_ms"]["sync"] for m in speeds],
                          [points[m]["sync_comm_share"] for m in speeds])
    net = result["network"]
    title = (f"tf_fusedemb pipelining: {net['hosts']} hosts x {net['ranks_per_host']} "
             f"rank(s), batch {result['batch_size_per_rank']}/rank\n"
             "(labels: share of the sync step spent in collectives)")
    return plots.save_figure(fig, ax, path, title, *plots.sweep_axes_labels(), log_x=True)


def _finish(result, args):
    if args.sweep and args.plot:
        result["plot"] = os.path.abspath(plot_sweep(result, args.plot))
        print(f"plot written to {args.plot}", file=sys.stderr)


def main(argv=None):
    return benchmark_main("tf_fusedemb.benchmarks.pipeline",
                          "tf_fusedemb.benchmarks.pipeline_worker", parse_args, RESULT_MARKER,
                          argv, finish=_finish)


if __name__ == "__main__":
    sys.exit(main())
