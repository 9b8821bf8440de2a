"""The Keras-path table: each path's largest difference from its plain-Keras reference
(per-batch losses, and every weight: table rows and dense variables), as a Markdown table.

    python tests/keras_paths_report.py                          # one process
    horovodrun -np 2 --gloo -H localhost:2 python tests/keras_paths_report.py   # 2 ranks

On N ranks rank 0 draws the reference's initial weights and computes the reference (plain
Keras on the global batch, in its own process: no collective); every rank trains its share
of each global batch with DistributedOptimizer. tests/test_keras_paths.py asserts the same
comparisons; this prints their sizes.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

import keras_paths as kpth  # noqa: E402
from tf_fusedemb.comm import get_communicator  # noqa: E402
from tf_fusedemb.models import FusedModel  # noqa: E402
from tf_fusedemb.training import DistributedOptimizer  # noqa: E402


def max_diff(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def table_diff(layer, embeds, comm):
    tables, _ = kpth.fused_tables(layer)
    parts = comm.allgather_object(tables)
    return max(max_diff(sum(p[f] for p in parts), e.get_weights()[0]) for f, e in embeds.items())


def one_rank_rows():
    import keras  # Keras 3, for its rows of the table
    comm = get_communicator()
    x, y = kpth.data()
    rows = []

    def pair(k, subclassed=False, optimizer="sgd", base=None, compiled=False, start=None):
        if subclassed:
            ref = kpth.build(kpth.subclassed_class(k, compiled_call=compiled)(False), x)
            fused = kpth.build(kpth.subclassed_class(k, base, compiled)(True, optimizer), x)
            embeds, layer = ref.embedding(), fused.embedding()
        else:
            ref, embeds = kpth.functional(k, False)
            fused, layer = kpth.functional(k, True, optimizer)
        if start is not None:
            start(ref, embeds)
        kpth.load_weights(fused, layer, kpth.initial_weights(ref, embeds))
        return ref, embeds, fused, layer

    def run(name, k, runner, optimizer, data=(x, y), **kwargs):
        ref, embeds, fused, layer = pair(k, optimizer=optimizer, **kwargs)
        want = runner(k, ref, kpth.keras_optimizer(k, optimizer), *data, kpth.BATCH)
        got = runner(k, fused, kpth.keras_optimizer(k, optimizer), *data, kpth.BATCH)
        dense = max(max_diff(a.numpy(), b.numpy()) for a, b in zip(
            [v for v in fused.trainable_variables if "row_update_marker" not in v.name],
            [v for v in ref.trainable_variables if "embeddings" not in v.name]))
        rows.append((name, max_diff(got["losses"], want["losses"]),
                     max(dense, table_diff(layer, embeds, comm))))

    for opt in ("sgd", "adagrad", "ftrl"):
        run(f"tf_keras functional Model.fit ({opt})", tf_keras, kpth.fit, opt)
    run("tf_keras subclassed Model.fit (adagrad)", tf_keras, kpth.fit, "adagrad",
        subclassed=True)
    run("GradientTape loop in tf.function (adagrad)", tf_keras, kpth.custom_loop, "adagrad")
    run("call decorated with tf.function, tf_keras.Model (adagrad)", tf_keras, kpth.fit,
        "adagrad", subclassed=True, compiled=True)
    run("call decorated with tf.function, FusedModel (adagrad)", tf_keras, kpth.fit,
        "adagrad", subclassed=True, compiled=True, base=FusedModel)
    for cls, name in ((None, "tf_keras.Model"), (FusedModel, "FusedModel")):
        ref, embeds = kpth.multi_output(False)
        fused, layer = kpth.multi_output(True, "sgd", cls)
        for n in ("hidden", "click", "rating"):
            fused.get_layer(n).set_weights(ref.get_layer(n).get_weights())
        layer.set_embedding_weights({f: e.get_weights()[0] for f, e in embeds.items()})
        want, _ = kpth.fit_multi_output(ref, kpth.keras_optimizer(tf_keras, "sgd"), x, y)
        got, _ = kpth.fit_multi_output(fused, kpth.keras_optimizer(tf_keras, "sgd"), x, y)
        rows.append((f"two outputs, dict labels, {name} (sgd)",
                     max(max_diff(got[k], want[k]) for k in want),
                     table_diff(layer, embeds, comm)))
    run(f"Keras {keras.__version__} functional Model.fit (sgd)", keras, kpth.fit, "sgd")
    run(f"Keras {keras.__version__} subclassed Model.fit (sgd)", keras, kpth.fit, "sgd",
        subclassed=True)
    run(f"Keras {keras.__version__} GradientTape loop (sgd)", keras, kpth.custom_loop, "sgd")
    run(f"Keras {keras.__version__} functional Model.fit (adagrad)", keras, kpth.fit, "adagrad")
    unique = kpth.data_unique_per_batch()
    run(f"Keras {keras.__version__} functional Model.fit (adagrad, IDs unique per batch)",
        keras, kpth.fit, "adagrad", data=unique)
    run(f"Keras {keras.__version__} functional Model.fit (ftrl from zero tables, IDs unique "
        "per batch)", keras, kpth.fit, "ftrl", data=unique, start=kpth.zero_tables)
    return rows


def two_rank_rows():
    import keras
    comm = get_communicator()
    x, y = kpth.data()
    rows = []

    def models(k, optimizer, subclassed, compiled):
        """(reference, its embeddings, fused model, its layer), functional or subclassed."""
        if not subclassed:
            return (*kpth.functional(k, False), *kpth.functional(k, True, optimizer))
        ref = kpth.build(kpth.subclassed_class(k, compiled_call=compiled)(False), x)
        fused = kpth.build(kpth.subclassed_class(k, None, compiled)(True, optimizer), x)
        return ref, ref.embedding(), fused, fused.embedding()

    def run(name, k, runner, optimizer, wrap=True, data=(x, y), start=None, subclassed=False,
            compiled=False):
        x, y = data
        ref, embeds, fused, layer = models(k, optimizer, subclassed, compiled)
        if start is not None:
            start(ref, embeds)
        initial = comm.allgather_object(kpth.initial_weights(ref, embeds))[0]
        want = None
        if comm.rank == 0:  # the reference (rank 0's draw): plain Keras on the global batch
            want = runner(k, ref, kpth.keras_optimizer(k, optimizer), x, y, 2 * kpth.BATCH)
        kpth.load_weights(fused, layer, initial)
        xr, yr = kpth.rank_slices(x, y, comm.rank, comm.size, kpth.BATCH)
        opt, done = kpth.keras_optimizer(k, optimizer), []
        try:
            got = runner(k, fused, DistributedOptimizer(opt) if wrap else opt, xr, yr,
                         kpth.BATCH, losses=done)
        except tf.errors.InvalidArgumentError as e:
            message = [line for line in e.message.splitlines() if "tf_fusedemb: " in line]
            rows.append((name, f"error after {len(done)} completed steps",
                         (message or [e.message])[0].strip()[:160]))
            return
        losses = comm.allgather_object(got["losses"])
        tables = table_diff(layer, embeds, comm)  # a collective: every rank
        if comm.rank != 0:
            return
        dense = max(max_diff(a.numpy(), b.numpy()) for a, b in zip(
            [v for v in fused.trainable_variables if "row_update_marker" not in v.name],
            [v for v in ref.trainable_variables if "embeddings" not in v.name]))
        rows.append((name, max_diff(np.mean(losses, 0), want["losses"]), max(dense, tables)))

    run("tf_keras functional Model.fit, DistributedOptimizer (adagrad)", tf_keras, kpth.fit,
        "adagrad")
    run("GradientTape loop, DistributedOptimizer (sgd)", tf_keras, kpth.custom_loop, "sgd")
    run(f"Keras {keras.__version__} functional fit, DistributedOptimizer (sgd)", keras,
        kpth.fit, "sgd")
    run("tf_keras functional Model.fit, DistributedOptimizer (ftrl)", tf_keras, kpth.fit,
        "ftrl")
    run("tf_keras subclassed Model.fit, DistributedOptimizer (adagrad)", tf_keras, kpth.fit,
        "adagrad", subclassed=True)
    run("call decorated with tf.function, tf_keras.Model, DistributedOptimizer (adagrad)",
        tf_keras, kpth.fit, "adagrad", subclassed=True, compiled=True)
    run(f"Keras {keras.__version__} subclassed fit, DistributedOptimizer (sgd)", keras,
        kpth.fit, "sgd", subclassed=True)
    unique = kpth.data_unique_per_batch(2 * kpth.BATCH)
    run(f"Keras {keras.__version__} functional fit, DistributedOptimizer (adagrad, IDs unique "
        "per batch)", keras, kpth.fit, "adagrad", data=unique)
    run(f"Keras {keras.__version__} functional fit, DistributedOptimizer (ftrl from zero "
        "tables, IDs unique per batch)", keras, kpth.fit, "ftrl", data=unique,
        start=kpth.zero_tables)
    multi_output_on_ranks(comm, x, y, rows)
    run("tf_keras Model.fit, bare optimizer (sgd)", tf_keras, kpth.fit, "sgd", wrap=False)
    run("GradientTape loop, bare optimizer (sgd)", tf_keras, kpth.custom_loop, "sgd",
        wrap=False)
    run(f"Keras {keras.__version__} functional fit, bare optimizer (sgd)", keras, kpth.fit,
        "sgd", wrap=False)
    return rows


def multi_output_on_ranks(comm, x, y, rows):
    """Two outputs, dict labels, on N ranks with DistributedOptimizer against rank 0's
    reference on the global batches: max difference of the global predictions (losses are
    per rank) and of the weights."""
    ref, embeds = kpth.multi_output(False)
    initial = comm.allgather_object({
        "dense": {n: ref.get_layer(n).get_weights() for n in ("hidden", "click", "rating")},
        "tables": {f: e.get_weights()[0] for f, e in embeds.items()}})[0]
    fused, layer = kpth.multi_output(True, "sgd")
    for n, w in initial["dense"].items():
        fused.get_layer(n).set_weights(w)
    layer.set_embedding_weights(initial["tables"])
    want = None
    if comm.rank == 0:  # its reference already holds the initial weights (rank 0's draw)
        want = kpth.fit_multi_output(ref, kpth.keras_optimizer(tf_keras, "sgd"), x, y,
                                     2 * kpth.BATCH)
    xr, yr = kpth.rank_slices(x, y, comm.rank, comm.size, kpth.BATCH)
    kpth.fit_multi_output(fused, DistributedOptimizer(kpth.keras_optimizer(tf_keras, "sgd")),
                          xr, yr)
    got = fused.predict(x, batch_size=kpth.BATCH, verbose=0)
    tables = table_diff(layer, embeds, comm)
    if comm.rank == 0:
        dense = max(max_diff(a, b) for n in ("hidden", "click", "rating")
                    for a, b in zip(fused.get_layer(n).get_weights(),
                                    ref.get_layer(n).get_weights()))
        rows.append(("two outputs, dict labels, tf_keras.Model, DistributedOptimizer (sgd); "
                     "loss column: global predictions", max(max_diff(got[k], want[1][k])
                                                            for k in want[1]),
                     max(dense, tables)))


def main():
    comm = get_communicator()
    rows = one_rank_rows() if comm.size == 1 else two_rank_rows()
    if comm.rank == 0:
        print("| path | ranks | max loss difference | max weight difference |")
        print("|---|---|---|---|")
        for name, loss, weight in rows:
            print(f"| {name} | {comm.size} | {loss if isinstance(loss, str) else f'{loss:.2e}'} "
                  f"| {weight if isinstance(weight, str) else f'{weight:.2e}'} |")


if __name__ == "__main__":
    main()
