"""Killed workers (issue 9, part 4).

One of 2 (and of 3) workers of the main job is SIGKILLed (a fault plan of
tf_fusedemb/testing/faults.py, installed by its command wrapping the job, at the job's
declared fault points) in the middle of a training step, and on the rerun in the
middle of a checkpoint save. The survivors must exit non-zero within 60 s of the kill,
saying which rank was lost and during what (the peer watchdog, tf_fusedemb/comm/watchdog.py),
by themselves: those runs start the workers without horovodrun's supervision
(tests/gloo_workers.py), which would otherwise kill them; one runs under horovodrun, the
ordinary command. The save must leave the previous checkpoint as ``latest``. Running the
command once more resumes from that checkpoint, removes the half-written one, and ends
exactly where an uninterrupted run with the same checkpoint schedule ends: the RESULT line
(final loss, train AUC, evaluation) and every embedding row, optimizer slot, access
count, dense weight and dense optimizer slot of the last checkpoint, bit for bit.
"""
import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import REPO_ROOT
from gloo_workers import GlooWorkers
from horovod_launch import HOROVODRUN, horovodrun

STEPS, EVERY = 12, 4
ARGS = ["-m", "tf_fusedemb.train", "--model", "dlrm", "--data", "synthetic",
        "--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--batch-size", "128",
        "--rows", "20000", "--eval-rows", "2000"]
KILL_TO_EXIT_S = 60  # survivors must be gone this long after the kill
# world size -> (victim in step 6, victim in the save of checkpoint 8, launcher of that run)
VICTIMS = {2: (1, 0, "horovodrun"), 3: (0, 2, "workers")}


def with_fault(fault):
    """The job's python arguments with ``fault`` switched on (tf_fusedemb.testing.faults
    installs the plan, then runs ``-m tf_fusedemb.train ARGS`` as python would)."""
    return ["-m", "tf_fusedemb.testing.faults", "--fault", fault] + ARGS


def parse(stdout):
    lines = [l for l in stdout.splitlines() if "RESULT " in l]
    assert lines, stdout[-3000:]
    return json.loads(lines[-1].split("RESULT ", 1)[1])


def load_checkpoint(path):
    """{name: array} of a checkpoint: embedding arrays of all shards sorted by key (tables
    export rows in insertion order, which a restore changes), and the dense variables. A
    storage-engine group's blocks, in its block directories, are read as the arrays the
    shards hold for other storage."""
    import tensorflow as tf
    shards = [np.load(p) for p in sorted(glob.glob(os.path.join(path, "shard-*.npz")))]
    merged = {k: np.concatenate([np.atleast_1d(s[k]) for s in shards]) for k in shards[0].files}
    for name in [k for k in merged if k.endswith("/ssd_checkpoint")]:
        del merged[name]
        layer, group = name.split("/")[:2]
        directories = glob.glob(os.path.join(path, "blocks", f"{layer}-{group}-shard-*"))
        merged.update(block_group_arrays(directories, f"{layer}/{group}"))
    out = {}
    for name, array in merged.items():
        prefix, _, leaf = name.rpartition("/")  # ".../keys", ".../values", ".../stats/counts"
        out[name] = array if leaf == "step" else \
            array[np.argsort(merged[prefix + "/keys"], kind="stable")]
    dense = os.path.join(path, "dense")
    reader = tf.train.load_checkpoint(dense)
    for name, _ in tf.train.list_variables(dense):
        if name != "_CHECKPOINTABLE_OBJECT_GRAPH":
            out["dense:" + name] = reader.get_tensor(name)
    return out


def block_group_arrays(directories, prefix):
    """The arrays the shards hold for other storage (rows, slots, each row's table and
    ID, statistics), read out of a storage-engine group's block ``directories`` into one
    engine. The group's name ends with its dim and optimizer (``g0_d16_adagrad``)."""
    from tf_fusedemb.specs import InitializerSpec, OptimizerSpec
    from tf_fusedemb.storage.engine_table import EngineGroupTable, EngineStatistics
    dim, optimizer = prefix.rsplit("_d", 1)[1].split("_", 1)
    table = EngineGroupTable("read", int(dim), InitializerSpec(),
                             getattr(OptimizerSpec, optimizer)(0.1))
    assert table.read_checkpoint(directories, 0, 1) > 0
    stats = EngineStatistics("read", [], table.engine).export()
    rows = {k: v.numpy() for k, v in table.export().items()}
    at = np.searchsorted(stats["keys"], rows["keys"])
    rows.update(tables=stats["categories"][at], ids=stats["ids"][at])
    out = {f"{prefix}/{k}": v for k, v in rows.items()}
    out.update({f"{prefix}/stats/{k}": v for k, v in stats.items()})
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """world size -> (RESULT, last checkpoint) of an uninterrupted run, made once each."""
    cache = {}

    def get(num_proc):
        if num_proc not in cache:
            ckpt = tmp_path_factory.mktemp(f"reference{num_proc}") / "ckpt"
            result = parse(horovodrun(ARGS + ["--checkpoint-dir", str(ckpt)], num_proc,
                                      timeout=600))
            cache[num_proc] = result, load_checkpoint(ckpt / f"ckpt-{STEPS}"), \
                sorted(os.listdir(ckpt))
        return cache[num_proc]
    return get


def run_killed_with_workers(num_proc, victim, fault, ckpt, log_dir, extra=()):
    """Runs the job (``extra``: more of its arguments) as plain Gloo workers with ``fault``;
    returns (seconds from the victim's death to the last survivor's exit, {rank: (exit
    status, output)})."""
    os.makedirs(log_dir, exist_ok=True)
    with GlooWorkers(with_fault(fault) + ["--checkpoint-dir", ckpt, *extra], num_proc,
                     log_dir) as workers:
        deadline = time.monotonic() + 420
        while workers.procs[victim].poll() is None:
            assert time.monotonic() < deadline, "the fault never fired:\n" + \
                workers.output(victim)[-3000:]
            ended = [r for r, p in enumerate(workers.procs) if p.poll() is not None]
            assert not ended or workers.procs[victim].poll() is not None, \
                f"rank(s) {ended} ended before the fault:\n" + "\n".join(
                    workers.output(r)[-2000:] for r in ended)
            time.sleep(0.05)
        killed = time.monotonic()
        while any(p.poll() is None for p in workers.procs) and \
                time.monotonic() < killed + KILL_TO_EXIT_S:
            time.sleep(0.05)
        took = time.monotonic() - killed
        outcome = {r: (p.poll(), workers.output(r)) for r, p in enumerate(workers.procs)}
    assert outcome[victim][0] == -signal.SIGKILL, outcome[victim][1][-3000:]
    return took, outcome


def run_killed_with_horovodrun(num_proc, fault, ckpt, log, extra=()):
    """Runs the ordinary command (``extra``: more of its arguments) with ``fault``; returns
    (seconds from the kill to the end of horovodrun, its exit status, its output)."""
    cmd = [HOROVODRUN, "-np", str(num_proc), "--gloo", "-H", f"localhost:{num_proc}",
           sys.executable] + with_fault(fault) + ["--checkpoint-dir", ckpt, *extra]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_USE_LEGACY_KERAS="1")
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        start, killed = time.monotonic(), None
        while proc.poll() is None:
            now = time.monotonic()
            if killed is None and "kills itself (SIGKILL)" in open(log).read():
                killed = now
            if now > (start + 420 if killed is None else killed + KILL_TO_EXIT_S):
                break
            time.sleep(0.05)
        assert killed is not None, "the fault never fired:\n" + open(log).read()[-3000:]
        return time.monotonic() - killed, proc.poll(), open(log).read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def latest(ckpt):
    with open(os.path.join(ckpt, "latest")) as f:
        return f.read().strip()


def check_survivors(num_proc, victim, took, outcome, during):
    lost = f"rank {victim} of {num_proc} was lost"
    for rank, (status, output) in outcome.items():
        if rank == victim:
            continue
        assert status not in (None, 0), \
            f"rank {rank} still running {took:.0f} s after the kill (or exited 0):\n" + \
            output[-3000:]
        assert re.search(re.escape(lost) + r".*during " + re.escape(during), output), \
            f"rank {rank} did not say that {lost} during {during}:\n{output[-3000:]}"
        assert "PeerLostError: " + lost in output, output[-3000:]
    assert took < KILL_TO_EXIT_S


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("num_proc,budget_mb", [(2, None), (3, "0.5")],
                         ids=["2-ranks", "3-ranks-tiered"])
def test_killed_worker_is_named_and_the_rerun_resumes_exactly(num_proc, budget_mb, reference,
                                                              tmp_path):
    """With ``budget_mb``, every run keeps about a tenth of its tables in DRAM and the rest
    in the SSD tier (--memory-budget-mb): killed and resumed, it still equals the
    uninterrupted run without a budget."""
    step_victim, save_victim, save_launcher = VICTIMS[num_proc]
    ckpt = str(tmp_path / "ckpt")
    timings = {}
    extra = [] if budget_mb is None else ["--memory-budget-mb", budget_mb,
                                          "--spill-dir", str(tmp_path / "spill")]

    # 1. Killed in training step 6: the others are inside its collectives.
    took, outcome = run_killed_with_workers(
        num_proc, step_victim, f"rank={step_victim},step=6,phase=step", ckpt, tmp_path / "run1",
        extra)
    timings["step"] = took
    check_survivors(num_proc, step_victim, took, outcome, "training step 6")
    assert latest(ckpt) == "ckpt-4"

    # 2. The same command again resumes from checkpoint 4; now a rank is killed half-way
    #    through writing its shard of checkpoint 8.
    fault = f"rank={save_victim},step=8,phase=save"
    if save_launcher == "workers":
        took, outcome = run_killed_with_workers(num_proc, save_victim, fault, ckpt,
                                                tmp_path / "run2", extra)
        check_survivors(num_proc, save_victim, took, outcome, "checkpoint save 8")
    else:  # horovodrun ends the others itself once one fails: in time, and names it
        took, status, output = run_killed_with_horovodrun(num_proc, fault, ckpt,
                                                          tmp_path / "run2.log", extra)
        assert status not in (None, 0) and took < KILL_TO_EXIT_S, output[-3000:]
        assert f"Process {save_victim} exit with status code 137" in output, output[-3000:]
    timings["save"] = took
    print(f"{num_proc} ranks: kill -> last survivor gone: "
          + ", ".join(f"{k} {v:.2f} s" for k, v in timings.items()))
    assert latest(ckpt) == "ckpt-4", "a half-written checkpoint became latest"
    assert os.path.isdir(os.path.join(ckpt, "ckpt-8.tmp"))
    assert not os.path.exists(os.path.join(ckpt, "ckpt-8"))

    # 3. Once more, undisturbed: resumes from checkpoint 4 and equals the uninterrupted run.
    result = parse(horovodrun(ARGS + ["--checkpoint-dir", ckpt, *extra], num_proc,
                              timeout=600))
    want_result, want, want_listing = reference(num_proc)
    assert sorted(os.listdir(ckpt)) == want_listing  # the .tmp debris is gone
    for key in ("final_loss", "train_auc", "eval_auc", "eval_logloss", "eval_rows"):
        assert result[key] == want_result[key], (key, result, want_result)
    got = load_checkpoint(os.path.join(ckpt, f"ckpt-{STEPS}"))
    assert sorted(got) == sorted(want)
    assert any(k.endswith("/values") for k in got) and any(k.startswith("dense:") for k in got)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    if budget_mb is not None:  # the SSD tier held blocks, and DRAM (the arena's high-water
        # mark) less than twice the budget: the checkpoints read no block back into DRAM,
        # and one step's pinned blocks come on top of the budget
        for rank in result["embedding_memory_by_rank"]:
            assert all(g["ssd_bytes"] > 0 for g in rank.values()), rank
            assert all(g["bytes"] < 2 * float(budget_mb) * 2**20 for g in rank.values()), rank


# ---- the pieces, alone ----------------------------------------------------------------
def test_fault_spec_parsing():
    from tf_fusedemb.testing import faults  # parsing alone loads no TensorFlow
    assert faults.parse(None) is None and faults.parse(" ") is None
    assert faults.parse("rank=1,step=30,phase=step") == faults.Fault(1, 30, "step")
    assert faults.parse(" phase=save , step=8,rank=0") == faults.Fault(0, 8, "save")
    for bad in ("rank=1,step=3", "rank=1,step=3,phase=eval", "rank=x,step=3,phase=step",
                "rank=1,step=3,phase=step,when=now", "nonsense"):
        with pytest.raises(ValueError, match="fault: "):
            faults.parse(bad)


def test_fault_points_are_no_ops_and_read_no_environment(monkeypatch):
    """Production code carries the declared hook only: without an installed plan a fault
    point does nothing, whatever the environment says (the old variable included)."""
    from tf_fusedemb.training import faults as points
    monkeypatch.setenv("TF_FUSEDEMB_FAULT", "rank=0,step=1,phase=step")
    points.inject("step", 1, 0)  # still alive
    source = open(points.__file__).read()
    assert "os.environ" not in source and "getenv" not in source and "os.kill" not in source


@pytest.mark.timeout(120)
def test_fault_kills_only_where_it_is_planned(tmp_path):
    shard = tmp_path / "shard.npz"
    script = ("import sys\n"
              "from tf_fusedemb.training import faults\n"
              f"open({str(shard)!r}, 'wb').write(bytes(1000))\n"
              "faults.inject('save', 8, 1); faults.inject('step', 8, 0)\n"
              "faults.inject('save', 7, 0); print('alive', flush=True)\n"
              f"faults.inject('save', 8, 0, partial_file={str(shard)!r}); print('not reached')\n")
    (tmp_path / "victim.py").write_text(script)
    out = subprocess.run([sys.executable, "-m", "tf_fusedemb.testing.faults", "--fault",
                          "rank=0,step=8,phase=save", str(tmp_path / "victim.py")],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=100)
    assert out.returncode == -signal.SIGKILL, out
    assert out.stdout == "alive\n" and "kills itself (SIGKILL) in save 8" in out.stderr
    assert shard.stat().st_size == 500  # half written
    # The same script without the wrapper: every fault point is a no-op.
    shard.unlink()
    out = subprocess.run([sys.executable, str(tmp_path / "victim.py")], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0 and out.stdout == "alive\nnot reached\n", out
    assert shard.stat().st_size == 1000


def test_fault_command_line_is_checked():
    out = subprocess.run([sys.executable, "-m", "tf_fusedemb.testing.faults", "--fault",
                          "rank=0,step=8,phase=eval", "-m", "tf_fusedemb.train"],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=100)
    assert out.returncode != 0 and "phase must be one of" in out.stderr, out
    assert "usage: python -m tf_fusedemb.testing.faults" in out.stderr


def test_peer_lost_error_message():
    from tf_fusedemb.comm.watchdog import PeerLostError
    e = PeerLostError(3, "checkpoint save 8 > barrier fusedemb/ckpt_written", lost=[2],
                      collective="fusedemb/ckpt_written")
    assert str(e).startswith("rank 2 of 3 was lost (the process ended without shutting down")
    assert "during checkpoint save 8 > barrier fusedemb/ckpt_written (collective " in str(e)
    e = PeerLostError(4, "training step 3", lost=[3, 1], failed={2: "ValueError: bad"})
    assert str(e).startswith("ranks 1, 3 of 4 were lost") and "rank 2 of 4 failed (ValueError" \
        in str(e) and e.lost == [1, 3]


WATCHED_SCRIPT = r"""
import os, signal, sys, time
import tensorflow as tf
from tf_fusedemb.comm import get_communicator
comm = get_communicator()
comm.allgather_object(0)
if comm.rank == 2:
    sys.exit(0)  # finishes early and normally: not a loss
if comm.rank == 1:
    time.sleep(3)
    os.kill(os.getpid(), signal.SIGKILL)
with comm.watch("a long local computation"):
    time.sleep(300)  # no collective: only the watchdog can end this rank
"""


@pytest.mark.timeout(300)
def test_rank_outside_collectives_is_not_left_hanging(tmp_path):
    """Rank 0 computes alone (no collective to fail) when rank 1 dies; rank 2 has already
    finished normally. Rank 0 names rank 1 (and not rank 2) and ends itself with status
    75 after TF_FUSEDEMB_PEER_LOSS_TIMEOUT_S."""
    with GlooWorkers(["-c", WATCHED_SCRIPT], 3, tmp_path,
                     env={"TF_FUSEDEMB_PEER_LOSS_TIMEOUT_S": "4"}) as workers:
        procs = workers.procs
        deadline = time.monotonic() + 240
        while procs[1].poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        killed = time.monotonic()
        while procs[0].poll() is None and time.monotonic() < killed + KILL_TO_EXIT_S:
            time.sleep(0.05)
        took = time.monotonic() - killed
        statuses = [p.poll() for p in procs]
        output = workers.output(0)
    assert statuses[1:] == [-signal.SIGKILL, 0], (statuses, workers.output(1)[-2000:])
    assert statuses[0] == 75, (statuses, output[-3000:])
    assert 3.5 < took < 15, took
    assert "rank 1 of 3 (host " in output, output[-3000:]
    assert "was lost while rank 0 was in a long local computation" in output, output[-3000:]
    assert "exiting with status 75" in output, output[-3000:]
    assert "rank 2 of 3" not in output, output[-3000:]
