"""BLS alltoallv (tf_fusedemb/comm/bls_alltoallv.py) under mpirun, against numpy.

The rank program (tests/bls_worker.py) regenerates every peer's message with numpy and
compares it with what arrived, for k in {0, 1, 2, 4}, random sizes including empty
messages, with rank 2 deliberately slow. Its timestamps then show the lag semantics:
nobody completes iteration i before every rank entered it (any k), with k = 0 a rank
enters iteration 1 only after the slow rank entered iteration 0, and with k >= 1 fast
ranks run ahead of the slow one. A rank that stops taking part makes the others raise
BLSTimeoutError instead of hanging.
"""
import json
import re
import sys

import pytest

from conftest import REPO_ROOT
from tf_fusedemb.comm import mpirun

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


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
