"""TFRA's MovieLens Keras-with-Horovod demo, ported to tf_fusedemb.

The model is the demo's ``DualChannelsDeepModel`` (tensorflow/recommenders-addons,
demo/dynamic_embedding/movielens-1m-keras-with-horovod): a user channel and a movie channel,
each a Dense(128, relu) over its embeddings, then LayerNormalization, Dense 64 -> 16 ->
softmax, a softmax "bias net", output 0.2 * dnn + 0.8 * bias, MSE loss on one-hot labels,
AUC, Adam(1e-3). What changes:

* TFRA's two ``HvdAllToAllEmbedding`` per channel (features concatenated into one shared
  table, told apart by ID prefixes) -> one ``FusedEmbedding`` with one FeatureSpec per
  feature: features of equal spec are fused into one group automatically (3 AlltoAll rounds
  per step per group) and keep their own rows (deferred category hashing, no prefixes).
* ``de.DynamicEmbeddingOptimizer(Adam)`` -> ``OptimizerSpec.adam(1e-3)`` per table (lazy
  Adam on touched rows) + a plain tf_keras Adam for the dense layers.
* ``DEHvdBroadcastGlobalVariablesCallback`` -> nothing: rows start from a deterministic
  function of (table, ID) and the dense layers are seeded, so ranks agree without a broadcast.
* Data: our MovieLens reader (``tf_fusedemb.data.movielens_dataset``, MovieLens
  "latest-small" CSVs) instead of tensorflow_datasets' movielens/1m-ratings. That file has
  no gender/occupation/age columns, so the user channel holds the user ID only; the movie
  channel holds the movie ID and its genres (all of them, mean-pooled; the demo kept the
  first). The label is the reader's "liked" (rating >= 4) as a 2-way one-hot instead of the
  5-way rating.

    horovodrun -np 2 --gloo -H localhost:2 python examples/movielens_from_tfra.py \\
        --data ../shared/data/movielens-latest-small --steps-per-epoch 200

The last line rank 0 prints is ``RESULT {json}`` (train loss, test loss and AUC).
"""
import argparse
import json
import pathlib

from tf_fusedemb import quiet

quiet.install()  # first: Keras 2 for tf.keras, no CUDA-factory lines (tf_fusedemb/quiet.py)

import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

from tf_fusedemb.comm import get_communicator  # noqa: E402
from tf_fusedemb.data import movielens_dataset  # noqa: E402
from tf_fusedemb.layers import FusedEmbedding  # noqa: E402
from tf_fusedemb.models import FusedModel  # noqa: E402
from tf_fusedemb.specs import FeatureSpec, InitializerSpec, OptimizerSpec, TableSpec  # noqa: E402

NUM_CLASSES = 2
DEFAULT_DATA = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / \
    "movielens-latest-small"


def feature_specs(embedding_size: int, lr: float):
    """The demo's "sparse" (2 x size: user, movie) and "dense" (1 x size: genres) tables."""
    init = InitializerSpec.normal(0.0, 0.5)  # the demo's RandomNormal(0.0, 0.5)

    def table(name, dim):
        return TableSpec(name, dim, OptimizerSpec.adam(lr), init)  # dynamic, like TFRA's

    return {"user": FeatureSpec("user", table("user", 2 * embedding_size)),
            "movie": FeatureSpec("movie", table("movie", 2 * embedding_size)),
            "genres": FeatureSpec("genres", table("genres", embedding_size), combiner="mean")}


def _dense(units, activation, seed):
    normal = tf_keras.initializers.RandomNormal
    return tf_keras.layers.Dense(units, activation=activation,
                                 kernel_initializer=normal(0.0, 0.1, seed=seed),
                                 bias_initializer=normal(0.0, 0.1, seed=seed + 1000))


def dual_channels_model(embedding_size: int = 32, lr: float = 1e-3):
    """DualChannelsDeepModel on FusedEmbedding: inputs user/movie int64[B], genres ragged
    int64[B, None]; output float32[B, NUM_CLASSES] (softmax mixture)."""
    specs = feature_specs(embedding_size, lr)
    inputs = {"user": tf_keras.Input([], dtype=tf.int64, name="user"),
              "movie": tf_keras.Input([], dtype=tf.int64, name="movie"),
              "genres": tf_keras.Input([None], dtype=tf.int64, ragged=True, name="genres")}
    emb = FusedEmbedding(list(specs.values()), name="fused_embedding")(inputs)
    user = _dense(128, "relu", 1)(emb["user"])
    movie = _dense(128, "relu", 2)(tf_keras.layers.Concatenate()([emb["movie"], emb["genres"]]))
    normalized = tf_keras.layers.LayerNormalization()(
        tf_keras.layers.Concatenate()([user, movie]))
    x = _dense(64, "relu", 3)(normalized)
    x = _dense(16, "relu", 4)(x)
    x = _dense(NUM_CLASSES, "softmax", 5)(x)
    bias = _dense(NUM_CLASSES, "softmax", 6)(normalized)
    rating = tf_keras.layers.Lambda(lambda t: 0.2 * t[0] + 0.8 * t[1], name="user_rating")(
        [x, bias])
    return FusedModel(inputs, rating)


def dataset(directory, batch_size, split, comm):
    """This rank's share of the split, repeated (every rank runs exactly the steps it is
    asked for): ({user, movie, genres}, one-hot label [B, 2])."""
    ds = movielens_dataset(directory, batch_size, num_shards=comm.size, shard_index=comm.rank,
                           split=split, drop_remainder=True, repeat=True)
    return ds.map(lambda f, y: ({k: f[k] for k in ("user", "movie", "genres")},
                                tf.one_hot(tf.cast(y[:, 0], tf.int32), NUM_CLASSES)))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(DEFAULT_DATA), help="folder with ratings.csv, movies.csv")
    p.add_argument("--embedding-size", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=256, help="per rank")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--steps-per-epoch", type=int, default=200)
    p.add_argument("--test-steps", type=int, default=20)
    args = p.parse_args(argv)
    comm = get_communicator()
    model = dual_channels_model(args.embedding_size)
    model.compile(optimizer=tf_keras.optimizers.Adam(1e-3),
                  loss=tf_keras.losses.MeanSquaredError(),
                  metrics=[tf_keras.metrics.AUC(num_thresholds=1000, name="auc")])
    history = model.fit(dataset(args.data, args.batch_size, "train", comm),
                        epochs=args.epochs, steps_per_epoch=args.steps_per_epoch)
    # The test split repeats: every rank then evaluates exactly test_steps batches.
    test = dataset(args.data, args.batch_size, "test", comm).take(args.test_steps)
    evaluation = model.evaluate(test, return_dict=True, verbose=0)
    if comm.rank == 0:
        print("RESULT " + json.dumps({"world_size": comm.size,
                                      "train_loss": history.history["loss"][-1],
                                      "test_loss": evaluation["loss"],
                                      "test_auc": evaluation["auc"]}), flush=True)


if __name__ == "__main__":
    main()
