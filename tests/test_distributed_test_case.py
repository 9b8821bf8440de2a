"""tf_fusedemb.testing.DistributedTestCase itself: run_ranks returns every rank's result in
rank order (checked against values each rank can only know through a real collective), a
hang fails within the timeout, and a failing rank fails the test with its output; the local
launch under it gives its ranks horovodrun's environment."""
import io
import json
import os
import subprocess
import sys
import time

import pytest

from tf_fusedemb.testing import DistributedTestCase
from tf_fusedemb.testing.cluster.launcher import run_local_job


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
        with self.assertRaisesRegex(AssertionError, "timed out after 8s"):
            self.run_ranks(_sleep_forever, 2, timeout=8)
        self.assertLess(time.monotonic() - begin, 60)

    @pytest.mark.timeout(300)
    def test_a_failing_rank_fails_with_its_output(self):
        with self.assertRaisesRegex(AssertionError, "rank one gives up"):
            self.run_ranks(_fail_on_rank_one, 2, timeout=120)


_PRINT_HOROVOD_ENV = ("import json, os; print('ENV ' + json.dumps({k: v for k, v in "
                      "os.environ.items() if k.startswith('HOROVOD_')}))")
# Where two launches of one job may differ: the rendezvous server's port, and the
# interface and address horovodrun picks (run_local_job: the loopback).
_PER_LAUNCH = {"HOROVOD_GLOO_RENDEZVOUS_PORT", "HOROVOD_GLOO_RENDEZVOUS_ADDR",
               "HOROVOD_GLOO_IFACE"}


def _rank_envs(lines):
    envs = [json.loads(l.split("ENV ", 1)[1]) for l in lines if "ENV " in l]
    return sorted(envs, key=lambda env: int(env["HOROVOD_RANK"]))


@pytest.mark.timeout(300)
def test_a_local_job_gives_its_ranks_the_environment_horovodrun_gives():
    """run_local_job (what run_ranks and the benchmarks launch with) against horovodrun
    itself: the same HOROVOD_ variables, with the same values but the rendezvous's."""
    command = [sys.executable, "-c", _PRINT_HOROVOD_ENV]
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    reference = subprocess.run([horovodrun, "-np", "3", "--gloo", "-H", "localhost:3", *command],
                               capture_output=True, text=True, timeout=240,
                               env={k: v for k, v in os.environ.items()
                                    if not k.startswith("HOROVOD_")})
    assert reference.returncode == 0, reference.stderr[-3000:]
    output = io.StringIO()
    job = run_local_job(command, 3, timeout=120, output=output)
    assert job.returncode == 0, output.getvalue()[-3000:]
    want = _rank_envs(reference.stdout.splitlines())
    got = _rank_envs(output.getvalue().splitlines())
    assert len(want) == len(got) == 3
    for w, g in zip(want, got):
        assert set(g) == set(w)
        assert {k: v for k, v in g.items() if k not in _PER_LAUNCH} == \
            {k: v for k, v in w.items() if k not in _PER_LAUNCH}
    assert {g["HOROVOD_GLOO_IFACE"] for g in got} == {"lo"}


@pytest.mark.timeout(300)
def test_a_local_job_stops_the_others_when_a_rank_fails():
    command = [sys.executable, "-c", "import os, sys, time\n"
               "if os.environ['HOROVOD_RANK'] == '1': sys.exit(3)\ntime.sleep(600)"]
    begin = time.monotonic()
    job = run_local_job(command, 2, timeout=240)
    assert (job.returncode, job.failed_rank) == (3, 1)
    assert time.monotonic() - begin < 60
