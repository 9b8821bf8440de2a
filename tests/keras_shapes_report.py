"""The model-shape table: each shape of tests/keras_shapes.py, converted by ``fuse_model``
and trained in tf_keras and in Keras 3, against the same model in plain Keras from the same
weights: the largest per-batch loss difference and weight difference (table rows and
dense weights), as a Markdown table; then the error a layer of one Keras raises in a
model of the other.

    TF_USE_LEGACY_KERAS=1 python tests/keras_shapes_report.py                   # one process
    TF_USE_LEGACY_KERAS=1 horovodrun -np 2 --gloo -H localhost:2 \
        python tests/keras_shapes_report.py                                     # 2 ranks

(TF_USE_LEGACY_KERAS=1 for tensorflow-recommenders, which needs tf.keras to be tf_keras;
the Keras 3 rows use ``import keras``, Keras 3 either way.)

On N ranks rank 0 draws the initial weights and computes the reference (plain Keras on the
global batches, in its own process: no collective; the other ranks build it too, so that
Keras names the layers alike); every rank trains its share of each global batch of
N * BATCH rows. tests/test_keras_shapes.py asserts the same comparisons.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402  (Keras 3; no TFRA in this process)
import tf_keras  # noqa: E402

import keras_shapes as ks  # noqa: E402
from tf_fusedemb.comm import get_communicator  # noqa: E402


def shape_rows(comm):
    """(shape, Keras, loss difference, weight difference) of every shape in both Kerases."""
    rows = []
    mine = np.arange(ks.ROWS).reshape(-1, comm.size, ks.BATCH)[:, comm.rank].reshape(-1)
    for k in (tf_keras, keras):
        # each example package's shape in the Keras it is written for
        other = "keras_rs_dlrm_layers" if k is tf_keras else "tfrs_model_ranking"
        for name in ks.installed(n for n in ks.SHAPES if n != other):
            # every rank builds (and trains) the reference, so that Keras names the layers
            # alike on every rank; rank 0's draw and result are the ones compared with
            want = ks.reference(k, name, comm.size * ks.BATCH)
            initial = comm.allgather_object(want[0])[0]
            try:
                run = ks.converted_run(k, name, initial, mine, ks.BATCH)
            except Exception as e:  # pylint: disable=broad-except  # reported, not hidden
                runs, error = comm.allgather_object(None), f"{type(e).__name__}: {e}"
            else:
                runs, error = comm.allgather_object(run), None
            if comm.rank == 0:
                diffs = ks.max_diffs(runs, want[1], want[2]) if error is None else None
                rows.append((name, "tf_keras" if k is tf_keras else f"Keras {keras.__version__}",
                             diffs["loss"] if diffs else error.splitlines()[0][:160],
                             diffs["weights"] if diffs else ""))
    return rows


def error_rows():
    """(case, message) of each layer class called on the other Keras's Input."""
    from tf_fusedemb import keras3, layers  # pylint: disable=import-outside-toplevel
    from tf_fusedemb.specs import FeatureSpec, OptimizerSpec, TableSpec  # pylint: disable=import-outside-toplevel
    feature = FeatureSpec("a", TableSpec("a", 2, OptimizerSpec.sgd(0.1), vocabulary_size=9))
    rows = []
    for module, k in ((layers, keras), (keras3, tf_keras)):
        ids = k.Input((), dtype="int64", name="a")
        for layer, call in ((module.FusedEmbedding([feature]), {"a": ids}),
                            (module.ShardedEmbedding(feature), ids)):
            try:
                layer(call)
                rows.append((f"{module.__name__}.{type(layer).__name__}", "no error"))
            except TypeError as e:
                rows.append((f"{module.__name__}.{type(layer).__name__} on a "
                             f"{'Keras 3' if k is keras else 'tf_keras'} Input", str(e)))
    return rows


def main():
    comm = get_communicator()
    rows = shape_rows(comm)
    if comm.rank != 0:
        return
    print("| shape | Keras | ranks | max loss difference | max weight difference |")
    print("|---|---|---|---|---|")
    for name, k, loss, weight in rows:
        show = [v if isinstance(v, str) else f"{v:.2e}" for v in (loss, weight)]
        print(f"| {name} | {k} | {comm.size} | {show[0]} | {show[1]} |")
    if comm.size == 1:
        print("\n| layer called in a model of the other Keras | error |\n|---|---|")
        for case, message in error_rows():
            print(f"| {case} | {message} |")


if __name__ == "__main__":
    main()
