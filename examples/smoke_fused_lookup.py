"""Two-worker smoke job: the FusedRec forward lookup over Horovod, checked end to end.

Each rank draws a Criteo-shaped batch (26 categories), deduplicates it with one
segment_unique, routes it with rankwise_sort and ONE hvd.alltoall (keys and category ids
together), hashes on the owner, "looks up" rows that are a known function of the unified
key, sends them back with a second alltoall and recovers the fused layout. Every rank
checks its recovered rows against the same function computed locally.

    horovodrun -np 2 --gloo -H localhost:2 python examples/smoke_fused_lookup.py
"""
import argparse
import sys
import time

from tf_fusedemb import quiet

quiet.install()  # before TensorFlow loads: no CUDA-factory lines (tf_fusedemb/quiet.py)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tf_fusedemb import ops  # noqa: E402
from tf_fusedemb.data.criteo import CRITEO_CATEGORICAL  # noqa: E402
from tf_fusedemb.data.synthetic import criteo_like_batch_keys  # noqa: E402
from tf_fusedemb.ops import hashing  # noqa: E402

CATEGORIES = list(CRITEO_CATEGORICAL)
DIM = 16


def rows_of(unified_keys):
    """A known row per unified key (stands in for the table): float32[u, DIM]."""
    cols = tf.range(DIM, dtype=tf.int64)
    mixed = hashing.tf_mix64(tf.bitwise.bitwise_xor(unified_keys[:, None], cols[None, :]))
    return tf.cast(tf.bitwise.right_shift(mixed, tf.constant(40, tf.uint64)), tf.float32) / 2.0**24


def build_step(hvd):
    @tf.function(input_signature=[tf.TensorSpec([None], tf.int64), tf.TensorSpec([None], tf.int64)])
    def fused_lookup(keys, segment_splits):
        uniq = ops.segment_unique(keys, segment_splits)
        srt = ops.rankwise_sort(uniq.unique_keys, uniq.unique_segment_splits, hvd.size())
        packed = tf.stack([srt.sorted_keys, tf.cast(srt.sorted_segment_ids, tf.int64)], axis=1)
        recv, recv_splits = hvd.alltoall(packed, splits=srt.rank_splits, name="smoke_keys")
        owner = ops.category_hash(recv[:, 0], tf.cast(recv[:, 1], tf.int32), CATEGORIES)
        served = tf.gather(rows_of(owner.lookup_keys), owner.inverse)
        back, _ = hvd.alltoall(served, splits=recv_splits, name="smoke_rows")
        fused, _ = ops.recovery_gather(back, srt.indices, uniq.inverse)
        # Every key received here must be owned here.
        owned = tf.reduce_all(tf.equal(ops.owner_rank(recv[:, 0], hvd.size()), hvd.rank()))
        return fused, owned, tf.size(uniq.unique_keys), tf.shape(recv)[0]
    return fused_lookup


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)

    import horovod.tensorflow as hvd  # pylint: disable=import-outside-toplevel
    hvd.init()
    step = build_step(hvd)
    for t in range(args.steps):
        keys, splits = criteo_like_batch_keys(args.batch_size, seed=1000 * t + hvd.rank())
        start = time.perf_counter()
        fused, owned, num_unique, num_recv = step(tf.constant(keys), tf.constant(splits))
        elapsed = time.perf_counter() - start
        names = np.repeat(np.array(CATEGORIES), np.diff(splits))
        want = rows_of(tf.constant(hashing.hashed_unified_keys(keys, names))).numpy()
        if not bool(owned) or not np.array_equal(fused.numpy(), want):
            print(f"rank {hvd.rank()} step {t}: WRONG rows or owners", flush=True)
            return 1
        print(f"rank {hvd.rank()}/{hvd.size()} step {t}: {keys.size} keys, {int(num_unique)} "
              f"unique sent, {int(num_recv)} received, {elapsed * 1e3:.1f} ms, rows exact",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
