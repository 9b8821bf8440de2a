"""BLS alltoallv (tf_fusedemb/comm/bls_alltoallv.py) under mpirun, against numpy.

The rank program (tests/bls_worker.py) regenerates every peer's message with numpy and
compares it with what arrived, for k in {0, 1, 2, 4}, random sizes including empty
messages, with rank 2 deliberately slow. Its timestamps then show the lag semantics:
nobody completes iteration i before every rank entered it (any k), with k = 0 a rank
enters iteration 1 only after the slow rank entered iteration 0, and with k >= 1 fast
ranks run ahead of the slow one. A rank that stops taking part makes the others raise
BLSTimeoutError instead of hanging, also over Open MPI's osc pt2pt (the one-sided
transport between hosts, without asynchronous progress: a Flush to the stalled rank
blocks inside MPI until its deadline ends the rank with the same message). A rank that
dies mid-run (os._exit) makes the job fail within a bounded time, naming that rank.
"""
import json
import re
import sys
import time

import pytest

from conftest import REPO_ROOT
from tf_fusedemb.testing import mpirun

pytestmark = pytest.mark.skipif(mpirun.unavailable_reason() is not None,
                                reason=str(mpirun.unavailable_reason()))

WORKER = str(REPO_ROOT / "tests" / "bls_worker.py")
LAGS, ITERS, SLOW, RANKS = [0, 1, 2, 4], 10, 2, 4
ENV = {"PYTHONPATH": str(REPO_ROOT)}


@pytest.fixture(scope="module")
def exchange_runs():
    proc = mpirun.run_mpirun(RANKS, [WORKER, "exchange", json.dumps(LAGS), str(ITERS),
                                     str(SLOW)], timeout=240, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = {}
    for line in proc.stdout.splitlines():
        if line.startswith("BLS_OK "):
            run = json.loads(line[len("BLS_OK "):])
            runs[run["lag"]] = run["times"]
    return runs


@pytest.mark.timeout(300)
@pytest.mark.parametrize("lag", LAGS)
def test_every_rank_received_what_peers_sent(exchange_runs, lag):
    # The worker asserts equality with numpy's messages before printing BLS_OK.
    assert lag in exchange_runs, f"no BLS_OK line for lag {lag}"
    times = exchange_runs[lag]
    assert len(times) == RANKS
    for t in times:
        assert len(t["finish_out"]) == ITERS


@pytest.mark.timeout(300)
@pytest.mark.parametrize("lag", LAGS)
def test_lag_semantics(exchange_runs, lag):
    times = exchange_runs[lag]
    for a in range(RANKS):
        for b in range(RANKS):
            for i in range(ITERS):
                # Data dependency: a completes i only after b entered i.
                assert times[a]["finish_out"][i] >= times[b]["start_in"][i]
    fast = [r for r in range(RANKS) if r != SLOW]
    if lag == 0:  # synchronous: no rank enters 1 before the slow rank entered 0
        for r in fast:
            assert times[r]["start_in"][1] >= times[SLOW]["start_in"][0]
    else:  # bounded lag: the fast ranks enter iteration k before the slow one enters 1
        for r in fast:
            assert times[r]["start_in"][lag] < times[SLOW]["start_in"][1]
        # ... and never more than k + 1 ahead in started iterations.
        for r in fast:
            for j in range(lag + 1, ITERS):
                assert times[r]["start_in"][j] >= times[SLOW]["start_in"][j - lag - 1]


@pytest.mark.timeout(120)
def test_stalled_peer_raises_timeout_instead_of_hanging():
    proc = mpirun.run_mpirun(3, [WORKER, "stall"], timeout=90, env=ENV)
    # mpirun may interleave the ranks' output mid-line: find the reports anywhere.
    reports = re.findall(r"BLS_TIMEOUT_OK rank (\d+): .*?waited 3s for rank (\d+)", proc.stdout)
    assert sorted(reports) == [("0", "1"), ("2", "1")], proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.timeout(120)
def test_stalled_peer_times_out_without_asynchronous_progress():
    """osc pt2pt: a Flush to the stalled rank returns only when that rank enters MPI
    (60 s later); the deadline must end the wait after 3 s with a clear message."""
    start = time.monotonic()
    proc = mpirun.run_mpirun(3, [WORKER, "stall"], timeout=90, env=ENV,
                             extra_flags=mpirun.PT2PT_FLAGS)
    took = time.monotonic() - start
    out = proc.stdout + proc.stderr
    # Raised (BLS_TIMEOUT_OK) or ended by the deadline thread (BLSTimeoutError, 124).
    reports = re.findall(r"(?:BLS_TIMEOUT_OK|BLSTimeoutError:) (?:rank \d+: )?BLS alltoallv on "
                         r"rank (\d+): waited 3s for .*?; rank (\d+) died", out)
    assert reports and {peer for _, peer in reports} == {"1"}, out[-4000:]
    assert {rank for rank, _ in reports} <= {"0", "2"}, out[-4000:]
    assert took < 50, f"the live ranks failed only after {took:.0f}s (rank 1 sleeps 60 s)"


@pytest.mark.timeout(120)
def test_dead_peer_fails_the_job_within_bounded_time():
    """Rank 1 of 3 exits mid-run (os._exit(3)): the job must end well before the test's
    timeout, non-zero, with mpirun's report naming the dead rank; no survivor may go on
    as if nothing happened."""
    start = time.monotonic()
    proc = mpirun.run_mpirun(3, [WORKER, "die"], timeout=90, env=ENV)
    took = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert "BLS_DYING rank 1" in out, out[-3000:]
    assert proc.returncode != 0 and "BLS_DIE_NOT_NOTICED" not in out, out[-3000:]
    # mpirun names the process that exited: "Process name: [[jobid,1],1]" and its status
    # (or, had the survivors noticed first, their BLSTimeoutError names rank 1).
    assert (re.search(r"Process name: \[\[\d+,\d+\],1\]\s+Exit code:\s+3", out)
            or re.search(r"waited \d+s for .*; rank 1 died", out)), out[-3000:]
    assert took < 60, f"the job ended {took:.0f}s after start (rank 1 died at once)"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
