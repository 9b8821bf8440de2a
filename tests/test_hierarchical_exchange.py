"""The hierarchical (TawPipe) exchange trains exactly like the single-process reference
(issue 11, part 3), on an emulated cluster of 2 hosts x 2 ranks with Horovod's own
local/cross topology and static process sets per node and rail:

  * synchronous training: per-step losses, dense weights and every table row equal the
    reference (1e-5), six AlltoAll rounds per step and group (keys, rows, gradients, each
    inside the node and along the rail), and the owners' access statistics are the exact
    counts of the keys (numpy), although the node merged its ranks' requests;
  * DBP prefetch + FWP (2 micro-batches): the same;
  * the measured choice of the exchange (``PipelineOptions(exchange="auto")``): both
    exchanges on the same tables in turn, then the faster: the same.

Where the machine cannot build the cluster (not root, no namespaces), the same runs go to
4 local ranks seen as 2 nodes x 2 (``TF_FUSEDEMB_TOPOLOGY=2x2``): the same process sets
and collectives over loopback.

3 hosts x 2 ranks: 6 local ranks seen as 3 nodes x 2 (``TF_FUSEDEMB_TOPOLOGY=3x2``), the
synchronous hierarchical exchange equal to the reference (rails of 3 ranks: a node's keys
go to two other nodes). The override is the cheaper emulation (no namespaces, and the
exactness does not depend on the link); Horovod's own local/cross detection, DBP + FWP
and the flat comparison are covered by the 2 x 2 runs above. About 3 minutes of 6 ranks
on 2 cores.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

import equivalence_model as em
from conftest import REPO_ROOT
from horovod_launch import horovodrun
from mp_train_equivalence import EACH
from test_fused_embedding_equivalence import SCRIPT, assert_equivalent, parse_result, parse_results
from test_multihost import reference
from tf_fusedemb.ops import hashing
from tf_fusedemb.testing.cluster import ClusterTimeout, ClusterUnavailable, EmulatedCluster
from tf_fusedemb.testing.cluster.forkserver import SHARED_FORK_SERVERS

HOSTS, RANKS_PER_HOST, WORLD = 2, 2, 4
FLAT_ROUNDS, HIER_ROUNDS = 3, 6  # AlltoAll rounds per step and group: (keys, rows, grads) x stages
RUN_TIMEOUT_S = 420
ENV = {"TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
HIERARCHICAL = ["--exchange", "hierarchical"]  # FusedEmbedding(exchange="hierarchical")


def with_exchange(args):
    """``[script, *options]`` with the hierarchical exchange among the options that every
    run of the launch shares (before the first ``--each``)."""
    return [args[0], *HIERARCHICAL, *args[1:]]


@pytest.fixture(scope="module")
def run_job():
    """``run(args) -> rank 0's stdout`` on the 2 x 2 cluster (or 4 local ranks as 2 x 2)."""
    try:
        cluster = EmulatedCluster(hosts=HOSTS, ranks_per_host=RANKS_PER_HOST,
                                  link_mbit=1000).start()
    except ClusterUnavailable:
        cluster = None

    def on_cluster(args):
        try:
            rc = cluster.run([sys.executable, *with_exchange(args)], timeout=RUN_TIMEOUT_S,
                             env=ENV, cwd=str(REPO_ROOT), echo=False,
                             fork_servers=SHARED_FORK_SERVERS)
        except ClusterTimeout as e:
            pytest.fail(str(e))
        result = cluster.last_result
        assert rc == 0, (f"rank {result.failed_rank} failed ({rc}):\n"
                         f"{result.text(result.failed_rank or 0, 'stderr')[-4000:]}")
        return result.text(0)

    def on_local_ranks(args):
        old = os.environ.get("TF_FUSEDEMB_TOPOLOGY")
        os.environ["TF_FUSEDEMB_TOPOLOGY"] = "2x2"
        try:
            return horovodrun(with_exchange(args), WORLD, timeout=RUN_TIMEOUT_S)
        finally:
            if old is None:
                os.environ.pop("TF_FUSEDEMB_TOPOLOGY")
            else:
                os.environ["TF_FUSEDEMB_TOPOLOGY"] = old
    try:
        yield on_cluster if cluster is not None else on_local_ranks
    finally:
        if cluster is not None:
            cluster.close()


def expected_accesses(steps, rank=0, world=WORLD):
    """Accesses of the keys ``rank`` owns, per table, counted in numpy: every ID of the
    ``steps`` global batches, plus each of the ``world`` ranks reading every row once at
    the end (the worker's read_state)."""
    out = {}
    for name, vocab in em.VOCAB.items():
        ids = [np.arange(vocab)] * world
        for t in range(steps):
            f = em.global_batch(t)[0][name]
            ids.append(np.asarray([i for row in f for i in row] if isinstance(f, list) else f,
                                  np.int64))
        out[name] = int((hashing.owner_rank(np.concatenate(ids), world) == rank).sum())
    return out


def check(result, steps, world=WORLD):
    (losses, dense, tables), _ = reference(steps)
    assert len(result["losses"]) == steps
    assert_equivalent(result, world, (losses, dense, tables))
    got = {n: c for access in result["access"].values() for n, c in access.items()}
    assert got == expected_accesses(steps, world=world)
    for group, c in result["counters"].items():
        assert c["inter_bytes_sent"] > 0 and c["intra_bytes_sent"] > 0, (group, c)


# The 2 x 2 runs, each from a fresh model, as runs of one launch (one process start per
# rank): {name: (steps, its options)}. Step 3 gives the last rank (second node) an empty
# batch in each.
RUNS = {"sync": (6, []), "dbp_fwp": (8, ["--pipeline", "dbp,fwp=2"]),
        "auto": (26, ["--pipeline", "exchange=auto"])}


@pytest.fixture(scope="module")
def results(run_job):
    """{run name: RESULT} of RUNS, from one launch."""
    args = [SCRIPT, "--empty-step", "3"]
    for steps, options in RUNS.values():
        args += [EACH, "--steps", str(steps), *options]
    return dict(zip(RUNS, parse_results(run_job(args), len(RUNS))))


@pytest.mark.timeout(900)
def test_hierarchical_sync_equals_reference(results):
    steps = RUNS["sync"][0]
    result = results["sync"]
    check(result, steps)
    for group, c in result["counters"].items():  # 2 stages x (keys, rows, gradients)
        assert c["rounds"] == HIER_ROUNDS * steps and c["inter_rounds"] == 3 * steps, (group, c)


@pytest.mark.timeout(900)
def test_hierarchical_dbp_fwp_equals_reference(results):
    check(results["dbp_fwp"], RUNS["dbp_fwp"][0])


@pytest.mark.timeout(900)
def test_measured_exchange_choice_equals_reference(results):
    """PipelineOptions(exchange="auto"): 12 steps with the flat exchange, 12 with the
    hierarchical one (an untimed block of 3 each, then 3 rounds of a block of each, on the
    same tables), then the faster; the counters show which exchange each step used, and
    training is exact throughout."""
    steps = RUNS["auto"][0]
    result = results["auto"]
    check(result, steps)
    chosen = result["pipeline_chosen"]
    assert chosen in ("exchange=flat", "exchange=hierarchical"), chosen
    rounds_after = FLAT_ROUNDS if chosen == "exchange=flat" else HIER_ROUNDS
    for group, c in result["counters"].items():
        assert c["rounds"] == 12 * FLAT_ROUNDS + 12 * HIER_ROUNDS + 2 * rounds_after, (group, c)


@pytest.mark.timeout(900)
def test_three_hosts_of_two_ranks_hierarchical_equals_reference(monkeypatch):
    """3 x 2: 6 local ranks seen as 3 nodes of 2 (``TF_FUSEDEMB_TOPOLOGY=3x2``: Horovod's
    static process sets per node and rail, the same collectives as on 3 hosts, over
    loopback). The hierarchical exchange, with an empty batch on the last rank at step 1,
    equals the single-process reference (1e-5), with 2 stages x (keys, rows, gradients)
    per step, half of them between nodes."""
    steps = 3
    monkeypatch.setenv("TF_FUSEDEMB_TOPOLOGY", "3x2")
    monkeypatch.setenv("TF_NUM_INTRAOP_THREADS", "1")  # 6 ranks share the cores
    result = parse_result(horovodrun([SCRIPT, "--steps", str(steps), "--empty-step", "1",
                                      *HIERARCHICAL], 6, timeout=840))
    check(result, steps, world=6)
    for group, c in result["counters"].items():
        assert c["rounds"] == HIER_ROUNDS * steps and c["inter_rounds"] == 3 * steps, (group, c)


EARLY_EXIT_SCRIPT = r"""
import time
import numpy as np
import tensorflow as tf
from tf_fusedemb.comm import get_communicator
comm = get_communicator()
assert [2, 3] in comm.process_sets, comm.process_sets
if comm.rank >= 2:  # node 1 is late with its intra-node stage; node 0 is done already
    time.sleep(4)
    x = tf.constant([[10.0 * comm.rank], [10.0 * comm.rank + 1]])
    received, _ = comm.alltoall(x, tf.constant([1, 1]), "late_intra_node", members=(2, 3))
    print(f"RANK {comm.rank} RECEIVED {received.numpy().ravel().tolist()}", flush=True)
"""


def run_early_exit(env):
    cmd = [sys.executable, "-m", "horovod.runner.launch", "-np", "4", "--gloo",
           "-H", "localhost:4", sys.executable, "-c", EARLY_EXIT_SCRIPT]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_FUSEDEMB_TOPOLOGY="2x2",
               TF_NUM_INTRAOP_THREADS="1", **env)
    return subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=240)


@pytest.mark.timeout(600)
def test_rank_done_early_does_not_abort_another_nodes_exchange():
    """Node 0's ranks finish while node 1 still runs an AlltoAll in its own process set.
    Horovod's shutdown on rank 0 would abort it ("Horovod has been shut down": how the
    3 x 2 run above once failed when rank 0 finished reading the tables first); the
    watchdog makes a normal exit wait for the peers, so all four ranks exit 0 and node 1's
    exchange delivers its rows. With the wait switched off (TF_FUSEDEMB_EXIT_WAIT_S=0)
    the same job fails, as before (the set is gone, or its collective aborted)."""
    out = run_early_exit({})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "RANK 2 RECEIVED [20.0, 30.0]" in out.stdout, out.stdout[-3000:]
    assert "RANK 3 RECEIVED [21.0, 31.0]" in out.stdout, out.stdout[-3000:]
    out = run_early_exit({"TF_FUSEDEMB_EXIT_WAIT_S": "0"})
    text = out.stdout + out.stderr
    assert out.returncode != 0 and ("Horovod has been shut down" in text or
                                    "Process set provided does not exist" in text), text[-3000:]
