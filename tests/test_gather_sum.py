"""The sum of a list over ranks as a grouped allgather and a local sum (``gather_sum``, what
``allreduce_sum_list`` does with two ranks): against numpy with simulated ranks, and on
two real Horovod ranks bit for bit against Horovod's own grouped allreduce."""
import numpy as np
import tensorflow as tf

from tf_fusedemb.comm.communicator import GATHER_SUM_MAX_RANKS, gather_sum
from tf_fusedemb.testing.distributed import DistributedTestCase


def _rank_tensors(rank):
    rng = np.random.default_rng(rank)
    return [rng.standard_normal([3, 4]).astype(np.float32),
            rng.integers(-5, 5, [2]).astype(np.int32),
            rng.standard_normal([5]).astype(np.float32),
            np.array(rng.standard_normal(), np.float32)]


def test_gather_sum_adds_every_ranks_tensors_in_their_shapes_with_one_collective():
    ranks = 3
    mine = [tf.constant(t) for t in _rank_tensors(0)]
    calls = []

    def allgather(parts):  # every rank's parts, as Horovod's grouped allgather returns them
        calls.append([(p.dtype, p.shape.as_list()) for p in parts])
        return [tf.constant(np.concatenate([np.reshape(_rank_tensors(r)[i], p.shape)
                                            for r in range(ranks)]))
                for i, p in enumerate(parts)]

    got = gather_sum(mine, ranks, allgather)
    want = [np.sum([_rank_tensors(r)[i] for r in range(ranks)], axis=0, dtype=t.dtype)
            for i, t in enumerate(_rank_tensors(0))]
    # one collective for all; a scalar travels as a vector of one
    assert calls == [[(tf.float32, [3, 4]), (tf.int32, [2]), (tf.float32, [5]),
                      (tf.float32, [1])]]
    for g, w in zip(got, want):
        assert g.dtype.as_numpy_dtype == w.dtype and g.shape.as_list() == list(w.shape)
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-6)


def _both_sums():
    import horovod.tensorflow as hvd  # pylint: disable=import-outside-toplevel
    from tf_fusedemb.comm import get_communicator  # pylint: disable=import-outside-toplevel
    comm = get_communicator()
    # float32 only: Horovod's grouped allreduce takes one dtype (the dense gradients')
    mine = [tf.constant(t) for t in _rank_tensors(comm.rank) if t.dtype == np.float32]

    @tf.function
    def sums(tensors):
        return (comm.allreduce_sum_list(tensors, "test/gather_sum"),
                hvd.grouped_allreduce(tensors, op=hvd.Sum))
    ours, horovods = sums(mine)
    return [t.numpy() for t in ours], [t.numpy() for t in horovods]


class GatherSumOnRanksTest(DistributedTestCase):
    def test_two_ranks_sum_bit_for_bit_as_horovods_allreduce(self):
        self.assertEqual(GATHER_SUM_MAX_RANKS, 2)
        want = [a + b for a, b in zip(_rank_tensors(0), _rank_tensors(1)) if a.dtype == np.float32]
        for ours, horovods in self.run_ranks(_both_sums, 2):
            self.assertEqual(len(ours), len(want))
            for o, h, w in zip(ours, horovods, want):
                self.assertEqual(o.dtype, w.dtype)
                self.assertEqual(o.tobytes(), h.tobytes())
                self.assertEqual(o.tobytes(), w.tobytes())
