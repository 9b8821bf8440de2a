"""EmulatedCluster: emulated hosts plus a launcher of Horovod jobs on them, torn down surely.

    with EmulatedCluster(hosts=2, ranks_per_host=2, link_mbit=1000) as cluster:
        rc = cluster.run([sys.executable, "train.py"], timeout=600)

Teardown happens on leaving the ``with`` block (also after an exception in it), at
interpreter exit if :meth:`close` was never called, and before building: leftovers of a
crashed run with the same name, and of default-named clusters whose process is gone.
"""
import atexit
import importlib.util
import signal
import sys
import threading
import warnings
from typing import List, Mapping, Optional, Sequence

from tf_fusedemb.testing.cluster import network
from tf_fusedemb.testing.cluster.errors import ClusterTimeout, ClusterUnavailable
from tf_fusedemb.testing.cluster.forkserver import ForkServers
from tf_fusedemb.testing.cluster.launcher import JobResult, TextSink, run_job
from tf_fusedemb.testing.cluster.placement import assign_cpus

_ACTIVE_NAMES: set = set()  # default names in use in this process (concurrent clusters)
_ACTIVE_LOCK = threading.Lock()


class EmulatedCluster:
    """H emulated hosts with R Horovod ranks each (ranks h*R .. h*R+R-1 on host h+1).

    Args:
        hosts: int >= 1, number of hosts (network namespaces).
        ranks_per_host: int >= 1.
        link_mbit: float, every host's link rate in Mbit/s, each direction.
        slow_host_mbit: float or None, the last host's rate instead (a straggler).
        name: str or None, prefix of namespaces and devices; None picks "fe<pid>", unique
            among this process's live clusters. Give two concurrent clusters of different
            processes different names, or leave both None.
        subnet: "a.b.c.d/n" or None to pick a free /24 of 10.77.0.0/16.
        pin: bool, pin each rank to its own core(s) with taskset and set its thread counts
            (see :mod:`tf_fusedemb.testing.cluster.placement`).
        cpus: the cores to spread ranks over (default: this process's affinity).
        inter_op_threads: int or None, TF_NUM_INTEROP_THREADS of each rank.
        sweep_stale: bool, remove default-named clusters of dead processes before building.

    Raises (from start / ``with``):
        ClusterUnavailable: the machine cannot build it (nothing is left behind).
    """

    def __init__(self, hosts: int = 2, ranks_per_host: int = 2, link_mbit: float = 1000.0,
                 slow_host_mbit: Optional[float] = None, name: Optional[str] = None,
                 subnet: Optional[str] = None, pin: bool = True,
                 cpus: Optional[Sequence[int]] = None, inter_op_threads: Optional[int] = None,
                 sweep_stale: bool = True):
        if ranks_per_host < 1:
            raise ValueError(f"ranks_per_host must be >= 1, got {ranks_per_host}")
        self._own_name = name is None
        with _ACTIVE_LOCK:
            name = network.default_name(sorted(_ACTIVE_NAMES)) if name is None else name
            network.validate_name(name)
            if self._own_name:
                _ACTIVE_NAMES.add(name)
        self.name = name
        self.ranks_per_host = ranks_per_host
        self.network = network.EmulatedNetwork(name, hosts, link_mbit, slow_host_mbit, subnet)
        self.pin = pin
        self._cpus = cpus
        self.inter_op_threads = inter_op_threads
        self.sweep_stale = sweep_stale
        self.last_result: Optional[JobResult] = None
        self._started = False

    @property
    def size(self) -> int:
        """Number of ranks, hosts * ranks_per_host."""
        return self.network.num_hosts * self.ranks_per_host

    @property
    def hosts(self) -> List[network.Host]:
        """The hosts (valid after start)."""
        return self.network.hosts

    def start(self) -> "EmulatedCluster":
        """Checks the machine, removes leftovers and builds the hosts; returns self."""
        if self._started:
            return self
        try:
            network.check_available(need_taskset=self.pin)
            if importlib.util.find_spec("horovod") is None:
                raise ClusterUnavailable("horovod is not installed (make setup builds it)")
            atexit.register(self.close)  # a backstop for callers that never close
            self._started = True
            self.network.create(sweep=self.sweep_stale)
        except BaseException:
            self.close()  # __exit__ does not run when __enter__ raises
            raise
        return self

    def close(self) -> None:
        """Removes every namespace, link and file of the cluster; safe to call twice.

        SIGINT/SIGTERM are held back meanwhile (main thread only), so an interrupt cannot
        leave half the devices behind; they are delivered when teardown is done."""
        if not self._started:
            self._release_name()
            return
        main = threading.current_thread() is threading.main_thread()
        held = {signal.SIGINT, signal.SIGTERM}
        old = signal.pthread_sigmask(signal.SIG_BLOCK, held) if main else None
        try:
            left = self.network.destroy()
            if left:
                warnings.warn(f"emulated cluster {self.name}: could not remove {left}")
            self._started = False
            atexit.unregister(self.close)
            self._release_name()
        finally:
            if old is not None:  # set on the main thread only
                signal.pthread_sigmask(signal.SIG_SETMASK, old)

    def _release_name(self) -> None:
        if self._own_name:
            with _ACTIVE_LOCK:
                _ACTIVE_NAMES.discard(self.name)

    def __enter__(self) -> "EmulatedCluster":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.close()

    def plan(self) -> list:
        """Horovod's slot plan: list of SlotInfo, ranks filled host by host."""
        # Horovod is optional: testing.cluster imports without it (unavailable_reason).
        from horovod.runner.common.util.hosts import (  # pylint: disable=import-outside-toplevel
            get_host_assignments, parse_hosts)
        spec = ",".join(f"{h.namespace}:{self.ranks_per_host}" for h in self.hosts)
        return get_host_assignments(parse_hosts(spec), self.size)

    def run(self, command: Sequence[str], timeout: Optional[float] = None,
            env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None,
            echo: bool = True, stdout: Optional[TextSink] = None,
            stderr: Optional[TextSink] = None, grace_s: float = 3.0,
            fork_servers: Optional[ForkServers] = None) -> int:
        """Runs ``command`` on every rank and returns the job's exit status.

        Output is kept in :attr:`last_result` (a JobResult) and, with ``echo``, written line
        by line as ``[rank]<stdout>:line`` to ``stdout``/``stderr`` (default: sys.stdout and
        sys.stderr at call time). If a rank exits non-zero the others are killed at once and
        its status is returned.

        Args:
            command: argv, e.g. [sys.executable, "-m", "tf_fusedemb.benchmarks.lookup"].
            timeout: seconds or None.
            env: extra environment of the ranks.
            cwd: working directory of the ranks.
            fork_servers: ranks are forked from these servers where one runs the command,
                in their host's namespace and on their cores (:mod:`.forkserver`: no
                import of TensorFlow per rank, for tests); None: each rank a process of
                its own, started with ``ip netns exec``.
        Raises:
            ClusterTimeout: past ``timeout``, after killing every rank (its output up to
                then is in :attr:`last_result` and the exception's ``result``).
        """
        if not self._started:
            raise RuntimeError("start the cluster first (with EmulatedCluster(...) as c:)")
        cpus = assign_cpus(self.size, self._cpus) if self.pin else None
        extra = dict(env or {})
        self.last_result = None
        assert self.network.bridge_address is not None  # set when the cluster started
        try:
            result = run_job(list(command), self.plan(), self.network.bridge_address,
                             cpus=cpus, env=extra, cwd=cwd, timeout=timeout,
                             stdout=(stdout or sys.stdout) if echo else None,
                             stderr=(stderr or sys.stderr) if echo else None,
                             inter_op_threads=self.inter_op_threads, grace_s=grace_s,
                             fork_servers=fork_servers)
        except ClusterTimeout as e:
            self.last_result = e.result
            raise
        self.last_result = result
        return result.returncode

    def run_python(self, args: Sequence[str], **kwargs) -> int:
        """:meth:`run` of ``[sys.executable, *args]``, e.g. ``run_python(["-m", "pkg.mod"])``."""
        return self.run([sys.executable, *args], **kwargs)
