"""Starting Horovod ranks in emulated hosts, or on this host: rendezvous, processes, output,
exit codes.

It does what ``horovod/runner/gloo_run.py:launch_gloo`` does, with ``ip netns exec HOST``
instead of ssh as the way to reach a host (:func:`run_job`), or with no way to reach one
for ranks on this host (:func:`run_local_job`: ``horovodrun -np N --gloo -H localhost:N``
without horovodrun's start-up check, which imports TensorFlow in a child process only to
ask whether Horovod was built with Gloo; a 2-rank job of 21 s took 2.7 s less here):
Horovod's own rendezvous server (kept alive for the whole job: process sets rendezvous
through it too), the environment of ``create_run_env_vars`` + ``create_slot_env_vars`` for
every slot, and output prefixed ``[rank]<stdout>:`` like horovodrun. Unlike launch_gloo,
the first rank that exits non-zero gets the others killed at once (a Gloo peer that lost
its partner can wait for minutes), and a timeout kills every rank.
"""
import contextlib
import dataclasses
import os
import signal
import subprocess
import threading
import time
from typing import IO, Any, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple, Union

from tf_fusedemb.testing.cluster.errors import ClusterTimeout, ClusterUnavailable
from tf_fusedemb.testing.cluster.forkserver import ForkedProcess, ForkServers
from tf_fusedemb.testing.cluster.network import HOST_IFACE
from tf_fusedemb.testing.cluster.placement import thread_env


class TextSink(Protocol):
    """Where a job's prefixed lines go: a text stream (sys.stdout), or any object with these."""

    def write(self, text: str, /) -> Any: ...

    def flush(self) -> Any: ...

_POLL_S = 0.05
LOOPBACK_IFACE, LOOPBACK_ADDRESS = "lo", "127.0.0.1"  # where run_local_job's Gloo meets


@dataclasses.dataclass
class JobResult:
    """What one job did.

    Attributes:
        returncode: int, 0 if every rank exited 0, else the exit status of the first rank
            seen failing (128 + N for a rank killed by signal N).
        failed_rank: int or None, that rank.
        seconds: float, wall time from the first start to the last exit.
        stdout: {rank: [line, ...]}, every line each rank wrote, without the prefix.
        stderr: {rank: [line, ...]}.
        exited_at: {rank: time.monotonic() when its exit was seen (within 50 ms)}, for the
            ranks that exited by themselves (not those killed after a failure or timeout).
    """
    returncode: int
    failed_rank: Optional[int]
    seconds: float
    stdout: Dict[int, List[str]]
    stderr: Dict[int, List[str]]
    exited_at: Dict[int, float] = dataclasses.field(default_factory=dict)

    def text(self, rank: int, stream: str = "stdout") -> str:
        """The whole output of ``rank`` on ``stream`` ("stdout" or "stderr") as one string."""
        return "".join(getattr(self, stream)[rank])


def _rendezvous_server(address: str):
    """Horovod's RendezvousServer, listening on ``address`` only.

    Its own start() binds every address of the machine; binding the bridge's address keeps
    the job's traffic on the emulated network. The subclass sets the two attributes that
    init() and stop() use (horovod 0.28.1)."""
    try:
        # Horovod is optional: testing.cluster imports without it (unavailable_reason).
        from horovod.runner.http.http_server import (  # pylint: disable=import-outside-toplevel
            RendezvousHandler, RendezvousHTTPServer, RendezvousServer)
        from horovod.runner.util.threads import (  # pylint: disable=import-outside-toplevel
            in_thread)
    except ImportError as e:
        raise ClusterUnavailable(f"horovod is not installed ({e})") from None

    class _BoundRendezvousServer(RendezvousServer):
        def start(self, handler_cls=RendezvousHandler):
            self._httpd = RendezvousHTTPServer((address, 0), handler_cls, self._verbose)
            self._listen_thread = in_thread(target=self._httpd.serve_forever)
            return self._httpd.server_address[1]

        def stop(self):
            super().stop()
            self._httpd.server_close()  # stop() leaves the listening socket open

    return _BoundRendezvousServer(0)


def _pump(pipe: IO[bytes], prefix: str, sink: Optional[TextSink], lines: List[str],
          lock: threading.Lock) -> None:
    """Copies a rank's pipe line by line into ``lines`` and, prefixed, into ``sink``."""
    for raw in iter(pipe.readline, b""):
        line = raw.decode("utf-8", errors="replace")
        lines.append(line)
        if sink is not None:
            with lock:
                sink.write(prefix + (line if line.endswith("\n") else line + "\n"))
                sink.flush()
    pipe.close()


Process = Union[subprocess.Popen, ForkedProcess]  # a rank: pid, stdout, stderr, poll, wait


def _kill_all(procs: Sequence[Process], grace_s: float) -> None:
    """SIGTERM to every rank's process group, SIGKILL to what is left after ``grace_s``.
    Whole groups, because a rank's command may have started children of its own."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(_POLL_S)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=grace_s)


def _returncode(proc: Process) -> int:
    code = proc.poll()
    assert code is not None, "only an exited rank has a status"
    return code


def _status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _start_pumps(proc: Process, rank: int, sinks: Tuple[Optional[TextSink], ...],
                 lines: Tuple[List[str], ...], lock: threading.Lock) -> List[threading.Thread]:
    """Threads that copy the rank's stdout and stderr, line by line, into ``lines`` (and
    prefixed into ``sinks``, where not None), in that order."""
    pumps = []
    for pipe, sink, into, tag in zip((proc.stdout, proc.stderr), sinks, lines, ("stdout", "stderr")):
        t = threading.Thread(target=_pump, daemon=True,
                             args=(pipe, f"[{rank}]<{tag}>:", sink, into, lock))
        t.start()
        pumps.append(t)
    return pumps


def _wait(procs: Sequence[Process], start: float, timeout: Optional[float],
          exited_at: Dict[int, float]) -> Tuple[Optional[int], Optional[List[int]]]:
    """Polls the ranks until one fails, all exit or ``timeout`` (seconds after ``start``)
    runs out, noting each rank's exit time in ``exited_at``. Returns (the lowest failed
    rank or None, the ranks still running at the timeout or None)."""
    while True:
        codes = [p.poll() for p in procs]
        now = time.monotonic()
        for r, c in enumerate(codes):
            if c is not None:
                exited_at.setdefault(r, now)
        failed = next((r for r, c in enumerate(codes) if c), None)
        if failed is not None or all(c is not None for c in codes):
            return failed, None
        if timeout is not None and now - start > timeout:
            return None, [r for r, c in enumerate(codes) if c is None]
        time.sleep(_POLL_S)


class _Ranks:
    """A job's rank processes, the threads that copy their output, and that output."""

    def __init__(self, sinks: Tuple[Optional[TextSink], Optional[TextSink]],
                 fork_servers: Optional[ForkServers] = None):
        self.procs: List[Process] = []  # in the order started (run_job: by rank)
        self._fork_servers = fork_servers
        self.stdout: Dict[int, List[str]] = {}
        self.stderr: Dict[int, List[str]] = {}
        self._sinks = sinks  # where prefixed stdout and stderr lines go (None: nowhere)
        self._pumps: List[threading.Thread] = []
        self._lock = threading.Lock()  # one prefixed line at a time into a shared sink

    def start(self, rank: int, command: List[str], env: Mapping[str, str],
              cwd: Optional[str], host: Optional[str], cpus: Optional[Tuple[int, ...]]) -> None:
        """Starts ``rank``'s process in a session of its own (so that it is stopped with
        its children), in network namespace ``host`` (None: this one) pinned to ``cpus``
        (None: unpinned), and the threads that copy its output. It is forked from a fork
        server where one runs the command (``fork_servers``), else ``ip netns exec`` and
        ``taskset`` start it as a process of its own."""
        server = self._fork_servers and self._fork_servers.server_for(rank, command, env)
        p: Process
        if server:
            p = server.spawn(command, env, cwd, netns=host, cpus=cpus)
        else:
            p = subprocess.Popen(_host_argv(host, cpus) + command, env=env, cwd=cwd,
                                 stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, start_new_session=True)
        self.procs.append(p)
        self.stdout[rank], self.stderr[rank] = [], []
        self._pumps += _start_pumps(p, rank, self._sinks, (self.stdout[rank], self.stderr[rank]),
                                    self._lock)

    def stop(self, grace_s: float) -> None:
        """Kills what still runs (:func:`_kill_all`) and waits up to 5 s per thread for the
        last of the output."""
        _kill_all(self.procs, grace_s)
        for t in self._pumps:
            t.join(timeout=5)


def _host_argv(host: Optional[str], cpus: Optional[Tuple[int, ...]]) -> List[str]:
    """The argv prefix that runs a command in namespace ``host`` (None: none) pinned to
    ``cpus`` (None: unpinned)."""
    argv = [] if host is None else ["ip", "netns", "exec", host]
    if cpus is not None:
        argv += ["taskset", "-c", ",".join(str(c) for c in cpus)]
    return argv


def _slot_env(slot, base: Mapping[str, str], run_env: Mapping[str, Any],
              cpus: Optional[Sequence[Tuple[int, ...]]], inter_op_threads: Optional[int],
              env: Optional[Mapping[str, str]]) -> Dict[str, str]:
    """The environment of ``slot``'s rank, each layer over the one before: ``base``, the
    thread counts of its pinning (with ``cpus``), the caller's ``env``, then Horovod's
    (``run_env``, from create_run_env_vars, and the slot's own)."""
    # Horovod is optional: testing.cluster imports without it (unavailable_reason).
    from horovod.runner.gloo_run import (  # pylint: disable=import-outside-toplevel
        create_slot_env_vars)
    rank_env = dict(base)
    if cpus is not None:
        rank_env.update(thread_env(cpus[slot.rank], inter_op_threads))
    rank_env.update(env or {})  # the caller's settings win over the defaults above
    rank_env.update({k: str(v) for k, v in run_env.items()})
    rank_env.update(create_slot_env_vars(slot))
    rank_env["PYTHONUNBUFFERED"] = "1"  # lines reach the prefixer as they are printed
    return rank_env


def run_job(command: Sequence[str], plan: Sequence, rendezvous_address: str,
            cpus: Optional[Sequence[Tuple[int, ...]]] = None,
            env: Optional[Mapping[str, str]] = None,
            cwd: Optional[str] = None, timeout: Optional[float] = None,
            stdout: Optional[TextSink] = None, stderr: Optional[TextSink] = None,
            inter_op_threads: Optional[int] = None, grace_s: float = 3.0,
            on_this_host: bool = False, fork_servers: Optional[ForkServers] = None
            ) -> JobResult:
    """Runs ``command`` once per slot of ``plan``, each in its slot's host, and waits.

    Args:
        command: argv of every rank, e.g. [sys.executable, "train.py"].
        plan: list of horovod SlotInfo (get_host_assignments); slot.hostname is the
            namespace the rank runs in.
        rendezvous_address: str, the root namespace's address on the bridge (with
            ``on_this_host``: a loopback address).
        cpus: per rank, the cores to pin it to (taskset), or None for no pinning.
        env: extra environment of every rank, over this process's own and the thread
            counts of pinning (HOROVOD_* of this process are dropped, the job's own set).
        cwd: working directory of the ranks (default: this process's).
        timeout: seconds, or None to wait forever.
        stdout, stderr: where prefixed lines go (None: only recorded in the result).
        inter_op_threads: TF_NUM_INTEROP_THREADS of each rank (default max(2, cores)).
        grace_s: seconds between SIGTERM and SIGKILL when ranks are stopped.
        on_this_host: run every rank here, not in its slot's namespace, with Gloo on the
            loopback device (:func:`run_local_job`).
        fork_servers: the ranks whose command a server runs are forked from it, in their
            host's namespace and on their cores (:mod:`.forkserver`: no import of
            TensorFlow per rank); None: every rank is a process of its own.

    Returns:
        JobResult; returncode != 0 when a rank failed (the others were killed).

    Raises:
        ClusterTimeout: after killing every rank, when ``timeout`` ran out; its ``result``
            holds the output until then (returncode 124).
    """
    # Horovod is optional: testing.cluster imports without it (unavailable_reason).
    from horovod.runner.gloo_run import (  # pylint: disable=import-outside-toplevel
        create_run_env_vars)
    plan = sorted(plan, key=lambda slot: slot.rank)  # ranks.procs[r] is rank r
    base = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")}
    server = _rendezvous_server(rendezvous_address)
    port = server.start()
    ranks = _Ranks((stdout, stderr), fork_servers)
    start = time.monotonic()
    exited_at: Dict[int, float] = {}
    try:
        server.init(plan)
        iface = LOOPBACK_IFACE if on_this_host else HOST_IFACE
        run_env = create_run_env_vars(rendezvous_address, [iface], port)
        for slot in plan:
            ranks.start(slot.rank, list(command),
                        _slot_env(slot, base, run_env, cpus, inter_op_threads, env), cwd,
                        None if on_this_host else slot.hostname,
                        None if cpus is None else tuple(cpus[slot.rank]))
        failed, timed_out = _wait(ranks.procs, start, timeout, exited_at)
    finally:
        ranks.stop(grace_s)  # ranks left after a failure, a timeout, an exception, a signal
        server.stop()
    seconds = time.monotonic() - start
    if timed_out is not None:
        raise ClusterTimeout(f"job timed out after {timeout:g} s with ranks {timed_out} still "
                             f"running; every rank was killed: {list(command)}",
                             JobResult(124, None, seconds, ranks.stdout, ranks.stderr, exited_at))
    code = 0 if failed is None else _status(_returncode(ranks.procs[failed]))
    return JobResult(code, failed, seconds, ranks.stdout, ranks.stderr, exited_at)


def run_local_job(command: Sequence[str], num_ranks: int, env: Optional[Mapping[str, str]] = None,
                  cwd: Optional[str] = None, timeout: Optional[float] = None,
                  output: Optional[TextSink] = None,
                  fork_servers: Optional[ForkServers] = None) -> JobResult:
    """Runs ``command`` on ``num_ranks`` Gloo ranks of this host and waits: what
    ``horovodrun -np N --gloo -H localhost:N COMMAND`` does (the same slots, rendezvous
    and environment), less its start-up check; the first rank that fails gets the others
    killed at once.

    Args:
        command: argv of every rank, e.g. [sys.executable, "train.py"].
        num_ranks: int >= 1.
        env, cwd, timeout: as for :func:`run_job`.
        output: where every rank's stdout and stderr lines go, prefixed as horovodrun
            prefixes them (``[1]<stderr>:``), in the order they arrive (None: only recorded
            in the result).
        fork_servers: as for :func:`run_job` (None: every rank a process of its own).

    Returns:
        JobResult; returncode != 0 when a rank failed.

    Raises:
        ValueError: ``num_ranks`` < 1.
        ClusterTimeout: past ``timeout``, after killing every rank.
    """
    if int(num_ranks) < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    # Horovod is optional: testing.cluster imports without it (unavailable_reason).
    from horovod.runner.common.util.hosts import (  # pylint: disable=import-outside-toplevel
        get_host_assignments, parse_hosts)
    plan = get_host_assignments(parse_hosts(f"localhost:{int(num_ranks)}"), int(num_ranks))
    return run_job(command, plan, LOOPBACK_ADDRESS, env=env, cwd=cwd, timeout=timeout,
                   stdout=output, stderr=output, on_this_host=True, fork_servers=fork_servers)
