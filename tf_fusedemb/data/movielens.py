"""MovieLens (ratings.csv + movies.csv, "latest" format) reader with genres and watch histories.

One sample per rating. Each element of `movielens_dataset` is `(features, label)`:
  features["user"]:    int64[B], the raw userId.
  features["movie"]:   int64[B], the raw movieId.
  features["genres"]:  tf.RaggedTensor int64[B, None], indices into GENRES of the movie's genres
                       in movies.csv order ("(no genres listed)" is a genre of its own, index 0);
                       empty for a movie missing from movies.csv.
  features["history"]: tf.RaggedTensor int64[B, None], the movieIds the user rated before this
                       rating, oldest first / most recent last, at most history_len of them.
                       "Before" is the order (timestamp, line in ratings.csv): strictly earlier
                       timestamps, and for equal timestamps the lines above this one. The history
                       crosses the split: a test sample's history includes the user's train ratings.
  label:               float32[B, 1] = 1.0 if rating >= 4.0 else 0.0.
Split: per user, in the same (timestamp, line) order, the last floor(n_u * test_fraction) of the
user's n_u ratings are "test", the rest "train".

Everything is precomputed once with csv + numpy (cached per directory); a batch is then gathered
with vectorised TF ops from constant tables (tf.data.Dataset.from_tensor_slices over sample
indices, batched, mapped), so 100k ratings load in about a second and batches cost microseconds
per row. Order: the train split is shuffled once by a numpy permutation seeded with `seed`
(identical on every rank), the test split keeps ratings.csv order; then sharding is by sample
before batching (rank r of N gets samples r, r+N, ... of that order), so ranks are disjoint and
together cover the split.
IDs are raw, not remapped: size static tables with `movielens_info(dir)` (max ID + 1).
"""
from __future__ import annotations

import csv
import functools
import os
from typing import Dict, Optional

import numpy as np

from .pipeline import check_shard, parse_and_prefetch

__all__ = ["GENRES", "NUM_GENRES", "MOVIELENS_FEATURES", "movielens_info", "movielens_arrays",
           "movielens_dataset"]

# The genre vocabulary of the MovieLens "latest" / 20M / 25M files, sorted (Python str order).
GENRES = ("(no genres listed)", "Action", "Adventure", "Animation", "Children", "Comedy", "Crime",
          "Documentary", "Drama", "Fantasy", "Film-Noir", "Horror", "IMAX", "Musical", "Mystery",
          "Romance", "Sci-Fi", "Thriller", "War", "Western")
NUM_GENRES = len(GENRES)
GENRE_INDEX = {g: i for i, g in enumerate(GENRES)}
MOVIELENS_FEATURES = ("user", "movie", "genres", "history")


@functools.lru_cache(maxsize=4)
def _load(directory: str):
    """Parses the two CSV files once: numpy arrays in ratings.csv order plus the genre table."""
    with open(os.path.join(directory, "ratings.csv"), newline="", encoding="utf-8") as f:
        r = csv.reader(f)
        header = next(r)
        if header[:4] != ["userId", "movieId", "rating", "timestamp"]:
            raise ValueError(f"unexpected ratings.csv header {header} in {directory}")
        cols = list(zip(*r))
    user, movie = np.array(cols[0], np.int64), np.array(cols[1], np.int64)
    rating, ts = np.array(cols[2], np.float64), np.array(cols[3], np.int64)
    movie_ids, values, splits = [], [], [0]
    with open(os.path.join(directory, "movies.csv"), newline="", encoding="utf-8") as f:
        r = csv.reader(f)
        next(r)
        for line, row in enumerate(r, start=2):
            try:
                ids = [GENRE_INDEX[g] for g in row[2].split("|")]
            except KeyError as e:
                raise ValueError(f"{directory}/movies.csv line {line}: genre {e} is not in GENRES")
            movie_ids.append(int(row[0]))
            values.extend(ids)
            splits.append(len(values))
    return (user, movie, rating, ts, np.array(movie_ids, np.int64), np.array(values, np.int64),
            np.array(splits, np.int64))


def movielens_info(directory) -> Dict[str, int]:
    """Sizes for tables: user_vocab_size / movie_vocab_size = max raw ID + 1 (over ratings and
    movies), genre_vocab_size = NUM_GENRES, num_ratings, num_users, num_movies (distinct)."""
    user, movie, _, _, movie_ids, _, _ = _load(os.fspath(directory))
    return {"user_vocab_size": int(user.max()) + 1,
            "movie_vocab_size": int(max(movie.max(), movie_ids.max())) + 1,
            "genre_vocab_size": NUM_GENRES, "num_ratings": int(user.size),
            "num_users": int(np.unique(user).size), "num_movies": int(np.unique(movie).size)}


def movielens_arrays(directory, history_len: int = 20, test_fraction: float = 0.1
                     ) -> Dict[str, np.ndarray]:
    """The whole data set as numpy arrays, one row per rating in ratings.csv order.

    Returns a dict of:
      user, movie, label (float32), is_test (bool): [n];
      hist_start, hist_len: int64[n], the history of rating i is seq[hist_start[i]:][:hist_len[i]];
      seq: int64[n], movieIds sorted by (user, timestamp, line);
      genre_row: int64[n], row of the movie in (genre_values, genre_splits), or the last, empty row;
      genre_values: int64[G], genre_splits: int64[movies + 2].
    """
    if history_len < 0 or not 0.0 <= test_fraction <= 1.0:
        raise ValueError(f"need history_len >= 0 and 0 <= test_fraction <= 1, got "
                         f"{history_len}, {test_fraction}")
    user, movie, rating, ts, movie_ids, g_values, g_splits = _load(os.fspath(directory))
    n = user.size
    order = np.lexsort((np.arange(n), ts, user))          # by user, then time, then line
    su = user[order]
    new_user = np.r_[True, su[1:] != su[:-1]]
    starts = np.flatnonzero(new_user)
    counts = np.diff(np.r_[starts, n])
    start_of = np.repeat(starts, counts)                  # per sorted position
    k = np.arange(n) - start_of                           # index within the user's sequence
    n_test = np.floor(counts * test_fraction + 1e-9).astype(np.int64)
    hist_len = np.empty(n, np.int64)
    hist_start = np.empty(n, np.int64)
    is_test = np.empty(n, bool)
    hist_len[order] = np.minimum(k, history_len)
    hist_start[order] = np.arange(n) - np.minimum(k, history_len)
    is_test[order] = k >= np.repeat(counts - n_test, counts)
    pos = np.searchsorted(movie_ids, movie) if np.all(np.diff(movie_ids) > 0) else None
    if pos is None:                                       # unsorted movies.csv: use a dict
        index = {m: i for i, m in enumerate(movie_ids.tolist())}
        genre_row = np.array([index.get(m, movie_ids.size) for m in movie.tolist()], np.int64)
    else:
        pos = np.minimum(pos, movie_ids.size - 1)
        genre_row = np.where(movie_ids[pos] == movie, pos, movie_ids.size)
    return {"user": user, "movie": movie, "label": (rating >= 4.0).astype(np.float32),
            "is_test": is_test, "hist_start": hist_start, "hist_len": hist_len,
            "seq": movie[order], "genre_row": genre_row.astype(np.int64),
            "genre_values": g_values, "genre_splits": np.r_[g_splits, g_splits[-1]]}


def movielens_dataset(directory, batch_size: int, history_len: int = 20, num_shards: int = 1,
                      shard_index: int = 0, split: str = "train", test_fraction: float = 0.1,
                      seed: int = 0, shuffle: Optional[bool] = None, repeat: bool = False,
                      drop_remainder: bool = False, deterministic: bool = True):
    """tf.data.Dataset of MovieLens batches `(features, label)` (shapes in the module docstring).

    Args:
      directory: folder with ratings.csv and movies.csv.
      batch_size: B. history_len: most recent movies kept in "history".
      num_shards, shard_index: Horovod size and rank (by-sample sharding).
      split: "train", "test" or "all". test_fraction: per-user chronological tail held out.
      seed: the train permutation (same on all ranks). shuffle: default True for "train" only.
      repeat: loop forever (same order every epoch). drop_remainder: static batch dimension.
    """
    import tensorflow as tf  # on use: tf_fusedemb.data imports without TensorFlow (data/__init__)
    check_shard(num_shards, shard_index)
    if split not in ("train", "test", "all"):
        raise ValueError(f"split must be 'train', 'test' or 'all', got {split!r}")
    a = movielens_arrays(directory, history_len, test_fraction)
    idx = np.arange(a["user"].size)
    if split != "all":
        idx = idx[a["is_test"] == (split == "test")]
    if shuffle if shuffle is not None else split == "train":
        idx = idx[np.random.default_rng(seed).permutation(idx.size)]
    idx = idx[shard_index::num_shards]

    user, movie, label = (tf.constant(a[k]) for k in ("user", "movie", "label"))
    hs, hl, seq, grow = (tf.constant(a[k]) for k in ("hist_start", "hist_len", "seq", "genre_row"))
    genre_table = tf.RaggedTensor.from_row_splits(tf.constant(a["genre_values"]),
                                                  tf.constant(a["genre_splits"]), validate=False)

    def static_rows(rt, b):  # keeps a static batch size (drop_remainder) in the ragged spec
        return rt if b is None else tf.RaggedTensor.from_row_splits(
            rt.values, tf.reshape(rt.row_splits, [b + 1]), validate=False)

    def gather(i):  # i: int64[B] sample indices
        start = tf.gather(hs, i)
        pos = tf.ragged.range(start, start + tf.gather(hl, i))                 # [B, None]
        feats = {"user": tf.gather(user, i), "movie": tf.gather(movie, i),
                 "genres": static_rows(tf.gather(genre_table, tf.gather(grow, i)), i.shape[0]),
                 "history": static_rows(pos.with_flat_values(tf.gather(seq, pos.flat_values)),
                                        i.shape[0])}
        return feats, tf.gather(label, i)[:, None]

    ds = tf.data.Dataset.from_tensor_slices(idx.astype(np.int64))
    if repeat:
        ds = ds.repeat()
    ds = ds.batch(int(batch_size), drop_remainder=bool(drop_remainder))
    return parse_and_prefetch(ds, gather, deterministic)
