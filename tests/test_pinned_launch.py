"""The default main-job launch pins each horovodrun rank to its share of the cores."""
import os
import subprocess
import sys

from tf_fusedemb.testing.cluster.pinned import pinned_argv
from tf_fusedemb.testing.cluster.placement import assign_cpus, available_cpus


def test_ranks_get_disjoint_cores_and_matching_threads():
    cores = available_cpus()
    seen = []
    for rank in range(2):
        argv, env = pinned_argv(["python", "x.py"], {"HOROVOD_LOCAL_RANK": str(rank),
                                                     "HOROVOD_LOCAL_SIZE": "2"})
        assert argv[:2] == ["taskset", "-c"] and argv[3:] == ["python", "x.py"]
        cpus = [int(c) for c in argv[2].split(",")]
        assert set(cpus) <= set(cores)
        assert env["TF_NUM_INTRAOP_THREADS"] == str(len(cpus))
        seen.append(set(cpus))
    if len(cores) >= 2:
        assert not seen[0] & seen[1]


def test_a_torchrun_rank_is_pinned_like_a_horovodrun_rank():
    """The peer benchmark runs TorchRec's ranks through the same wrapper under torchrun,
    whose slot variables are LOCAL_RANK and LOCAL_WORLD_SIZE."""
    for rank in range(2):
        torch_argv, torch_env = pinned_argv(["w"], {"LOCAL_RANK": str(rank),
                                                    "LOCAL_WORLD_SIZE": "2"})
        hvd_argv, hvd_env = pinned_argv(["w"], {"HOROVOD_LOCAL_RANK": str(rank),
                                                "HOROVOD_LOCAL_SIZE": "2"})
        assert torch_argv == hvd_argv and torch_env == hvd_env
        assert torch_argv[2] == ",".join(map(str, assign_cpus(2)[rank]))


def test_outside_horovodrun_the_command_is_unchanged():
    assert pinned_argv(["python", "x.py"], {}) == (["python", "x.py"], {})


def test_the_pinned_command_runs_on_its_core():
    env = dict(os.environ, HOROVOD_LOCAL_RANK="0", HOROVOD_LOCAL_SIZE="1")
    out = subprocess.run([sys.executable, "-m", "tf_fusedemb.testing.cluster.pinned",
                          sys.executable, "-c",
                          "import os; print(sorted(os.sched_getaffinity(0)), "
                          "os.environ['TF_NUM_INTRAOP_THREADS'])"],
                         env=env, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == f"{available_cpus()} {len(available_cpus())}"


def test_a_rank_of_mpirun_pins_itself_to_one_core():
    """pin_this_rank (the inference benchmark's ranks): Open MPI's local rank and size, one
    core of that rank's share, every thread of the process."""
    env = dict(os.environ, OMPI_COMM_WORLD_LOCAL_RANK="1", OMPI_COMM_WORLD_LOCAL_SIZE="2")
    out = subprocess.run([sys.executable, "-c",
                          "import os, threading; from tf_fusedemb.testing.cluster.pinned import "
                          "pin_this_rank; e = threading.Event(); t = threading.Thread("
                          "target=e.wait); t.start(); cpus = pin_this_rank(cores=1); "
                          "print(list(cpus), sorted(os.sched_getaffinity(t.native_id))); e.set()"],
                         env=env, capture_output=True, text=True, timeout=60, check=True)
    core = list(assign_cpus(2)[1][:1])
    assert out.stdout.strip() == f"{core} {core}"
