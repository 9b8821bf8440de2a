"""Upserts into TFRA CPU tables never run on several threads while the table may resize
(libcuckoo's concurrent-resize race, see tf_fusedemb/storage/resize_safe_insert.py)."""
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

from tf_fusedemb.storage import resize_safe_insert as rsi

# Eigen's TensorCostModel: a ParallelFor runs on the calling thread while
# (cost - kStartupCycles) / kPerThreadCycles + 0.9 < 2, i.e. cost < 2.1e5 cycles.
EIGEN_ONE_THREAD_COST = 210_000


@pytest.mark.parametrize("dim", [1, 4, 8, 16, 64, 128, 1024])
def test_serial_chunks_stay_on_one_thread_for_any_thread_count(dim):
    n = rsi.serial_chunk(dim)
    # TFRA's cost per key is total_values / threads + 1: largest with one thread.
    assert n * (n * dim + 1) < EIGEN_ONE_THREAD_COST
    assert n >= 1


def test_parallel_room_never_reaches_a_resize():
    # Capacities are powers of two; libcuckoo resized at load >= 0.958 in every
    # measured run. Check both sides of every power of two, where float error lurks.
    for k in range(0, 41):
        for s in {max(0, 2 ** k + d) for d in (-2, -1, 0, 1, 2)} | {int(0.95 * 2 ** k)}:
            capacity = 1 << max(int(s - 1).bit_length(), 0)  # smallest power of two >= s
            room = int(rsi.parallel_room(tf.constant(s, tf.int64)))
            assert s + max(room, 0) < 0.958 * capacity or room <= 0, (s, room, capacity)


def test_bulk_load_on_eight_threads_keeps_every_row():
    """324k rows into one table on 8 intra-op threads: every row stored, exactly."""
    script = textwrap.dedent("""
        import numpy as np, tensorflow as tf
        tf.config.threading.set_intra_op_parallelism_threads(8)
        from tf_fusedemb.specs import InitializerSpec, OptimizerSpec
        from tf_fusedemb.storage import DynamicGroupTable
        rng = np.random.default_rng(0)
        keys = np.unique(rng.integers(-2**63, 2**63 - 1, 324382, dtype=np.int64))
        rows = rng.standard_normal((len(keys), 16)).astype(np.float32)
        table = DynamicGroupTable("g", 16, InitializerSpec(), OptimizerSpec.adagrad(0.1))
        table.load({"keys": keys, "values": rows})
        got, exists = table.values.lookup(keys, return_exists=True)
        assert int(table.size()) == len(keys), int(table.size())
        assert bool(tf.reduce_all(exists)), int(tf.reduce_sum(1 - tf.cast(exists, tf.int32)))
        np.testing.assert_array_equal(got.numpy(), rows)
        exported = table.export()
        np.testing.assert_array_equal(exported["keys"].numpy(), np.sort(keys))
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]
