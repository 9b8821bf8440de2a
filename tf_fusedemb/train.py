"""The main job: train a production-style model with fused, sharded embeddings.

    horovodrun -np 2 --gloo -H localhost:2 python -m tf_fusedemb.train \\
        --model dlrm --data synthetic --steps 300 --checkpoint-dir runs/ckpt --export-dir runs/export

Runs single-process without horovodrun. Shows a Keras progress bar (loss, AUC, samples/s)
on rank 0, writes TensorBoard logs (loss, AUC, samples/s, AlltoAll rounds and bytes per
group, access statistics), checkpoints every ``--checkpoint-every`` steps (resuming from
the latest one, data position included), evaluates AUC and logloss on the held-out split
and exports a SavedModel from every rank (each writes its own rows; one per
``--export-row-dtypes``, each checked on the held-out split). The last line printed by
rank 0 is ``RESULT {json}``.

Export a checkpoint without training, on any number of ranks (each reads its share):

    horovodrun -np 4 --gloo -H localhost:4 python -m tf_fusedemb.train --model dlrm \\
        --data synthetic --checkpoint-dir runs/ckpt --export-dir runs/export --export-only
"""
import argparse
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from tf_fusedemb import quiet

quiet.install()  # a command: quiet TensorFlow before it loads (tf_fusedemb/quiet.py)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

from tf_fusedemb import job  # noqa: E402
from tf_fusedemb.benchmarks.op_profile import StepProfiler  # noqa: E402
from tf_fusedemb.comm import Communicator, get_communicator  # noqa: E402
from tf_fusedemb.inference import export_saved_model  # noqa: E402
from tf_fusedemb.inference.row_codec import ROW_DTYPES  # noqa: E402
from tf_fusedemb.models import fused_embedding_layers  # noqa: E402
from tf_fusedemb.pipeline import (AutoPipeline, PipelineOptions, cluster_dataset,  # noqa: E402
                                  make_pipeline)
from tf_fusedemb.training import KerasLoss  # noqa: E402
from tf_fusedemb.training import faults  # noqa: E402
from tf_fusedemb.training.checkpoint import CheckpointManager  # noqa: E402
from tf_fusedemb.training.progress import progress_bar  # noqa: E402
from tf_fusedemb.training.loop import SynchronousStep, TrainLoop  # noqa: E402
from tf_fusedemb.training.tracing import RankInvariantFunction  # noqa: E402


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dlrm", choices=job.MODELS)
    p.add_argument("--data", default="synthetic", choices=job.DATASETS)
    p.add_argument("--data-path", default=None, help="file or folder of a real dataset")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--epochs", type=float, default=None,
                   help="instead of --steps: passes over the synthetic/real training rows")
    p.add_argument("--batch-size", type=int, default=1024, help="per rank")
    p.add_argument("--rows", type=int, default=200_000, help="synthetic training rows")
    p.add_argument("--eval-rows", type=int, default=20_000, help="synthetic held-out rows")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--memory-budget-mb", type=float, default=None, metavar="MB",
                   help="DRAM for the embedding tables' blocks per rank (all tables "
                        "together); the rest spills to an SSD tier (a file), results "
                        "unchanged (default: every row in DRAM)")
    p.add_argument("--spill-dir", default=None,
                   help="where the SSD tier's stores go (default: the system temporary "
                        "directory); only with --memory-budget-mb")
    p.add_argument("--wide-ids", type=int, default=None, metavar="N",
                   help="synthetic data only: one more feature, W, whose table grows to N "
                        "distinct IDs, one new ID per sample until the job has seen N "
                        "samples (then they repeat): a table at the size users have, e.g. "
                        "with --memory-budget-mb for one larger than memory")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--export-dir", default=None)
    p.add_argument("--log-dir", default=None, help="TensorBoard logs (default: none)")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--pipeline", default=None,
                   help="NestPipe/EmbRace pipelining, e.g. 'dbp,fwp=4' (dual-buffer prefetch "
                        "with vertical scheduling, 4 micro-batches), 'fwp=auto' (measured), "
                        "'exchange=auto' (flat or hierarchical exchange, measured on several "
                        "hosts); default synchronous")
    p.add_argument("--cluster-samples", action="store_true",
                   help="key-centric sample clustering of each batch for the pipeline's "
                        "micro-batches (tf.data, asynchronous)")
    p.add_argument("--dtype-policy", default="float32", choices=("float32", "mixed_bfloat16"),
                   help="Keras dtype policy of the dense layers: mixed_bfloat16 runs their "
                        "matmuls in bf16 (AVX-512 BF16 / AMX through oneDNN) on float32 "
                        "weights; the logit, the loss, the rows and their optimizer stay "
                        "float32")
    p.add_argument("--row-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="how the tables store their rows (TableSpec.row_dtype): bfloat16 "
                        "halves the row bytes; slots and the row optimizer stay float32")
    p.add_argument("--profile-steps", type=int, default=0, metavar="N",
                   help="profile N steps after the first 5 with TensorFlow's profiler and "
                        "report where each rank's step time goes (RESULT's profile_by_rank; "
                        "tf_fusedemb.benchmarks.op_profile)")
    p.add_argument("--export-only", action="store_true",
                   help="no training: restore the latest checkpoint of --checkpoint-dir (each "
                        "rank its share, any number of ranks) and export it to --export-dir")
    p.add_argument("--export-row-dtypes", default="float32,bfloat16,int8",
                   help="comma-separated row dtypes to export (float32 to --export-dir, the "
                        "others to <export-dir>-<dtype>), each evaluated on the held-out split")
    args = p.parse_args(argv)
    args.export_row_dtypes = args.export_row_dtypes.split(",")
    for row_dtype in args.export_row_dtypes:
        if row_dtype not in ROW_DTYPES:
            p.error(f"--export-row-dtypes: {row_dtype!r} is not one of {ROW_DTYPES}")
    if args.export_only and not (args.checkpoint_dir and args.export_dir):
        p.error("--export-only needs --checkpoint-dir and --export-dir")
    try:
        args.pipeline = PipelineOptions.parse(args.pipeline) if args.pipeline else None
    except ValueError as e:
        p.error(str(e))
    if args.cluster_samples and (args.pipeline is None or
                                 not isinstance(args.pipeline.micro_batches, int) or
                                 args.pipeline.micro_batches == 1):
        p.error("--cluster-samples needs --pipeline with micro-batches, e.g. --pipeline dbp,fwp=4")
    if args.memory_budget_mb is not None and args.memory_budget_mb < 0:
        p.error(f"--memory-budget-mb must be >= 0, got {args.memory_budget_mb}")
    if args.spill_dir is not None and args.memory_budget_mb is None:
        p.error("--spill-dir needs --memory-budget-mb (without a budget nothing spills)")
    if args.wide_ids is not None and args.wide_ids <= 0:
        p.error(f"--wide-ids must be a positive number of IDs, got {args.wide_ids}")
    if args.wide_ids is not None and args.data != "synthetic":
        p.error(f"--wide-ids needs --data synthetic, got --data {args.data}")
    if args.epochs is not None:
        args.steps = max(1, int(args.epochs * args.rows / (args.batch_size * max(
            1, int(os.environ.get("HOROVOD_SIZE", "1"))))))
    return args


def build(args: argparse.Namespace, comm: Communicator) -> Tuple[
        tf_keras.Model, tf.data.Dataset, tf.data.Dataset, Dict[str, str], Sequence[str]]:
    """(model, train dataset, eval dataset, feature kinds, dense feature names) of ``args``."""
    train, evaluation, kinds, dense = job.make_data(
        args.data, args.data_path, args.batch_size, comm.rank, comm.size, rows=args.rows,
        eval_rows=args.eval_rows, seed=args.seed, wide_ids=args.wide_ids)
    if args.cluster_samples:  # reorders samples inside each batch only (NestPipe V-C)
        train = cluster_dataset(train, sorted(kinds), args.pipeline.micro_batches)
    storage = job.TableStorage(
        None if args.memory_budget_mb is None else int(args.memory_budget_mb * 2**20),
        args.spill_dir, args.row_dtype)
    model = _with_policy(args.dtype_policy, lambda: job.make_model(
        args.model, kinds, dense, dim=args.dim, lr=args.lr, storage=storage))
    x0, _ = next(iter(evaluation))
    model(tf.nest.map_structure(lambda t: t[:0], x0))  # build variables, record no key
    return model, train, evaluation, kinds, dense


def _with_policy(policy: str, make: Callable[[], Any]) -> Any:
    """``make()`` with Keras's global dtype policy set to ``policy`` (Keras reads it when
    each layer is constructed), then the previous policy back."""
    previous = tf_keras.mixed_precision.global_policy()
    tf_keras.mixed_precision.set_global_policy(policy)
    try:
        return make()
    finally:
        tf_keras.mixed_precision.set_global_policy(previous)


def evaluate(model: tf_keras.Model, evaluation: tf.data.Dataset,
             comm: Communicator) -> Dict[str, Any]:
    """Global AUC and logloss of the held-out split (predictions gathered on all ranks).

    Ranks may hold different numbers of eval batches (real data sharded by line): every
    rank runs as many forward passes as the rank with the most, feeding empty batches
    once its own run out, so the lookups' collectives always meet."""
    return evaluate_predictions(RankInvariantFunction(
        lambda x: tf.sigmoid(model(x, training=False))), evaluation, comm)


def evaluate_predictions(predict: Callable[[Any], tf.Tensor], evaluation: tf.data.Dataset,
                         comm: Communicator) -> Dict[str, Any]:
    """``evaluate`` of the probabilities ``predict(x)`` float32[B, 1] (see there)."""
    batches = list(evaluation)
    rounds = max(comm.allgather_object(len(batches)))
    if not batches:
        raise ValueError(f"rank {comm.rank} has no evaluation rows at all")
    empty = tf.nest.map_structure(lambda t: t[:0], batches[0])
    preds, labels = [], []
    for i in range(rounds):
        x, y = batches[i] if i < len(batches) else empty
        preds.append(predict(x).numpy().ravel())
        labels.append(y.numpy().ravel())
    gathered = comm.allgather_object((np.concatenate(preds), np.concatenate(labels)))
    p = np.concatenate([g[0] for g in gathered])
    y = np.concatenate([g[1] for g in gathered])
    auc = tf_keras.metrics.AUC(num_thresholds=4000)
    auc.update_state(y, p)
    eps = 1e-7
    logloss = -np.mean(y * np.log(p + eps) + (1 - y) * np.log(1 - p + eps))
    return {"eval_auc": float(auc.result()), "eval_logloss": float(logloss),
            "eval_rows": int(len(y))}


def log_scalars(writer: Any, step: int, values: Dict[str, float]) -> None:
    """Writes ``values`` at ``step`` to the TensorBoard ``writer`` (a tf.summary writer)."""
    with writer.as_default(step=step):
        for k, v in values.items():
            tf.summary.scalar(k, v)


def train(args: argparse.Namespace) -> Dict[str, Any]:
    """The main job of ``args``; returns its result (what it prints after RESULT)."""
    comm = get_communicator()
    tf.random.set_seed(args.seed)
    model, train_ds, evaluation, kinds, dense = build(args, comm)
    optimizer = tf_keras.optimizers.Adagrad(args.lr)
    loss_fn = KerasLoss(tf_keras.losses.BinaryCrossentropy(from_logits=True))
    # Rank 0's running training AUC is checkpointed too: a resumed run reports the same.
    auc = tf_keras.metrics.AUC(num_thresholds=2000)
    manager = CheckpointManager(args.checkpoint_dir, model, optimizer,
                                extra={"train_auc": auc}) if args.checkpoint_dir else None
    start = _resume(manager, args, comm)
    batches = _train_batches(train_ds, start, args.steps)
    # The step (traced once with unknown batch dimensions: the same graph on every rank),
    # or the pipeline, which routes and retrieves the next batch during each step; the
    # TrainLoop owns the data iterator and looks one batch ahead for it (as fit's does).
    steps = make_pipeline(model, loss_fn, optimizer, args.pipeline) if args.pipeline \
        else SynchronousStep(model, loss_fn, optimizer)
    loop = TrainLoop(steps)
    layers = fused_embedding_layers(model)
    progress = Progress(args, comm, start, auc)
    counters_before = [layer.comm_counters() for layer in layers]
    profile_dir = tempfile.mkdtemp(prefix=f"tf_fusedemb_profile_rank{comm.rank}_") \
        if args.profile_steps else ""
    profiler = StepProfiler(profile_dir, range(start + 5, start + 5 + args.profile_steps))
    for step in range(start, args.steps):
        begin = time.perf_counter()
        faults.inject("step", step + 1, comm.rank)  # no-op unless tf_fusedemb.testing.faults
        with comm.watch(f"training step {step + 1}"), profiler.step(step):
            done, (x, y) = loop.progress(batches)
        progress.step_done(step, time.perf_counter() - begin, float(done.loss), y,
                           done.predictions)
        if (step + 1) % args.log_every == 0:
            progress.log(step, layers)  # a collective: every rank
        if manager and (step + 1) % args.checkpoint_every == 0:
            steps.flush()  # a pipeline's delayed rows written before the tables are saved
            manager.save(step + 1, {"data_position": step + 1})
    # The loop flushed the steps after the last batch.
    if manager:
        manager.save(args.steps, {"data_position": args.steps})
    chosen = steps.chosen if isinstance(steps, AutoPipeline) else None
    result = _result(args, comm, start, progress, layers, counters_before, profiler, chosen)
    if profile_dir:
        shutil.rmtree(profile_dir, ignore_errors=True)
    with comm.watch("evaluation"):
        result.update(evaluate(model, evaluation, comm))
    if args.export_dir:  # every rank writes its own rows
        result["export"] = export_and_check(args, model, evaluation, kinds, dense, comm)
        result["export"]["checkpoint_step"] = args.steps
    # The job's last collective is done: every rank agrees on the end, so each one's exit
    # shuts Horovod down at once (every rank's teardown follows).
    comm.end_job()
    progress.log_evaluation(args.steps, result)
    if comm.rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    return result


def _resume(manager: Optional[CheckpointManager], args: argparse.Namespace,
            comm: Communicator) -> int:
    """The step to start from: the data position of the latest checkpoint (restored),
    else 0. The same command again resumes; another model cannot (named in one line)."""
    if manager is None or not manager.latest():
        return 0
    try:
        meta = manager.restore()
        assert meta is not None  # latest() found a complete checkpoint
    except ValueError as e:
        raise SystemExit(f"tf_fusedemb.train: cannot resume from {args.checkpoint_dir}: {e} "
                         "(`make train FRESH=1` starts afresh)") from None
    start = int(meta["state"]["data_position"])
    if comm.rank == 0:
        print(f"resuming from {manager.latest()} at step {start} of {args.steps}", flush=True)
    return start


def _train_batches(train_ds: tf.data.Dataset, start: int, steps: int) -> Iterator[Any]:
    """The batches of steps [start, steps): the data resumes where it stopped. Without
    tf.data's autotuning thread: deleting an autotuned iterator waits out that thread's
    current period (up to 23 s seen on 2 loaded cores, at the end of every job). Parallel
    maps then run min(16, cores) calls and prefetch keeps its own buffer tuning."""
    options = tf.data.Options()
    options.autotune.enabled = False
    return itertools.islice(iter(train_ds.skip(start).with_options(options)),
                            max(0, steps - start))


class Progress:
    """What the job reports as it trains: rank 0's progress bar and TensorBoard scalars,
    the samples/s of the timed steps (from the fourth on: after tracing and warm-up), the
    running-mean loss, the last loss and the training AUC (every rank's own)."""

    def __init__(self, args: argparse.Namespace, comm: Communicator, start: int, auc: Any):
        self.comm, self.start, self.auc = comm, start, auc
        rank0 = comm.rank == 0
        self.writer = tf.summary.create_file_writer(args.log_dir) \
            if rank0 and args.log_dir else None
        self.bar = progress_bar(args.steps, stateful_metrics=["auc", "samples/s"]) \
            if rank0 else None
        self.timed_s, self.timed_samples = 0.0, 0
        self.loss_sum, self.loss_steps = 0.0, 0
        self.last_loss: Optional[float] = None
        self.first_step_s: Optional[float] = None  # the trace plus the first step

    @property
    def samples_per_s(self) -> float:
        return self.timed_samples / self.timed_s if self.timed_s else 0.0

    def step_done(self, step: int, elapsed: float, loss: float, y: tf.Tensor,
                  logits: tf.Tensor) -> None:
        """Step ``step`` took ``elapsed`` s; ``y`` float32[B, 1], ``logits`` float32[B, 1]."""
        if step == self.start:
            self.first_step_s = elapsed
        if step >= self.start + 3:
            self.timed_s += elapsed
            self.timed_samples += int(y.shape[0]) * self.comm.size
        self.auc.update_state(y, tf.sigmoid(logits))
        if self.bar:  # samples/s from the first timed step on (not a 0 before it)
            self.bar.update(step + 1, [("loss", loss), ("auc", float(self.auc.result()))] +
                            ([("samples/s", self.samples_per_s)] if self.timed_s else []))
        self.loss_sum, self.loss_steps = self.loss_sum + loss, self.loss_steps + 1
        self.last_loss = loss

    def log(self, step: int, layers: List[Any]) -> None:
        """The job's statistics (a collective: every rank calls it) and, on rank 0, the
        bar's running-mean loss, AUC, samples/s and exchange counters to TensorBoard."""
        stats = [layer.global_statistics() for layer in layers]
        if not self.writer:
            return
        values = {"loss": self.loss_sum / self.loss_steps, "auc": float(self.auc.result()),
                  "samples_per_s": self.samples_per_s}
        for layer, layer_stats in zip(layers, stats):
            for g, c in layer.comm_counters().items():
                values.update({f"comm/{g}/{k}": v for k, v in c.items()})
            for g, metrics in layer_stats.items():
                values.update({f"stats/{g}/{k}": v for k, v in metrics.items()})
        log_scalars(self.writer, step + 1, values)

    def log_evaluation(self, step: int, result: Dict[str, Any]) -> None:
        if self.writer:
            log_scalars(self.writer, step, {k: result[k] for k in ("eval_auc", "eval_logloss")})


def _result(args: argparse.Namespace, comm: Communicator, start: int, progress: Progress,
            layers: List[Any], counters_before: List[Any], profiler: StepProfiler,
            chosen: Optional[str]) -> Dict[str, Any]:
    """The RESULT fields of the training part (collectives with a budget or a profile);
    ``chosen``: the schedule a measured pipeline kept (its label), else None."""
    counters = [layer.comm_counters() for layer in layers]
    result = {"model": args.model, "data": args.data, "world_size": comm.size,
              "pipeline": args.pipeline.label if args.pipeline else "sync",
              "pipeline_chosen": chosen,
              "steps": args.steps, "resumed_from_step": start,
              "batch_size_per_rank": args.batch_size,
              "train_samples_per_s": round(progress.samples_per_s, 1) if progress.timed_s
              else None,
              "first_step_s": round(progress.first_step_s, 3)
              if progress.first_step_s is not None else None,
              "train_auc": float(progress.auc.result()),
              "final_loss": progress.last_loss if args.steps > start else None,
              "alltoall_rounds_per_step": {
                  g: (c[g]["rounds"] - b[g]["rounds"]) / max(1, args.steps - start)
                  for b, c in zip(counters_before, counters) for g in c}}
    if args.memory_budget_mb is not None:  # the tiers' contents, every rank's (a collective)
        result["embedding_memory_by_rank"] = comm.allgather_object(
            {g: m for layer in layers for g, m in layer.memory().items()})
    if args.profile_steps:  # every rank's, gathered (a collective)
        result["profile_by_rank"] = comm.allgather_object(
            profiler.summary(layers[0].name)._asdict())
    return result


def serving_inputs(x: Dict[str, Any], kinds: Dict[str, str]) -> Dict[str, tf.Tensor]:
    """The serving signature's raw inputs of a batch ``x``: list features zero-padded
    int64[B, L] plus ``<name>_length`` int64[B]."""
    raw = {k: (v if kinds.get(k) != "list" else v.to_tensor()) for k, v in x.items()}
    for k, kind in kinds.items():
        if kind == "list":
            raw[k + "_length"] = x[k].row_lengths()
    return raw


def directory_bytes(path: str) -> int:
    """Bytes of the files under ``path``."""
    return sum(os.path.getsize(os.path.join(root, f))
               for root, _, files in os.walk(path) for f in files)


def export_and_check(args: argparse.Namespace, model: tf_keras.Model,
                     evaluation: tf.data.Dataset, kinds: Dict[str, str], dense: Sequence[str],
                     comm: Communicator) -> Dict[str, Any]:
    """Every rank: exports the model once per ``--export-row-dtypes`` (float32 to
    ``--export-dir``, the others to ``<export-dir>-<dtype>``), each rank writing its own
    rows; checks the float32 export's predictions against the trained model's on each
    rank's first eval batch, and evaluates every export on the held-out split (each rank
    loads the SavedModel and serves its share: a check at the job's scale)."""
    x, _ = next(iter(evaluation))
    # Traced, as the SavedModel serves it: under mixed_bfloat16 an eager call rounds
    # between ops that the traced graph fuses (MatMul + BiasAdd + ReLU in one kernel).
    trained = RankInvariantFunction(lambda x: model(x, training=False))(x).numpy()
    out: Dict[str, Any] = {"export_dir": args.export_dir, "row_dtypes": {}}
    for row_dtype in args.export_row_dtypes:
        path = args.export_dir if row_dtype == "float32" else f"{args.export_dir}-{row_dtype}"
        begin = time.perf_counter()
        with comm.watch(f"export ({row_dtype} rows)"):
            export_saved_model(model, path, kinds, dense_features=dense, row_dtype=row_dtype)
        seconds = time.perf_counter() - begin
        served = tf.saved_model.load(path).signatures["serving_default"]
        if row_dtype == "float32":
            logits = served(**serving_inputs(x, kinds))["logits"].numpy()
            diff = float(np.max(np.abs(logits - trained))) if len(trained) else 0.0
            out["max_abs_diff_vs_trained"] = max(comm.allgather_object(diff))
        def probability(x: Dict[str, tf.Tensor], served: Any = served) -> tf.Tensor:
            return served(**serving_inputs(x, kinds))["probability"]

        metrics = evaluate_predictions(probability, evaluation, comm)
        out["row_dtypes"][row_dtype] = {
            "export_dir": path, "export_s": seconds, "eval_auc": metrics["eval_auc"],
            "variables_bytes": directory_bytes(os.path.join(path, "variables"))}
    if out.get("max_abs_diff_vs_trained", 0.0) > 1e-5:
        raise SystemExit(f"exported predictions differ from the trained model by "
                         f"{out['max_abs_diff_vs_trained']}")
    return out


def export_only(args: argparse.Namespace) -> None:
    """Every rank: restores its share of the latest checkpoint and exports (see
    ``export_and_check``); rank 0 prints ``EXPORT {json}``."""
    comm = get_communicator()
    model, _, evaluation, kinds, dense = build(args, comm)
    meta = CheckpointManager(args.checkpoint_dir, model).restore()
    if meta is None:
        raise SystemExit(f"export: no complete checkpoint in {args.checkpoint_dir}")
    result = export_and_check(args, model, evaluation, kinds, dense, comm)
    result["checkpoint_step"] = meta["step"]
    if comm.rank == 0:
        print("EXPORT " + json.dumps(result), flush=True)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The command line (see the module doc)."""
    args = parse_args(argv)
    if args.export_only:
        export_only(args)
    else:
        train(args)


if __name__ == "__main__":
    main()
