"""Launching Python modules under Open MPI's ``mpirun`` (BLS inference, its tests and
benchmark): one command line, one availability check, one bounded run, on this machine or
on emulated hosts (network namespaces of :mod:`tf_fusedemb.testing.cluster`). A launcher, like
the cluster's: it sits in ``testing`` (above ``comm``), so it may build emulated hosts.

Command form (root and iproute2 for ``--hosts``)::

    python -m tf_fusedemb.testing.mpirun -np 4 -- python -m tf_fusedemb.serve ...
    python -m tf_fusedemb.testing.mpirun --hosts 2 --ranks-per-host 1 [--link-mbit 1000] \\
        [--timeout S] -- python -m tf_fusedemb.serve ...

On emulated hosts no ssh is needed: Open MPI's rsh agent is a script that runs each
host's daemon (``orted``) with ``ip netns exec HOST``; its TCP traffic (daemons and ranks)
is kept on the cluster's subnet, so ranks of different hosts cross the rate-limited
links. The emulated hosts share one hostname and one ``/tmp``, so the agent gives each
host's daemon (and through it the host's ranks) a session directory of its own
(``OMPI_MCA_orte_tmpdir_base``): Open MPI names session directories after the hostname
and the job, and two daemons in one tree race on its directories (seen: one daemon
failing in ``orte_init`` with "mkdir ... File exists", i.e. a directory there at mkdir
and gone right after; it had detached already, so ``mpirun`` waited for it for ever without a word: the silent hang of the
2-host serve test). The daemons also stay attached to the agent
(``orte_leave_session_attached``): one that fails at start-up then ends the job at once
with Open MPI's message, where a detached one left ``mpirun`` waiting for ever.

Between hosts Open MPI 4.1 has one one-sided (RMA) component that works over TCP,
``osc pt2pt``, and it refuses MPI_THREAD_MULTIPLE (mpi4py's default level): those runs
use ``--mca osc pt2pt`` and ``MPI4PY_RC_THREAD_LEVEL=serialized`` (:data:`PT2PT_FLAGS`).
pt2pt makes progress only inside MPI calls of the target rank (no asynchronous progress),
which is why the BLS alltoallv bounds its blocking calls (comm/bls_alltoallv.py).
"""
import argparse
import ipaddress
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import List, Mapping, Optional, Sequence

from tf_fusedemb.testing.cluster import ClusterUnavailable, EmulatedCluster

# Root works here (containers); oversubscribe lets 4 ranks share 2 cores; vader is the
# shared-memory transport, and TCP stays on loopback unless hosts are given.
MPIRUN_FLAGS = ("--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
                "--mca", "btl", "self,vader,tcp")
# The one-sided transport without asynchronous progress (used between hosts; on one
# host it makes tests of that case, see tests/test_bls_alltoallv.py).
PT2PT_FLAGS = ("--mca", "osc", "pt2pt", "-x", "MPI4PY_RC_THREAD_LEVEL=serialized")
EXIT_TIMEOUT = 124      # the command form, past --timeout (like timeout(1))
EXIT_UNAVAILABLE = 69   # the command form, where mpirun or the hosts cannot run


def unavailable_reason() -> Optional[str]:
    """Why ``mpirun`` + mpi4py cannot run here (None when they can)."""
    if shutil.which("mpirun") is None:
        return "mpirun not found (make mpi-tools installs Open MPI: openmpi-bin)"
    try:
        import mpi4py  # noqa: F401  optional: this is its availability check  pylint: disable=import-outside-toplevel,unused-import
    except ImportError:
        return "mpi4py is not installed (pip install -r requirements.txt)"
    return None


def mpirun_command(num_proc: int, argv: Sequence[str], python: Optional[str] = sys.executable,
                   extra_flags: Sequence[str] = ()) -> List[str]:
    """``mpirun ... [extra_flags] -np N python argv...`` as a list (``python=None``:
    ``argv`` is the whole command, its program first)."""
    if num_proc < 1:
        raise ValueError(f"num_proc must be >= 1, got {num_proc}")
    program = [python] if python else []
    return ["mpirun", *MPIRUN_FLAGS, *extra_flags, "-np", str(int(num_proc)), *program, *argv]


def host_alias(namespace: str) -> str:
    """The node name Open MPI is given for an emulated host: its namespace with '-' for
    '_' (Open MPI refuses node names with underscores)."""
    return namespace.replace("_", "-")


def write_rsh_agent(directory: str, namespaces: Sequence[str]) -> str:
    """Writes Open MPI's rsh agent for emulated hosts into ``directory``; returns its path.
    ``AGENT ALIAS COMMAND...`` runs COMMAND (a shell command line, as ssh would) in the
    namespace of ALIAS (:func:`host_alias`), with ``directory/NAMESPACE`` as Open MPI's
    session directory base of that host (see the module doc: the hosts share ``/tmp``)."""
    cases = "".join(f"  {host_alias(ns)}) ns={ns} ;;\n" for ns in namespaces)
    path = os.path.join(directory, "netns_rsh_agent.sh")
    base = shlex.quote(os.path.abspath(directory))
    with open(path, "w") as f:
        f.write("#!/bin/sh\n# Open MPI rsh agent of tf_fusedemb.testing.mpirun: emulated host -> "
                "ip netns exec\ncase \"$1\" in\n" + cases +
                "  *) echo \"netns_rsh_agent: unknown emulated host '$1'\" >&2; exit 1 ;;\n"
                "esac\nshift\n"
                "# One session directory tree per emulated host: they share hostname and /tmp.\n"
                f"OMPI_MCA_orte_tmpdir_base={base}/\"$ns\"\n"
                "mkdir -p \"$OMPI_MCA_orte_tmpdir_base\" || exit 1\n"
                "export OMPI_MCA_orte_tmpdir_base\n"
                "exec ip netns exec \"$ns\" /bin/sh -c \"$*\"\n")
    os.chmod(path, 0o755)
    return path


def host_flags(namespaces: Sequence[str], ranks_per_host: int, agent: str,
               subnet: str) -> List[str]:
    """mpirun flags that start ``ranks_per_host`` ranks on each emulated host (through
    ``agent``, see :func:`write_rsh_agent`), keep TCP on ``subnet`` ("a.b.c.d/n") and pick
    the one-sided transport that works between hosts (:data:`PT2PT_FLAGS`)."""
    hosts = ",".join(f"{host_alias(ns)}:{int(ranks_per_host)}" for ns in namespaces)
    return ["--host", hosts, "--mca", "plm_rsh_agent", agent,
            "--mca", "plm_rsh_no_tree_spawn", "1",
            "--mca", "orte_leave_session_attached", "1",
            "--mca", "oob_tcp_if_include", subnet, "--mca", "btl_tcp_if_include", subnet,
            *PT2PT_FLAGS]


def _environment(env):
    full_env = dict(os.environ, **(env or {}))
    full_env.setdefault("TF_USE_LEGACY_KERAS", "1")
    full_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    full_env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    return full_env


def _run_bounded(command, timeout, env, cwd, capture=True):
    """Runs ``command`` in its own session; past ``timeout`` kills the whole job (mpirun
    forwards the kill to its daemons and ranks) and raises ``subprocess.TimeoutExpired``."""
    pipe = subprocess.PIPE if capture else None
    proc = subprocess.Popen(command, env=_environment(env), cwd=cwd, stdout=pipe, stderr=pipe,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException as error:  # the timeout, or an interrupt of the caller
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        if isinstance(error, subprocess.TimeoutExpired):  # what the job printed says where
            # text=True: str, as subprocess itself stores there (typeshed says bytes)
            error.stdout, error.stderr = out, err  # type: ignore[assignment]
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_mpirun(num_proc: int, argv: Sequence[str], timeout: Optional[float],
               env: Optional[Mapping[str, str]] = None, cwd=None,
               extra_flags: Sequence[str] = (), capture: bool = True):
    """Runs ``python argv...`` on N ranks of this machine; returns the CompletedProcess
    (stdout and stderr as text, or None with ``capture=False``). Raises
    ``subprocess.TimeoutExpired`` after ``timeout`` seconds, the whole job killed first."""
    return _run_bounded(mpirun_command(num_proc, argv, extra_flags=extra_flags), timeout,
                        env, cwd, capture)


def run_on_emulated_hosts(hosts: int, ranks_per_host: int, command: Sequence[str],
                          timeout: Optional[float], link_mbit: float = 1000.0,
                          env: Optional[Mapping[str, str]] = None, cwd=None,
                          capture: bool = True, name: Optional[str] = None):
    """Runs ``command`` (its program first, e.g. ``[sys.executable, "-m", ...]``) under
    mpirun on ``hosts`` x ``ranks_per_host`` ranks of an emulated cluster built for this
    run (ranks filled host by host) and removed afterwards, also on a timeout or an error.
    Returns the CompletedProcess.

    Raises:
      tf_fusedemb.testing.cluster.ClusterUnavailable: the machine cannot build the hosts
        (not root, no iproute2, ...).
      subprocess.TimeoutExpired: past ``timeout``, the job killed and the hosts removed.
    """
    if hosts < 1 or ranks_per_host < 1:
        raise ValueError(f"need hosts >= 1 and ranks_per_host >= 1, got {hosts} and "
                         f"{ranks_per_host}")
    with EmulatedCluster(hosts=hosts, ranks_per_host=ranks_per_host, link_mbit=link_mbit,
                         name=name, pin=False) as cluster, \
            tempfile.TemporaryDirectory(prefix="fusedemb_mpirun_") as tmp:
        namespaces = [h.namespace for h in cluster.hosts]
        subnet = ipaddress.ip_network(f"{cluster.network.bridge_address}/24", strict=False)
        flags = host_flags(namespaces, ranks_per_host, write_rsh_agent(tmp, namespaces),
                           str(subnet))
        full = mpirun_command(hosts * ranks_per_host, list(command), python=None,
                              extra_flags=flags)
        return _run_bounded(full, timeout, env, cwd, capture)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command form (module doc); returns the job's exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(
        prog="python -m tf_fusedemb.testing.mpirun", usage="%(prog)s [options] -- COMMAND...",
        description="Run COMMAND under Open MPI's mpirun, on this machine (-np) or on "
                    "emulated hosts (--hosts; needs root and iproute2).")
    parser.add_argument("-np", type=int, default=None, help="ranks on this machine")
    parser.add_argument("--hosts", type=int, default=None, help="emulated hosts")
    parser.add_argument("--ranks-per-host", type=int, default=1, help="(default 1)")
    parser.add_argument("--link-mbit", type=float, default=1000.0,
                        help="each emulated host's link rate, Mbit/s (default 1000)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds; exit 124 after")
    args = parser.parse_args(argv[:cut])
    command = argv[cut + 1:]
    if not command:
        parser.error("no COMMAND given after --")
    if (args.np is None) == (args.hosts is None):
        parser.error("give exactly one of -np and --hosts")
    reason = unavailable_reason()
    if reason:
        print(f"tf_fusedemb.testing.mpirun: cannot run here: {reason}", file=sys.stderr)
        return EXIT_UNAVAILABLE

    def stop(signum, _frame):  # unwinds: the job is killed and the hosts removed
        raise SystemExit(128 + signum)
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        if args.hosts is None:
            proc = _run_bounded(mpirun_command(args.np, command, python=None), args.timeout,
                                None, None, capture=False)
        else:
            proc = run_on_emulated_hosts(args.hosts, args.ranks_per_host, command, args.timeout,
                                         args.link_mbit, capture=False)
    except ClusterUnavailable as e:
        print(f"tf_fusedemb.testing.mpirun: cannot build emulated hosts: {e}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except subprocess.TimeoutExpired:
        print(f"tf_fusedemb.testing.mpirun: stopped after --timeout {args.timeout:g}s",
              file=sys.stderr)
        return EXIT_TIMEOUT
    finally:
        signal.signal(signal.SIGTERM, previous)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
