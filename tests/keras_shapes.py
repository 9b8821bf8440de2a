"""Model shapes users write, each next to its reference: the same model, built the same way
(unseeded, functional or subclassed, in tf_keras or Keras 3), trained by plain Keras
``fit`` from the same weights. The converted model is made by ``fuse_model`` from a copy.

Shapes (each a function ``(k) -> built model`` of the Keras module ``k``):
  dict_output        a single output given as a dict, dict labels, ``metrics=[AUC()]``;
  bytes_vocabulary   ``StringLookup`` vocabularies as numpy bytes arrays (``np.unique``);
  nested_blocks      ``Sequential([StringLookup, Embedding])`` blocks in a functional model;
  and the public examples' shapes (written from their shapes, not their code):
  tfrs_ranking       TensorFlow Recommenders' basic ranking model: subclassed, nested
                     ``Sequential`` blocks, bytes vocabularies;
  tfrs_model_ranking the same on ``tfrs.Model`` with a ``tfrs.tasks.Ranking`` task (its
                     own train_step), where tensorflow-recommenders is installed;
  tfrs_dcn           TensorFlow Recommenders' DCN: subclassed, one lookup block per
                     feature, a cross layer, a deep tower;
  tfra_movielens     TFRA's MovieLens Keras + Horovod demo: a dict output
                     ``{"user_rating": ...}``, dict labels, AUC;
  dependent_ids      a subclassed model whose third table's IDs come from another
                     table's output (it keeps its own exchange);
  keras_rs_dlrm      a DLRM as keras-rs examples write it (Keras 3): dense features
                     through a bottom MLP, one Embedding per sparse feature, a dot
                     interaction, a top MLP; keras_rs_dlrm_layers: the same with
                     keras-rs's DotInteraction, where keras-rs is installed.

Module-level functions travel to the ranks of ``DistributedTestCase.run_ranks``.
"""
from typing import Any, Callable, Dict, List, NamedTuple

import numpy as np
import tensorflow as tf

from keras_paths import BatchLosses
from tf_fusedemb.specs import OptimizerSpec

USERS = np.unique(np.array([b"user %d" % i for i in range(24)]))
MOVIES = np.unique(np.array([b"movie %d" % i for i in range(16)]))
GENRES = np.unique(np.array([b"genre %d" % i for i in range(5)]))
DIM, BATCH, ROWS, LR = 4, 16, 64, 0.1


def data(rows: int = ROWS, seed: int = 0):
    """(features, ratings): {"user_id": bytes[rows], "movie_title": bytes[rows],
    "genre": bytes[rows], "user": int64[rows], "movie": int64[rows], "dense":
    float32[rows, 3]}, and float32[rows] ratings in 1..5; IDs repeat within batches."""
    rng = np.random.default_rng(seed)
    users, movies = rng.integers(0, len(USERS), rows), rng.integers(0, len(MOVIES), rows)
    genres = rng.integers(0, len(GENRES), rows)
    x = {"user_id": USERS[users], "movie_title": MOVIES[movies], "genre": GENRES[genres],
         "user": users.astype(np.int64), "movie": movies.astype(np.int64),
         "dense": rng.normal(size=(rows, 3)).astype(np.float32)}
    return x, (1 + (users + 2 * movies + genres) % 5).astype(np.float32)


def _lookup(k, vocabulary):
    return k.layers.StringLookup(vocabulary=vocabulary, mask_token=None)


# ---- the shapes
def dict_output(k):
    """Int IDs -> Embeddings -> MLP -> {"user_rating": Dense(5, softmax)}."""
    inputs = {f: k.Input((), dtype="int64", name=f) for f in ("user", "movie")}
    vectors = [k.layers.Embedding(len(USERS), DIM)(inputs["user"]),
               k.layers.Embedding(len(MOVIES), DIM)(inputs["movie"])]
    hidden = k.layers.Dense(8, activation="relu")(k.layers.Concatenate()(vectors))
    return k.Model(inputs, {"user_rating": k.layers.Dense(5, activation="softmax")(hidden)})


def bytes_vocabulary(k):
    """Strings -> StringLookup(bytes vocabulary) -> Embedding, top level -> MLP -> rating."""
    inputs = {f: k.Input((), dtype="string", name=f) for f in ("user_id", "movie_title")}
    vectors = [k.layers.Embedding(len(v) + 1, DIM)(_lookup(k, v)(inputs[f]))
               for f, v in (("user_id", USERS), ("movie_title", MOVIES))]
    hidden = k.layers.Dense(8, activation="relu")(k.layers.Concatenate()(vectors))
    return k.Model(inputs, k.layers.Dense(1)(hidden))


def nested_blocks(k):
    """Strings -> Sequential([StringLookup, Embedding]) blocks -> a Sequential tower."""
    inputs = {f: k.Input((), dtype="string", name=f) for f in ("user_id", "movie_title")}
    vectors = [k.Sequential([_lookup(k, v), k.layers.Embedding(len(v) + 1, DIM)])(inputs[f])
               for f, v in (("user_id", USERS), ("movie_title", MOVIES))]
    tower = k.Sequential([k.layers.Dense(8, activation="relu"), k.layers.Dense(1)])
    return k.Model(inputs, tower(k.layers.Concatenate()(vectors)))


def tfrs_ranking(k):
    """TensorFlow Recommenders' basic ranking model, written as its tutorial's shape."""
    class RankingModel(k.Model):
        def __init__(self):
            super().__init__()
            self.user_embeddings = k.Sequential([
                _lookup(k, USERS), k.layers.Embedding(len(USERS) + 1, DIM)])
            self.movie_embeddings = k.Sequential([
                _lookup(k, MOVIES), k.layers.Embedding(len(MOVIES) + 1, DIM)])
            self.ratings = k.Sequential([k.layers.Dense(8, activation="relu"),
                                         k.layers.Dense(4, activation="relu"),
                                         k.layers.Dense(1)])

        def call(self, features):
            return self.ratings(tf.concat([self.user_embeddings(features["user_id"]),
                                           self.movie_embeddings(features["movie_title"])],
                                          axis=1))
    return RankingModel()


def tfrs_model_ranking(k):
    """The basic ranking tutorial's model on ``tfrs.Model`` (its own ``train_step``:
    ``compute_loss``, a ``tfrs.tasks.Ranking`` task), where tensorflow-recommenders is
    installed (tf_keras)."""
    import tensorflow_recommenders as tfrs  # pylint: disable=import-outside-toplevel

    class RankingTask(tfrs.Model):
        def __init__(self):
            super().__init__()
            self.ranking_model = tfrs_ranking(k)
            self.task = tfrs.tasks.Ranking(loss=k.losses.MeanSquaredError(),
                                           metrics=[k.metrics.RootMeanSquaredError()])

        def call(self, features):
            return self.ranking_model(features)

        def compute_loss(self, inputs, training=False):
            features, ratings = inputs
            return self.task(labels=ratings, predictions=self(features))
    return RankingTask()


def tfrs_dcn(k):
    """TensorFlow Recommenders' DCN: a lookup block per string feature, a cross layer on
    the stacked embeddings, a deep tower, a rating."""
    class Cross(k.layers.Layer):
        """x0 * (W x + b) + x, the cross layer of DCN (full-rank)."""

        def __init__(self):
            super().__init__()
            self.dense = None

        def build(self, input_shape):
            self.dense = k.layers.Dense(input_shape[-1])
            self.dense.build(input_shape)

        def call(self, x0, x=None):
            x = x0 if x is None else x
            return x0 * self.dense(x) + x

    class DCN(k.Model):
        def __init__(self):
            super().__init__()
            self.embeddings = {f: k.Sequential([_lookup(k, v),
                                                k.layers.Embedding(len(v) + 1, DIM)])
                               for f, v in (("user_id", USERS), ("movie_title", MOVIES),
                                            ("genre", GENRES))}
            self.cross = Cross()
            self.deep = [k.layers.Dense(8, activation="relu")]
            self.logit = k.layers.Dense(1)

        def call(self, features):
            x = tf.concat([self.embeddings[f](features[f])
                           for f in ("user_id", "movie_title", "genre")], axis=1)
            x = self.cross(x)
            for layer in self.deep:
                x = layer(x)
            return self.logit(x)
    return DCN()


def tfra_movielens(k):
    """TFRA's MovieLens demo shape: a subclassed model of int IDs with a dict output."""
    class DualChannels(k.Model):
        def __init__(self):
            super().__init__()
            self.user_embedding = k.layers.Embedding(len(USERS), DIM)
            self.movie_embedding = k.layers.Embedding(len(MOVIES), DIM)
            self.tower = [k.layers.Dense(8, activation="relu"),
                          k.layers.Dense(5, activation="softmax")]

        def call(self, features):
            x = tf.concat([self.user_embedding(features["user"]),
                           self.movie_embedding(features["movie"])], axis=1)
            for layer in self.tower:
                x = layer(x)
            return {"user_rating": x}
    return DualChannels()


def dependent_ids(k):
    """A subclassed model one of whose tables is looked up by IDs computed from another
    table's output (the bucket of the user's row, argmax of its entries): that table
    cannot be looked up before the forward pass."""
    class TwoStage(k.Model):
        def __init__(self):
            super().__init__()
            self.user = k.Sequential([_lookup(k, USERS), k.layers.Embedding(len(USERS) + 1, DIM)])
            self.movie = k.Sequential([_lookup(k, MOVIES),
                                       k.layers.Embedding(len(MOVIES) + 1, DIM)])
            self.bucket = k.layers.Embedding(DIM, DIM, name="bucket")
            self.rating = k.layers.Dense(1)

        def call(self, features):
            user = self.user(features["user_id"])
            bucket = self.bucket(tf.argmax(user, axis=1))
            return self.rating(tf.concat([user, self.movie(features["movie_title"]), bucket],
                                         axis=1))
    return TwoStage()


def _dot_interaction(vectors):
    """The pairwise dot products of the vectors [B, DIM] (i < j): [B, n (n - 1) / 2]."""
    stacked = tf.stack(vectors, axis=1)                      # [B, n, DIM]
    dots = tf.matmul(stacked, stacked, transpose_b=True)    # [B, n, n]
    n = len(vectors)
    upper = [i * n + j for i in range(n) for j in range(i + 1, n)]
    return tf.gather(tf.reshape(dots, [-1, n * n]), upper, axis=1)


def keras_rs_dlrm(k, interaction=_dot_interaction):
    """A DLRM as keras-rs examples write it: bottom MLP on the dense features, one
    Embedding per sparse feature, the pairwise dot products of all vectors
    (``interaction``), a top MLP."""
    class DLRM(k.Model):
        def __init__(self):
            super().__init__()
            self.bottom = k.Sequential([k.layers.Dense(8, activation="relu"),
                                        k.layers.Dense(DIM, activation="relu")])
            self.embeddings = {"user": k.layers.Embedding(len(USERS), DIM),
                               "movie": k.layers.Embedding(len(MOVIES), DIM)}
            self.interaction = interaction
            self.top = k.Sequential([k.layers.Dense(8, activation="relu"), k.layers.Dense(1)])

        def call(self, features):
            vectors = [self.bottom(features["dense"])] + [
                self.embeddings[f](features[f]) for f in ("user", "movie")]
            return self.top(tf.concat([vectors[0], self.interaction(vectors)], axis=1))
    return DLRM()


def keras_rs_dlrm_layers(k):
    """keras_rs_dlrm with keras-rs's own ``DotInteraction``, where keras-rs is installed
    (Keras 3)."""
    import keras_rs  # pylint: disable=import-outside-toplevel
    return keras_rs_dlrm(k, keras_rs.layers.DotInteraction())


class Shape(NamedTuple):
    """A model shape and how it is trained.

    Fields:
      build: (k) -> the model, built (called once) where it is subclassed.
      inputs: the features of ``data()`` it takes.
      loss: (k) -> its compile loss; labels: (ratings float32[n]) -> its labels.
      metrics: (k) -> its compile metrics.
    """
    build: Callable[[Any], Any]
    inputs: tuple
    loss: Callable[[Any], Any]
    labels: Callable[[np.ndarray], Any]
    metrics: Callable[[Any], list]


def _one_hot(ratings):
    return {"user_rating": np.eye(5, dtype=np.float32)[ratings.astype(int) - 1]}


_CATEGORICAL = dict(loss=lambda k: k.losses.CategoricalCrossentropy(), labels=_one_hot,
                    metrics=lambda k: [k.metrics.AUC()])
_REGRESSION = dict(loss=lambda k: "mse", labels=lambda r: r,
                   metrics=lambda k: [k.metrics.RootMeanSquaredError()])
SHAPES: Dict[str, Shape] = {
    "dict_output": Shape(dict_output, ("user", "movie"), **_CATEGORICAL),
    "bytes_vocabulary": Shape(bytes_vocabulary, ("user_id", "movie_title"), **_REGRESSION),
    "nested_blocks": Shape(nested_blocks, ("user_id", "movie_title"), **_REGRESSION),
    "tfrs_ranking": Shape(tfrs_ranking, ("user_id", "movie_title"), **_REGRESSION),
    "tfrs_model_ranking": Shape(tfrs_model_ranking, ("user_id", "movie_title"),
                                **_REGRESSION),
    "tfrs_dcn": Shape(tfrs_dcn, ("user_id", "movie_title", "genre"), **_REGRESSION),
    "tfra_movielens": Shape(tfra_movielens, ("user", "movie"), **_CATEGORICAL),
    "dependent_ids": Shape(dependent_ids, ("user_id", "movie_title"), **_REGRESSION),
    "keras_rs_dlrm": Shape(keras_rs_dlrm, ("dense", "user", "movie"), **_REGRESSION),
    "keras_rs_dlrm_layers": Shape(keras_rs_dlrm_layers, ("dense", "user", "movie"),
                                  **_REGRESSION),
}


# Each example in the Keras it is written for (TensorFlow Recommenders and TFRA: tf_keras;
# keras-rs: Keras 3); the shapes of the issue in both. keras_shapes_report.py runs all.
TF_KERAS_SHAPES = ("dict_output", "bytes_vocabulary", "nested_blocks", "tfrs_ranking",
                   "tfrs_model_ranking", "tfrs_dcn", "tfra_movielens", "dependent_ids")
# AlltoAll rounds per step of each shape on 2 ranks (flat exchange), tf_keras: 3 for one
# fused group (keys, rows, gradients); the model with its own train_step looks its two
# tables up alone; dependent_ids's third table makes its own exchange.
ROUNDS = {"tfrs_model_ranking": 6, "dependent_ids": 6}
KERAS3_SHAPES = ("dict_output", "bytes_vocabulary", "nested_blocks", "keras_rs_dlrm",
                 "keras_rs_dlrm_layers")
# The shapes written with an example's own package, and that package's module.
PACKAGES = {"tfrs_model_ranking": "tensorflow_recommenders",
            "keras_rs_dlrm_layers": "keras_rs"}


def installed(names) -> tuple:
    """The shapes of ``names`` whose example package (if any) is installed."""
    import importlib.util  # pylint: disable=import-outside-toplevel
    return tuple(n for n in names
                 if n not in PACKAGES or importlib.util.find_spec(PACKAGES[n]) is not None)


def shape_data(name: str, rows=slice(None)):
    """(x, labels) of shape ``name`` on ``data()``'s ``rows``."""
    x, ratings = data()
    spec = SHAPES[name]
    return {f: x[f][rows] for f in spec.inputs}, spec.labels(ratings[rows])


def built(k, name: str, weights=None):
    """Shape ``name``'s model, called once on two rows (a subclassed model is then
    built), with ``weights`` (a ``get_weights()`` list) when given."""
    model = SHAPES[name].build(k)
    x, _ = shape_data(name, slice(0, 2))
    model(x)
    if weights is not None:
        model.set_weights(weights)
    return model


# ---- comparing a converted model with its reference
def leaves(layer) -> List[Any]:
    """The layers of ``layer`` that are not models, depth first in tracking order
    (a subclassed model's attributes' layers, a Sequential block's layers); a layer that
    holds layers itself (DCN's cross layer) is one leaf."""
    inner = getattr(layer, "layers", None)
    if inner is None:
        return [layer]
    return [leaf for l in inner for leaf in leaves(l)]


def with_weights(model, k) -> List[Any]:
    """(name, is an Embedding) of every leaf of ``model`` with weights, in order."""
    return [(l.name, isinstance(l, k.layers.Embedding)) for l in leaves(model)
            if l.get_weights()]


def fused_rows(model) -> Dict[str, np.ndarray]:
    """{table name: float32[vocabulary, dim]} of this rank's stored rows of every table of
    ``model``'s FusedEmbedding layers (zeros where another rank owns the row)."""
    from tf_fusedemb.layers import fused_embedding_layers  # pylint: disable=import-outside-toplevel
    tables = {}
    for layer in fused_embedding_layers(model):
        for group in layer.groups:
            rows = group.store.stored_rows()
            for t, spec in enumerate(group.group.tables):
                mine = rows.tables == t
                tables[spec.name] = np.zeros((spec.vocabulary_size, spec.dim), np.float32)
                tables[spec.name][rows.ids[mine]] = rows.values[mine]
    return tables


def train(k, model, name: str, x, y, batch_size: int, optimizer=None) -> List[float]:
    """compile (SGD, the shape's loss and metrics) + fit for 2 epochs; per-batch losses."""
    spec = SHAPES[name]
    model.compile(optimizer=optimizer or k.optimizers.SGD(LR), loss=spec.loss(k),
                  metrics=spec.metrics(k))
    losses = BatchLosses(k)
    if k.__name__ != "tf_keras":  # Keras 3 takes strings as a tensor, not numpy bytes
        x = {f: tf.constant(v) if v.dtype.kind == "S" else v for f, v in x.items()}
    model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0,
              callbacks=[losses])
    return losses.losses


def reference(k, name: str, batch_size: int):
    """(initial weights, per-batch losses, trained weights of each ``with_weights`` leaf)
    of plain Keras fit of shape ``name`` on batches of ``batch_size`` rows, in this
    process."""
    model = built(k, name)
    initial = model.get_weights()
    x, y = shape_data(name)
    losses = train(k, model, name, x, y, batch_size)
    return initial, losses, [l.get_weights() for l in leaves(model) if l.get_weights()]


def fuse(k, model):
    """``fuse_model`` of that Keras, SGD rows at LR."""
    if k.__name__ == "tf_keras":
        from tf_fusedemb.models import fuse_model  # pylint: disable=import-outside-toplevel
    else:
        from tf_fusedemb.keras3 import fuse_model  # pylint: disable=import-outside-toplevel
    return fuse_model(model, OptimizerSpec.sgd(LR))


def distributed_optimizer(k):
    """That Keras's DistributedOptimizer class."""
    if k.__name__ == "tf_keras":
        from tf_fusedemb.training import DistributedOptimizer  # pylint: disable=import-outside-toplevel
    else:
        from tf_fusedemb.keras3 import DistributedOptimizer  # pylint: disable=import-outside-toplevel
    return DistributedOptimizer


def converted_run(k, name: str, initial, rows=slice(None), batch_size=BATCH):
    """Shape ``name`` built from ``initial``, converted by fuse_model, trained on the
    ``rows`` of ``data()`` (its optimizer in DistributedOptimizer on several ranks where
    the converted model is a plain Keras model, not a FusedModel): per-batch losses,
    "tables" {leaf position: this rank's rows}, "dense" {leaf position: weights},
    positions in ``with_weights`` order, and "rounds" (AlltoAll rounds per step of all
    its fused groups together on this rank)."""
    from tf_fusedemb.comm import get_communicator  # pylint: disable=import-outside-toplevel
    from tf_fusedemb.models.fused_model import SparseTrainingMixin  # pylint: disable=import-outside-toplevel
    original = built(k, name, initial)
    leaves_before = with_weights(original, k)
    converted = fuse(k, original)
    x, y = shape_data(name, rows)
    optimizer = k.optimizers.SGD(LR)
    if get_communicator().size > 1 and not isinstance(converted, SparseTrainingMixin):
        optimizer = distributed_optimizer(k)(optimizer)
    before = alltoall_rounds(converted)
    losses = train(k, converted, name, x, y, batch_size, optimizer)
    rows_of = fused_rows(converted)
    by_name = {l.name: l for l in leaves(converted)}
    return {"losses": losses,
            "tables": {i: rows_of[n] for i, (n, emb) in enumerate(leaves_before) if emb},
            "dense": {i: by_name[n].get_weights()
                      for i, (n, emb) in enumerate(leaves_before) if not emb},
            "rounds": (alltoall_rounds(converted) - before) / len(losses)}


def alltoall_rounds(model) -> int:
    """AlltoAll rounds (keys, rows, gradients) this rank made so far in all the fused
    groups of ``model`` (``CommCounters``)."""
    from tf_fusedemb.layers import fused_embedding_layers  # pylint: disable=import-outside-toplevel
    return sum(c["rounds"] for layer in fused_embedding_layers(model)
               for c in layer.comm_counters().values())


def max_diffs(runs: List[Dict], want_losses, want_weights) -> Dict[str, float]:
    """{"loss": largest per-batch loss difference (of the ranks' mean loss), "weights":
    largest weight difference (table rows summed over the ranks, dense weights of every
    rank)} of ``converted_run`` results against ``reference``'s."""
    loss = np.mean([r["losses"] for r in runs], axis=0)
    diffs = [np.abs(loss - np.asarray(want_losses))]
    for i in runs[0]["tables"]:
        diffs.append(np.abs(sum(r["tables"][i] for r in runs) - want_weights[i][0]))
    for r in runs:
        for i, got in r["dense"].items():
            diffs += [np.abs(g - w) for g, w in zip(got, want_weights[i])]
    return {"loss": float(np.max(diffs[0])), "weights": float(max(np.max(d) for d in diffs[1:]))}


def shapes_on_ranks(k_name: str, names, initials) -> List[Dict]:
    """One rank: ``converted_run`` of each shape in ``names`` from its initial weights on
    this rank's half of every global batch of 2 * BATCH rows."""
    import importlib  # pylint: disable=import-outside-toplevel
    from tf_fusedemb.comm import get_communicator  # pylint: disable=import-outside-toplevel
    k = importlib.import_module(k_name)
    comm = get_communicator()
    mine = np.arange(ROWS).reshape(-1, comm.size, BATCH)[:, comm.rank].reshape(-1)
    return [converted_run(k, name, initial, mine, BATCH)
            for name, initial in zip(names, initials)]


def two_rank_diffs(run_ranks, k, names) -> Dict[str, Dict[str, float]]:
    """{shape: ``max_diffs`` and "rounds" (AlltoAll rounds per step on rank 0)} of the
    shapes ``names`` in Keras ``k`` on 2 ranks, in one job (``run_ranks``: a
    DistributedTestCase's), against their references in this process on the global
    batches of 2 * BATCH rows."""
    refs = [reference(k, name, 2 * BATCH) for name in names]
    ranks = run_ranks(shapes_on_ranks, 2, (k.__name__, names, [r[0] for r in refs]))
    return {name: dict(max_diffs([r[i] for r in ranks], losses, trained),
                       rounds=ranks[0][i]["rounds"])
            for i, (name, (_, losses, trained)) in enumerate(zip(names, refs))}
