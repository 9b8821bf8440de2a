"""Issue 19, part 4: restoring a checkpoint of ANOTHER model fails before anything is
loaded, in one line naming the difference (the layer, feature and field of an embedding
spec; the dense variable and its shapes), instead of a raw TF shape error and a flood of
warnings; ``train --model dcn`` on a DLRM checkpoint says so too."""
import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from conftest import REPO_ROOT
from tf_fusedemb.layers import FusedEmbedding
from tf_fusedemb.models import FusedModel
from tf_fusedemb.specs import FeatureSpec, OptimizerSpec, TableSpec
from tf_fusedemb.training import CheckpointManager

OPT = OptimizerSpec.adagrad(0.1)


def specs(dims=None, names=("a", "b", "c")):
    dims = dims or {}
    return [FeatureSpec(n, TableSpec(n, dims.get(n, 4), OPT)) for n in names]


def model_of(features, hidden=None):
    """A functional FusedModel (built: variables exist) with an optional hidden layer."""
    inputs = {f.name: tf_keras.Input([], dtype=tf.int64, name=f.name) for f in features}
    out = FusedEmbedding(features, name="emb")(inputs)
    x = tf_keras.layers.Concatenate()([out[f.name] for f in features])
    if hidden:
        x = tf_keras.layers.Dense(hidden, name="hidden")(x)
    model = FusedModel(inputs, tf_keras.layers.Dense(1, name="head")(x), name="m")
    model.compile(tf_keras.optimizers.Adagrad(0.1), "mse")
    return model


def dense_count(model):
    """Variables of the model outside its FusedEmbedding layer (weights, the loss tracker)."""
    own = {v.ref() for v in model.get_layer("emb").variables}
    return len([v for v in model.variables if v.ref() not in own])


def fit_once(model):
    x = {name: np.arange(8, dtype=np.int64) for name in model.input_names}
    model.fit(x, np.ones((8, 1), np.float32), batch_size=8, verbose=0)


@pytest.fixture(name="saved")
def fixture_saved(tmp_path):
    model = model_of(specs())
    fit_once(model)
    CheckpointManager(str(tmp_path), model, model.optimizer).save(1, {"data_position": 1})
    return str(tmp_path), model


def refused(directory, model, caplog):
    """The restore's ValueError text; asserts nothing was loaded and nothing warned."""
    layer = model.get_layer("emb")
    before = [int(g.store.table.size()) for g in layer.groups]
    weights = [w.copy() for w in model.get_weights()]
    with caplog.at_level(logging.WARNING):
        with pytest.raises(ValueError) as info:
            CheckpointManager(directory, model, model.optimizer).restore()
    text = str(info.value)
    assert "\n" not in text, text  # one line
    assert [int(g.store.table.size()) for g in layer.groups] == before  # no row loaded
    for got, want in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(got, want)
    assert not [r for r in caplog.records if "checkpoint" in r.getMessage().lower()], \
        [r.getMessage() for r in caplog.records]
    return text


def test_the_same_model_restores(saved):
    directory, trained = saved
    again = model_of(specs())
    meta = CheckpointManager(directory, again, again.optimizer).restore()
    assert meta["state"] == {"data_position": 1}
    np.testing.assert_array_equal(again.get_layer("head").kernel, trained.get_layer("head").kernel)
    np.testing.assert_array_equal(again.get_layer("emb").groups[0].store.table.export()["values"],
                                  trained.get_layer("emb").groups[0].store.table.export()["values"])


def test_another_dense_model_names_the_variable_and_shapes(saved, caplog):
    directory, trained = saved
    other = model_of(specs(), hidden=3)
    text = refused(directory, other, caplog)
    counts = [dense_count(m) for m in (trained, other)]
    assert counts[1] == counts[0] + 2  # the hidden layer's kernel and bias
    assert ("holds the dense variables of another model (FunctionalFusedModel 'm', "
            f"{counts[0]} dense variables; this is FunctionalFusedModel 'm', {counts[1]})"
            ) in text, text
    assert ("dense variable 0 is 'head/kernel:0' float32[12, 1] in the checkpoint, "
            "'hidden/kernel:0' float32[12, 3] in the model") in text, text


@pytest.mark.parametrize("change,expected", [
    ("removed", "features only in the checkpoint ['c'], only in the model []"),
    ("added", "features only in the checkpoint [], only in the model ['d']"),
    ("dim", "specs differ for ['b'] (feature 'b': table.dim 4 in the checkpoint, 8 in the "
            "model)"),
])
def test_another_embedding_spec_names_the_feature_and_field(saved, caplog, change, expected):
    directory, _ = saved
    features = {"removed": specs(names=("a", "b")), "added": specs(names=("a", "b", "c", "d")),
                "dim": specs({"b": 8})}[change]
    text = refused(directory, model_of(features), caplog)
    assert text.startswith(f"checkpoint {directory}/ckpt-1 was written with another "
                           "embedding spec for FusedEmbedding layer 'emb': "), text
    assert expected in text, text


def test_checkpoints_of_older_versions_still_name_the_dense_shapes(saved, caplog):
    """Before this change meta.json held no plan or variable list: the dense shapes come
    from the checkpoint itself (names unknown there)."""
    directory, _ = saved
    path = os.path.join(directory, "ckpt-1", "meta.json")
    with open(path) as f:
        meta = json.load(f)
    for key in ("plan_specs", "model", "dense"):
        meta.pop(key)
    with open(path, "w") as f:
        json.dump(meta, f)
    text = refused(directory, model_of(specs(), hidden=3), caplog)
    assert ("dense variable 0 is '#0' [12, 1] in the checkpoint, 'hidden/kernel:0' "
            "float32[12, 3] in the model") in text, text
    text = refused(directory, model_of(specs({"b": 8})), caplog)
    assert "was written with other fusion plans" in text, text


@pytest.mark.timeout(300)
def test_train_with_another_model_on_a_dlrm_checkpoint(tmp_path):
    """The issue's case: ``train --model dcn`` where a DLRM run left its checkpoint."""
    args = ["--data", "synthetic", "--steps", "2", "--batch-size", "32", "--rows", "256",
            "--eval-rows", "64", "--dim", "4", "--checkpoint-dir", str(tmp_path / "ckpt")]
    env = dict(os.environ, TF_USE_LEGACY_KERAS="1", TF_CPP_MIN_LOG_LEVEL="2")

    def train(model):
        return subprocess.run([sys.executable, "-m", "tf_fusedemb.train", "--model", model]
                              + args, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                              timeout=240)
    first = train("dlrm")
    assert first.returncode == 0, first.stderr[-3000:]
    second = train("dcn")
    assert second.returncode != 0
    errors = second.stderr.strip().splitlines()
    assert errors[-1].startswith(f"tf_fusedemb.train: cannot resume from {tmp_path}/ckpt: "
                                 f"checkpoint {tmp_path}/ckpt/ckpt-2 holds the dense "
                                 "variables of another model (DLRM 'dlrm'"), errors[-1]
    assert "this is DCNv2 'dcn_v2'" in errors[-1] and "dense variable 0 is" in errors[-1]
    assert errors[-1].endswith("(`make train FRESH=1` starts afresh)")
    assert not [l for l in errors if "WARNING" in l or "Traceback" in l], errors
