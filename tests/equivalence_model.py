"""A small mixed-feature model, its data, and an independent single-process reference.

Features: two one-hot features with equal ID ranges (a, b), a multi-hot mean-pooled one
(c) and a sequence (s) in two dynamic groups with different dims and optimizers, and a
static-vocabulary group (e) whose IDs are all owned by rank 0, so other ranks receive no
keys for it. The reference keeps one ordinary tf.Variable table per feature and uses only
plain TF ops (gather, ragged reductions), the numpy initializer mirror and the row
optimizers (themselves tested against tf_keras).
"""
import numpy as np
import tensorflow as tf
import tf_keras

from tf_fusedemb.ops import hashing
from tf_fusedemb.specs import FeatureSpec, InitializerSpec, OptimizerSpec, TableSpec

VOCAB = {"a": 40, "b": 40, "c": 30, "s": 20, "d": 25, "e": 64}
MAX_LEN = 5
GLOBAL_BATCH = 12


def feature_specs(storage=None):
    """The model's features; ``storage`` is the dynamic tables' backend (TableSpec.storage,
    None: the default)."""
    t8 = dict(dim=8, optimizer=OptimizerSpec.adagrad(0.1),
              initializer=InitializerSpec.uniform(-0.1, 0.1), storage=storage)
    t4 = dict(dim=4, optimizer=OptimizerSpec.adam(0.01),
              initializer=InitializerSpec.normal(0.0, 0.1), storage=storage)
    return [
        FeatureSpec("a", TableSpec("a", **t8), "sum"),
        FeatureSpec("s", TableSpec("s", **t4), None, max_len=MAX_LEN),
        FeatureSpec("b", TableSpec("b", **t8), "sum"),
        FeatureSpec("c", TableSpec("c", **t8), "mean"),
        FeatureSpec("d", TableSpec("d", **t4), "sum"),
        FeatureSpec("e", TableSpec("e", dim=4, optimizer=OptimizerSpec.sgd(0.2),
                                   initializer=InitializerSpec.uniform(-0.1, 0.1),
                                   vocabulary_size=VOCAB["e"]), "sum"),
    ]


def rank0_ids():
    """IDs of table e owned by rank 0 on 1, 2, 3 (and 6) ranks: mix64(id) % 6 == 0, so the
    data does not depend on the world size."""
    ids = np.arange(VOCAB["e"])
    return ids[hashing.owner_rank(ids, 6) == 0]


def global_batch(step):
    """Deterministic global batch of a step: (features as numpy/lists, labels float[G, 1])."""
    rng = np.random.default_rng(1000 + step)
    g = GLOBAL_BATCH
    hot = rng.integers(0, 5, g)  # hot IDs shared by consecutive batches and features
    feats = {
        "a": np.where(rng.random(g) < 0.5, hot, rng.integers(0, VOCAB["a"], g)),
        "b": np.where(rng.random(g) < 0.5, hot, rng.integers(0, VOCAB["b"], g)),
        "c": [list(rng.integers(0, VOCAB["c"], rng.integers(0, 5))) for _ in range(g)],
        "s": [list(rng.integers(0, VOCAB["s"], rng.integers(0, MAX_LEN + 1))) for _ in range(g)],
        "d": rng.integers(0, VOCAB["d"], g),
        "e": rng.choice(rank0_ids(), g),
    }
    labels = (rng.random((g, 1)) < 0.4).astype(np.float32)
    return feats, labels


def rank_slice(step, rank, num_ranks, empty_step=None):
    """[lo, hi) of the global batch fed to ``rank``; at ``empty_step`` the last rank
    gets no samples (an empty batch)."""
    n = num_ranks if empty_step != step or num_ranks == 1 else num_ranks - 1
    bounds = np.linspace(0, GLOBAL_BATCH, n + 1).astype(int)
    if rank >= n:
        return GLOBAL_BATCH, GLOBAL_BATCH
    return bounds[rank], bounds[rank + 1]


def to_tensors(feats, labels, lo, hi):
    """Slice [lo, hi) of a global batch as model inputs (ragged for c and s)."""
    out = {}
    for name, value in feats.items():
        part = value[lo:hi]
        if isinstance(value, list):
            out[name] = tf.ragged.constant(part, dtype=tf.int64, ragged_rank=1) if part else \
                tf.RaggedTensor.from_row_splits(tf.zeros([0], tf.int64), [0])
        else:
            out[name] = tf.constant(np.asarray(part, np.int64))
    return out, tf.constant(labels[lo:hi])


def make_head():
    """The dense part, deterministic across processes (seeded initializers)."""
    return [tf_keras.layers.Dense(8, activation="relu",
                                  kernel_initializer=tf_keras.initializers.GlorotUniform(seed=1)),
            tf_keras.layers.Dense(1, kernel_initializer=tf_keras.initializers.GlorotUniform(seed=2))]


def head_forward(head, emb):
    """Pooled features and the sequence (summed over positions) -> logits [B, 1]."""
    x = tf.concat([emb["a"], emb["b"], emb["c"], tf.reduce_sum(emb["s"], axis=1), emb["d"],
                   emb["e"]], axis=1)
    for layer in head:
        x = layer(x)
    return x


def bce(y, logits):
    return tf_keras.losses.binary_crossentropy(y, logits, from_logits=True)


class Reference:
    """One ordinary table per feature, plain TF ops, single process, global batches."""

    def __init__(self, specs):
        from tf_fusedemb.storage.initializers import init_rows_np
        from tf_fusedemb.storage.optimizers import RowOptimizer
        self.specs = {f.name: f for f in specs}
        self.tables, self.slots, self.opt = {}, {}, {}
        for name, f in self.specs.items():
            keys = hashing.hashed_unified_keys(np.arange(VOCAB[name]), [name] * VOCAB[name])
            self.tables[name] = tf.Variable(init_rows_np(keys, f.dim, f.table.initializer))
            self.opt[name] = RowOptimizer.from_spec(f.table.optimizer)
            slots = self.opt[name].initial_slots(VOCAB[name], f.dim)
            self.slots[name] = {k: tf.Variable(v) for k, v in slots.items()}
        self.step = 0
        self.head = make_head()
        self.dense_opt = tf_keras.optimizers.SGD(0.05)

    def lookup(self, x):
        out = {}
        for name in ("a", "b", "d", "e"):
            out[name] = tf.gather(self.tables[name], x[name])
        c = tf.ragged.map_flat_values(tf.gather, self.tables["c"], x["c"])
        count = tf.cast(x["c"].row_lengths(), tf.float32)[:, None]
        out["c"] = tf.reduce_sum(c, axis=1) / tf.maximum(count, 1.0)
        s = tf.ragged.map_flat_values(tf.gather, self.tables["s"], x["s"])
        out["s"] = s.to_tensor(shape=[None, MAX_LEN, self.specs["s"].dim])
        return out

    def train_step(self, x, y):
        self.step += 1
        with tf.GradientTape() as tape:
            logits = head_forward(self.head, self.lookup(x))
            loss = tf.reduce_mean(bce(y, logits))
        names = list(self.tables)
        dense_vars = [v for layer in self.head for v in layer.trainable_variables]
        grads = tape.gradient(loss, dense_vars + [self.tables[n] for n in names])
        self.dense_opt.apply_gradients(zip(grads[:len(dense_vars)], dense_vars))
        for name, g in zip(names, grads[len(dense_vars):]):
            if g is None:
                continue
            rows, idx = tf.unique(tf.cast(g.indices, tf.int64))
            summed = tf.math.unsorted_segment_sum(g.values, idx, tf.size(rows))
            slots = {k: tf.gather(v, rows) for k, v in self.slots[name].items()}
            new_rows, new_slots = self.opt[name].apply(
                tf.gather(self.tables[name], rows), slots, summed, tf.constant(self.step, tf.int64))
            self.tables[name].scatter_nd_update(rows[:, None], new_rows)
            for k, v in new_slots.items():
                self.slots[name][k].scatter_nd_update(rows[:, None], v)
        return float(loss)

    def dense_weights(self):
        return [v.numpy() for layer in self.head for v in layer.trainable_variables]


def clustered(feats, labels, lo, hi, num_micro_batches):
    """The global batch with rows [lo, hi) reordered by key-centric clustering (the
    rank's samples stay the same set: only their order inside the slice changes)."""
    from tf_fusedemb.pipeline.clustering import cluster_permutation
    part = {n: v[lo:hi] for n, v in feats.items()}
    perm = lo + np.asarray(cluster_permutation(part, num_micro_batches), np.int64)
    order = np.concatenate([np.arange(lo), perm, np.arange(hi, GLOBAL_BATCH)])
    out = {n: (np.asarray(v)[order] if not isinstance(v, list) else [v[i] for i in order])
           for n, v in feats.items()}
    return out, labels[order]
