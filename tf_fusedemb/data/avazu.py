"""Avazu CTR CSV reader: graph-mode tf.data, Horovod-sharded by line.

Line format (comma-separated, 24 fields, no quoting): id, click, hour, C1, banner_pos, site_id,
site_domain, site_category, app_id, app_domain, app_category, device_id, device_ip, device_model,
device_type, device_conn_type, C14..C21. A first line starting with "id," is a header and skipped
(per file; the Kaggle train.csv has one, the sample's dev/test files do not). Each element of
`avazu_dataset` is `(features, label)`:
  features[name] for name in AVAZU_CATEGORICAL (every column but id and click, "hour" included):
      int64[B] = tf.strings.to_hash_bucket_fast(value, 2**62), i.e. FarmHash Fingerprint64 of
      the string mod 2**62: stable across runs, platforms and TF versions (it is the function
      behind tf.fingerprint), non-negative. Equal strings of different columns get equal IDs; the
      fused layer keeps categories apart. An empty field gives MISSING_ID (0); a real string
      hashes to 0 with probability 2**-62.
  features["hour_of_day"] (when hour_of_day=True): int64[B] in 0..23, the last two digits of
      "hour" (YYMMDDHH), an exact small ID rather than a hash.
  label: float32[B, 1] = click (0.0 / 1.0).
Sharding is by line before shuffling and batching (see pipeline.py). A line with a field count
other than 24 raises tf.errors.InvalidArgumentError naming the file and line number.
"""
from __future__ import annotations

from .pipeline import (PathOrPaths, parse_and_prefetch, resolve_paths, shard_shuffle_batch,
                       split_fields, text_lines)
from .synthetic import MISSING_ID

__all__ = ["AVAZU_COLUMNS", "AVAZU_CATEGORICAL", "AVAZU_HOUR_OF_DAY", "AVAZU_NUM_BUCKETS",
           "avazu_dataset"]

AVAZU_COLUMNS = ("id", "click", "hour", "C1", "banner_pos", "site_id", "site_domain",
                 "site_category", "app_id", "app_domain", "app_category", "device_id", "device_ip",
                 "device_model", "device_type", "device_conn_type", "C14", "C15", "C16", "C17",
                 "C18", "C19", "C20", "C21")
AVAZU_CATEGORICAL = AVAZU_COLUMNS[2:]
AVAZU_HOUR_OF_DAY = "hour_of_day"
AVAZU_NUM_BUCKETS = 2 ** 62


def _has_header(path: str) -> bool:
    with open(path, "rb") as f:
        return f.readline().startswith(b"id,")


def _parse_batch(lines, origins, paths, hour_of_day: bool):
    """string[B] lines, int64[B] origins -> (features dict, label float32[B, 1])."""
    import tensorflow as tf  # on use: tf_fusedemb.data imports without TensorFlow (data/__init__)
    t = split_fields(lines, origins, paths, ",", len(AVAZU_COLUMNS), "Avazu")          # [B, 24]
    label = tf.strings.to_number(t[:, 1:2], tf.float32)
    c = t[:, 2:]
    ids = tf.where(tf.equal(c, ""), tf.constant(MISSING_ID, tf.int64),
                   tf.strings.to_hash_bucket_fast(c, AVAZU_NUM_BUCKETS))
    feats = {n: ids[:, k] for k, n in enumerate(AVAZU_CATEGORICAL)}
    if hour_of_day:
        feats[AVAZU_HOUR_OF_DAY] = tf.strings.to_number(t[:, 2], tf.int64) % 100
    return feats, label


def avazu_dataset(path_or_paths: PathOrPaths, batch_size: int, num_shards: int = 1,
                  shard_index: int = 0, repeat: bool = False, shuffle_buffer: int = 0,
                  seed: int = 0, drop_remainder: bool = False, hour_of_day: bool = True,
                  deterministic: bool = True):
    """tf.data.Dataset of Avazu batches `(features, label)` (shapes in the module docstring).

    Args:
      path_or_paths: a CSV file, a glob, or a list of them, read in order (headers skipped).
      batch_size: B. num_shards, shard_index: Horovod size and rank (by-line sharding).
      repeat, shuffle_buffer, seed, drop_remainder, deterministic: as in criteo_dataset.
      hour_of_day: add the "hour_of_day" feature.
    """
    paths = resolve_paths(path_or_paths)
    ds = text_lines(paths, [int(_has_header(p)) for p in paths])
    ds = shard_shuffle_batch(ds, batch_size, num_shards, shard_index, shuffle_buffer, seed, repeat,
                             drop_remainder)
    return parse_and_prefetch(ds, lambda l, o: _parse_batch(l, o, paths, hour_of_day),
                              deterministic)
