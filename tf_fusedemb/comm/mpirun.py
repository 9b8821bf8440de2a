"""Launching Python modules under Open MPI's ``mpirun`` (BLS inference, its tests and
benchmark): one command line, one availability check, one bounded run."""
import os
import shutil
import subprocess
import sys
from typing import Mapping, Optional, Sequence

# Root works here (containers); oversubscribe lets 4 ranks share 2 cores; vader is the
# shared-memory transport, and TCP stays on loopback unless hosts are given.
MPIRUN_FLAGS = ("--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
                "--mca", "btl", "self,vader,tcp")


def unavailable_reason() -> Optional[str]:
    """Why ``mpirun`` + mpi4py cannot run here (None when they can)."""
    if shutil.which("mpirun") is None:
        return "mpirun not found (make mpi-tools installs Open MPI: openmpi-bin)"
    try:
        import mpi4py  # noqa: F401 pylint: disable=import-outside-toplevel,unused-import
    except ImportError:
        return "mpi4py is not installed (pip install -r requirements.txt)"
    return None


def mpirun_command(num_proc: int, argv: Sequence[str], python: str = sys.executable):
    """``mpirun ... -np N python argv...`` as a list."""
    if num_proc < 1:
        raise ValueError(f"num_proc must be >= 1, got {num_proc}")
    return ["mpirun", *MPIRUN_FLAGS, "-np", str(int(num_proc)), python, *argv]


def run_mpirun(num_proc: int, argv: Sequence[str], timeout: float,
               env: Optional[Mapping[str, str]] = None, cwd=None):
    """Runs ``python argv...`` on N ranks; returns the CompletedProcess (stdout and
    stderr as text). Raises ``subprocess.TimeoutExpired`` after ``timeout`` seconds, the
    whole job killed first (mpirun forwards the kill to its ranks)."""
    full_env = dict(os.environ, **(env or {}))
    full_env.setdefault("TF_USE_LEGACY_KERAS", "1")
    full_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    full_env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    proc = subprocess.Popen(mpirun_command(num_proc, argv), env=full_env, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 15)
        try:
            proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
