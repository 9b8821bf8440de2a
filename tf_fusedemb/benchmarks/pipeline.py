"""Nested-pipelining benchmark: synchronous fused training vs. NestPipe's DBP and FWP
(with EmbRace's vertical scheduling) and key-centric clustering, side by side.

    python -m tf_fusedemb.benchmarks.pipeline --json          # synthetic Criteo-like
    python -m tf_fusedemb.benchmarks.pipeline --json \
        --data /work/shared/data/criteo-kaggle-sample/train.txt

Run plainly, it re-launches itself on ``--np`` (2) local Gloo workers
(``tf_fusedemb.benchmarks.launcher``) and prints rank 0's JSON as the LAST line.

Model: the lookup benchmark's Criteo net (26 one-hot features, dim 16, one fused group,
Adagrad) with a larger dense part, ``--hidden`` (512,256,128), so there is compute to
overlap; ``--batch-size`` samples per rank. Every variant trains through
``tf_fusedemb.pipeline.NestedPipeline`` on the same batches, in the same processes.

Variants (``step_ms``): ``sync`` (N=1, no prefetch: the fused baseline, same computation
as ``tf_fusedemb.models.train_step``), ``dbp`` (prefetch + vertical scheduling), ``fwp2``,
``fwp4``, ``fwp8``, ``dbp_fwp4``, ``dbp_fwp4_cluster`` (the batches reordered by
``cluster_permutation`` for 4 micro-batches beforehand, as the tf.data stage would).

Timing: each round runs every variant (order shuffled per round, same seed on every rank)
for ``--steps`` consecutive steps through ``NestedPipeline.run``; the first and the last
step of a run are not timed (the first includes the prologue prefetch, the last has no
next batch), the rest are timed one by one (loss read back); ``step_ms`` = median.

Exposed communication ratio, FWP with N micro-batches (NestPipe's metric; theory 1/N):
``exposed_comm_ratio[N] = clip((T_N - P_N) / C_N, 0, 1)`` where T_N is the real step,
P_N the same step of a twin model on a single-rank communicator in the same worker
(identical lookups, pooling and dense compute, no collective: the owner serves its own
keys), and C_N the time of the step's collectives alone, run one after another: per
micro-batch the key, row and gradient AlltoAlls with the real payloads and splits, plus
the dense and scalar AllReduces. T_N - P_N is the time the collectives add to the step
(not hidden behind compute).

Exposed lookup time: ``lookup_ms`` is routing + retrieval of one batch alone (the
prefetch function); a synchronous step pays all of it, so ``exposed_lookup_ms[dbp] =
clip(T_dbp - (T_sync - lookup_ms), 0, lookup_ms)``.

Emulated network (``--emulate-mbps M``): on one machine the collectives run over
loopback on the cores that compute, so there is no communication worth hiding and no
separate resource to hide it on. With this flag every collective also occupies a per-rank
emulated link for bytes / M (sleeping, no CPU; see ``emulated_network``), which gives the
pipeline the network the papers assume; the JSON then says ``emulated_network``.

Clustering: summed unique (feature, ID) keys over the N micro-batches of a rank's batch
(what the AlltoAlls carry), unclustered vs clustered, mean over rank 0's batches, and
the reduction; ``cluster_ms`` is the cost per batch on the CPU (off the step's path).
"""
import argparse
import sys

from tf_fusedemb.benchmarks.launcher import benchmark_main

RESULT_MARKER = "PIPELINE_BENCHMARK_RESULT "
VARIANTS = ("sync", "dbp", "fwp2", "fwp4", "fwp8", "dbp_fwp4", "dbp_fwp4_cluster")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="NestPipe / EmbRace pipelining benchmark")
    p.add_argument("--json", action="store_true", help="print one JSON object last")
    p.add_argument("--np", type=int, default=2, help="Horovod workers to launch")
    p.add_argument("--batch-size", type=int, default=4096, help="samples per rank")
    p.add_argument("--hidden", default="512,256,128", help="dense layer widths")
    p.add_argument("--steps", type=int, default=5, help="steps per variant per round (>= 3)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds")
    p.add_argument("--num-batches", type=int, default=8, help="distinct global batches")
    p.add_argument("--data", default=None, help="Criteo TSV; default synthetic")
    p.add_argument("--max-rows", type=int, default=None, help="rows read from --data")
    p.add_argument("--emulate-mbps", type=float, default=None,
                   help="emulate a network link of this many MB/s per rank under every "
                        "collective (tf_fusedemb.benchmarks.emulated_network); default off")
    p.add_argument("--emulate-latency-ms", type=float, default=0.05,
                   help="per-transfer latency of the emulated link")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds before the launcher kills the workers")
    args = p.parse_args(argv)
    args.hidden = tuple(int(h) for h in args.hidden.split(",") if h)
    if args.np < 1 or args.batch_size < 8 or args.steps < 3 or args.rounds < 1:
        p.error("--np >= 1, --batch-size >= 8, --steps >= 3 and --rounds >= 1 are required")
    return args


def main(argv=None):
    return benchmark_main("tf_fusedemb.benchmarks.pipeline", "tf_fusedemb.benchmarks.pipeline_worker",
                          parse_args, RESULT_MARKER, argv)


if __name__ == "__main__":
    sys.exit(main())
