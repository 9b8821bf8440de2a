"""Bounded-lag distributed inference benchmark (paper 001, issue 12).

    python -m tf_fusedemb.benchmarks.inference --json [--plot inference.png]

Sharded DLRM inference on ``--np`` ranks (default 4), push-based (inference/distributed.py):
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
  oversubscribed      more ranks than cores: a sleeping rank lends its core to the
                      others, so T_k can beat T_ideal and the share exceed 1
  straggler_slowdown  {k: T_k with the straggler / T_k without delays}
"""
import argparse
import json
import os
import sys

from tf_fusedemb.benchmarks import plots
from tf_fusedemb.benchmarks.launcher import REPO_ROOT, launch_local
from tf_fusedemb.benchmarks.timing import emit
from tf_fusedemb.testing import mpirun

MARKER = "FUSEDEMB_INFERENCE_RESULT "
MODULE = "tf_fusedemb.benchmarks.inference"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=4, help="ranks")
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
    if args.np < 2:
        p.error("--np must be at least 2")
    return args


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
                                MARKER, timeout=args.job_timeout)
    if code != 0 or result is None:
        raise SystemExit(f"Horovod baseline job failed (exit {code})")
    return result


def summarise(bls, hvd, lags):
    """The headline ratios (see module doc) from both jobs' conditions."""
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
            "oversubscribed": bls["ranks"] > (os.cpu_count() or 1)}


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
    if "OMPI_COMM_WORLD_RANK" in os.environ or "HOROVOD_RANK" in os.environ:
        # A rank: TensorFlow and Horovod load here, never in the launching process.
        from tf_fusedemb.benchmarks import inference_worker  # pylint: disable=import-outside-toplevel
        result = inference_worker.run(args)
        if result is not None:
            print(MARKER + json.dumps(result, sort_keys=True), flush=True)
        return 0
    passed = [a for a in argv if a != "--json"]
    bls = _launch_bls(args, passed)
    hvd = _launch_horovod(args, passed, bls["max_delay_ms"])
    result = {"ranks": bls["ranks"], "max_delay_ms": bls["max_delay_ms"], "lags": args.lags,
              "bls": bls["conditions"], "horovod": hvd["conditions"],
              **summarise(bls, hvd, args.lags),
              "note": "BLS (mpirun) and Horovod (horovodrun) run as two jobs one after "
                      "the other in this run; conditions inside a job are interleaved"}
    if args.plot:
        plot(result, args.lags, args.plot)
        result["plot"] = args.plot
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
