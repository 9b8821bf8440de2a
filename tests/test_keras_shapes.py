"""Model shapes users write, converted by ``fuse_model``, train exactly like the same
model in plain tf_keras from the same weights, on one rank and on two: a single output
given as a dict (dict labels, AUC), ``StringLookup`` vocabularies of numpy bytes,
``Sequential([StringLookup, Embedding])`` blocks in a functional model, and the shapes of
public examples (TensorFlow Recommenders' ranking and DCN models, TFRA's MovieLens demo, a
keras-rs DLRM), written from their shapes (tests/keras_shapes.py). Per-batch losses and
every weight (table rows, dense variables) to 1e-5; the rows must move.

The same shapes in Keras 3, and a layer of one Keras called in a model of the other, are
in tests/keras3_shapes_checks.py, run in a fresh process (as the Keras 3 paths are)."""
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import tf_keras

import keras_shapes as ks
from tf_fusedemb.testing import DistributedTestCase

TOL = 1e-5


def assert_exact(diffs, name):
    assert diffs["loss"] <= TOL and diffs["weights"] <= TOL, (name, diffs)


def assert_rows_moved(k, name, initial, trained):
    """The reference's tables moved: a fused model whose rows stood still would differ."""
    model = ks.built(k, name, initial)
    start = [l.get_weights() for l in ks.leaves(model) if l.get_weights()]
    tables = [i for i, (_, emb) in enumerate(ks.with_weights(model, k)) if emb]
    assert tables, name
    for i in tables:
        assert np.abs(trained[i][0] - start[i][0]).max() > 1e-4, (name, i)


@pytest.mark.parametrize("name", ks.TF_KERAS_SHAPES)
def test_shape_trains_like_plain_tf_keras(name):
    if name in ks.PACKAGES:
        pytest.importorskip(ks.PACKAGES[name])
    initial, losses, trained = ks.reference(tf_keras, name, ks.BATCH)
    assert_rows_moved(tf_keras, name, initial, trained)
    assert_exact(ks.max_diffs([ks.converted_run(tf_keras, name, initial)], losses, trained),
                 name)


@pytest.mark.parametrize("name", ["bytes_vocabulary", "nested_blocks"])
def test_converted_model_shares_nothing_and_keeps_vocabularies(name):
    """The converted functional model holds new layers and variables; its lookup layers
    hold the original's vocabularies (given as numpy bytes) and give the same IDs."""
    original = ks.built(tf_keras, name)
    converted = ks.fuse(tf_keras, original)
    assert not {id(v) for v in original.weights} & {id(v) for v in converted.weights}
    old, new = ks.leaves(original), ks.leaves(converted)
    assert not {id(l) for l in old} & {id(l) for l in new}
    lookups = {l.name: l for l in new if isinstance(l, tf_keras.layers.StringLookup)}
    x, _ = ks.shape_data(name)
    for layer in old:
        if isinstance(layer, tf_keras.layers.StringLookup):
            assert layer.get_vocabulary() == lookups[layer.name].get_vocabulary()
            column = x["user_id"] if len(layer.get_vocabulary()) == len(ks.USERS) + 1 \
                else x["movie_title"]
            np.testing.assert_array_equal(lookups[layer.name](column), layer(column))


def test_sequential_block_called_twice_shares_its_table():
    """One Sequential block called on two inputs: two features of one table, fused."""
    block = tf_keras.Sequential([tf_keras.layers.StringLookup(vocabulary=ks.USERS,
                                                              mask_token=None),
                                 tf_keras.layers.Embedding(len(ks.USERS) + 1, ks.DIM)])
    inputs = [tf_keras.Input((), dtype="string") for _ in range(2)]
    model = tf_keras.Model(inputs, tf_keras.layers.Dot(axes=1)([block(i) for i in inputs]))
    converted = ks.fuse(tf_keras, model)
    x, _ = ks.data()
    pair = [x["user_id"], x["user_id"][::-1]]
    np.testing.assert_allclose(converted.predict(pair, verbose=0),
                               model.predict(pair, verbose=0), rtol=1e-6, atol=1e-7)
    (layer,) = [l for l in converted.layers if type(l).__name__ == "FusedEmbedding"]
    assert len(layer.features) == 2 and len(layer.plan.groups) == 1


def test_keras3_shapes_in_a_fresh_process():
    """tests/keras3_shapes_checks.py (the shapes in Keras 3 on 1 and 2 ranks, and the
    classes of one Keras in a model of the other) in a process of its own, without
    TF_USE_LEGACY_KERAS, as a Keras 3 program runs."""
    env = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(pathlib.Path(__file__).with_name("keras3_shapes_checks.py"))],
                         capture_output=True, text=True, timeout=840, env=env)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and " failed" not in out.stdout, out.stdout[-2000:]


class TwoRankShapesTest(DistributedTestCase):
    """Every shape on 2 ranks (each rank half of every global batch of 32 rows), in one
    2-rank job, equals plain tf_keras on the global batches in this process, with one
    exchange (3 AlltoAll rounds per step) per fused group: the subclassed models' tables
    too, their keys computed before the forward pass."""
    timeout = 600

    @pytest.mark.timeout(700)
    def test_shapes_on_two_ranks(self):
        names = ks.installed(ks.TF_KERAS_SHAPES)
        for name, diffs in ks.two_rank_diffs(self.run_ranks, tf_keras, names).items():
            assert_exact(diffs, name)
            assert diffs["rounds"] == ks.ROUNDS.get(name, 3), (name, diffs)
