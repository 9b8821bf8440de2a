"""End-to-end training-step benchmark of the distributed embedding lookup: FusedRec's
fused lookup vs. no fusion vs. TFRA (the paper's baseline) vs. TFRA-fused.

    python -m tf_fusedemb.benchmarks.lookup --json            # synthetic Criteo-like
    python -m tf_fusedemb.benchmarks.lookup --json \
        --data /work/shared/data/criteo-kaggle-sample/train.txt         # real Criteo sample

    python -m tf_fusedemb.benchmarks.lookup --json --hosts 2 --ranks-per-host 1 \
        --link-mbit 1000                                      # on an emulated cluster

Run plainly, the module re-launches itself on Horovod workers
(``tf_fusedemb.benchmarks.launcher``): with ``--hosts H`` on an emulated cluster of H hosts
x ``--ranks-per-host`` ranks whose links run at ``--link-mbit`` Mbit/s (needs root),
otherwise under ``horovodrun -np N --gloo -H localhost:N`` (``--np``, default 2, loopback);
streams the workers' output to stderr and prints rank 0's JSON as the LAST line of stdout
(``network`` says where it ran). A process with ``HOROVOD_RANK`` set is a worker.

Model (every variant): 26 one-hot categorical features C1..C26, embedding dim 16, dynamic
tables, Adagrad lr 0.05 (``--lr``) for the embeddings; 13 dense features log1p(max(x, 0));
MLP concat(26*16 + 13) -> 256 relu -> 128 relu -> 1; binary cross-entropy on the logit;
``--batch-size`` (4096) samples per rank; the dense optimizer is
``tf_keras.optimizers.Adagrad`` with the same lr. Dense layers start from the same seeded
weights in every variant. ``--data`` reads a Criteo TSV (C hex -> int, empty -> 0) and
cycles its rows into batches; default: ``generate_criteo_like`` rows
(``--num-batches`` distinct global batches, cycled). Every step is a ``tf.function``
(AutoGraph off: no data-dependent Python control flow; dense weights and optimizer slots
are created before tracing, so each step is traced once).

Variants, all built and trained in the same worker processes, on the same batches:

* ``fused``: ``FusedEmbedding`` with ``plan_fusion``'s groups (1 group here), trained by
  ``tf_fusedemb.models.train_step`` (global-mean loss, one grouped dense AllReduce, rows
  updated on their owners), its tables on our storage engine (``storage="engine"``).
  3 AlltoAll rounds per group and step.
* ``fused_bf16``: ``fused`` in bf16 mode: the hidden layers under Keras's
  ``mixed_bfloat16`` policy (bf16 matmuls on AVX-512 BF16 / AMX through oneDNN, float32
  master weights, float32 logit and loss) and the rows and row gradients sent in bf16
  (``FusedEmbedding(wire_dtype="bfloat16")``: half their AlltoAll bytes); the tables and
  the engine's optimizer stay float32.
* ``fused_tfra_backend``: the same fused step with the tables on the TFRA backend
  (``TableSpec(storage="tfra")``: TFRA hash tables for rows and slots, core-TF hash tables
  for the access statistics): what the storage engine alone changes.
* ``unfused``: the ``fused`` layer with ``unfused_plan`` (26 groups): 78 rounds.
* ``tfra``: TFRA's ``dynamic_embedding.keras.layers.HvdAllToAllEmbedding``, one layer per
  feature, trained with ``DynamicEmbeddingOptimizer(tf_keras Adagrad, synchronous=True)``
  (TFRA's Horovod path: each dense gradient AllReduced with ``hvd.allreduce(Sum)``,
  embedding gradients applied on the owners), inside a ``tf.function`` step like
  TFRA's Keras ``train_step`` (tape -> gradients -> ``apply_gradients``); same loss scaling
  as ``train_step``. Per feature: key + row AlltoAll forward, row-gradient AlltoAll
  backward (Horovod's registered gradient) = 78 rounds.
* ``tfra_fused``: the paper's TFRA-fused scheme (FusedRec Sec. 4 "Baseline"): the same
  groups as ``fused``; on the SOURCE side every key is hashed with its category,
  ``mix64(id ^ tag(table))`` in pure TF (``tf_fusedemb.ops.hashing.tf_mix64``); ONE
  ``tf.unique_with_counts`` deduplicates the group; the unique hashed keys go through ONE
  ``HvdAllToAllEmbedding`` per group (``with_unique=False`` since they are unique already;
  TFRA's owner-side secondary unique kept); PLUS the extra AlltoAll that ships the
  category information to the owners: ``count << 16 | category`` (int64) per unique key,
  partitioned with TFRA's own ``partition_fn`` + ``make_partition`` -- the routing
  ``HvdVariable.__relocate_dense_feature__`` applies to the keys (owner = key mod N on a
  CPU build, ``(key & 0x7fffffff) mod N`` on a CUDA build) -- and sent with
  ``hvd.alltoall`` using the same splits, so it arrives aligned with the keys TFRA sends.
  The owner records per-category access counts from it (what FusedEmbedding's key
  exchange carries in-band). 4 rounds per group and step. See
  ``lookup_models.TfraFusedEmbedding``.

Timing (``tf_fusedemb.benchmarks.timing``' side-by-side idea, at step granularity): each
variant is warmed up (``--warmup`` steps, the first traces), then ``--rounds`` rounds; a
round runs ``--steps`` consecutive training steps of every variant, in an order shuffled
per round with the same seed on every rank, after a barrier. Every step is timed on its
own (the call returns when the synchronous step is done: the loss is read); ``step_ms`` is
the median over all timed steps of rank 0 (also p10/p90/min, and the median of per-round
means). All variants share the machine, the process and the data, so the ratios are
side by side.

Profile (``--profile``): after the timed rounds every fused variant runs a few more steps
under TensorFlow's profiler on every rank; ``profile`` gives, per variant and rank, the
median step's milliseconds per category of :mod:`tf_fusedemb.benchmarks.op_profile`
(dense, exchange, engine, pooling/recovery, other embedding ops, input, waiting on
collectives, Python/tf.function overhead), the op executions per step and the largest op
types; ``graph_ops`` is the number of ops in the traced step graph, the bodies of the
functions it calls included.

Counting, per variant (``lookup_comm``): ``alltoall_rounds_per_step`` from in-graph
counters during the timed steps (FusedEmbedding's ``comm_counters()``; for TFRA a shim
around ``horovod.tensorflow.alltoall`` -- the function TFRA's ``HvdVariable`` calls --
records each call and, through an identity with a custom gradient, the gradient
AlltoAll Horovod's registered gradient issues); cross-checked with
``graph_alltoall_ops``, the ``HorovodAlltoall`` nodes of the traced step graph (gradient
included). ``bytes_per_step``: payload bytes sent to OTHER ranks by AlltoAlls per step
(mean over ranks; ``bytes_per_step_by_rank`` too); ``mean_message_bytes`` = bytes sent /
non-empty messages to other ranks (all ranks pooled).
"""
import argparse
import sys

from tf_fusedemb import quiet

quiet.install()  # a command (and its workers): quiet TensorFlow before it loads

from tf_fusedemb.benchmarks import plots
from tf_fusedemb.benchmarks.launcher import (add_launch_args, add_workload_args, benchmark_main,
                                             check_launch_args)
from tf_fusedemb.benchmarks.lookup_data import DEFAULT_CRITEO  # noqa: F401  (re-export)

RESULT_MARKER = "LOOKUP_BENCHMARK_RESULT "
VARIANTS = ("fused", "fused_bf16", "fused_tfra_backend", "unfused", "tfra", "tfra_fused")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="FusedRec lookup benchmark (training steps)")
    add_launch_args(parser)
    add_workload_args(parser, batch_size=4096, steps=5, rounds=8, num_batches=8)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated subset of {','.join(VARIANTS)}")
    parser.add_argument("--plot", metavar="PATH", help="also write a PNG of the step times")
    parser.add_argument("--profile", type=int, nargs="?", const=5, default=0, metavar="STEPS",
                        help="after the timed rounds, profile STEPS (default 5) more steps of "
                             "each fused variant with TensorFlow's profiler and report where "
                             "the step's time goes (tf_fusedemb.benchmarks.op_profile)")
    args = parser.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {VARIANTS}")
    if args.batch_size < 1 or args.steps < 1 or args.rounds < 1:
        parser.error("--batch-size, --steps and --rounds must be >= 1")
    return check_launch_args(parser, args)


def plot_variants(result, args):
    """With ``--plot PATH``: a PNG of the median step time per variant (``finish`` hook)."""
    if args.plot:
        result["plot"] = plots.bar_chart(
            args.plot, {k: v["step_ms"] for k, v in result["variants"].items()},
            f"training step per lookup variant, {result['environment']['np']} ranks, batch "
            f"{result['environment']['batch_size_per_rank']}/rank",
            "step time, ms (median)")


def main(argv=None):
    return benchmark_main("tf_fusedemb.benchmarks.lookup", "tf_fusedemb.benchmarks.lookup_worker",
                          parse_args, RESULT_MARKER, argv, finish=plot_variants)


if __name__ == "__main__":
    sys.exit(main())
