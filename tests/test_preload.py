"""testing.preload: a rank forked from a preloading server runs its command as a plain
``python`` process would. Each check compares the forked run with the same command run
as a plain process (the reference), through the launcher the suite's jobs use."""
import io
import json
import os
import subprocess
import sys
import time

import pytest

from tf_fusedemb.testing.cluster.errors import ClusterTimeout
from tf_fusedemb.testing.cluster.launcher import run_local_job
from tf_fusedemb.testing.distributed import RANK_ENV
from tf_fusedemb.testing.preload import Preloader

ENV = {**RANK_ENV, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_USE_LEGACY_KERAS": "1"}
# What a process can see of how it was started: argv, sys.path's head, __main__, the
# working directory, the job's variables, the rank's string-hash seed and random state.
PROBE = """
import json, os, random, sys
import numpy as np
print("PROBE " + json.dumps({
    "argv": sys.argv, "path0": sys.path[0], "main": __name__, "cwd": os.getcwd(),
    "pythonpath": [p for p in sys.path if p == os.environ.get("PROBE_DIR")],
    "job": os.environ.get("TF_FUSEDEMB_PROBE"), "hash": hash("rank-order"),
    "random": random.random(), "np": float(np.random.rand())}), flush=True)
sys.exit(int(os.environ.get("TF_FUSEDEMB_EXIT", "0")))
"""


@pytest.fixture(scope="module")
def preloader():
    with Preloader({**os.environ, **ENV}) as p:
        yield p


def _probes(command, ranks, preloader, tmp_path, **env):
    job = run_local_job(command, ranks, env={**ENV, "PYTHONPATH": str(tmp_path),
                                             "PROBE_DIR": str(tmp_path), **env},
                        cwd=str(tmp_path), timeout=120, output=io.StringIO(),
                        preloader=preloader)
    found = [json.loads(line.split("PROBE ", 1)[1]) for r in range(ranks)
             for line in job.stdout[r] if line.startswith("PROBE ")]
    return job, found


@pytest.mark.timeout(300)
@pytest.mark.parametrize("form", ["code", "script", "module"])
def test_forked_rank_sees_what_a_plain_process_sees(preloader, tmp_path, form):
    (tmp_path / "probe_script.py").write_text(PROBE)
    command = {"code": [sys.executable, "-c", PROBE, "x", "y"],
               "script": [sys.executable, str(tmp_path / "probe_script.py"), "x", "y"],
               "module": [sys.executable, "-m", "probe_script", "x", "y"]}[form]
    assert preloader.command_for(0, command, {**os.environ, **ENV}) is not None
    plain_job, plain = _probes(command, 2, None, tmp_path, TF_FUSEDEMB_PROBE="p")
    forked_job, forked = _probes(command, 2, preloader, tmp_path, TF_FUSEDEMB_PROBE="p")
    assert plain_job.returncode == forked_job.returncode == 0
    assert len(plain) == len(forked) == 2
    same = ("argv", "path0", "main", "cwd", "pythonpath", "job")
    for p, f in zip(plain, forked):
        assert {k: f[k] for k in same} == {k: p[k] for k in same}
    # The ranks of one job differ as plain processes do: their own hash seed and entropy.
    assert forked[0]["hash"] != forked[1]["hash"]
    assert forked[0]["random"] != forked[1]["random"] and forked[0]["np"] != forked[1]["np"]


@pytest.mark.timeout(300)
def test_exit_codes_signals_and_timeouts_reach_the_launcher(preloader, tmp_path):
    command = [sys.executable, "-c", PROBE]
    job, _ = _probes(command, 2, preloader, tmp_path, TF_FUSEDEMB_EXIT="3")
    assert job.returncode == 3
    killed = [sys.executable, "-c", "import os, signal, time\n"
              "if os.environ['HOROVOD_RANK'] == '1': os.kill(os.getpid(), signal.SIGKILL)\n"
              "time.sleep(60)"]
    job = run_local_job(killed, 2, env=ENV, timeout=120, preloader=preloader)
    plain = run_local_job(killed, 2, env=ENV, timeout=120)
    assert (job.returncode, job.failed_rank) == (plain.returncode, plain.failed_rank) == (137, 1)
    # A rank that ignores SIGTERM is killed at the timeout all the same, leaving nothing.
    stuck = [sys.executable, "-c", "import os, signal, time\n"
             "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
             "print('PID', os.getpid(), flush=True)\ntime.sleep(600)"]
    with pytest.raises(ClusterTimeout) as err:
        run_local_job(stuck, 2, env=ENV, timeout=10, preloader=preloader)
    pids = [int(l.split()[1]) for lines in err.value.result.stdout.values() for l in lines
            if l.startswith("PID ")]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids), pids


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_commands_it_cannot_reproduce_run_as_plain_processes(preloader):
    env = {**os.environ, **ENV}
    code = [sys.executable, "-c", "pass"]
    assert preloader.command_for(0, code, env) is not None
    assert preloader.command_for(0, code, {**env, "TF_FUSEDEMB_ANY": "1"}) is not None
    # read at TensorFlow's import or by Python's start-up: a plain process
    assert preloader.command_for(0, code, {**env, "TF_CPP_MIN_LOG_LEVEL": "0"}) is None
    assert preloader.command_for(0, code, {**env, "TF_USE_LEGACY_KERAS": "0"}) is None
    assert preloader.command_for(0, ["taskset", "-c", "0"] + code, env) is None
    assert preloader.command_for(0, [sys.executable, "-X", "importtime", "-c", "pass"], env) is None
    assert preloader.command_for(0, ["/bin/echo", "hi"], env) is None


def test_server_ends_with_its_owner():
    """A Preloader's process that dies without close() leaves no server behind."""
    owner = subprocess.Popen([sys.executable, "-c",
                              "import os, sys\nfrom tf_fusedemb.testing.preload import Preloader\n"
                              "p = Preloader(dict(os.environ))\n"
                              "p.command_for(0, [sys.executable, '-c', 'pass'], dict(os.environ))\n"
                              "print(p._servers[0][0].pid, flush=True)\nos._exit(0)"],
                             stdout=subprocess.PIPE, text=True, env={**os.environ, **ENV})
    server = int(owner.stdout.readline())
    owner.wait(timeout=120)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(server):
        time.sleep(0.2)
    assert not _alive(server)
