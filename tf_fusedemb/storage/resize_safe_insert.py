"""Upserts into TFRA CPU hash tables that never run concurrently with a table resize.

Why: TFRA 0.8.1 splits one insert over TensorFlow's intra-op threads (``Shard``) into
its vendored copy of libcuckoo, and libcuckoo's concurrent resize has a race
(efficient/libcuckoo#157, open): a thread that misses a resize writes its row into the
bucket array being discarded, so the row is counted by ``size()`` but gone. Measured on
TFRA's header with 8 threads inserting 324,382 random keys from an empty table: 1-2 rows
lost in 3 of 200 runs; 0 of 200 when the table was pre-sized (no resize), and never on
one thread. libcuckoo's HEAD (with its 2024 resize fix 91b9c2d) trips its own
``cuckoo_insert`` assertion under the same load. After a loss TFRA's ``export`` returns
uninitialised memory as its last key: the main job's intermittent "stored keys have no
recorded (table, ID)" (issue 9), on the export's bulk restore of 324k rows.

So an upsert runs as a loop of blocks: a block that cannot resize the table (see
:func:`parallel_room`) is inserted in parallel as before; near a resize, blocks are chunks
small enough that TensorFlow runs each on the calling thread, one after another. Eigen's
cost model keeps a ``ParallelFor`` of total cost below 2.1e5 cycles on one thread; TFRA
charges ``n * dim / threads + 1`` cycles per key, so a chunk of n keys with
``n * (n * dim + 1) < SERIAL_COST`` is serial for any thread count. A training step far
from a resize is one parallel block; a bulk restore of 324k rows inserts about 15% of
its rows serially.
"""
import math
from typing import Callable, Sequence

import tensorflow as tf

# libcuckoo doubles when an insert finds no free slot: measured at load factors
# 0.958-0.975 (single thread, random keys, 8 doublings x 20 runs). Below this fraction
# of a power-of-two capacity no resize can happen.
RESIZE_LOAD_FACTOR = 0.9
# Half of Eigen's one-thread limit (kStartupCycles + 1.1 * kPerThreadCycles = 2.1e5).
SERIAL_COST = 100_000


def serial_chunk(dim: int) -> int:
    """Keys per upsert that TFRA inserts on one thread, for rows of width ``dim``."""
    n = int(math.isqrt(SERIAL_COST // dim))
    while n > 1 and n * (n * dim + 1) >= SERIAL_COST:
        n -= 1
    return max(n, 1)


def parallel_room(stored: tf.Tensor) -> tf.Tensor:
    """int64 scalar: how many more keys a table holding ``stored`` rows takes with no
    possible resize. libcuckoo capacities are powers of two and the table holds
    ``stored``, so its capacity is at least C = the smallest power of two >= stored, and
    a resize needs the load to pass RESIZE_LOAD_FACTOR of it. Errs low (the exponent is
    biased down); may be negative."""
    stored = tf.cast(stored, tf.float64)
    exponent = tf.math.ceil(tf.math.log(tf.maximum(stored, 1.0)) / math.log(2.0) - 1e-6)
    capacity = tf.pow(tf.constant(2.0, tf.float64), exponent)
    return tf.cast(tf.math.floor(RESIZE_LOAD_FACTOR * capacity - stored) - 1, tf.int64)


def upsert(tables: Sequence, keys: tf.Tensor, values: Sequence[tf.Tensor], dim: int,
           size: Callable[[], tf.Tensor]):
    """Upserts ``values[i]`` (float32[n, dim]) under ``keys`` (int64[n], unique) into each
    TFRA ``dynamic_embedding.Variable`` ``tables[i]``; the tables hold the same keys,
    ``size()`` (int64 scalar) of them. Returns an op (None when eager)."""
    if tf.executing_eagerly():  # a bulk load: run the loop as one graph, not op by op
        def load():
            _upsert(tables, keys, values, dim, size)  # stateful: runs without being returned
        tf.function(load, autograph=False)()
        return None
    return _upsert(tables, keys, values, dim, size)


def _upsert(tables, keys, values, dim, size):
    chunk, total = tf.constant(serial_chunk(dim), tf.int64), tf.size(keys, out_type=tf.int64)

    def body(start):
        room = parallel_room(size())
        count = tf.minimum(tf.where(room >= chunk, room, chunk), total - start)
        block = tf.range(start, start + count)
        ops = [t.upsert(tf.gather(keys, block), tf.gather(v, block))
               for t, v in zip(tables, values)]
        with tf.control_dependencies(ops):
            return start + count
    done = tf.while_loop(lambda start: start < total, body, [tf.constant(0, tf.int64)],
                         parallel_iterations=1)
    return tf.group(done)
