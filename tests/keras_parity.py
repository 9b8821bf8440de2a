"""A tf_keras model written the usual way (one Embedding per feature + an MLP) and its
FusedEmbedding twin with identical initial weights, for parity tests against plain
``tf_keras.Model.fit`` (the reference is Keras itself, not our own helpers)."""
import numpy as np
import tensorflow as tf
import tf_keras

from tf_fusedemb.data.criteo import CRITEO_CATEGORICAL, CRITEO_DENSE
from tf_fusedemb.layers import from_keras_embeddings
from tf_fusedemb.models import fuse_model
from tf_fusedemb.models import FusedModel
from tf_fusedemb.specs import OptimizerSpec
from tf_fusedemb.testing.distributed import BatchLosses, rank_bounds, rank_dataset

FEATURES = ("f0", "f1", "f2", "f3")
VOCAB, DIM = 50, 8
LR = {"sgd": 0.5, "adagrad": 0.3, "ftrl": 0.3, "adam": 0.05}
# The Criteo-shaped variant: 26 categorical features with one Embedding each, 13 dense ones.
CRITEO = {"features": CRITEO_CATEGORICAL, "num_dense": len(CRITEO_DENSE)}


def data(n, seed, features=FEATURES, num_dense=0):
    """(x {feature: int64[n]} (+ "dense": float32[n, num_dense]), labels float32[n],
    sample weights float32[n])."""
    rng = np.random.default_rng(seed)
    x = {f: rng.zipf(1.3, n).clip(1, VOCAB).astype(np.int64) - 1 for f in features}
    a, b = features[:2]
    logit = (x[a] % 3 == 0).astype(np.float32) - (x[b] % 4 == 1) + 0.3 * rng.normal(size=n)
    if num_dense:
        x["dense"] = rng.normal(size=(n, num_dense)).astype(np.float32)
        logit = logit + x["dense"][:, 0]
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


def plain_model(output_rank=2, seed=7, features=FEATURES, num_dense=0):
    """26-Embedding-style Keras model: Embedding(VOCAB, DIM) per feature (and a "dense"
    input of ``num_dense`` floats), an MLP, logits [B, 1] (or [B] with ``output_rank=1``)."""
    inputs = {f: tf_keras.Input([], dtype=tf.int64, name=f) for f in features}
    embs = [tf_keras.layers.Embedding(
        VOCAB, DIM, name=f"emb_{f}",
        embeddings_initializer=tf_keras.initializers.RandomUniform(-0.05, 0.05, seed=seed + i))(
            inputs[f]) for i, f in enumerate(features)]
    if num_dense:
        inputs["dense"] = tf_keras.Input([num_dense], name="dense")
        embs.append(inputs["dense"])
    return tf_keras.Model(inputs, _head(embs, output_rank))


def fused_by_fuse_model(plain, optimizer_name):
    """The plain model rewritten by ``tf_fusedemb.models.fuse_model`` (static tables)."""
    return fuse_model(plain, table_optimizer(optimizer_name))


def keras_global(optimizer, rows, global_batch, features=FEATURES, num_dense=0):
    """Plain Keras on the global batches, one process: the multi-rank reference."""
    x, y, sw = data(rows, 0, features, num_dense)
    xt, yt, _ = data(rows // 2, 1, features, num_dense)
    return train(plain_model(features=features, num_dense=num_dense), keras_optimizer(optimizer),
                 LOSSES["bce_object"](), x, y, global_batch, sample_weight=sw,
                 validation=(xt, yt), test=(xt, yt))


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


# ---- builders for tf_fusedemb.testing.DistributedTestCase (module level: they travel to
# the ranks by reference).
def compile_for_parity(model, optimizer_name="adagrad"):
    """compile as ``train`` does: BCE on logits, accuracy and AUC."""
    model.compile(optimizer=keras_optimizer(optimizer_name), loss=LOSSES["bce_object"](),
                  metrics=[tf_keras.metrics.BinaryAccuracy(threshold=0.0, name="acc"),
                           tf_keras.metrics.AUC(from_logits=True, name="auc")])
    return model


def criteo_plain_compiled():
    return compile_for_parity(plain_model(**CRITEO))


def criteo_fused_compiled():
    return compile_for_parity(fused_by_fuse_model(plain_model(**CRITEO), "adagrad"))


def criteo_data():
    return data(96, 0, **CRITEO)


def fit_on_ranks(optimizers, shares, rows, pipeline=None):
    """One rank of the multi-rank parity test (``DistributedTestCase.run_ranks``):
    FusedModel fit/evaluate/predict on this rank's share of every global batch, per
    optimizer; predictions put back into global row order."""
    from tf_fusedemb.comm import get_communicator  # pylint: disable=import-outside-toplevel
    comm = get_communicator()
    assert len(shares) == comm.size, (shares, comm.size)
    x, y, sw = data(rows, 0)
    xt, yt, _ = data(rows // 2, 1)
    train_ds = rank_dataset((x, y, sw), rank_bounds(rows, shares, comm.rank))
    test_bounds = rank_bounds(rows // 2, shares, comm.rank)
    test = rank_dataset((xt, yt), test_bounds)
    results = []
    for name in optimizers:
        model = fused_twin(plain_model(), name)
        out = fit_datasets(model, keras_optimizer(name), LOSSES["bce_object"](), train_ds, test,
                           test, pipeline=pipeline)
        parts = comm.allgather_object((test_bounds, out["predictions"].tolist()))
        predictions = np.zeros(rows // 2)
        for bounds, values in parts:
            rows_of_rank = np.concatenate([np.arange(lo, hi) for lo, hi in bounds])
            predictions[rows_of_rank] = values
        results.append(dict(out, optimizer=name, predictions=predictions.tolist()))
    return results
