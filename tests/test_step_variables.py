"""A training step is traced once: ``create_step_variables`` makes the model's and the
optimizer's variables before the first trace (TensorFlow traces a function twice when
its first trace creates variables), with the values the first trace would have given
them. Checked against a plain ``tf.function`` step that creates them itself (traced
twice), and through ``FusedModel.fit`` and a pipeline, whose step functions call it (the
pipeline's first step runs the trace of the steps after it)."""
import numpy as np
import pytest
import tensorflow as tf
import tf_keras
from tensorflow.python.framework import func_graph

from tf_fusedemb.layers import FusedEmbedding
from tf_fusedemb.models import FusedModel
from tf_fusedemb.pipeline import PipelineOptions, make_pipeline
from tf_fusedemb.specs import FeatureSpec, OptimizerSpec, TableSpec
from tf_fusedemb.training import create_step_variables, train_step


def _specs():
    return [FeatureSpec(n, TableSpec(n, 4, OptimizerSpec.adagrad(0.1), vocabulary_size=50))
            for n in ("u", "v")]


class _Net(tf_keras.Model):  # subclassed and unseeded, as users write them
    def __init__(self):
        super().__init__()
        self.emb = FusedEmbedding(_specs())
        self.hidden = tf_keras.layers.Dense(8, activation="relu")
        self.out = tf_keras.layers.Dense(1)

    def call(self, x, training=False):
        e = self.emb(x)
        return self.out(self.hidden(tf.concat([e["u"], e["v"]], 1)))


def _batches(n, b=16):
    rng = np.random.default_rng(1)
    return [({"u": tf.constant(rng.integers(0, 50, b), tf.int64),
              "v": tf.constant(rng.integers(0, 50, b), tf.int64)},
             tf.constant(rng.integers(0, 2, (b, 1)), tf.float32)) for _ in range(n)]


_LOSS = tf_keras.losses.BinaryCrossentropy(from_logits=True)


def _losses(model, optimizer, prepare):
    step = tf.function(lambda x, y: train_step(model, x, y, _LOSS, optimizer).loss,
                       autograph=False)
    batches = _batches(4)
    if prepare:
        create_step_variables(model, optimizer, batches[0][0])
    return [float(step(x, y)) for x, y in batches], step.experimental_get_tracing_count()


def test_the_step_is_traced_once_and_trains_as_when_its_trace_made_the_variables():
    plain, prepared = _Net(), _Net()
    batch = _batches(1)[0][0]
    plain(batch)  # both built, then given the same weights (the rows are deterministic)
    prepared(batch)
    prepared.set_weights(plain.get_weights())
    want, plain_traces = _losses(plain, tf_keras.optimizers.Adam(0.01), prepare=False)
    got, traces = _losses(prepared, tf_keras.optimizers.Adam(0.01), prepare=True)
    assert plain_traces == 2, "the control: slots made by the first trace cost a second"
    assert traces == 1
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_an_unbuilt_model_and_a_legacy_optimizer_are_built_first():
    model, optimizer = _Net(), tf_keras.optimizers.legacy.Adagrad(0.1)
    x = _batches(1)[0][0]
    create_step_variables(model, optimizer, x)
    assert model.built and len(model.trainable_variables) == 5  # 2 Dense + the row marker
    assert len(optimizer.variables()) == 1 + 5  # iterations + one accumulator each
    create_step_variables(model, optimizer, x)  # again: nothing new
    assert len(optimizer.variables()) == 6


@pytest.fixture
def traced_names(monkeypatch):
    """The names of the graphs TensorFlow traces from now on, in order."""
    names = []
    init = func_graph.FuncGraph.__init__

    def recording(self, name, *args, **kwargs):
        init(self, name, *args, **kwargs)
        names.append(name)
    monkeypatch.setattr(func_graph.FuncGraph, "__init__", recording)
    return names


def test_fit_traces_its_training_step_once(traced_names):
    inputs = {n: tf_keras.Input((), dtype=tf.int64, name=n) for n in ("u", "v")}
    e = FusedEmbedding(_specs())(inputs)
    model = FusedModel(inputs, tf_keras.layers.Dense(1)(tf.concat([e["u"], e["v"]], 1)))
    model.compile(optimizer=tf_keras.optimizers.Adagrad(0.1), loss=_LOSS)
    data = tf.data.Dataset.from_tensor_slices(
        ({k: tf.concat([b[0][k] for b in _batches(3)], 0) for k in ("u", "v")},
         tf.concat([b[1] for b in _batches(3)], 0))).batch(16)
    history = model.fit(data, epochs=2, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    assert traced_names.count("_train_core") == 1, traced_names


def test_a_pipelined_step_is_traced_once_per_kind_of_step(traced_names):
    model, optimizer = _Net(), tf_keras.optimizers.Adagrad(0.1)
    pipeline = make_pipeline(model, _LOSS, optimizer, PipelineOptions.parse("dbp,fwp=2"))
    losses = [float(loss) for loss, _ in pipeline.run(_batches(4))]
    assert len(losses) == 4 and np.all(np.isfinite(losses))
    # Every step runs one trace: the first skips the dense update it is given (no step
    # before it left one), the last prefetches an empty batch (there is no next one).
    assert traced_names.count("_step") == 1, traced_names
