"""The benchmark's emulated network link: collectives return the base communicator's
values, but only after bytes / bandwidth of wall time, one transfer at a time, and the
gradient of an AlltoAll waits on the link too."""
import time

import numpy as np
import pytest
import tensorflow as tf

from tf_fusedemb.benchmarks.emulated_network import EmulatedNetworkCommunicator
from tf_fusedemb.comm import LocalCommunicator


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def test_alltoall_values_unchanged_and_delayed_by_bytes():
    comm = EmulatedNetworkCommunicator(LocalCommunicator(), megabytes_per_s=1.0)
    x = tf.random.uniform([25_000, 4])  # 400 kB -> 0.4 s on a 1 MB/s link
    (received, splits), seconds = _timed(lambda: comm.alltoall(x, [25_000], "t"))
    np.testing.assert_array_equal(received.numpy(), x.numpy())
    assert splits.numpy().tolist() == [25_000]
    assert 0.38 <= seconds < 5.0
    assert comm.busy_seconds == pytest.approx(0.4, rel=0.05)


def test_transfers_are_serialised_and_gradients_wait_on_the_link():
    comm = EmulatedNetworkCommunicator(LocalCommunicator(), megabytes_per_s=1.0)

    @tf.function
    def two_transfers_and_grad(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            a, _ = comm.alltoall(x, [12_500], "a")    # 200 kB
            b, _ = comm.alltoall(x * 2, [12_500], "b")  # 200 kB, concurrent with a
            loss = tf.reduce_sum(a) + tf.reduce_sum(b)
        return tape.gradient(loss, x)  # two more 200 kB transfers

    x = tf.ones([12_500, 4])
    grad, seconds = _timed(lambda: two_transfers_and_grad(x))
    np.testing.assert_allclose(grad.numpy(), 3.0)
    assert seconds >= 0.78  # 4 x 0.2 s on one link, not overlapped
    assert comm.busy_seconds == pytest.approx(0.8, rel=0.05)


def test_allreduce_counts_twice_the_payload_and_rejects_bad_bandwidth():
    comm = EmulatedNetworkCommunicator(LocalCommunicator(), megabytes_per_s=2.0)
    out = comm.allreduce_sum_list([tf.ones([25_000, 4])], "d")  # 2 x 400 kB / 2 MB/s
    np.testing.assert_array_equal(out[0].numpy(), 1.0)
    assert comm.busy_seconds == pytest.approx(0.4, rel=0.05)
    with pytest.raises(ValueError, match="megabytes_per_s"):
        EmulatedNetworkCommunicator(LocalCommunicator(), 0)
