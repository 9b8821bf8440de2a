"""tf_fusedemb.testing.DistributedTestCase itself: run_ranks returns every rank's result in
rank order (checked against values each rank can only know through a real collective), a
hang fails within the timeout, and a failing rank fails the test with its output."""
import time

import pytest

from tf_fusedemb.testing import DistributedTestCase


def _gather_ranks(offset):
    """Each rank's (rank, size, allgather of rank + offset) through Horovod."""
    from tf_fusedemb.comm import get_communicator
    comm = get_communicator()
    return comm.rank, comm.size, comm.allgather_object(comm.rank + offset)


def _sleep_forever():
    time.sleep(3600)


def _fail_on_rank_one():
    import os
    if os.environ.get("HOROVOD_RANK") == "1":
        raise RuntimeError("rank one gives up")
    return "rank 0 done"


class RunRanksTest(DistributedTestCase):

    @pytest.mark.timeout(300)
    def test_results_in_rank_order(self):
        results = self.run_ranks(_gather_ranks, 2, args=(10,))
        self.assertEqual(results, [(0, 2, [10, 11]), (1, 2, [10, 11])])

    @pytest.mark.timeout(300)
    def test_a_hang_fails_within_the_timeout(self):
        begin = time.monotonic()
        with self.assertRaisesRegex(AssertionError, "timed out after 20s"):
            self.run_ranks(_sleep_forever, 2, timeout=20)
        self.assertLess(time.monotonic() - begin, 60)

    @pytest.mark.timeout(300)
    def test_a_failing_rank_fails_with_its_output(self):
        with self.assertRaisesRegex(AssertionError, "rank one gives up"):
            self.run_ranks(_fail_on_rank_one, 2, timeout=120)
