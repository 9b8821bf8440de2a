"""Which cores each rank runs on, and the thread counts that match them.

With at least as many cores as ranks, rank r gets its own block of ``cores // ranks``
cores; with fewer cores, ranks go round-robin over them (rank r on core r mod cores), so
ranks of one host land on different cores. Without pinning, the ranks of every host
would contend for all cores and compute contention would hide what the network does.

Environment each rank gets (benchmarks report ``TF_FUSEDEMB_CPUS``):

    TF_NUM_INTRAOP_THREADS  k, the number of cores of the rank (TensorFlow reads it when
                            the program sets no thread count itself)
    TF_NUM_INTEROP_THREADS  max(2, k) by default: one blocking kernel (a py_function, a
                            queue) must not stall every other op of the step
    OMP_NUM_THREADS         k (oneDNN / OpenMP kernels)
    TF_FUSEDEMB_CPUS        the rank's cores, e.g. "0" or "2,3"
"""
import os
from typing import Dict, List, Optional, Sequence, Tuple


def available_cpus() -> List[int]:
    """The cores this process may run on (its affinity mask), sorted."""
    return sorted(os.sched_getaffinity(0))


def assign_cpus(num_ranks: int, cpus: Optional[Sequence[int]] = None) -> List[Tuple[int, ...]]:
    """Returns, for each rank 0..num_ranks-1, the tuple of cores it is pinned to.

    Args:
        num_ranks: int >= 1.
        cpus: the cores to use, or None for :func:`available_cpus`.
    """
    cores = sorted(cpus) if cpus is not None else available_cpus()
    if not cores:
        raise ValueError("no cores to pin ranks to")
    if len(cores) >= num_ranks:
        per_rank = len(cores) // num_ranks
        return [tuple(cores[r * per_rank:(r + 1) * per_rank]) for r in range(num_ranks)]
    return [(cores[r % len(cores)],) for r in range(num_ranks)]


def thread_env(cpus: Sequence[int], inter_op_threads: Optional[int] = None) -> Dict[str, str]:
    """The thread-count environment of a rank pinned to ``cpus`` (see the module doc)."""
    k = len(cpus)
    return {"TF_NUM_INTRAOP_THREADS": str(k),
            "TF_NUM_INTEROP_THREADS": str(inter_op_threads or max(2, k)),
            "OMP_NUM_THREADS": str(k),
            "TF_FUSEDEMB_CPUS": ",".join(str(c) for c in cpus)}
