"""tf_fusedemb.testing.cluster: emulated hosts (network namespaces, rate-limited links) and
Horovod jobs on them; teardown in every exit path; prompt failure and timeouts.

Tests that build hosts need root and iproute2 and are skipped elsewhere with the reason."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO_ROOT
from tf_fusedemb.testing.cluster import (ClusterTimeout, ClusterUnavailable, EmulatedCluster,
                                         check_available, network, unavailable_reason)
from tf_fusedemb.testing.cluster import __main__ as cluster_main
from tf_fusedemb.testing.cluster.forkserver import ForkServers

_UNAVAILABLE = unavailable_reason()
needs_cluster = pytest.mark.skipif(_UNAVAILABLE is not None,
                                   reason=f"no emulated cluster on this machine: {_UNAVAILABLE}")
PROBE = str(REPO_ROOT / "tests" / "cluster_probe.py")


def _nothing_left(name):
    left = network.leftovers(name)
    return not any(left.values()), left


def _rank_cmd(code):
    """argv running Python ``code`` on a rank (no TensorFlow: starts in well under a second)."""
    return [sys.executable, "-c", "import os, sys, time\nrank = int(os.environ['HOROVOD_RANK'])\n"
            + code]


def _probe_reports(cluster, mb_per_peer, fork_servers=None):
    rc = cluster.run([sys.executable, PROBE, str(mb_per_peer)], timeout=240, echo=False,
                     fork_servers=fork_servers)
    result = cluster.last_result
    assert rc == 0, result.text(result.failed_rank or 0, "stderr")[-3000:]
    return [json.loads(result.text(r).strip().splitlines()[-1]) for r in range(cluster.size)]


@needs_cluster
@pytest.mark.timeout(300)
def test_horovod_topology_allreduce_and_link_rate():
    """Ranks started with ``ip netns exec`` and ranks forked from fork servers (the
    project's tests' way) see the same topology, cores, host and link limit."""
    mb_per_peer, mbit = 2.0, 50.0
    pool = ForkServers(max_rank=4, max_servers=4)
    try:
        with EmulatedCluster(hosts=2, ranks_per_host=2, link_mbit=mbit) as cluster:
            fresh = _probe_reports(cluster, mb_per_peer)
            forked = _probe_reports(cluster, mb_per_peer, pool)
    finally:
        pool.close()
    for reports in (fresh, forked):
        for r, rep in enumerate(reports):
            assert (rep["rank"], rep["size"], rep["local_size"], rep["cross_size"]) == (r, 4, 2, 2)
            assert (rep["local_rank"], rep["cross_rank"]) == (r % 2, r // 2)
            assert rep["allreduce"] == 1 + 2 + 3 + 4
            assert rep["alltoall_ok"]
            assert rep["intra_op_threads"] == str(len(rep["cpus"]))
        if len(os.sched_getaffinity(0)) >= 2:  # the two ranks of a host run on different cores
            assert reports[0]["cpus"] != reports[1]["cpus"]
        assert reports[0]["host"]["address"] != reports[2]["host"]["address"]
        # Each host sends 2 ranks x 2 remote peers x 2 MB = 8 MB through its 50 Mbit/s link.
        theoretical_s = 2 * 2 * mb_per_peer * 8 / mbit
        slowest = max(rep["alltoall_s"] for rep in reports)
        print(f"alltoall of {mb_per_peer} MB/peer at {mbit} Mbit/s: {slowest:.3f} s "
              f"(link-limited minimum {theoretical_s:.3f} s)")
        assert slowest >= 0.5 * theoretical_s, "the link limit is not in effect"
    assert [r["preloaded"] for r in fresh + forked] == [False] * 4 + [True] * 4
    for want, got in zip(fresh, forked):
        assert (got["cpus"], got["intra_op_threads"], got["host"]) == \
            (want["cpus"], want["intra_op_threads"], want["host"])


@needs_cluster
@pytest.mark.timeout(120)
def test_teardown_after_exception_and_concurrent_clusters_do_not_collide():
    name = f"ft{os.getpid()}"
    with pytest.raises(RuntimeError, match="inside"):
        with EmulatedCluster(hosts=2, ranks_per_host=1, link_mbit=100, slow_host_mbit=10,
                             name=name) as cluster:
            left = network.leftovers(name)
            assert len(left["namespaces"]) == 2 and len(left["links"]) == 3
            assert len(left["etc"]) == 2
            qdisc = [subprocess.run(["tc", "-n", h.namespace, "qdisc", "show", "dev", "eth0"],
                                    capture_output=True, text=True, check=True).stdout
                     for h in cluster.hosts]
            assert "rate 100Mbit" in qdisc[0] and "rate 10Mbit" in qdisc[1]
            with EmulatedCluster(hosts=1, ranks_per_host=1) as other:  # a second, concurrent one
                assert other.name != name
                assert other.network.bridge_address != cluster.network.bridge_address
                other_name = other.name
            assert _nothing_left(other_name)[0]
            raise RuntimeError("inside the with block")
    empty, left = _nothing_left(name)
    assert empty, f"left behind: {left}"


@needs_cluster
@pytest.mark.timeout(120)
def test_leftovers_of_crashed_runs_are_removed_first():
    # Same name: a run that built its hosts and died before teardown.
    name = f"fc{os.getpid()}"
    network.EmulatedNetwork(name, 2, 100).create()
    assert not _nothing_left(name)[0]
    # Default name: a process with a cluster, killed with SIGKILL (no teardown at all).
    code = ("import sys, time\nfrom tf_fusedemb.testing.cluster import EmulatedCluster\n"
            "c = EmulatedCluster(hosts=2, ranks_per_host=1).start()\n"
            "print(c.name, flush=True)\ntime.sleep(120)\n")
    crashed = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    crashed_name = crashed.stdout.readline().strip()
    crashed.kill()
    crashed.wait()
    assert crashed_name and not _nothing_left(crashed_name)[0]
    with EmulatedCluster(hosts=2, ranks_per_host=1, name=name) as cluster:
        assert cluster.run(_rank_cmd("print('up')"), timeout=30, echo=False) == 0
        assert _nothing_left(crashed_name)[0]  # swept: its process is gone
    assert _nothing_left(name)[0]


@needs_cluster
@pytest.mark.timeout(120)
def test_failing_rank_stops_the_others_promptly():
    code = "if rank == 1:\n    time.sleep(0.5)\n    sys.exit(3)\ntime.sleep(120)\n"
    with EmulatedCluster(hosts=2, ranks_per_host=2, link_mbit=1000) as cluster:
        start = time.monotonic()
        rc = cluster.run(_rank_cmd(code), timeout=100, echo=False)
        elapsed = time.monotonic() - start
        assert (rc, cluster.last_result.failed_rank) == (3, 1)
        assert elapsed < 20, f"run() took {elapsed:.1f} s after a rank failed"


@needs_cluster
@pytest.mark.timeout(120)
def test_timeout_kills_every_rank():
    code = "print(os.getpid(), flush=True)\ntime.sleep(120)\n"
    with EmulatedCluster(hosts=2, ranks_per_host=1, link_mbit=1000) as cluster:
        start = time.monotonic()
        with pytest.raises(ClusterTimeout, match="timed out after 3 s") as timed_out:
            cluster.run(_rank_cmd(code), timeout=3, echo=False)
        assert time.monotonic() - start < 20
    result = timed_out.value.result
    assert result is cluster.last_result and result.returncode == 124
    for rank in range(2):  # the output up to the timeout is kept; the ranks are gone
        with pytest.raises(ProcessLookupError):
            os.kill(int(result.text(rank).split()[0]), 0)


@needs_cluster
@pytest.mark.timeout(120)
def test_command_prefixes_output_and_returns_the_status():
    base = [sys.executable, "-m", "tf_fusedemb.testing.cluster", "--hosts", "2",
            "--ranks-per-host", "1", "--link-mbit", "200", "--timeout", "60", "--"]
    ok = subprocess.run(base + _rank_cmd("print('hello', rank)"), cwd=REPO_ROOT,
                        capture_output=True, text=True, timeout=100)
    assert ok.returncode == 0, ok.stderr
    assert "[0]<stdout>:hello 0" in ok.stdout and "[1]<stdout>:hello 1" in ok.stdout
    bad = subprocess.run(base + _rank_cmd("sys.exit(7 if rank == 0 else 0)"), cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=100)
    assert bad.returncode == 7, bad.stderr


@needs_cluster
@pytest.mark.timeout(120)
def test_command_removes_the_cluster_on_sigterm():
    name = f"fs{os.getpid()}"
    cmd = [sys.executable, "-m", "tf_fusedemb.testing.cluster", "--hosts", "2",
           "--ranks-per-host", "1", "--name", name, "--"] + \
        _rank_cmd("print('ready', flush=True)\ntime.sleep(120)\n")
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().endswith("ready\n")
    assert not _nothing_left(name)[0]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    empty, left = _nothing_left(name)
    assert empty, f"left behind: {left}"


@pytest.mark.timeout(60)
def test_unavailable_machine_gets_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ClusterUnavailable, match="need root"):
        check_available()
    assert cluster_main.main(["--hosts", "2", "--", "true"]) == cluster_main.EXIT_UNAVAILABLE
    assert "cannot run here" in capsys.readouterr().err
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(network.shutil, "which", lambda tool: None if tool == "ip" else "/x")
    with pytest.raises(ClusterUnavailable, match="`ip` not found: install iproute2"):
        check_available()
