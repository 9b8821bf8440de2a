"""The model, the changes and the state read-out of the incremental-checkpoint tests
(tests/test_incremental_checkpoint.py and its 2-rank worker).

The model is built as users build theirs (unseeded Dense, functional or subclassed): one
fused engine group ("u" with a TTL eviction, "i"), optionally tiered, and one static
table ("s", stored as arrays, written in full by every save). ``change`` alters the
tables in every way a row or a key changes: training (rows, slots, statistics; TTL
evictions), ``load_rows``, ``set_embedding_weights``, ``remove`` (rows) and the
statistics' ``remove`` (whole keys). ``state`` reads out everything a checkpoint holds.
"""
from typing import Dict, Optional

import numpy as np
import tensorflow as tf
import tf_keras

from tf_fusedemb.layers import FusedEmbedding
from tf_fusedemb.models import FusedModel
from tf_fusedemb.specs import EvictionPolicy, FeatureSpec, OptimizerSpec, TableSpec
from tf_fusedemb.training.replicas import dense_variables

DIM = 4
STATIC_VOCAB = 30


def bce(y, logits):
    return tf_keras.losses.binary_crossentropy(y, logits, from_logits=True)


def specs(budget: Optional[int] = None, spill_dir: Optional[str] = None):
    def engine_table(name, **kw):
        return TableSpec(name, DIM, OptimizerSpec.adagrad(0.3), memory_budget_bytes=budget,
                         spill_dir=spill_dir, **kw)
    return [FeatureSpec("u", engine_table("u", eviction=EvictionPolicy(ttl_steps=3))),
            FeatureSpec("i", engine_table("i")),
            FeatureSpec("s", TableSpec("s", DIM, OptimizerSpec.sgd(0.1),
                                       vocabulary_size=STATIC_VOCAB))]


class Subclassed(FusedModel):
    """The subclassed way: layers in __init__, call() joins them."""

    def __init__(self, budget=None, spill_dir=None):
        super().__init__()
        self.emb = FusedEmbedding(specs(budget, spill_dir))
        self.head = tf_keras.layers.Dense(1)

    def call(self, inputs, training=False):
        out = self.emb(inputs)
        return self.head(tf.concat([out["u"], out["i"], out["s"]], axis=1))


def build(budget: Optional[int] = None, spill_dir: Optional[str] = None,
          subclassed: bool = False):
    """(model, layer), compiled, its variables and the optimizer's built (a restore
    fills them)."""
    if subclassed:
        model = Subclassed(budget, spill_dir)
        layer = model.emb
    else:
        layer = FusedEmbedding(specs(budget, spill_dir))
        inputs = {n: tf_keras.Input([], dtype=tf.int64, name=n) for n in "uis"}
        out = layer(inputs)
        logits = tf_keras.layers.Dense(1)(tf_keras.layers.Concatenate()([out[n] for n in "uis"]))
        model = FusedModel(inputs, logits)
    model.compile(optimizer=tf_keras.optimizers.Adagrad(0.1), loss=bce)
    model({n: tf.zeros([0], tf.int64) for n in "uis"})
    model.optimizer.build(model.trainable_variables)
    return model, layer


def data(seed: int, n: int, low: int, high: int):
    rng = np.random.default_rng(seed)
    x = {"u": rng.integers(low, high, n), "i": rng.integers(0, 60, n),
         "s": rng.integers(0, STATIC_VOCAB, n)}
    return x, rng.integers(0, 2, (n, 1)).astype(np.float32)


def fit(model, seed: int, low: int, high: int, n: int = 64) -> None:
    """Trains on ``n`` samples of IDs ``u`` in [low, high) (8 steps of 8 samples)."""
    x, y = data(seed, n, low, high)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)


def engine_group(layer):
    return next(g for g in layer.groups if "u" in g.table_names)


def change(model, layer, phase: int) -> None:
    """Phase ``phase``'s changes (0, 1, 2, ...): training on IDs that move up, so older
    ``u`` keys are evicted by TTL; rows loaded by ``load_rows`` and
    ``set_embedding_weights``; rows removed; keys forgotten. The same on every rank (a
    collective where it has to be)."""
    fit(model, 100 + phase, 40 * phase, 40 * phase + 60)
    group = engine_group(layer)
    rng = np.random.default_rng(200 + phase)
    ids = np.arange(1000 + 10 * phase, 1010 + 10 * phase)
    group.store.load_rows("u", ids, rng.normal(size=(len(ids), DIM)).astype(np.float32))
    if phase % 2:
        weights = rng.normal(size=(20, DIM)).astype(np.float32)
        layer.set_embedding_weights({"i": weights})
    stored = group.store.table.export()["keys"].numpy()
    if len(stored) > 3:
        group.store.table.remove(tf.constant(stored[:3]))  # rows go, statistics stay
        group.store.statistics.remove(stored[1:3])  # then two of them go entirely


def optimizer_variables(model):
    variables = model.optimizer.variables
    return list(variables() if callable(variables) else variables)


def state(model, layer) -> Dict[str, np.ndarray]:
    """Everything a checkpoint holds of this rank, as arrays by name: per group its step,
    every engine block (key, row, slots, statistics) or the static table's rows and
    statistics; the dense variables and the optimizer's."""
    out: Dict[str, np.ndarray] = {}
    for g in layer.groups:
        name = g.group.name
        out[f"{name}/step"] = g.store.table.step.numpy()
        engine = getattr(g.store.table, "engine", None)
        if engine is not None:
            e = engine.export(stored_only=False, with_rows=True)
            out.update({f"{name}/keys": e.keys.numpy(), f"{name}/values": e.values.numpy(),
                        f"{name}/slots": e.slots.numpy()})
            out.update({f"{name}/{f}": getattr(e.fields, f).numpy() for f in e.fields._fields})
        else:
            out.update({f"{name}/{k}": v.numpy() for k, v in g.store.table.export().items()})
            out.update({f"{name}/stats/{k}": v for k, v in g.store.statistics.export().items()})
    # What a checkpoint holds of the dense side (not the layers' per-batch counters).
    out.update({f"dense/{i}": v.numpy() for i, v in enumerate(dense_variables(model))})
    out.update({f"optimizer/{i}": v.numpy() for i, v in enumerate(optimizer_variables(model))})
    return out


def assert_same(got: Dict[str, np.ndarray], want: Dict[str, np.ndarray], what: str) -> None:
    """Bit-identical: the same names, shapes, dtypes and bytes."""
    assert sorted(got) == sorted(want), what
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=f"{what}: {k}")
        assert got[k].dtype == want[k].dtype, f"{what}: {k}"
