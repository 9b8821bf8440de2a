"""Where the pipelined step's time goes: a Horovod timeline and TensorFlow profiler traces
of the pipeline benchmark's steps on an emulated cluster, summarised per collective.

    python -m tf_fusedemb.benchmarks.pipeline_trace --hosts 2 --ranks-per-host 1 \\
        --link-mbit 300 --out /tmp/trace --modes sync,dbp_fwp4 [--summary docs/timelines/x.md]

The workers (``pipeline_trace_worker``) train the benchmark's model in each mode: a
warm-up, then ``--steps`` steps while Horovod writes its timeline (``HOROVOD_TIMELINE``,
rank 0's view: every rank's readiness, negotiation and execution of each collective) and
TensorFlow's profiler records every rank's ops. The launcher then summarises the recorded
steps (:mod:`tf_fusedemb.benchmarks.timeline_summary`): per collective its wait for the
other rank, its execution time and bytes, the gaps of Horovod's background thread, and
how much of the collectives' execution ran while rank 0 computed. The raw traces stay in
``--out`` (several MB each); the summary is small enough to keep.
"""
import argparse
import os
import sys

from tf_fusedemb import quiet

quiet.install()  # a command (and its workers): quiet TensorFlow before it loads

from tf_fusedemb.benchmarks.launcher import (add_launch_args, add_workload_args, benchmark_main,
                                             check_launch_args)
from tf_fusedemb.benchmarks import timeline_summary
from tf_fusedemb.benchmarks.pipeline_worker import REAL

RESULT_MARKER = "PIPELINE_TRACE_RESULT "


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="timeline + profiler of the pipelined step")
    add_launch_args(p)
    add_workload_args(p, batch_size=4096, steps=6, rounds=1, num_batches=8)
    p.add_argument("--hidden", default="512,256,128", help="dense layer widths")
    p.add_argument("--modes", default="sync,dbp_fwp4", help="comma-separated modes to trace")
    p.add_argument("--out", required=True, help="directory of the raw traces")
    p.add_argument("--no-profile", dest="profile", action="store_false",
                   help="Horovod timeline only (no TensorFlow profiler)")
    p.add_argument("--summary", default=None,
                   help="markdown summary written here (default OUT/summary.md), its PNG beside")
    p.add_argument("--title", default="", help="heading of the summary")
    args = p.parse_args(argv)
    args.hidden = tuple(int(h) for h in args.hidden.split(",") if h)
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = set(args.modes) - set(REAL)
    if unknown:
        p.error(f"unknown modes {sorted(unknown)}; choose from {sorted(REAL)}")
    if args.steps < 3:
        p.error("--steps >= 3")
    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    if "HOROVOD_RANK" not in os.environ:
        os.environ["HOROVOD_TIMELINE"] = os.path.join(args.out, "horovod_timeline.json")
    return check_launch_args(p, args)


def _finish(result, args):
    summary = timeline_summary.summarize(result["timeline"], result["windows"])
    text = timeline_summary.markdown(summary, args.title, sys.argv)
    path = args.summary or os.path.join(args.out, "summary.md")
    with open(path, "w") as f:
        f.write(text)
    print(text, file=sys.stderr)
    plot = os.path.splitext(path)[0] + ".png"
    timeline_summary.plot_steps(summary, plot, args.title)
    for mode in summary["modes"].values():
        mode.pop("detail")
    result.clear()
    result.update({"summary": path, "plot": plot, "modes": summary["modes"]})


def main(argv=None):
    return benchmark_main("tf_fusedemb.benchmarks.pipeline_trace",
                          "tf_fusedemb.benchmarks.pipeline_trace_worker", parse_args,
                          RESULT_MARKER, argv, finish=_finish)


if __name__ == "__main__":
    sys.exit(main())
