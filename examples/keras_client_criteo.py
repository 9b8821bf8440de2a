"""A Keras model written the ordinary way (no seeds: 6 Embedding layers and a small MLP)
converted with ``fuse_model`` and trained on the real Criteo sample, on one process or
under ``horovodrun -np N``: each rank reads its own shard of the lines.

    python examples/keras_client_criteo.py ../shared/data/criteo-kaggle-sample
    horovodrun -np 2 --gloo -H localhost:2 python examples/keras_client_criteo.py \\
        ../shared/data/criteo-kaggle-sample

Prints one JSON line: the test AUC (train.txt -> test.txt) and the largest difference of
any dense weight between the ranks after training (0: one model on every rank).
"""
import json
import os
import sys

import numpy as np

from tf_fusedemb import quiet

quiet.install()  # first: Keras 2 for tf.keras, no CUDA-factory lines (tf_fusedemb/quiet.py)

import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402
from tf_fusedemb.comm import get_communicator  # noqa: E402
from tf_fusedemb.data.criteo import CRITEO_CATEGORICAL, CRITEO_DENSE, read_criteo  # noqa: E402
from tf_fusedemb.models import fuse_model  # noqa: E402
from tf_fusedemb.specs import OptimizerSpec  # noqa: E402

FEATURES = CRITEO_CATEGORICAL[:6]
VOCAB, DIM = 10_000, 8


def features(columns, rows):
    """The model's inputs: 6 categorical IDs folded into the vocabulary, 13 dense ones."""
    x = {f: (columns[f][rows] % VOCAB).astype(np.int64) for f in FEATURES}
    x["numeric"] = np.log1p(np.maximum(np.stack([columns[d][rows] for d in CRITEO_DENSE], 1),
                                     0)).astype(np.float32)
    return x


def keras_model():
    inputs = {f: tf_keras.Input([], dtype=tf.int64, name=f) for f in FEATURES}
    inputs["numeric"] = tf_keras.Input([len(CRITEO_DENSE)], name="numeric")
    embedded = [tf_keras.layers.Embedding(VOCAB, DIM)(inputs[f]) for f in FEATURES]
    h = tf_keras.layers.Concatenate()(embedded + [inputs["numeric"]])
    h = tf_keras.layers.Dense(64, activation="relu")(h)
    h = tf_keras.layers.Dense(32, activation="relu")(h)
    return tf_keras.Model(inputs, tf_keras.layers.Dense(1)(h))


def main(data_dir, epochs=3, batch_size=256):
    comm = get_communicator()
    train = read_criteo(os.path.join(data_dir, "train.txt"))
    test = read_criteo(os.path.join(data_dir, "test.txt"))
    mine = np.arange(comm.rank, len(train["label"]), comm.size)  # this rank's shard
    model = fuse_model(keras_model(), optimizer=OptimizerSpec.adagrad(0.05))
    model.compile(optimizer=tf_keras.optimizers.Adam(1e-3),
                  loss=tf_keras.losses.BinaryCrossentropy(from_logits=True),
                  metrics=[tf_keras.metrics.AUC(from_logits=True, name="auc")])
    model.fit(features(train, mine), train["label"][mine], batch_size=batch_size // comm.size,
              epochs=epochs, verbose=0)
    test_rows = np.arange(comm.rank, len(test["label"]), comm.size)
    auc = model.evaluate(features(test, test_rows), test["label"][test_rows], verbose=0,
                         return_dict=True)["auc"]
    weights = [w for layer in model.layers if not hasattr(layer, "groups")
               for w in layer.get_weights()]
    everyone = comm.allgather_object(weights)
    diff = max(float(np.abs(a - b).max()) for other in everyone[1:]
               for a, b in zip(everyone[0], other)) if comm.size > 1 else 0.0
    if comm.rank == 0:
        print("RESULT " + json.dumps({"ranks": comm.size, "test_auc": round(float(auc), 4),
                                      "max_dense_weight_diff_across_ranks": diff}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "../shared/data/criteo-kaggle-sample")
