"""The end of a job over the peer watchdog (tf_fusedemb/comm/watchdog.py), in one process.

Three PeerWatchdogs connected over loopback (one thread per rank, ``exit_process=False``):
``end_of_job`` returns on every rank once all have called it, counts a peer that exited
normally as ended, raises naming a peer that died (or failed) before it ended, and gives
up after its timeout with a warning when a peer never ends. After the agreement, the exit
does not wait for the peers (Horovod may shut down at once). The whole job on 2 x 2
emulated hosts is tests/test_multihost.py::test_normal_end_with_process_sets_is_prompt.
"""
import socket
import threading
import time

import pytest

from tf_fusedemb.comm.watchdog import PeerLostError, PeerWatchdog

SIZE = 3


def make_watchdogs(size=SIZE, exit_wait_s=30.0):
    """``size`` watchdogs of one job, made concurrently (``PeerWatchdog.connect`` is
    collective)."""
    table, barrier = [None] * size, threading.Barrier(size)

    def allgather(rank):
        def gather(obj):
            table[rank] = obj
            barrier.wait()
            return list(table)
        return gather
    made, errors = [None] * size, []

    def build(rank):
        try:
            made[rank] = PeerWatchdog.connect(rank, size, allgather(rank), timeout_s=None,
                                              exit_process=False, exit_wait_s=exit_wait_s)
        except Exception as e:  # pylint: disable=broad-except
            errors.append(e)
    threads = [threading.Thread(target=build, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return made


def in_threads(fns):
    """Runs the callables concurrently; returns their results (or exceptions)."""
    out = [None] * len(fns)

    def run(i):
        try:
            out[i] = fns[i]()
        except Exception as e:  # pylint: disable=broad-except
            out[i] = e
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def die(watchdog):
    """Closes a watchdog's connections without a goodbye, as the kernel does for a killed
    process."""
    for sock in watchdog._conns.values():  # pylint: disable=protected-access
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()


@pytest.mark.timeout(60)
def test_every_rank_returns_once_all_ended_and_the_exit_does_not_wait():
    dogs = make_watchdogs()
    start = time.monotonic()
    late = lambda: (time.sleep(1.0), dogs[2].end_of_job(timeout_s=20))[1]  # noqa: E731
    results = in_threads([lambda: dogs[0].end_of_job(timeout_s=20),
                          lambda: dogs[1].end_of_job(timeout_s=20), late])
    assert results == [True, True, True], results
    assert 1.0 <= time.monotonic() - start < 5.0  # the first two waited for the late one
    # At exit: no wait for peers that are still alive (nobody has closed yet).
    start = time.monotonic()
    dogs[0].at_exit()
    assert time.monotonic() - start < 1.0
    for d in dogs[1:]:
        d.at_exit()


@pytest.mark.timeout(60)
def test_a_peer_that_exited_normally_counts_as_ended():
    dogs = make_watchdogs()
    dogs[2].close("")  # exited normally without calling end_of_job (its at-exit goodbye)
    assert in_threads([lambda: dogs[0].end_of_job(timeout_s=20),
                       lambda: dogs[1].end_of_job(timeout_s=20)]) == [True, True]


@pytest.mark.timeout(60)
def test_a_peer_that_dies_before_its_end_is_named_at_once():
    dogs = make_watchdogs()
    killer = threading.Timer(0.5, die, args=(dogs[2],))
    killer.start()
    start = time.monotonic()
    results = in_threads([lambda: dogs[0].end_of_job(timeout_s=20),
                          lambda: dogs[1].end_of_job(timeout_s=20)])
    assert time.monotonic() - start < 5.0
    for r in results:
        assert isinstance(r, PeerLostError), results
        assert r.lost == [2] and "the end of the job" in str(r), str(r)


@pytest.mark.timeout(60)
def test_a_peer_that_failed_is_named_with_its_error():
    dogs = make_watchdogs(size=2)
    dogs[1].close("ValueError: bad input on rank 1")
    with pytest.raises(PeerLostError, match="rank 1 of 2 failed .*bad input on rank 1"):
        dogs[0].end_of_job(timeout_s=20)


@pytest.mark.timeout(60)
def test_a_peer_that_never_ends_times_out_with_a_warning(capfd):
    dogs = make_watchdogs(size=2, exit_wait_s=0.5)
    start = time.monotonic()
    assert dogs[0].end_of_job(timeout_s=1.0) is False
    assert 1.0 <= time.monotonic() - start < 5.0
    assert "rank 1 of 2 had not after 1 s" in capfd.readouterr().err
    # Not agreed: the exit waits (here exit_wait_s = 0.5 s) for the peer, then warns.
    start = time.monotonic()
    dogs[0].at_exit()
    assert time.monotonic() - start >= 0.5
    assert "still running after 0.5 s" in capfd.readouterr().err
