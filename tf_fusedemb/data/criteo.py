"""Criteo Display Advertising (Kaggle) TSV reader: graph-mode tf.data, Horovod-sharded by line.

Line format (tab-separated, 40 fields): label, I1..I13 (integers, may be empty), C1..C26 (32-bit
hex strings such as "68fd1e64", may be empty). Each element of `criteo_dataset` is
`(features, label)`:
  features["I1".."I13"]: float32[B] = log1p(max(x, 0)); an empty field counts as x = 0, so it
      gives 0.0 (the usual Criteo preprocessing: I2 has negative values, which also clamp to 0).
  features["C1".."C26"]: int64[B] = the hex parsed as an unsigned 32-bit integer, in [0, 2**32);
      an empty field gives MISSING_ID (= 0, from synthetic.py). A real hex value "00000000" would
      collide with "missing"; Criteo's values are hashes, so the chance is ~2**-32 per distinct
      value (~1% that any of the ~33M distinct values of the full 45M-row data set is 0; none in
      the shipped sample), and such a collision only merges two rows of one table.
  label: float32[B, 1] (0.0 or 1.0).
B = batch_size, except a smaller last batch unless drop_remainder.

Sharding is by line before shuffling and batching (see pipeline.py): rank r of N gets lines
r, r+N, ... of the (skip/take-trimmed) concatenated files. Malformed input is never silently
dropped: a line with a field count other than 40, or a categorical field that is not 0..8 hex
digits, raises tf.errors.InvalidArgumentError naming the file and line number (one regex per
line checks this); a non-numeric label or dense field raises tf.strings.to_number's
InvalidArgumentError (which names the bad string, not the file).

`read_criteo` runs the same parser eagerly and returns numpy columns (benchmarks, profile fitting):
this module is the one definition of the format and of what a missing value becomes.

Hold-out: the Kaggle train.txt is in time order, so `criteo_eval_split` keeps the LAST
`eval_fraction` of the lines for evaluation; or pass the separate test.txt as its own dataset;
or use `skip_lines` / `take_lines` directly.
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

import numpy as np

if TYPE_CHECKING:  # the datasets are built by data.pipeline (importing this module needs no TF)
    import tensorflow as tf

from .pipeline import (PathOrPaths, count_lines, parse_and_prefetch, resolve_paths,
                       shard_shuffle_batch, split_fields, text_lines)
from .synthetic import MISSING_ID

__all__ = ["CRITEO_DENSE", "CRITEO_CATEGORICAL", "CRITEO_NUM_FIELDS", "parse_hex32",
           "criteo_dataset", "criteo_eval_split", "read_criteo", "dense_log1p"]

CRITEO_DENSE = tuple(f"I{i}" for i in range(1, 14))
CRITEO_CATEGORICAL = tuple(f"C{i}" for i in range(1, 27))
CRITEO_NUM_FIELDS = 1 + len(CRITEO_DENSE) + len(CRITEO_CATEGORICAL)  # 40


def dense_log1p(values):
    """The usual Criteo dense preprocessing, log1p(max(x, 0)), for numpy columns (raw values
    from `read_criteo` or `synthetic.generate_criteo_like`); the TF parser applies the same.

    Args:
      values: float[...] raw integer values (I2 has negative ones, which clamp to 0).
    Returns:
      float32[...].
    """
    return np.log1p(np.maximum(np.asarray(values, np.float64), 0.0)).astype(np.float32)


def parse_hex32(strings):
    """Parses hex strings of at most 8 digits (either case) as unsigned 32-bit integers.

    TF ops only, SWAR style: decode_raw pads each string with zero bytes to 8 bytes, which are
    bitcast to one int64 word; per byte, nibble = (b & 15) + 9 * (b >> 6 & 1) ('0'-'9' -> 0-9,
    'a'-'f'/'A'-'F' -> 10-15, zero padding -> 0); three mask-and-shift steps pack the 8 nibbles
    (first character most significant), and a right shift by 4 * (8 - length) drops the padding.
    Characters are NOT validated here (criteo_dataset validates whole lines with one regex).
    Args:
      strings: string[...] of 0..8 hex digits; "" parses as 0.
    Returns:
      int64[...] in [0, 2**32).
    """
    import tensorflow as tf  # on use: tf_fusedemb.data imports without TensorFlow (data/__init__)
    band, bor = tf.bitwise.bitwise_and, tf.bitwise.bitwise_or
    shr, shl = tf.bitwise.right_shift, tf.bitwise.left_shift
    raw = tf.io.decode_raw(strings, tf.uint8, fixed_length=8)                         # [..., 8]
    if sys.byteorder == "big":
        raw = tf.reverse(raw, [-1])  # first character in the lowest byte, as on little-endian
    w = tf.bitcast(raw, tf.int64)
    nib = band(w, 0x0F0F0F0F0F0F0F0F) + 9 * band(shr(w, 6), 0x0101010101010101)
    v = bor(shl(band(nib, 0x000F000F000F000F), 4), band(shr(nib, 8), 0x000F000F000F000F))
    v = bor(shl(band(v, 0x000000FF000000FF), 8), band(shr(v, 16), 0x000000FF000000FF))
    v = bor(shl(band(v, 0xFFFF), 16), band(shr(v, 32), 0xFFFF))
    pad = 4 * (8 - tf.minimum(tf.strings.length(strings), 8))
    return shr(v, tf.cast(pad, tf.int64))


# A whole line: label, 13 dense fields (any text; to_number checks them), 26 fields of 0..8 hex.
_LINE_REGEX = r"[^\t]*(?:\t[^\t]*){13}(?:\t[0-9a-fA-F]{0,8}){26}"


def _parse_batch(lines, origins, paths, log1p: bool, with_missing: bool = False):
    """string[B] lines, int64[B] origins -> (features dict, label float32[B, 1]); with
    `with_missing`, also {feature: bool[B]} saying which cells were empty."""
    import tensorflow as tf  # on use: tf_fusedemb.data imports without TensorFlow (data/__init__)
    t = split_fields(lines, origins, paths, "\t", CRITEO_NUM_FIELDS, "Criteo", _LINE_REGEX,
                     " (C1..C26 must be 0..8 hex digits)")                             # [B, 40]
    label = tf.strings.to_number(t[:, :1], tf.float32)
    empty = tf.equal(t[:, 1:], "")                                                     # [B, 39]
    d = t[:, 1:14]
    dense = tf.strings.to_number(tf.where(empty[:, :13], "0", d), tf.float64)
    dense = tf.cast(tf.math.log1p(tf.maximum(dense, 0.0)) if log1p else dense, tf.float32)
    ids = tf.where(empty[:, 13:], tf.constant(MISSING_ID, tf.int64), parse_hex32(t[:, 14:]))
    feats = {n: dense[:, k] for k, n in enumerate(CRITEO_DENSE)}
    feats.update({n: ids[:, k] for k, n in enumerate(CRITEO_CATEGORICAL)})
    if not with_missing:
        return feats, label
    return feats, label, {n: empty[:, k] for k, n in enumerate(CRITEO_DENSE + CRITEO_CATEGORICAL)}


def criteo_dataset(path_or_paths: PathOrPaths, batch_size: int, num_shards: int = 1,
                   shard_index: int = 0, repeat: bool = False, shuffle_buffer: int = 0,
                   seed: int = 0, drop_remainder: bool = False, skip_lines: int = 0,
                   take_lines: Optional[int] = None, log1p: bool = True,
                   deterministic: bool = True):
    """tf.data.Dataset of Criteo batches `(features, label)` (shapes in the module docstring).

    Args:
      path_or_paths: a TSV file, a glob, or a list of them, read in order as one stream of lines.
      batch_size: B. num_shards, shard_index: Horovod size and rank (by-line sharding).
      repeat: loop forever. shuffle_buffer, seed: per-rank seeded line shuffle (0 = file order).
      drop_remainder: drop a smaller last batch (static batch dimension).
      skip_lines, take_lines: trim the concatenated lines before sharding (hold-out splits).
      log1p: dense as log1p(max(x, 0)) (default) or the raw integer values (empty -> 0).
      deterministic: keep element order under parallel parsing.
    """
    paths = resolve_paths(path_or_paths)
    ds = text_lines(paths)
    if skip_lines:
        ds = ds.skip(int(skip_lines))
    if take_lines is not None:
        ds = ds.take(int(take_lines))
    ds = shard_shuffle_batch(ds, batch_size, num_shards, shard_index, shuffle_buffer, seed, repeat,
                             drop_remainder)
    return parse_and_prefetch(ds, lambda l, o: _parse_batch(l, o, paths, log1p), deterministic)


def criteo_eval_split(path_or_paths: PathOrPaths, batch_size: int, eval_fraction: float = 0.1,
                      num_lines: Optional[int] = None, eval_batch_size: Optional[int] = None,
                      **kwargs: Any) -> Tuple[tf.data.Dataset, tf.data.Dataset]:
    """(train, eval) datasets: eval = the last `eval_fraction` of the lines (time order).

    The eval dataset is neither shuffled nor repeated; both are sharded by `num_shards` /
    `shard_index` from kwargs. `num_lines` avoids counting the lines (one pass over the files).
    Returns:
      (train_ds, eval_ds), each as from `criteo_dataset`.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    n = count_lines(resolve_paths(path_or_paths)) if num_lines is None else int(num_lines)
    n_eval = int(n * eval_fraction)
    train = criteo_dataset(path_or_paths, batch_size, take_lines=n - n_eval, **kwargs)
    ekw = {k: v for k, v in kwargs.items() if k not in ("repeat", "shuffle_buffer", "seed")}
    ev = criteo_dataset(path_or_paths, eval_batch_size or batch_size, skip_lines=n - n_eval, **ekw)
    return train, ev


def read_criteo(path_or_paths: PathOrPaths, max_rows: Optional[int] = None, log1p: bool = False,
                with_missing: bool = False) -> Dict[str, Any]:
    """The first `max_rows` lines (all when None) as numpy columns, parsed by `criteo_dataset`'s
    parser (same validation, same missing values), eagerly.

    Args:
      path_or_paths: as for `criteo_dataset`.
      max_rows: at most this many lines (>= 1), None for all.
      log1p: dense as log1p(max(x, 0)); default False, the raw integers (empty -> 0).
      with_missing: also return which cells were empty.
    Returns:
      {"C1".."C26": int64[n] (empty -> MISSING_ID), "I1".."I13": float32[n], "label":
      float32[n]}, the form of `synthetic.generate_criteo_like`; with `with_missing`, also
      "missing": {feature: bool[n]}.
    Raises:
      ValueError: no lines or max_rows < 1; tf.errors.InvalidArgumentError: a malformed line
      (naming file and line).
    """
    if max_rows is not None and int(max_rows) < 1:
        raise ValueError(f"max_rows must be >= 1 or None, got {max_rows}")
    paths = resolve_paths(path_or_paths)
    ds = text_lines(paths)
    ds = (ds if max_rows is None else ds.take(int(max_rows))).batch(1 << 16)
    parts = [_parse_batch(lines, origins, paths, log1p, True) for lines, origins in ds]
    if not parts:
        raise ValueError(f"no Criteo lines in {paths}")
    columns = {n: np.concatenate([p[0][n].numpy() for p in parts])
               for n in CRITEO_CATEGORICAL + CRITEO_DENSE}
    columns["label"] = np.concatenate([p[1].numpy()[:, 0] for p in parts])
    if with_missing:
        columns["missing"] = {n: np.concatenate([p[2][n].numpy() for p in parts])
                              for n in parts[0][2]}
    return columns
