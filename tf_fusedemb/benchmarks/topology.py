"""Topology-aware exchange benchmark (TawPipe, issue 11): flat vs hierarchical per step.

``python -m tf_fusedemb.benchmarks.topology --json [--sweep --plot PATH]`` runs on an
emulated cluster (``tf_fusedemb.testing.cluster``, needs root): the main job on ``--hosts``
x ``--ranks-per-host`` (default 2 x 4), then, for ``--also`` layouts (default 2x2), a
bytes-only job. ``--topology HxR`` instead runs H*R local ranks over loopback seen as H
nodes (byte counts only mean something there).

Model: the Criteo-shaped CriteoNet of the lookup benchmark (26 one-hot features, dim 16,
one fused group) with a small dense part (``--hidden``, default 64), so the step is
dominated by the exchange; three copies trained side by side on the same batches: the flat
exchange, the hierarchical one, and a twin of the flat one on a single-rank communicator
(no collective; it owns every key).

Figures (last line, one JSON object):

* ``inter_node_bytes_ratio``: bytes sent between nodes per step, summed over ranks (the
  ``inter_bytes_sent`` counters of both exchanges), hierarchical / flat, synthetic
  Criteo-profile data (``--batch-size`` rows per rank), main layout;
  ``inter_node_bytes_ratio_2x2`` the same on the first ``--also`` layout;
  ``inter_node_bytes_ratio_real`` on the real Criteo sample (``--real-batch-size`` rows per
  rank, main layout).
* ``dedup_bound``: the same ratio counted from the keys alone in numpy
  (``cost_model.node_dedup_ratio``): what perfect node-level dedup gives.
* per link speed (``sweep``; ``--sweep`` re-times at every ``--sweep-mbit`` speed in one
  job): median step times; ``hier_comm_share`` = (T_flat - T_twin) / T_flat, the share of
  the flat step spent in collectives; ``speedup_hier_vs_flat`` = T_flat / T_hier;
  ``planner_choice`` and ``planner_vs_best`` = T(planner's choice) / min(T_flat, T_hier),
  the planner being ``cost_model.estimate`` (what ``FusedEmbedding(exchange="auto")``
  runs) with the inter-node link speed declared, the intra-node bandwidth and round
  latency measured (``cost_model.measure_link_costs``, ``planner_links``) and the dedup
  ratio and unique keys counted on the first batches; ``measured_choice`` and
  ``measured_vs_best`` the same for the exchange that ``PipelineOptions(exchange="auto")``
  keeps after training a fourth copy 12 steps with each (``measured_probe_ms``: its probe's
  step times; ``tf_fusedemb.pipeline.auto``), before the timed rounds at that speed.
* the top-level timing figures are those of ``link_mbit``: the fastest swept link at which
  the flat step spends >= 50% in collectives (else the largest share).
"""
import argparse
import copy
import os
import sys

from tf_fusedemb import quiet

quiet.install()  # a command (and its workers): quiet TensorFlow before it loads

from tf_fusedemb.benchmarks import plots
from tf_fusedemb.benchmarks.launcher import (EXIT_UNAVAILABLE, add_launch_args,
                                             add_workload_args, benchmark_main,
                                             check_launch_args, launch_cluster, launch_local)
from tf_fusedemb.benchmarks.lookup_data import DEFAULT_CRITEO
from tf_fusedemb.benchmarks.timing import emit
from tf_fusedemb.comm.topology import TOPOLOGY_ENV

MODULE = "tf_fusedemb.benchmarks.topology"
WORKER = "tf_fusedemb.benchmarks.topology_worker"
RESULT_MARKER = "TOPOLOGY_BENCHMARK_RESULT "
SWEEP_MBIT = (100, 300, 1000, 3000)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="flat vs hierarchical (TawPipe) fused exchange")
    add_launch_args(p)
    p.set_defaults(hosts=2, ranks_per_host=4, link_mbit=300.0, timeout=3000)
    add_workload_args(p, batch_size=4096, steps=3, rounds=3, num_batches=4)
    p.add_argument("--hidden", default="64", help="dense layer widths")
    p.add_argument("--topology", default=None,
                   help="HxR: run H*R local ranks over loopback seen as H nodes (no --hosts)")
    p.add_argument("--also", default="2x2",
                   help="extra layouts HxR for inter_node_bytes_ratio_HxR (bytes only)")
    p.add_argument("--bytes-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--sweep", action="store_true", help="time at every --sweep-mbit speed")
    p.add_argument("--sweep-mbit", default=",".join(str(m) for m in SWEEP_MBIT))
    p.add_argument("--plot", default=None, help="PNG of step time against link speed")
    p.add_argument("--real-data", default=str(DEFAULT_CRITEO))
    p.add_argument("--real-batch-size", type=int, default=512)
    args = p.parse_args(argv)
    args.hidden = tuple(int(h) for h in args.hidden.split(",") if h)
    args.sweep_mbit = [float(m) for m in args.sweep_mbit.split(",") if m]
    args.also = [_layout(p, a) for a in args.also.split(",") if a]
    if args.topology:
        layout = _layout(p, args.topology)
        args.hosts, args.np = None, layout[0] * layout[1]
        if args.sweep:
            p.error("--sweep changes emulated links: not with --topology")
    if args.steps < 1 or args.rounds < 1:
        p.error("--steps and --rounds must be >= 1")
    return check_launch_args(p, args)


def _layout(parser, text):
    try:
        hosts, ranks = (int(v) for v in text.lower().split("x"))
    except ValueError:
        parser.error(f"a layout looks like 2x4 (hosts x ranks per host), got {text!r}")
    return hosts, ranks


def _launch(argv, args):
    """Runs the workers of ``args``'s layout; returns (exit code, rank 0's result)."""
    if args.hosts is not None:
        return launch_cluster(MODULE, argv, RESULT_MARKER, args)
    os.environ[TOPOLOGY_ENV] = args.topology
    return launch_local(MODULE, args.np, argv, RESULT_MARKER, args.timeout, args.pin)


def plot_sweep(result, path):
    """PNG: median step time of the flat and hierarchical exchanges (and the flat step's
    twin without collectives) against the inter-node link speed; returns ``path``."""
    points = result["sweep"]
    speeds, x = plots.sweep_speeds(points)
    fig, ax = plots.new_figure()
    for name, style in (("flat", "o-"), ("hierarchical", "s-"), ("twin", "k--")):
        ax.plot(x, [points[m]["step_ms"][name] for m in speeds], style,
                label=name if name != "twin" else "flat without collectives (twin)")
    plots.annotate_shares(ax, x, [points[m]["step_ms"]["flat"] for m in speeds],
                          [points[m]["hier_comm_share"] for m in speeds])
    net = result["network"]
    title = (f"fused exchange, {net['hosts']} hosts x {net['ranks_per_host']} ranks, batch "
             f"{result['batch_size_per_rank']}/rank\n"
             "(labels: share of the flat step spent in collectives)")
    return plots.save_figure(fig, ax, path, title, *plots.sweep_axes_labels(), log_x=True)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "HOROVOD_RANK" in os.environ:
        return benchmark_main(MODULE, WORKER, parse_args, RESULT_MARKER, argv)
    args = parse_args(argv)
    code, result = _launch(argv, args)
    if code != 0 or result is None:
        print(f"{MODULE} failed: exit code {code}", file=sys.stderr)
        return code or 1
    for hosts, ranks in args.also:
        extra = copy.copy(args)
        extra_argv = argv + ["--bytes-only", "--ranks-per-host", str(ranks)]
        if args.hosts is not None:
            extra.hosts, extra.ranks_per_host = hosts, ranks
            extra_argv += ["--hosts", str(hosts)]
        else:
            extra.topology, extra.np = f"{hosts}x{ranks}", hosts * ranks
            extra_argv += ["--topology", extra.topology]
        code, other = _launch(extra_argv, extra)
        key = f"{hosts}x{ranks}"
        if code == EXIT_UNAVAILABLE or other is None:
            result[f"inter_node_bytes_ratio_{key}"] = None
            continue
        result[f"inter_node_bytes_ratio_{key}"] = other["inter_node_bytes_ratio"]
        result[f"dedup_bound_{key}"] = other["dedup_bound"]
        result[f"bytes_per_step_{key}"] = other["bytes_per_step"]
    if args.plot and "sweep" in result:
        result["plot"] = os.path.abspath(plot_sweep(result, args.plot))
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
