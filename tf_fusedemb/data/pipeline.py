"""Shared tf.data helpers of the real-data readers (criteo, movielens, avazu).

Conventions of every reader built on these helpers:
  * Elements are `(features, label)`: `features` a dict name -> int64[B] / float32[B] /
    tf.RaggedTensor int64[B, None], `label` float32[B, 1].
  * Sharding is by line (sample) BEFORE shuffling and batching: rank r of N keeps lines
    r, r + N, r + 2N, ... of the (skip/take-trimmed) input, so the ranks' slices are disjoint and
    their union is the whole input. Line counts of ranks differ by at most one, so their batch
    counts may differ by one: use `equal_steps` and `dataset.take(steps)` (or `repeat=True`) so
    that every Horovod rank runs the same number of collective steps.
  * Order is deterministic by default (seeded shuffles, `deterministic=True` on parallel maps);
    parsing runs on whole batches with `num_parallel_calls=tf.data.AUTOTUNE`, then prefetch.

TensorFlow is imported inside the functions, so importing this module does not import it.
"""
from __future__ import annotations

import glob as _glob
import os
from typing import Callable, List, Sequence, Union

__all__ = ["resolve_paths", "check_shard", "text_lines", "split_fields", "shard_shuffle_batch",
           "parse_and_prefetch", "origin_message", "assert_ok", "batch", "equal_steps",
           "count_lines", "array_batches"]

PathOrPaths = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]


def resolve_paths(path_or_paths: PathOrPaths) -> List[str]:
    """A path, a glob or a list of them -> list of existing files (order kept, globs sorted).

    Raises:
      FileNotFoundError: a path or pattern matches no file.
    """
    items: List[Union[str, os.PathLike]] = (
        [path_or_paths] if isinstance(path_or_paths, (str, os.PathLike)) else list(path_or_paths))
    out: List[str] = []
    for item in items:
        path = os.fspath(item)
        matches = sorted(_glob.glob(path)) if _glob.has_magic(path) else [path]
        if not matches or not all(os.path.isfile(m) for m in matches):
            raise FileNotFoundError(f"no data file at {path!r}")
        out.extend(matches)
    if not out:
        raise FileNotFoundError("no data files given")
    return out


def check_shard(num_shards: int, shard_index: int) -> None:
    """Raises ValueError unless 0 <= shard_index < num_shards."""
    if int(num_shards) < 1 or not 0 <= int(shard_index) < int(num_shards):
        raise ValueError(f"need 0 <= shard_index < num_shards, got shard_index={shard_index}, "
                         f"num_shards={num_shards}")


def count_lines(paths: Sequence[str]) -> int:
    """Number of lines of the files together (a last line without newline counts)."""
    total = 0
    for p in paths:
        last = b"\n"
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                total += chunk.count(b"\n")
                last = chunk[-1:]
        total += last != b"\n"
    return total


def text_lines(paths: Sequence[str], skip_first: Sequence[int] = (), block: int = 512):
    """Lines of the files in order, each tagged with where it came from (for error messages).

    Lines are read in blocks of `block`, tagged with vectorised ops, then unbatched: ~2x faster
    than zipping a per-line counter (tf.data's per-element overhead dominates line reading).
    Args:
      paths: files, read one after the other.
      skip_first: per file, how many leading lines (headers) to skip; default none.
    Returns:
      tf.data.Dataset of (line: string[], origin: int64[] = file_index * 2**40 + line_number,
      line_number 1-based in its file); `origin_message` decodes it.
    """
    import tensorflow as tf  # on use: tf_fusedemb.data imports without TensorFlow (data/__init__)
    skips = list(skip_first) or [0] * len(paths)

    def per_file(path, first, skip):
        def tag(lines, k):
            num = k * block + tf.range(tf.size(lines, out_type=tf.int64))   # 0-based line number
            keep = num >= skip
            return tf.boolean_mask(lines, keep), tf.boolean_mask(first + num, keep)
        return tf.data.Dataset.zip((tf.data.TextLineDataset(path).batch(block),
                                    tf.data.Dataset.range(_LINE_BASE))).map(tag)

    files = tf.data.Dataset.from_tensor_slices((
        tf.constant(list(paths), tf.string),
        tf.constant([k * _LINE_BASE + 1 for k in range(len(paths))], tf.int64),
        tf.constant(skips, tf.int64)))
    return files.flat_map(per_file).unbatch()


_LINE_BASE = 1 << 40


def origin_message(paths: Sequence[str], origin):
    """int64[] origin from `text_lines` -> string[] "file <path> line <n>"."""
    import tensorflow as tf  # on use: tf_fusedemb.data imports without TensorFlow (data/__init__)
    path = tf.gather(tf.constant(list(paths), tf.string), origin // _LINE_BASE)
    return tf.strings.join(["file ", path, " line ", tf.strings.as_string(origin % _LINE_BASE)])


def split_fields(lines, origins, paths: Sequence[str], sep: str, num_fields: int, what: str,
                 line_regex: str = "", rule: str = ""):
    """Splits a batch of lines into `num_fields` string columns, checking the format first.

    One RE2 full match per line validates it (by default only the field count; `line_regex`
    may be stricter, with `rule` saying how in the error message), then tf.strings.split splits
    it (quotes are plain characters; measured faster per CPU-second than tf.io.decode_csv).
    Args:
      lines: string[B]; origins: int64[B] (from `text_lines`, batched); paths: its file list;
      sep: one character.
    Returns:
      string[B, num_fields].
    Raises (when run):
      tf.errors.InvalidArgumentError naming the first bad line's file and line number, its field
      count and its first 120 characters.
    """
    import tensorflow as tf  # on use: tf_fusedemb.data imports without TensorFlow (data/__init__)
    if len(sep) != 1:
        raise ValueError(f"sep must be one character, got {sep!r}")
    x = "\\x{%02x}" % ord(sep)
    regex = line_regex or f"[^{x}]*(?:{x}[^{x}]*){{{num_fields - 1}}}"
    bad = tf.logical_not(tf.strings.regex_full_match(lines, regex))
    i = tf.argmax(tf.cast(bad, tf.int32))
    lines = assert_ok(lines, bad, lambda: tf.strings.join([
        f"bad {what} line: ", origin_message(paths, origins[i]), " has ",
        tf.strings.as_string(tf.size(tf.strings.split(lines[i], sep))),
        f" fields, expected {num_fields}{rule}; it starts: ", tf.strings.substr(lines[i], 0, 120)]))
    return tf.strings.split(lines, sep).to_tensor(default_value="",
                                                  shape=[lines.shape[0], num_fields])


def assert_ok(value, bad, message_fn):
    """`value` (a tf.Tensor), gated on a check: raises tf.errors.InvalidArgumentError(message_fn())
    when any of bool[B] `bad` is True. The message is only built on failure (tf.cond)."""
    import tensorflow as tf  # on use: tf_fusedemb.data imports without TensorFlow (data/__init__)

    def fail():
        with tf.control_dependencies([tf.debugging.Assert(False, [message_fn()])]):
            return tf.constant(False)

    ok = tf.cond(tf.reduce_any(bad), fail, lambda: tf.constant(True))
    with tf.control_dependencies([ok]):
        return tf.identity(value)


def shard_shuffle_batch(ds, batch_size: int, num_shards: int = 1, shard_index: int = 0,
                        shuffle_buffer: int = 0, seed: int = 0, repeat: bool = False,
                        drop_remainder: bool = False):
    """shard (by element) -> shuffle(shuffle_buffer, seed) -> repeat -> batch(batch_size).

    Every rank must pass the same `seed`; shuffling happens inside a rank's own slice, after
    sharding, so slices stay disjoint. The shuffle order differs every epoch (still seeded).
    """
    check_shard(num_shards, shard_index)
    if int(batch_size) < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if num_shards > 1:
        ds = ds.shard(num_shards, shard_index)
    if shuffle_buffer and shuffle_buffer > 1:
        ds = ds.shuffle(int(shuffle_buffer), seed=int(seed), reshuffle_each_iteration=True)
    if repeat:
        ds = ds.repeat()
    return ds.batch(int(batch_size), drop_remainder=bool(drop_remainder))


def parse_and_prefetch(ds, parse_fn: Callable, deterministic: bool = True):
    """map(parse_fn, AUTOTUNE parallel calls, deterministic order) -> prefetch(AUTOTUNE)."""
    import tensorflow as tf  # on use: tf_fusedemb.data imports without TensorFlow (data/__init__)
    ds = ds.map(parse_fn, num_parallel_calls=tf.data.AUTOTUNE, deterministic=bool(deterministic))
    return ds.prefetch(tf.data.AUTOTUNE)


def batch(ds, batch_size: int, drop_remainder: bool = False):
    """Batches elements, turning variable-length components (shape [None, ...]) into
    tf.RaggedTensor [B, None, ...] via `Dataset.ragged_batch`; all-fixed elements use `batch`."""
    import tensorflow as tf  # on use: tf_fusedemb.data imports without TensorFlow (data/__init__)
    specs = tf.nest.flatten(ds.element_spec)
    ragged = any(isinstance(s, tf.RaggedTensorSpec) or
                 (isinstance(s, tf.TensorSpec) and not s.shape.is_fully_defined()) for s in specs)
    if ragged:
        return ds.ragged_batch(int(batch_size), drop_remainder=bool(drop_remainder))
    return ds.batch(int(batch_size), drop_remainder=bool(drop_remainder))


def array_batches(arrays, batch_size: int, repeat: bool = False,
                  drop_remainder: bool = False):
    """Batches of in-memory ``arrays`` (a nest of arrays with equal first dimension n),
    the same batches as ``from_tensor_slices(arrays)[.repeat()].batch(batch_size,
    drop_remainder)`` but built one batch at a time: batch k gathers rows
    ``k*B .. k*B+B-1`` (modulo n when repeating, so batches wrap across epochs as
    ``repeat().batch()`` does). Slicing element by element costs a tensor slice per row
    and column, and on the main job's 40 columns it was most of the input pipeline's time.

    Returns:
      a tf.data.Dataset of the nest's structure with leading dimension B (the last batch
      of a finite one may be shorter unless ``drop_remainder``), prefetched.
    """
    import tensorflow as tf  # on use: tf_fusedemb.data imports without TensorFlow (data/__init__)
    flat = [tf.convert_to_tensor(a) for a in tf.nest.flatten(arrays)]
    n, b = int(flat[0].shape[0]), int(batch_size)
    if b <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if any(int(t.shape[0]) != n for t in flat):
        raise ValueError(f"arrays must share their first dimension, got "
                         f"{[int(t.shape[0]) for t in flat]}")
    if repeat and n == 0:
        raise ValueError("cannot repeat zero rows")
    positions = tf.range(b, dtype=tf.int64)
    if repeat:
        steps = tf.data.Dataset.counter()
        rows_of = lambda k: tf.math.floormod(k * b + positions, n)  # noqa: E731
    elif drop_remainder:  # whole batches only: a static batch dimension, as batch() gives
        steps = tf.data.Dataset.range(n // b)
        rows_of = lambda k: k * b + positions  # noqa: E731
    else:
        steps = tf.data.Dataset.range(-(-n // b))
        rows_of = lambda k: tf.range(k * b, tf.minimum(k * b + b, n))  # noqa: E731

    def gather(k):
        rows = rows_of(k)
        return tf.nest.pack_sequence_as(arrays, [tf.gather(t, rows) for t in flat])

    return steps.map(gather).prefetch(tf.data.AUTOTUNE)


def equal_steps(num_rows: int, batch_size: int, num_shards: int = 1,
                drop_remainder: bool = False) -> int:
    """Batches per epoch that EVERY rank has under line sharding (the minimum over ranks).

    Rank r holds ceil((num_rows - r) / num_shards) rows; the last rank holds the fewest,
    floor(num_rows / num_shards). Pass the result to `dataset.take(...)` so all Horovod ranks
    run the same number of steps.
    """
    rows = int(num_rows) // int(num_shards)
    return rows // int(batch_size) if drop_remainder else -(-rows // int(batch_size))
