"""Multi-host correctness (issue 10, part 7) on an emulated cluster of 2 hosts x 2 ranks.

The ranks of a host talk over its loopback, the two hosts over rate-limited veth links
(tf_fusedemb.testing.cluster), so these runs cross a real (emulated) network with Horovod's
local/cross topology, unlike the one-host tests of the same contracts:

  * synchronous ``FusedModel.fit`` equals the single-process reference (1e-5);
  * DBP + FWP4 (``NestedPipeline``) equals the single-process reference (1e-5);
  * a checkpoint written on 2 x 2 restores bit-exactly onto 3 ranks of one host
    (``horovodrun -np 3``) and training continued there equals the reference continued;
  * the main job (``python -m tf_fusedemb.train``) runs through the cluster command on
    2 x 2, reports world size 4 and verifies its SavedModel export.

Skipped, with the reason, where the machine cannot build the cluster (not root, no network
namespaces, no iproute2, no Horovod). Steps are few: on 2 shared cores each 4-rank run
costs about a minute, mostly process start and tracing.
"""
import functools
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import equivalence_model as em
from conftest import REPO_ROOT
from horovod_launch import horovodrun
from mp_train_equivalence import EACH
from test_fused_embedding_equivalence import SCRIPT, parse_result, parse_results
from tf_fusedemb.testing.cluster import ClusterTimeout, ClusterUnavailable, EmulatedCluster
from tf_fusedemb.testing.cluster.forkserver import SHARED_FORK_SERVERS

HOSTS, RANKS_PER_HOST, LINK_MBIT = 2, 2, 1000.0
WORLD = HOSTS * RANKS_PER_HOST
FIRST, SECOND = 5, 4      # steps on 2 x 2 before the checkpoint, steps on 3 ranks after it
PIPELINE_STEPS = 8        # DBP needs consecutive batches sharing keys (they do: hot IDs)
RUN_TIMEOUT_S = 420       # one cluster job; pytest's timeouts are above it (teardown fits)
EXIT_UNAVAILABLE = 69     # the cluster command's status where it cannot build the hosts
ENV = {"TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}


@pytest.fixture(scope="module")
def cluster():
    """One 2 x 2 cluster for the module's library-launched jobs, removed at the end."""
    try:
        built = EmulatedCluster(hosts=HOSTS, ranks_per_host=RANKS_PER_HOST,
                                link_mbit=LINK_MBIT).start()
    except ClusterUnavailable as e:
        pytest.skip(f"no emulated cluster on this machine: {e}")
    try:
        yield built
    finally:
        built.close()


def run_on_cluster(cluster, args, timeout=RUN_TIMEOUT_S):
    """Runs ``python args...`` on every rank; returns the JobResult (fails the test on a
    non-zero exit or a timeout, with the failing rank's output)."""
    try:
        rc = cluster.run([sys.executable, *args], timeout=timeout, env=ENV, cwd=str(REPO_ROOT),
                         echo=False, fork_servers=SHARED_FORK_SERVERS)
    except ClusterTimeout as e:
        tails = {r: e.result.text(r, "stderr")[-1500:] for r in e.result.stderr} if e.result else {}
        pytest.fail(f"{e}\n{tails}")
    result = cluster.last_result
    if rc != 0:
        rank = result.failed_rank or 0
        pytest.fail(f"rank {rank} of {WORLD} failed with status {rc} on the emulated cluster: "
                    f"{' '.join(args)}\n{result.text(rank)[-2000:]}\n"
                    f"{result.text(rank, 'stderr')[-4000:]}")
    assert sorted(result.stdout) == list(range(WORLD))
    return result


@functools.lru_cache(maxsize=None)
def reference(steps, snapshot_at=None):
    """The single-process reference over ``steps`` global batches: (losses, dense, tables)
    at the end, and the same triple after ``snapshot_at`` steps (or None)."""
    ref = em.Reference(em.feature_specs())
    losses, snapshot = [], None
    for t in range(steps):
        if t == snapshot_at:
            snapshot = (list(losses), ref.dense_weights(),
                        {n: v.numpy() for n, v in ref.tables.items()})
        feats, labels = em.global_batch(t)
        losses.append(ref.train_step(*em.to_tensors(feats, labels, 0, em.GLOBAL_BATCH)))
    if snapshot_at == steps:
        snapshot = (list(losses), ref.dense_weights(),
                    {n: v.numpy() for n, v in ref.tables.items()})
    return (losses, ref.dense_weights(), {n: v.numpy() for n, v in ref.tables.items()}), snapshot


def assert_matches(got, want, what):
    """``got``: a worker's RESULT (losses, dense, tables); ``want``: a reference triple."""
    losses, dense, tables = want
    np.testing.assert_allclose(got["losses"], losses, rtol=1e-5, err_msg=f"{what}: losses")
    assert len(got["dense"]) == len(dense)
    for got_w, want_w in zip(got["dense"], dense):
        np.testing.assert_allclose(got_w, want_w, rtol=1e-5, atol=1e-7,
                                   err_msg=f"{what}: dense weights")
    assert sorted(got["tables"]) == sorted(tables)
    for name, want_rows in tables.items():
        np.testing.assert_allclose(got["tables"][name], want_rows, rtol=1e-5, atol=1e-7,
                                   err_msg=f"{what}: table {name}")


@pytest.fixture(scope="module")
def runs_2x2(cluster, tmp_path_factory):
    """Two runs of one 4-rank launch on 2 x 2 (one process start per rank): (RESULT of
    ``FusedModel.fit`` for FIRST steps, its checkpoint dir, RESULT of DBP+FWP4 for
    PIPELINE_STEPS, where step 3 gives the last rank, on the second host, an empty batch:
    its 4 micro-batches are empty, and it still takes part in every collective)."""
    ckpt = str(tmp_path_factory.mktemp("multihost") / "ckpt")
    job = run_on_cluster(cluster, [
        SCRIPT, EACH, "--steps", str(FIRST), "--keras-fit", "--save-dir", ckpt,
        EACH, "--steps", str(PIPELINE_STEPS), "--pipeline", "dbp,fwp=4", "--empty-step", "3"])
    fit, pipelined = parse_results(job.text(0), 2)
    return fit, ckpt, pipelined


@pytest.fixture(scope="module")
def fit_2x2(runs_2x2):
    """(RESULT, checkpoint dir) of the fit run: shared by the fit and restore tests."""
    return runs_2x2[:2]


@pytest.mark.timeout(900)
def test_keras_fit_on_two_hosts_equals_reference(fit_2x2):
    result, _ = fit_2x2
    _, at_first = reference(FIRST + SECOND, FIRST)
    assert_matches(result, at_first, f"fit on {HOSTS}x{RANKS_PER_HOST}")
    # the dense head (4) and the FusedEmbedding layer's row-update marker: rows are no variables
    assert result["num_trainable"] == 5, "only the dense head and the row-update marker"
    for group, counters in result["counters"].items():  # the lookups did cross the hosts
        assert counters["bytes_sent"] > 0, (group, counters)


@pytest.mark.timeout(900)
def test_dbp_fwp4_on_two_hosts_equals_reference(runs_2x2):
    result = runs_2x2[2]
    (losses, dense, tables), _ = reference(PIPELINE_STEPS)
    assert len(result["losses"]) == PIPELINE_STEPS
    assert_matches(result, (losses, dense, tables), f"DBP+FWP4 on {HOSTS}x{RANKS_PER_HOST}")


@pytest.mark.timeout(1200)
def test_checkpoint_from_two_hosts_restores_exactly_on_three_local_ranks(fit_2x2):
    saved, ckpt = fit_2x2
    assert sorted(os.listdir(ckpt)) == [f"ckpt-{FIRST}", "latest"]
    meta = json.load(open(os.path.join(ckpt, f"ckpt-{FIRST}", "meta.json")))
    assert meta["world_size"] == WORLD
    out = horovodrun([SCRIPT, "--steps", str(SECOND), "--restore-dir", ckpt,
                      "--report-restored"], 3, timeout=RUN_TIMEOUT_S)
    restored = [l for l in out.splitlines() if "RESTORED " in l]
    assert len(restored) == 1, out[-3000:]
    restored = json.loads(restored[0].split("RESTORED ", 1)[1])
    # Exactly what the 4 ranks of 2 hosts held (both read every row through the layer).
    for got, want in zip(restored["dense"], saved["dense"]):
        np.testing.assert_array_equal(got, want, err_msg="restored dense weights")
    for name, want in saved["tables"].items():
        np.testing.assert_array_equal(restored["tables"][name], want,
                                      err_msg=f"restored table {name}")
    # Training continued on 3 ranks equals the reference continued.
    second = parse_result(out)
    assert second["start"] == FIRST
    (losses, dense, tables), _ = reference(FIRST + SECOND, FIRST)
    assert_matches(dict(second, losses=saved["losses"] + second["losses"]),
                   (losses, dense, tables), "2x2 -> 3 ranks, continued")
    for group, size in saved["table_sizes"].items():  # no key lost in the re-sharding
        assert second["table_sizes"][group] >= size, group


@pytest.mark.timeout(900)
def test_main_job_runs_on_two_hosts_through_the_cluster_command(tmp_path):
    command = [sys.executable, "-m", "tf_fusedemb.testing.cluster", "--hosts", str(HOSTS),
               "--ranks-per-host", str(RANKS_PER_HOST), "--link-mbit", f"{LINK_MBIT:g}",
               "--timeout", str(RUN_TIMEOUT_S), "--",
               sys.executable, "-m", "tf_fusedemb.train", "--model", "dlrm", "--data",
               "synthetic", "--steps", "30", "--batch-size", "256", "--rows", "20000",
               "--checkpoint-dir", str(tmp_path / "ckpt"), "--export-dir",
               str(tmp_path / "export")]
    try:
        out = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=RUN_TIMEOUT_S + 120, env=dict(os.environ, **ENV))
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the cluster command did not return (it should time out by itself): {e}")
    if out.returncode == EXIT_UNAVAILABLE:
        pytest.skip(f"no emulated cluster on this machine: {out.stderr.strip()[-500:]}")
    assert out.returncode == 0, f"status {out.returncode}\n{out.stdout[-2000:]}\n" \
                                f"{out.stderr[-5000:]}"
    lines = [l for l in out.stdout.splitlines() if "RESULT " in l]
    assert len(lines) == 1 and lines[0].startswith("[0]<stdout>:"), out.stdout[-3000:]
    result = json.loads(lines[0].split("RESULT ", 1)[1])
    assert result["world_size"] == WORLD and result["steps"] == 30, result
    assert np.isfinite(result["final_loss"]), result
    assert all(r == 3.0 for r in result["alltoall_rounds_per_step"].values()), result
    assert result["export"]["checkpoint_step"] == 30, result["export"]
    assert result["export"]["max_abs_diff_vs_trained"] <= 1e-5, result["export"]
    assert os.path.isfile(tmp_path / "export" / "saved_model.pb")


END_SCRIPT = r"""
import sys, time
import tensorflow as tf
from tf_fusedemb.comm import get_communicator
comm = get_communicator()
node = (0, 1) if comm.rank < 2 else (2, 3)
assert list(node) in comm.process_sets, comm.process_sets
x = tf.constant([[float(comm.rank)], [comm.rank + 0.5]])
comm.alltoall(x, tf.constant([1, 1]), "end_test_intra_node", members=node)  # the last one
if sys.argv[1] == "end_job":
    comm.end_job()
print(f"END {time.monotonic():.3f}", flush=True)
if comm.rank == 0:  # work outside Horovod after the last collective (like train.py's export)
    time.sleep(float(sys.argv[2]))
"""
TAIL_S = 20  # rank 0's work after the job's last collective (the others exit within ~1 s)
PROMPT_S = 12  # an agreed end: ranks 1-3 exit this soon after their last collective


@pytest.mark.timeout(900)
def test_normal_end_with_process_sets_is_prompt(cluster):
    """On 2 x 2 with process sets, a normal end is prompt: after ``end_job`` (every rank
    agrees its last collective is done; train.py calls it after evaluation) ranks 1-3 exit
    within seconds of their last collective, while rank 0 still works outside Horovod for
    TAIL_S. Without it they wait at exit until rank 0 is done (up to
    TF_FUSEDEMB_EXIT_WAIT_S = 120 s), which is what the agreement removes."""
    def end_to_exit(mode):
        result = run_on_cluster(cluster, ["-c", END_SCRIPT, mode, str(TAIL_S)])
        ends = {r: float(l.split()[1]) for r, lines in result.stdout.items() for l in lines
                if l.startswith("END ")}
        assert sorted(ends) == list(range(WORLD)), result.stdout
        return {r: result.exited_at[r] - ends[r] for r in range(WORLD)}
    agreed = end_to_exit("end_job")
    assert agreed[0] >= TAIL_S, agreed
    assert all(agreed[r] < PROMPT_S for r in (1, 2, 3)), agreed  # the wait without: 120 s
    implicit = end_to_exit("no_end_job")
    print(f"last collective -> exit, s: with end_job {agreed}, without {implicit}")
    assert all(implicit[r] >= TAIL_S - 5 for r in (1, 2, 3)), implicit
