"""Issue 19, part 4: rerunning the README's ``make train`` resumes from the last complete
checkpoint of its run directory (after a lost worker, as the watchdog's message promises);
``FRESH=1`` starts afresh. Through the Makefile, on 2 Horovod workers, tiny settings."""
import json
import os
import subprocess

import pytest

from conftest import REPO_ROOT, STACK

TRAIN_ARGS = ("--model dlrm --data synthetic --steps 4 --batch-size 32 --rows 512 "
              "--eval-rows 128 --dim 4 --checkpoint-every 2")


def make_train(run_dir, *extra, timeout=400):
    """``make train`` with setup taken as done (``-o setup``: the test must not rebuild the
    op library the suite runs against); returns the CompletedProcess."""
    cmd = ["make", "--no-print-directory", "-o", "setup", "train", f"RUN_DIR={run_dir}",
           "NP=2", f"TRAIN_ARGS={TRAIN_ARGS}", f"STACK={STACK}", *extra]
    try:
        return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"make train timed out after {timeout}s (a hang?)") from e


def result_of(out):
    """The RESULT json rank 0 printed (horovodrun prefixes its lines with the rank)."""
    lines = [l.split("RESULT ", 1)[1] for l in out.stdout.splitlines() if "RESULT {" in l]
    assert out.returncode == 0 and lines, f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return json.loads(lines[-1])


@pytest.mark.timeout(900)
def test_rerunning_make_train_resumes_after_a_lost_worker(tmp_path):
    run_dir = tmp_path / "run"
    ckpt = run_dir / "ckpt"
    # Rank 1 dies right before step 3: checkpoint 2 is the last complete one.
    first = make_train(run_dir, "TRAIN_FAULT=rank=1,step=3,phase=step")  # testing.faults
    assert first.returncode != 0, first.stdout[-2000:]
    assert "rerun the job to resume from its last complete checkpoint" in first.stderr
    assert (ckpt / "latest").read_text().strip() == "ckpt-2"

    second = make_train(run_dir)  # the same command, as the message says
    result = result_of(second)
    assert f"resuming from {ckpt}/ckpt-2 at step 2 of 4" in second.stdout
    assert result["resumed_from_step"] == 2 and result["steps"] == 4
    # The resumed run trained steps 3 and 4 only (the progress bar counts from the resume).
    assert "step 4/4" in second.stdout and "step 1/4" not in second.stdout
    assert (ckpt / "latest").read_text().strip() == "ckpt-4"
    assert result["export"]["checkpoint_step"] == 4


def test_fresh_is_the_explicit_way_to_start_afresh(tmp_path):
    """Only FRESH=1 removes the run directory (a dry run of the Makefile's recipe)."""
    def recipe(*extra):
        out = subprocess.run(["make", "--no-print-directory", "-n", "-o", "setup", "train",
                              f"RUN_DIR={tmp_path}", f"STACK={STACK}", *extra], cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=60, check=True)
        return out.stdout
    assert f"rm -rf {tmp_path}" not in recipe()
    # The fault switch is make's command line only (tf_fusedemb.testing.faults wraps the job).
    assert "-m tf_fusedemb.train" in recipe() and "testing.faults" not in recipe()
    env = dict(os.environ, TRAIN_FAULT="rank=0,step=1,phase=step")
    out = subprocess.run(["make", "--no-print-directory", "-n", "-o", "setup", "train",
                          f"RUN_DIR={tmp_path}", f"STACK={STACK}"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=60, check=True, env=env)
    assert "testing.faults" not in out.stdout  # an environment variable does not switch it on
    assert "-m tf_fusedemb.testing.faults --fault rank=1,step=3,phase=step -m tf_fusedemb.train" \
        in recipe("TRAIN_FAULT=rank=1,step=3,phase=step")
    assert f"rm -rf {tmp_path}" not in recipe("FRESH=0")
    assert recipe("FRESH=1").splitlines()[0] == f"rm -rf {tmp_path}"
