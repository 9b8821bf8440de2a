"""Worker of ``tf_fusedemb.benchmarks.pipeline_trace`` (one per Horovod rank): trains the
pipeline benchmark's model in each mode while Horovod's timeline (rank 0 writes it, the
launcher sets ``HOROVOD_TIMELINE``) and TensorFlow's profiler (every rank) record it."""
import json
import os
import time

import tensorflow as tf
import tf_keras

from tf_fusedemb.benchmarks.pipeline_worker import (REAL, as_tensors, build_model, load_batches,
                                                    step_loss, time_run)
from tf_fusedemb.comm import get_communicator
from tf_fusedemb.pipeline import NestedPipeline
from tf_fusedemb.training.loop import TrainLoop

WARMUP_STEPS = 3  # traces the step functions (not recorded in the summary)


def _epoch_steps(pipeline, batches, steps):
    """Runs ``steps`` steps through a ``TrainLoop`` (each prefetching the next, the last
    none, then flushed); returns [(begin, end)] of each in epoch microseconds (the clock
    of both traces)."""
    loop = TrainLoop(pipeline)
    data = iter([batches[(WARMUP_STEPS + k) % len(batches)] for k in range(steps)])
    spans = []
    for _ in range(steps):
        begin = time.time_ns() // 1000
        step_loss(loop.progress(data).result)
        spans.append((begin, time.time_ns() // 1000))
    return spans


def run(args):
    """Per mode: warm-up, then ``args.steps`` steps under the profiler; returns (rank 0)
    the step windows (epoch microseconds) and times, and writes them to ``args.out``."""
    comm = get_communicator()
    rank = comm.rank
    raw, _ = load_batches(args, comm.size, rank)
    batches = as_tensors(raw)
    loss_fn = tf_keras.losses.BinaryCrossentropy(from_logits=True)
    model, optimizer = build_model(comm, args)
    windows = {}
    for mode in args.modes:
        pipeline = NestedPipeline(model, loss_fn, optimizer, REAL[mode], communicator=comm)
        time_run(pipeline, batches, 0, WARMUP_STEPS)
        comm.allgather_object(None)
        logdir = os.path.join(args.out, f"tf_{mode}_rank{rank}")
        if args.profile:
            tf.profiler.experimental.start(logdir)
        steps = _epoch_steps(pipeline, batches, args.steps)
        if args.profile:
            tf.profiler.experimental.stop()
        comm.allgather_object(None)
        windows[mode] = {"steps_us": steps, "tf_profile": logdir if args.profile else None}
        if rank == 0:
            print(f"[trace] {mode}: steps {[round((b - a) / 1e3, 1) for a, b in steps]} ms",
                  flush=True)
    everyone = comm.allgather_object(windows)
    if rank != 0:
        return None
    result = {"windows": everyone, "timeline": os.environ.get("HOROVOD_TIMELINE"),
              "cycle_time_ms": os.environ.get("HOROVOD_CYCLE_TIME")}
    with open(os.path.join(args.out, "windows.json"), "w") as f:
        json.dump(result, f)
    return result
