"""The Criteo-shaped model of the lookup benchmark and its four embedding front ends.

* ``fused`` / ``unfused``: :class:`tf_fusedemb.layers.FusedEmbedding` with the planner's
  groups or ``unfused_plan``; trained by ``tf_fusedemb.models.train_step``.
* ``tfra``: one TFRA ``HvdAllToAllEmbedding`` per feature (:class:`TfraPerFeature`).
* ``tfra_fused``: one ``HvdAllToAllEmbedding`` per fused group with source-side category
  hashing and an extra category AlltoAll (:class:`TfraFusedEmbedding`).
TFRA variants train with :func:`tfra_train_step` (TFRA's own synchronous optimizer path).
"""
import tensorflow as tf
import tf_keras

from tf_fusedemb.benchmarks.lookup_data import CATEGORICAL, DENSE
from tf_fusedemb.ops import hashing
from tf_fusedemb.ops.key_messages import category_bits
from tf_fusedemb.specs import FeatureSpec, InitializerSpec, OptimizerSpec, TableSpec
from tf_fusedemb.training.replicas import replicas_of

DIM = 16
HIDDEN = (256, 128)
# Categories ride in the low bits of the extra exchange, access counts above them (the
# same packing as FusedEmbedding's key exchange, tf_fusedemb.layers.group_lookup).


def feature_specs(learning_rate, dim=DIM, storage=None):
    """26 one-hot Criteo features, one dynamic table each, Adagrad, uniform(-0.05, 0.05);
    ``storage``: the tables' backend (TableSpec.storage, None: the default)."""
    return [FeatureSpec(c, TableSpec(c, dim, OptimizerSpec.adagrad(learning_rate),
                                     InitializerSpec.uniform(-0.05, 0.05), storage=storage),
                        "sum")
            for c in CATEGORICAL]


class CriteoNet(tf_keras.Model):
    """embeddings (26 x [B, dim]) ++ dense [B, 13] -> hidden relu layers (default 256, 128)
    -> 1 logit.

    The dense layers use seeded initializers, so every rank and every variant starts from
    the same dense weights (the replicas must agree; the variants are then comparable)."""

    def __init__(self, embedding, seed=0, hidden=HIDDEN, dense_policy=None, **kwargs):
        """``dense_policy``: the hidden layers' Keras dtype policy (e.g. "mixed_bfloat16":
        bf16 matmuls, float32 weights); the logit stays float32, as Keras's mixed-precision
        guide asks, so the loss is float32."""
        super().__init__(**kwargs)
        self.embedding = embedding
        self.hidden = tuple(hidden)
        self.mlp = [tf_keras.layers.Dense(
            units, activation="relu" if units != 1 else None,
            kernel_initializer=tf_keras.initializers.GlorotUniform(seed=seed + i),
            bias_initializer="zeros", dtype=dense_policy if units != 1 else "float32")
            for i, units in enumerate(self.hidden + (1,))]

    def build_variables(self, optimizer):
        """Creates the dense weights and the optimizer's slots before the step is traced,
        so ``tf.function`` traces the step once instead of twice (a first trace that
        creates variables is thrown away; tracing these graphs takes tens of seconds)."""
        width = len(CATEGORICAL) * DIM + len(DENSE)
        for layer, units in zip(self.mlp, self.hidden + (1,)):
            layer.build((None, width))
            width = units
        optimizer.build(self.trainable_variables)
        replicas_of(self)  # the dense-state broadcast's flags (training.replicas)

    def call(self, x, training=False):
        embs = self.embedding({c: x[c] for c in CATEGORICAL})
        h = tf.concat([embs[c] for c in CATEGORICAL] + [x["dense"]], axis=1)
        for layer in self.mlp:
            h = layer(h)
        return h


def _tfra():
    import tensorflow_recommenders_addons as tfra  # optional: the TFRA baseline only # pylint: disable=import-outside-toplevel
    return tfra.dynamic_embedding


def _tfra_initializer():
    return tf_keras.initializers.RandomUniform(-0.05, 0.05)


class TfraPerFeature(tf_keras.layers.Layer):
    """The paper's TFRA baseline: one ``HvdAllToAllEmbedding`` per feature (TFRA's
    defaults: ``with_unique`` on the source, ``with_secondary_unique`` on the owner).
    Per feature and step: key AlltoAll + row AlltoAll forward, row-gradient AlltoAll
    backward = 3 rounds."""

    def __init__(self, dim=DIM, **kwargs):
        super().__init__(**kwargs)
        de = _tfra()
        self.tables = [de.keras.layers.HvdAllToAllEmbedding(
            embedding_size=dim, key_dtype=tf.int64, value_dtype=tf.float32,
            initializer=_tfra_initializer(), name=f"{self.name}_{c}") for c in CATEGORICAL]

    def call(self, inputs):
        return {c: t(tf.cast(inputs[c], tf.int64)) for c, t in zip(CATEGORICAL, self.tables)}


class TfraFusedEmbedding(tf_keras.layers.Layer):
    """FusedRec's TFRA-fused comparison scheme, per fused group of ``plan``:

    1. source side: the group's keys are concatenated and hashed WITH their category,
       ``H = mix64(id ^ tag(table))`` (``tf_fusedemb.ops.hashing.tf_mix64``, pure TF; the
       same unified key FusedEmbedding's owners compute, so a0 and b0 stay distinct);
    2. ONE ``tf.unique_with_counts`` over the hashed keys (the dedup; counts are free);
    3. the extra AlltoAll: for each unique key, ``count << 16 | category`` (int64) is
       partitioned with TFRA's own ``partition_fn`` and ``make_partition`` -- exactly the
       routing ``HvdVariable.__relocate_dense_feature__`` applies to the keys -- and sent
       with ``hvd.alltoall`` using the same splits, so the owner receives, aligned with the
       keys TFRA sends it, each key's category and access count. The owner records them
       as per-category access statistics (``category_accesses``), the information
       FusedEmbedding's key exchange carries for free;
    4. the unique hashed keys go through ONE ``HvdAllToAllEmbedding`` per group
       (``with_unique=False``: already unique; TFRA's owner-side secondary unique kept):
       TFRA's key AlltoAll, owner lookup, row AlltoAll (and its gradient AlltoAll);
    5. ``tf.gather`` by the unique inverse, split per feature.
    Per group and step: keys + categories + rows forward, row gradients backward = 4
    AlltoAll rounds.
    """

    def __init__(self, plan, hvd, dim=DIM, **kwargs):
        super().__init__(**kwargs)
        de = _tfra()
        self._hvd = hvd
        self.plan = plan
        self.tables, self._tags, self.category_accesses = [], [], []
        for g in plan.groups:
            self._tags.append(tf.constant(hashing.category_tags(f.table.name for f in g.features)))
            self.tables.append(de.keras.layers.HvdAllToAllEmbedding(
                with_unique=False, embedding_size=dim, key_dtype=tf.int64,
                value_dtype=tf.float32, initializer=_tfra_initializer(),
                name=f"{self.name}_{g.name}"))
            self.category_accesses.append(tf.Variable(
                tf.zeros([g.num_features], tf.int64), trainable=False,
                name=f"{g.name}_category_accesses"))

    def _send_categories(self, table, unique_keys, info, group_name):
        """The extra AlltoAll: ``info`` int64[u] to the owners of ``unique_keys``, with the
        splits TFRA's key exchange uses. Returns the received int64[r]."""
        # TFRA's own partitioning helper (not exported publicly): the exact routing of
        # HvdVariable.__relocate_dense_feature__.
        # pylint: disable=import-outside-toplevel
        from tensorflow_recommenders_addons.dynamic_embedding.python.ops import (
            dynamic_embedding_variable as devar)
        make_partition = devar.make_partition
        size = self._hvd.size()
        owners = table.params.partition_fn(unique_keys, size)  # TFRA's routing of the keys
        parts, _ = make_partition(info, owners, size)
        splits = tf.stack([tf.size(p) for p in parts], axis=0)
        received, _ = self._hvd.alltoall(tf.concat(parts, axis=0), splits=splits,
                                         name=f"tfra_fused/{group_name}/categories")
        return received

    def call(self, inputs):
        out = {}
        for g, table, tags, stats in zip(self.plan.groups, self.tables, self._tags,
                                         self.category_accesses):
            ids = [tf.cast(inputs[f.name], tf.int64) for f in g.features]
            lengths = tf.stack([tf.size(i) for i in ids])
            category = tf.repeat(tf.range(g.num_features, dtype=tf.int64), lengths)
            keys = tf.concat(ids, axis=0)
            hashed = tf.bitcast(hashing.tf_mix64(tf.bitwise.bitwise_xor(
                keys, tf.gather(tags, category))), tf.int64)
            unique_keys, inverse, counts = tf.unique_with_counts(hashed, out_idx=tf.int32)
            deps = []
            if self._hvd.size() > 1:
                unique_category = tf.math.unsorted_segment_min(category, inverse,
                                                               tf.size(unique_keys))
                info = tf.bitwise.bitwise_or(
                    tf.bitwise.left_shift(tf.cast(counts, tf.int64), category_bits()),
                    unique_category)
                received = self._send_categories(table, unique_keys, info, g.name)
                recv_category = tf.bitwise.bitwise_and(received, (1 << category_bits()) - 1)
                recv_count = tf.bitwise.right_shift(received, category_bits())
                deps.append(stats.assign_add(tf.math.unsorted_segment_sum(
                    recv_count, recv_category, g.num_features)))
            rows = table(unique_keys)  # [u, dim]
            with tf.control_dependencies(deps):
                embs = tf.gather(rows, inverse)
            for f, emb in zip(g.features, tf.split(embs, lengths, axis=0)):
                out[f.name] = tf.reshape(emb, [-1, g.dim])
        return out


def tfra_optimizer(learning_rate):
    """TFRA's synchronous training optimizer: ``DynamicEmbeddingOptimizer(Adagrad,
    synchronous=True)`` AllReduces (Horovod, Sum) each dense gradient and applies the
    TrainableWrapper (embedding) gradients locally on the owners."""
    de = _tfra()
    return de.DynamicEmbeddingOptimizer(
        tf_keras.optimizers.Adagrad(learning_rate), synchronous=True)


def tfra_train_step(model, x, y, loss_fn, optimizer, hvd):
    """One synchronous TFRA step with the same loss scaling as tf_fusedemb's train_step:
    each rank's per-example SUM over the GLOBAL batch size, so Horovod's summed dense
    gradients and the summed row gradients of the backward AlltoAll give the global-mean
    update. Returns (global mean loss, logits)."""
    local_n = tf.cast(tf.shape(y)[0], tf.float32)
    global_n = tf.maximum(hvd.allreduce(local_n, op=hvd.Sum, name="tfra/global_batch"), 1.0)
    with tf.GradientTape() as tape:
        logits = model(x, training=True)
        local_sum = tf.reduce_sum(loss_fn(y, logits))
        loss = local_sum / global_n
    variables = model.trainable_variables
    grads = tape.gradient(loss, variables)
    update = optimizer.apply_gradients(zip(grads, variables))
    deps = [update] if update is not None else []
    with tf.control_dependencies(deps):
        global_loss = hvd.allreduce(local_sum, op=hvd.Sum, name="tfra/loss_sum") / global_n
    return global_loss, logits
