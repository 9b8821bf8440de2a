"""Worker script: trains the equivalence model with FusedEmbedding on this rank's slice of
each global batch and prints, on rank 0, "RESULT <json>" with per-step losses, dense
weights, every table row (read back through the layer) and the communication counters.

    horovodrun -np 2 --gloo -H localhost:2 python tests/mp_train_equivalence.py --steps 20
    python tests/mp_train_equivalence.py   # single process, no Horovod

Several runs in one launch (each from a fresh model, one RESULT line each with its
``run`` index): the options before the first ``--each`` apply to every run, those after
each ``--each`` to that run only. One launch then pays the processes' start-up once::

    horovodrun ... tests/mp_train_equivalence.py --steps 32 --each --pipeline dbp \
        --each --pipeline fwp=2
"""
import argparse
import json
import os
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

import equivalence_model as em  # noqa: E402
from tf_fusedemb.comm import get_communicator  # noqa: E402
from tf_fusedemb.layers import FusedEmbedding  # noqa: E402
from tf_fusedemb.models import FusedModel, train_step  # noqa: E402
from tf_fusedemb.training.step_variables import step_variables_first  # noqa: E402
from tf_fusedemb.training.tracing import RankInvariantFunction  # noqa: E402


def all_rows_inputs():
    """One ID per sample covering each table, so the layer returns every row."""
    x = {n: tf.range(v, dtype=tf.int64) for n, v in em.VOCAB.items()}
    x["c"] = tf.RaggedTensor.from_row_splits(x["c"], tf.range(em.VOCAB["c"] + 1, dtype=tf.int64))
    x["s"] = tf.RaggedTensor.from_row_splits(x["s"], tf.range(em.VOCAB["s"] + 1, dtype=tf.int64))
    return x


def read_state(layer, head):
    """Dense weights and every table row (read through the layer: a collective, every rank
    calls it) as JSON-ready lists: {"dense": [...], "tables": {feature: rows}}."""
    rows = tf.function(layer)(all_rows_inputs())
    return {"dense": [v.numpy().tolist() for h in head for v in h.trainable_variables],
            "tables": {n: (r[:, 0] if n == "s" else r).numpy().tolist()
                       for n, r in rows.items()}}


EACH = "--each"  # separates the runs of one launch (see module doc)


def runs_of(argv):
    """The runs' argument lists: the options before the first ``--each`` with those of
    each run (one run without ``--each``)."""
    parts, current = [], []
    for arg in argv:
        if arg == EACH:
            parts.append(current)
            current = []
        else:
            current.append(arg)
    parts.append(current)
    common, runs = parts[0], parts[1:] or [[]]
    return [common + run for run in runs]


def main(argv=None):
    comm = get_communicator()
    for index, run_argv in enumerate(runs_of(sys.argv[1:] if argv is None else argv)):
        train(run_argv, comm, index)


def train(argv, comm, index=0):
    """One run (``argv``: its options), from a fresh model; rank 0 prints its RESULT."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--empty-step", type=int, default=None)
    parser.add_argument("--keras-fit", action="store_true",
                        help="train through FusedModel.compile/fit instead of train_step")
    parser.add_argument("--save-dir", help="save a checkpoint there after training")
    parser.add_argument("--restore-dir", help="restore the latest checkpoint there first; "
                                              "training continues at its next step")
    parser.add_argument("--report-restored", action="store_true",
                        help="with --restore-dir: rank 0 also prints 'RESTORED <json>' with the "
                             "dense weights and table rows as restored, before training")
    parser.add_argument("--pipeline", default=None,
                        help="train through NestedPipeline with these options, e.g. "
                             "'dbp,fwp=4' (see PipelineOptions.parse)")
    parser.add_argument("--stale", action="store_true",
                        help="with --pipeline dbp: drop the dual-buffer synchronisation")
    parser.add_argument("--cluster", type=int, default=0,
                        help="reorder each rank's slice by key-centric clustering for this "
                             "many micro-batches")
    parser.add_argument("--storage", default=None,
                        help="the dynamic tables' storage backend (TableSpec.storage)")
    parser.add_argument("--exchange", default=None,
                        help="FusedEmbedding(exchange=...): flat, hierarchical or auto")
    parser.add_argument("--mismatch", action="store_true",
                        help="rank 1 builds feature 'a' with another dim (must fail clearly)")
    args = parser.parse_args(argv)

    specs = em.feature_specs(args.storage)
    if args.mismatch and comm.rank == 1:
        from tf_fusedemb.specs import FeatureSpec, TableSpec
        t = specs[0].table
        specs[0] = FeatureSpec("a", TableSpec("a", 6, t.optimizer, t.initializer), "sum")
    layer = FusedEmbedding(specs, exchange=args.exchange)
    head = em.make_head()
    dense_opt = tf_keras.optimizers.SGD(0.05)

    class Model(FusedModel):
        def __init__(self):
            super().__init__()
            self.emb, self.head = layer, head

        def call(self, x, training=False):
            return em.head_forward(self.head, self.emb(x))
    model = Model()

    # Traced once per input structure on every rank (reduce_retracing would retrace on the
    # ranks whose batch size changes, e.g. when one rank's batch is empty, and ranks
    # running different traces never meet in their collectives).
    step = RankInvariantFunction(
        lambda x, y: train_step(model, x, y, em.bce, dense_opt, communicator=comm).loss,
        before_trace=step_variables_first(model, dense_opt))

    if args.keras_fit:
        model.compile(optimizer=dense_opt, loss=em.bce)

        def step(x, y):  # noqa: F811  one fit() call per global batch, history = its loss
            n = int(y.shape[0])
            history = model.fit(x, y, batch_size=max(n, 1), epochs=1, shuffle=False, verbose=0)
            return history.history["loss"][0]

    from tf_fusedemb.training import CheckpointManager
    start = 0
    if args.restore_dir:
        empty = em.to_tensors(*em.global_batch(0), 0, 0)
        model(empty[0])  # builds every variable without recording any key
        manager = CheckpointManager(args.restore_dir, model, dense_opt, communicator=comm)
        start = manager.restore()["state"]["next_step"]
        if args.report_restored:
            restored = read_state(layer, head)  # collective: every rank reads
            if comm.rank == 0:
                print("RESTORED " + json.dumps(restored), flush=True)
    def batches():
        for t in range(start, start + args.steps):
            feats, labels = em.global_batch(t)
            lo, hi = em.rank_slice(t, comm.rank, comm.size, args.empty_step)
            if args.cluster:
                feats, labels = em.clustered(feats, labels, lo, hi, args.cluster)
            yield em.to_tensors(feats, labels, lo, hi)

    if args.pipeline:
        import dataclasses
        from tf_fusedemb.pipeline import PipelineOptions, make_pipeline
        options = PipelineOptions.parse(args.pipeline)
        if args.stale:
            options = dataclasses.replace(options, sync_buffers=False)
        pipeline = make_pipeline(model, em.bce, dense_opt, options, communicator=comm)
        losses = [float(loss) for loss, _ in pipeline.run(batches())]
    else:
        pipeline = None
        losses = [float(step(x, y)) for x, y in batches()]
    if args.save_dir:
        CheckpointManager(args.save_dir, model, dense_opt, communicator=comm).save(
            start + args.steps, {"next_step": start + args.steps})
    sizes = comm.allgather_object({g.group.name: int(g.store.table.size()) for g in layer.groups})
    counters = layer.comm_counters()
    state = read_state(layer, head)
    if comm.rank == 0:
        result = {
            "run": index,
            "losses": losses,
            "dense": state["dense"],
            "num_trainable": len(model.trainable_variables),
            "tables": state["tables"],
            "counters": counters,
            "start": start,
            "table_sizes": {k: sum(s[k] for s in sizes) for k in sizes[0]},
            "groups": [g.group.feature_names for g in layer.groups],
            "access": {g.group.name: g.store.statistics.category_totals() for g in layer.groups},
            "pipeline_chosen": getattr(pipeline, "chosen", None),  # an AutoPipeline's
        }
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
