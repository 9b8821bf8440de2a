"""Runs a command pinned to this rank's share of the host's cores, with thread counts to
match: the placement the emulated-host launcher gives each rank, for ranks that
``horovodrun`` starts on one host.

    horovodrun -np 2 --gloo -H localhost:2 python -m tf_fusedemb.testing.cluster.pinned \\
        python -m tf_fusedemb.train ...

The rank's slot on its host comes from Horovod's ``HOROVOD_LOCAL_RANK`` and
``HOROVOD_LOCAL_SIZE`` (set by horovodrun), Open MPI's ``OMPI_COMM_WORLD_LOCAL_RANK``
and ``OMPI_COMM_WORLD_LOCAL_SIZE`` (mpirun) or torchrun's ``LOCAL_RANK`` and
``LOCAL_WORLD_SIZE``; the cores and thread counts from
:mod:`tf_fusedemb.testing.cluster.placement`. A program can also pin itself
(:func:`pin_this_rank`, e.g. the inference benchmark: one core per rank). Unpinned, two
ranks on two cores each run TensorFlow thread pools as wide as the machine and preempt
each other's kernels (the main job ran at 34,775 samples/s unpinned on loopback, 40,295
pinned on emulated hosts). Outside those launchers the command runs unchanged.
"""
import os
import shutil
import sys
from typing import Mapping, Optional, Tuple

from tf_fusedemb.testing.cluster.placement import assign_cpus, thread_env

# (local rank, local size) variables of the launchers: horovodrun's, mpirun's, then
# torchrun's (the peer benchmark pins TorchRec's ranks as it pins ours).
LOCAL_SLOT_VARS = (("HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"),
                   ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
                   ("LOCAL_RANK", "LOCAL_WORLD_SIZE"))


def rank_cpus(environ: Mapping[str, str]) -> Optional[Tuple[int, ...]]:
    """The cores of the rank that ``environ`` describes (its local rank and size from
    horovodrun or mpirun, see LOCAL_SLOT_VARS; :func:`placement.assign_cpus`), or None
    outside both launchers."""
    for rank_var, size_var in LOCAL_SLOT_VARS:
        if rank_var in environ:
            local_rank = int(environ[rank_var])
            return assign_cpus(int(environ.get(size_var, local_rank + 1)))[local_rank]
    return None


def pinned_argv(argv, environ) -> tuple:
    """(argv, extra environment) that pin ``argv`` to the core(s) of the rank described
    by ``environ`` (see :func:`rank_cpus`); unchanged outside those launchers."""
    cpus = rank_cpus(environ)
    if cpus is None or not shutil.which("taskset"):
        return list(argv), {}
    return ["taskset", "-c", ",".join(map(str, cpus))] + list(argv), thread_env(cpus)


def pin_this_rank(environ: Mapping[str, str] = os.environ,
                  cores: Optional[int] = None) -> Optional[Tuple[int, ...]]:
    """Pins every thread of this process to its rank's cores (:func:`rank_cpus`; only
    the first ``cores`` of them when given), so threads started later (TensorFlow's
    pools, MPI's, Horovod's) run there too. Call it early, before the program sizes its
    thread pools. Returns the cores; None (nothing done) outside those launchers."""
    cpus = rank_cpus(environ)
    if cpus is None:
        return None
    cpus = cpus[:cores] if cores else cpus
    for task in os.listdir("/proc/self/task"):  # the calling thread's mask is inherited
        try:
            os.sched_setaffinity(int(task), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    return cpus


def main(argv) -> None:
    if not argv:
        raise SystemExit("usage: python -m tf_fusedemb.testing.cluster.pinned COMMAND [ARGS...]")
    command, extra = pinned_argv(argv, os.environ)
    os.execvpe(command[0], command, dict(os.environ, **extra))


if __name__ == "__main__":
    main(sys.argv[1:])
