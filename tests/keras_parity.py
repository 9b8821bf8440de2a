"""A tf_keras model written the usual way (one Embedding per feature + an MLP) and its
FusedEmbedding twin with identical initial weights, for parity tests against plain
``tf_keras.Model.fit`` (the reference is Keras itself, not our own helpers)."""
import numpy as np
import tensorflow as tf
import tf_keras

from tf_fusedemb.layers import from_keras_embeddings
from tf_fusedemb.models import FusedModel
from tf_fusedemb.specs import OptimizerSpec

FEATURES = ("f0", "f1", "f2", "f3")
VOCAB, DIM = 50, 8
LR = {"sgd": 0.5, "adagrad": 0.3, "ftrl": 0.3, "adam": 0.05}


def data(n, seed):
    """(x {feature: int64[n]}, labels float32[n], sample weights float32[n])."""
    rng = np.random.default_rng(seed)
    x = {f: rng.zipf(1.3, n).clip(1, VOCAB).astype(np.int64) - 1 for f in FEATURES}
    logit = (x["f0"] % 3 == 0).astype(np.float32) - (x["f1"] % 4 == 1) + 0.3 * rng.normal(size=n)
    y = (logit > 0).astype(np.float32)
    return x, y, rng.uniform(0.5, 2.0, n).astype(np.float32)


def keras_optimizer(name):
    """The Keras optimizer of the plain model (legacy Ftrl: its sparse update touches
    only the rows in the gradient, like ours; the new one densifies the gradient)."""
    lr = LR[name]
    return {"sgd": lambda: tf_keras.optimizers.SGD(lr),
            "adagrad": lambda: tf_keras.optimizers.Adagrad(lr),
            "ftrl": lambda: tf_keras.optimizers.legacy.Ftrl(lr),
            "adam": lambda: tf_keras.optimizers.Adam(lr)}[name]()


def table_optimizer(name):
    lr = LR[name]
    return {"sgd": OptimizerSpec.sgd, "adagrad": OptimizerSpec.adagrad,
            "ftrl": OptimizerSpec.ftrl, "adam": OptimizerSpec.adam}[name](lr)


def _head(features, output_rank, seed=7):
    h = tf_keras.layers.Concatenate(name="concat")(features)
    h = tf_keras.layers.Dense(16, activation="relu", name="hidden",
                              kernel_initializer=tf_keras.initializers.GlorotUniform(seed))(h)
    out = tf_keras.layers.Dense(1, name="logit",
                                kernel_initializer=tf_keras.initializers.GlorotUniform(seed + 1))(h)
    if output_rank == 1:
        out = tf_keras.layers.Reshape((), name="squeeze")(out)
    return out


def plain_model(output_rank=2, seed=7):
    """26-Embedding-style Keras model: Embedding(VOCAB, DIM) per feature, an MLP, logits
    [B, 1] (or [B] with ``output_rank=1``)."""
    inputs = {f: tf_keras.Input([], dtype=tf.int64, name=f) for f in FEATURES}
    embs = [tf_keras.layers.Embedding(
        VOCAB, DIM, name=f"emb_{f}",
        embeddings_initializer=tf_keras.initializers.RandomUniform(-0.05, 0.05, seed=seed + i))(
            inputs[f]) for i, f in enumerate(FEATURES)]
    return tf_keras.Model(inputs, _head(embs, output_rank))


def fused_twin(plain, optimizer_name, output_rank=2, dynamic=False):
    """The plain model with its Embeddings converted to one FusedEmbedding, carrying
    every weight over (dense layers and embedding tables)."""
    embeddings = {f: plain.get_layer(f"emb_{f}") for f in FEATURES}
    layer = from_keras_embeddings(embeddings, table_optimizer(optimizer_name), dynamic=dynamic)
    inputs = {f: tf_keras.Input([], dtype=tf.int64, name=f) for f in FEATURES}
    outs = layer(inputs)
    model = FusedModel(inputs, _head([outs[f] for f in FEATURES], output_rank))
    for name in ("hidden", "logit"):
        model.get_layer(name).set_weights(plain.get_layer(name).get_weights())
    layer.set_embedding_weights({f: e.get_weights()[0] for f, e in embeddings.items()})
    return model


class BatchLosses(tf_keras.callbacks.Callback):
    """Records the ``loss`` log of every batch (what a user's callback sees)."""

    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


LOSSES = {
    "bce_object": lambda: tf_keras.losses.BinaryCrossentropy(from_logits=True),
    "bce_sum": lambda: tf_keras.losses.BinaryCrossentropy(
        from_logits=True, reduction=tf_keras.losses.Reduction.SUM),
    "bce_none": lambda: tf_keras.losses.BinaryCrossentropy(
        from_logits=True, reduction=tf_keras.losses.Reduction.NONE),
    "mse_string": lambda: "mse",
    "function": lambda: tf_keras.losses.mean_squared_error,
}


def train(model, optimizer, loss, x, y, batch_size, epochs=2, sample_weight=None,
          class_weight=None, validation=None, metrics=True, test=None, **compile_kwargs):
    """compile + fit (+ evaluate and predict on ``test`` = (x, y)); returns history,
    per-batch losses, evaluate results and predictions."""
    model.compile(optimizer=optimizer, loss=loss, **compile_kwargs,
                  metrics=[tf_keras.metrics.BinaryAccuracy(threshold=0.0, name="acc"),
                           tf_keras.metrics.AUC(from_logits=True, name="auc")]
                  if metrics else None)
    batches = BatchLosses()
    history = model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0,
                        sample_weight=sample_weight, class_weight=class_weight,
                        validation_data=validation, validation_batch_size=batch_size,
                        callbacks=[batches])
    out = {"history": history.history, "batch_losses": batches.losses}
    if test is not None:
        out["evaluate"] = model.evaluate(test[0], test[1], batch_size=batch_size, verbose=0,
                                         return_dict=True)
        out["predictions"] = model.predict(test[0], batch_size=batch_size,
                                           verbose=0).reshape(-1).tolist()
    return out


def rank_bounds(n, shares, rank):
    """[(lo, hi)] of the rows ``rank`` feeds in each global batch of sum(shares) rows:
    rank r takes the r-th share of each global batch (the last one may leave a rank
    empty), so concatenating the ranks' batches in rank order gives Keras's batches."""
    size = sum(shares)
    off = sum(shares[:rank])
    return [(min(s + off, n), min(s + off + shares[rank], n)) for s in range(0, n, size)]


def rank_dataset(arrays, bounds):
    """tf.data batches of ``arrays`` (a nest of numpy arrays) cut at ``bounds``; empty
    batches included."""
    lo, hi = (np.array([b[i] for b in bounds], np.int64) for i in (0, 1))
    tensors = tf.nest.map_structure(tf.constant, arrays)
    return tf.data.Dataset.from_tensor_slices((lo, hi)).map(
        lambda a, b: tf.nest.map_structure(lambda t: t[a:b], tensors))


def fit_datasets(model, optimizer, loss, train, validation, test, epochs=2, **compile_kwargs):
    """compile + fit + evaluate + predict on datasets (the multi-rank form of train)."""
    model.compile(optimizer=optimizer, loss=loss, **compile_kwargs,
                  metrics=[tf_keras.metrics.BinaryAccuracy(threshold=0.0, name="acc"),
                           tf_keras.metrics.AUC(from_logits=True, name="auc")])
    batches = BatchLosses()
    history = model.fit(train, epochs=epochs, verbose=0, validation_data=validation,
                        callbacks=[batches])
    return {"history": history.history, "batch_losses": batches.losses,
            "evaluate": model.evaluate(test, verbose=0, return_dict=True),
            "predictions": model.predict(test.map(lambda x, y: x), verbose=0).reshape(-1)}
