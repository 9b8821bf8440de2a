"""Communication counters, the single-process communicator, FusedModel.fit and its
counters callback."""
import numpy as np
import tensorflow as tf
import tf_keras

from tf_fusedemb.comm import CommCounters, LocalCommunicator
from tf_fusedemb.layers import FusedEmbedding
from tf_fusedemb.models import CommCountersLogger, FusedModel
from tf_fusedemb.models.fused_model import SparseTrainingMixin
from tf_fusedemb.specs import FeatureSpec, InitializerSpec, OptimizerSpec, TableSpec


def test_counters_record_only_traffic_to_other_ranks():
    c = CommCounters("g")
    c.record(tf.constant([3, 5, 0], tf.int32), tf.constant([3, 2, 4], tf.int32),
             tf.zeros([0, 16], tf.float32), rank=0)  # rows of 64 bytes
    c.record(tf.constant([1, 1, 1], tf.int32), tf.constant([0, 0, 0], tf.int32),
             tf.zeros([0, 2, 2], tf.bfloat16), rank=0)  # rows of 8 bytes
    snap = c.snapshot()
    assert snap == {"rounds": 2, "bytes_sent": 5 * 64 + 2 * 8,
                    "bytes_received": 6 * 64, "messages": 1 + 2}
    per = CommCounters.per_step({k: 0 for k in snap}, snap, steps=2)
    assert per["rounds"] == 1 and per["mean_message_bytes"] == (5 * 64 + 16) / 3


def test_local_communicator_is_the_identity():
    comm = LocalCommunicator()
    x = tf.constant([[1.0, 2.0]])
    got, splits = comm.alltoall(x, tf.constant([1]), "t")
    np.testing.assert_array_equal(got, x)
    np.testing.assert_array_equal(splits, [1])
    assert comm.allgather_object({"a": 1}) == [{"a": 1}]


def _model():
    table = TableSpec("t", 4, OptimizerSpec.adagrad(0.5), InitializerSpec.uniform(-0.1, 0.1))
    layer = FusedEmbedding([FeatureSpec("u", table), FeatureSpec("v", TableSpec(
        "t2", 4, OptimizerSpec.adagrad(0.5), InitializerSpec.uniform(-0.1, 0.1)), "mean")])
    inputs = {"u": tf_keras.Input([], dtype=tf.int64, name="u"),
              "v": tf_keras.Input([None], dtype=tf.int64, ragged=True, name="v")}
    emb = layer(inputs)
    out = tf_keras.layers.Dense(1)(tf_keras.layers.Concatenate()([emb["u"], emb["v"]]))
    return FusedModel(inputs, out), layer


def test_functional_fused_model_fits_and_learns():
    tf_keras.utils.set_random_seed(0)  # fit() shuffles: a fixed order, a reproducible result
    model, layer = _model()
    model.compile(optimizer=tf_keras.optimizers.Adagrad(0.1),
                  loss=tf_keras.losses.BinaryCrossentropy(from_logits=True),
                  metrics=[tf_keras.metrics.AUC(name="auc")])
    rng = np.random.default_rng(0)
    u = rng.integers(0, 50, 512)
    v = tf.ragged.constant([list(rng.integers(0, 20, rng.integers(1, 4))) for _ in range(512)],
                           tf.int64)
    y = (u % 2).astype(np.float32)[:, None]  # learnable only through the u embeddings
    logger = CommCountersLogger(log_every=0)
    history = model.fit({"u": u, "v": v}, y, batch_size=64, epochs=6, verbose=0,
                        callbacks=[logger])
    losses = history.history["loss"]
    assert losses[-1] < 0.5 * losses[0], losses
    assert history.history["auc"][-1] > 0.95
    # Single process: no AlltoAll is made, and the callback says so in the logs.
    assert history.history["a2a_rounds"][-1] == 0
    # u and v share a spec, so they were fused into one group: 50 u IDs + 20 v IDs.
    assert len(layer.groups) == 1
    assert layer.groups[0].store.table.size().numpy() == 50 + 20


def test_functional_use_does_not_turn_later_subclasses_functional():
    # Keras rewrites the bases of a Model subclass used functionally; FusedModel must
    # keep working as a base class afterwards (DLRM, DCNv2, ... subclass it).
    model, _ = _model()
    assert isinstance(model, SparseTrainingMixin)

    class Sub(FusedModel):
        def __init__(self):
            super().__init__(name="sub")
            self.dense = tf_keras.layers.Dense(1)

        def call(self, x):
            return self.dense(x)
    assert Sub()(tf.ones([2, 3])).shape == (2, 1)
