"""Launching multi-process Horovod jobs from tests, with a timeout so a hang fails."""
import os
import subprocess
import sys

from conftest import REPO_ROOT

HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")


def horovodrun(script_args, num_proc, timeout=300):
    """Runs ``python script_args...`` on ``num_proc`` local Gloo workers; returns stdout.
    Fails the test (AssertionError) on a non-zero exit or a timeout."""
    cmd = [HOROVODRUN, "-np", str(num_proc), "--gloo", "-H", f"localhost:{num_proc}",
           sys.executable] + list(script_args)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_USE_LEGACY_KERAS="1")
    try:
        out = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"horovodrun -np {num_proc} timed out after {timeout}s "
                             f"(a hang?): {' '.join(script_args)}") from e
    assert out.returncode == 0, (f"horovodrun -np {num_proc} failed ({out.returncode}):\n"
                                 f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out.stdout
