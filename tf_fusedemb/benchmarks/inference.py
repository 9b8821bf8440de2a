"""Bounded-lag distributed inference benchmark (paper 001, issue 12).

    python -m tf_fusedemb.benchmarks.inference --json [--plot inference.png]

Sharded DLRM inference on ``--np`` ranks (default: as many as this process has cores, 2
to 4), each pinned to a core of its own, push-based (inference/distributed.py):
the BLS alltoallv for k in ``--lags`` (default 0,1,2,4,8) in one mpirun job, then the
synchronous Horovod alltoall baseline (k = 0) in one horovodrun job, each without delays,
with uniform random per-rank delays (maximum: twice the no-delay iteration time of the
BLS job's k = 0, passed on to the Horovod job) and with a persistent straggler (the last
rank sleeps the same mean delay every iteration). Per condition: iteration time,
throughput, per-batch latency p50/p99 (benchmarks/inference_worker.py).

The last line (``--json``) holds, besides every condition:
  k0_vs_horovod       throughput of BLS k = 0 over Horovod's, no delays
  masked_delay_share  {k: (T_sync - T_k) / (T_sync - T_ideal)} with random delays; T are
                      mean iteration times, T_sync that of k = 0, T_ideal the no-delay
                      time of k = 0 plus the mean delay a rank slept per iteration
                      (measured: time.sleep overshoots its request)
  oversubscribed      whether ranks shared a core: always false in a printed result.
                      A sleeping rank would lend its core to the others, so T_k could
                      beat T_ideal and the share exceed 1 (1.95 was printed for 4 ranks
                      on 2 cores; 1.135 for 2 unpinned ranks there, each borrowing the
                      sleeping one's core): more ranks than cores is refused up front,
                      and a result whose ranks shared a core, or whose cores other
                      processes used meanwhile, is refused, not printed
  straggler_slowdown  {k: T_k with the straggler / T_k without delays}

Pinning one core per rank (``tf_fusedemb.testing.cluster.pinned.pin_this_rank``, the
emulated hosts' placement) keeps each rank's threads (TensorFlow's, MPI's, Horovod's) on
its own core, so a delayed rank frees nothing the others can use and the share means
what it says: 0 = the delays cost as much as in lock step, 1 = only a rank's own delay
is left (tests/test_benchmark_inference.py checks it stays within [0, 1] up to noise).
"""
import argparse
import json
import os
import resource
import sys
import time
from typing import List, Sequence, Tuple

from tf_fusedemb import quiet

quiet.install()  # a command (and its workers): quiet TensorFlow before it loads

from tf_fusedemb.benchmarks import plots
from tf_fusedemb.benchmarks.launcher import REPO_ROOT, launch_local
from tf_fusedemb.benchmarks.timing import emit
from tf_fusedemb.testing import mpirun
from tf_fusedemb.testing.cluster.pinned import pin_this_rank
from tf_fusedemb.testing.cluster.placement import assign_cpus, available_cpus

MARKER = "FUSEDEMB_INFERENCE_RESULT "
OTHERS_MAX = 0.25  # of a core, on average: more CPU used by other processes is refused
MODULE = "tf_fusedemb.benchmarks.inference"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=None,
                   help="ranks, one core each (default: this process's cores, 2 to 4)")
    p.add_argument("--lags", default="0,1,2,4,8", help="BLS bounds k, comma-separated")
    p.add_argument("--batch-size", type=int, default=256, help="global batch")
    p.add_argument("--iters", type=int, default=200,
                   help="batches per timed block (a block ends in step: fewer iterations "
                        "weigh that end more)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per condition")
    p.add_argument("--features", type=int, default=8, help="one-hot categorical features")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--max-delay-ms", type=float, default=None,
                   help="maximum injected delay (default: twice the no-delay iteration time)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0, help="BLS wait deadline, seconds")
    p.add_argument("--job-timeout", type=float, default=900.0, help="per launched job, seconds")
    p.add_argument("--plot", default=None, help="write a PNG plot here")
    p.add_argument("--json", action="store_true", help="last line: the result as JSON")
    p.add_argument("--exchange", default="bls", choices=("bls", "horovod"),
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.lags = [int(k) for k in args.lags.split(",")]
    if 0 not in args.lags:
        p.error("--lags must include 0 (the synchronous reference)")
    cores = len(available_cpus())
    if args.np is None:
        args.np = max(2, min(4, cores))
    if args.np < 2:
        p.error("--np must be at least 2")
    if args.np > cores and not _in_a_rank():
        p.error(f"--np {args.np} needs {args.np} cores, one per rank, and this process has "
                f"{cores}: ranks sharing cores lend each other the time a delayed rank "
                "sleeps, so the masked delay share would not mean what it says (it read "
                f"1.95 for 4 ranks on 2 cores); use --np {cores} or fewer" if cores >= 2 else
                f"--np {args.np}: this process has {cores} core; the benchmark needs one "
                "per rank and at least 2 ranks")
    return args


def _in_a_rank() -> bool:
    """True in a rank that mpirun or horovodrun started (the launcher checked --np)."""
    return "OMPI_COMM_WORLD_RANK" in os.environ or "HOROVOD_RANK" in os.environ


def oversubscribed(job: dict) -> bool:
    """Whether the ranks of a job's result could run on a common core: from the cores
    each rank ran on (``rank_cpus``), else more ``ranks`` than this process's cores."""
    if "rank_cpus" not in job:
        return job["ranks"] > len(available_cpus())
    seen: set = set()
    for cpus in job["rank_cpus"]:
        if seen & set(cpus):
            return True
        seen |= set(cpus)
    return False


def rank_cores(num_ranks: int) -> List[int]:
    """The core each rank is pinned to (``pin_this_rank(cores=1)`` in a rank)."""
    return [cpus[0] for cpus in assign_cpus(num_ranks)]


def _cpu_seconds(cores: Sequence[int]) -> Tuple[float, float, float]:
    """(wall clock, CPU-seconds ``cores`` were busy (/proc/stat), CPU-seconds of this
    process and its finished children: the launched jobs' ranks), in seconds."""
    busy = 0
    with open("/proc/stat") as f:
        for line in f:
            name, *ticks = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
                user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, ticks[:8])
                busy += user + nice + system + irq + softirq + steal
    ours = sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))
    return time.time(), busy / os.sysconf("SC_CLK_TCK"), ours


def check_cores_were_ours(before: Tuple[float, float, float],
                          after: Tuple[float, float, float]) -> None:
    """Raises ValueError when other processes used more than OTHERS_MAX of a core on
    average between the two :func:`_cpu_seconds` readings of the ranks' cores (what this
    process and its children used anywhere is counted as theirs): the cores were not
    theirs, so a sleeping rank could have been replaced on its core by another process
    (or left it to one) and the share would not mean what it says."""
    wall, busy, ours = (a - b for a, b in zip(after, before))
    others = busy - ours
    if others > OTHERS_MAX * wall:
        raise ValueError(f"other processes used {others:.0f} CPU-seconds of the {wall:.0f} s "
                         "the jobs ran: the ranks did not have their cores to themselves, so "
                         "masked_delay_share would not mean what it says; refused, not "
                         "printed (rerun on a quiet machine)")


def _launch_bls(args, argv):
    reason = mpirun.unavailable_reason()
    if reason:
        raise SystemExit(f"inference benchmark: {reason}")
    proc = mpirun.run_mpirun(args.np, ["-m", MODULE, *argv, "--exchange", "bls"],
                             timeout=args.job_timeout, env={"PYTHONPATH": str(REPO_ROOT)})
    lines = [l for l in proc.stdout.splitlines() if l.startswith(MARKER)]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"BLS job failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-5000:]}")
    return json.loads(lines[-1][len(MARKER):])


def _launch_horovod(args, argv, max_delay_ms):
    code, result = launch_local(MODULE, args.np, [*argv, "--exchange", "horovod",
                                                  "--max-delay-ms", str(max_delay_ms)],
                                MARKER, timeout=args.job_timeout, pin=False)  # pins itself
    if code != 0 or result is None:
        raise SystemExit(f"Horovod baseline job failed (exit {code})")
    return result


def summarise(bls, hvd, lags):
    """The headline ratios (see module doc) from both jobs' conditions. Raises
    ValueError when the ranks of either job shared a core (the masked delay share would
    have no meaning: see the module doc)."""
    for job, name in ((bls, "BLS"), (hvd, "Horovod")):
        if "ranks" in job and oversubscribed(job):
            raise ValueError(
                f"the {name} job's {job['ranks']} ranks shared cores "
                f"({job.get('rank_cpus', 'unpinned')}): a delayed rank lent its core to the "
                "others, so masked_delay_share would exceed what it measures; refused, not "
                "printed (run at most one rank per core)")
    c, h = bls["conditions"], hvd["conditions"]
    slept = sum(c[f"k{k}/random"]["slept_ms"] for k in lags) / len(lags)
    t_sync = c["k0/random"]["iter_ms"]
    t_ideal = c["k0/none"]["iter_ms"] + slept  # no waiting for others, own delay kept
    masked, straggler = {}, {}
    for k in lags:
        masked[str(k)] = round((t_sync - c[f"k{k}/random"]["iter_ms"]) / (t_sync - t_ideal), 3) \
            if t_sync != t_ideal else None
        straggler[str(k)] = round(c[f"k{k}/straggler"]["iter_ms"] / c[f"k{k}/none"]["iter_ms"], 3)
    return {"k0_vs_horovod": round(c["k0/none"]["samples_per_s"] /
                                   h["k0/none"]["samples_per_s"], 3),
            "masked_delay_share": masked, "straggler_slowdown": straggler,
            "mean_injected_delay_ms": round(bls["max_delay_ms"] / 2, 3),
            "mean_slept_delay_ms": round(slept, 3),
            "oversubscribed": oversubscribed(bls)}


def plot(result, lags, path):
    """Throughput and p99 latency against k per delay mode; Horovod as lines. Returns
    ``path``."""
    fig, axes = plots.new_figure(11, 4, ncols=2)
    for mode, color in zip(("none", "random", "straggler"), ("C0", "C1", "C2")):
        for ax, key in zip(axes, ("samples_per_s", "latency_p99_ms")):
            ax.plot(lags, [result["bls"][f"k{k}/{mode}"][key] for k in lags], "o-",
                    color=color, label=f"BLS, {mode}")
            ax.axhline(result["horovod"][f"k0/{mode}"][key], color=color, ls="--",
                       label=f"Horovod, {mode}")
    for ax, title in zip(axes, ("throughput (samples/s)", "per-batch latency p99 (ms)")):
        ax.set_xlabel("bound k")
        ax.set_title(title)
        ax.set_xticks(lags)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"sharded DLRM inference, {result['ranks']} ranks, max delay "
                 f"{result['max_delay_ms']} ms")
    return plots.write_figure(fig, path, dpi=110)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if _in_a_rank():
        pin_this_rank(cores=1)  # one core per rank, before TensorFlow and MPI start threads
        # A rank: TensorFlow and Horovod load here, never in the launching process.
        from tf_fusedemb.benchmarks import inference_worker  # pylint: disable=import-outside-toplevel
        result = inference_worker.run(args)
        if result is not None:
            print(MARKER + json.dumps(result, sort_keys=True), flush=True)
        return 0
    passed = [a for a in argv if a != "--json"] + (["--np", str(args.np)]
                                                  if "--np" not in argv else [])
    cores = rank_cores(args.np)
    before = _cpu_seconds(cores)
    bls = _launch_bls(args, passed)
    hvd = _launch_horovod(args, passed, bls["max_delay_ms"])
    try:
        check_cores_were_ours(before, _cpu_seconds(cores))
        headline = summarise(bls, hvd, args.lags)
    except ValueError as e:
        raise SystemExit(f"inference benchmark: {e}") from None
    result = {"ranks": bls["ranks"], "max_delay_ms": bls["max_delay_ms"], "lags": args.lags,
              "bls": bls["conditions"], "horovod": hvd["conditions"], **headline,
              "note": "BLS (mpirun) and Horovod (horovodrun) run as two jobs one after "
                      "the other in this run; conditions inside a job are interleaved"}
    if args.plot:
        plot(result, args.lags, args.plot)
        result["plot"] = args.plot
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
