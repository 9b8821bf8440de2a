"""The one harness of the self-launching benchmarks: shared flags, launching the workers
(on this host, or on an emulated multi-host cluster) and collecting rank 0's
result; plus the worker side of changing the link rate during a job.

``python -m tf_fusedemb.benchmarks.NAME [flags]`` is run plainly; :func:`benchmark_main`
re-launches the same module on Horovod workers and prints rank 0's result (the JSON after
``marker`` on its stdout) as the LAST line with ``--json``:

* ``--hosts H [--ranks-per-host R] [--link-mbit M] [--slow-host-mbit S]``: on an
  :class:`~tf_fusedemb.testing.cluster.EmulatedCluster` (H network namespaces, each host's
  link limited to M Mbit/s per direction with ``tc tbf``, every rank pinned to its own
  core with TensorFlow's thread counts set to match). Needs root and iproute2; where the
  cluster cannot be built the command exits 69 and says why. This is where every
  communication figure is measured.
* otherwise ``--np N``: N Gloo ranks on this host, started as ``horovodrun -np N --gloo -H
  localhost:N`` starts them (``tf_fusedemb.testing.cluster.launcher.run_local_job``):
  collectives over loopback. Each rank is pinned to its share of the host's cores, with
  TensorFlow's thread counts to match (``tf_fusedemb.testing.cluster.pinned``), as ``make
  train`` runs the main job; ``--no-pin`` leaves them unpinned (a machine shared with
  other work, where a pinned rank waits for its core).

Workers' output goes to stderr prefixed ``[rank]<stdout>:`` / ``[rank]<stderr>:``. With
``TF_FUSEDEMB_BENCH_NICE=-15`` (root) the workers run at that priority, their sessions'
autogroups included, so other jobs on a shared machine disturb the timings less; with
``TF_FUSEDEMB_COMM_THREAD_NICE=-20`` the threads Horovod starts in a worker (its background
thread, Gloo's) get priority over its compute threads (see :func:`_raise_comm_threads`).

Link rate during a job (cluster only): a worker calls :func:`request_link_rate`; rank 0
prints ``LINK_RATE_MARKER mbit token``, the launcher (which owns the hosts) sets every
host's link to ``mbit`` (both qdiscs of the host, as the cluster built them) and creates
``token`` in the directory named by ``TF_FUSEDEMB_LINK_CONTROL_DIR``; every rank waits for that
file, then for the others (a barrier). A benchmark sweeps link speeds this way in ONE job,
with its functions traced once.
"""
import importlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import uuid

from tf_fusedemb.benchmarks.timing import emit
from tf_fusedemb.testing.cluster import (ClusterTimeout, ClusterUnavailable, EmulatedCluster,
                                         network)
from tf_fusedemb.testing.cluster.launcher import run_local_job

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
LINK_RATE_MARKER = "FUSEDEMB_LINK_RATE "
LINK_CONTROL_ENV = "TF_FUSEDEMB_LINK_CONTROL_DIR"  # set by the launcher for its workers
PIN_MODULE = "tf_fusedemb.testing.cluster.pinned"  # pins a local worker to its cores
EXIT_UNAVAILABLE = 69  # like ``python -m tf_fusedemb.testing.cluster``
BENCH_NICE_ENV = "TF_FUSEDEMB_BENCH_NICE"  # workers' priority, see _raise_priority
COMM_NICE_ENV = "TF_FUSEDEMB_COMM_THREAD_NICE"  # their communication threads', ditto
# Renamed (one prefix for every variable of the package): set, they stop the benchmark
# with the new name rather than time it silently at the wrong priority.
RENAMED_ENV = {"FUSEDEMB_BENCH_NICE": BENCH_NICE_ENV, "FUSEDEMB_COMM_THREAD_NICE": COMM_NICE_ENV}


# ---------------------------------------------------------------------------- flags
def add_launch_args(parser):
    """Flags of every self-launching benchmark: output and where the workers run."""
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument("--np", type=int, default=2,
                        help="local Gloo workers (as horovodrun starts them) when --hosts is "
                             "not given")
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="local workers run unpinned (default: each pinned to its share "
                             "of this host's cores, as make train runs the main job)")
    parser.add_argument("--hosts", type=int, default=None,
                        help="run on an emulated cluster of this many hosts (network "
                             "namespaces with rate-limited links; needs root)")
    parser.add_argument("--ranks-per-host", type=int, default=1,
                        help="Horovod ranks per emulated host (default 1)")
    parser.add_argument("--link-mbit", type=float, default=1000.0,
                        help="each emulated host's link rate, Mbit/s each direction "
                             "(default 1000)")
    parser.add_argument("--slow-host-mbit", type=float, default=None,
                        help="the last emulated host's link rate instead (a straggler)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds before the launcher kills the workers")


def add_workload_args(parser, batch_size=4096, steps=5, rounds=3, num_batches=8):
    """Flags of the training-step benchmarks: batches, timing rounds, optimizer, data."""
    parser.add_argument("--batch-size", type=int, default=batch_size, help="samples per rank")
    parser.add_argument("--steps", type=int, default=steps,
                        help="consecutive steps per variant per round")
    parser.add_argument("--rounds", type=int, default=rounds, help="timed rounds")
    parser.add_argument("--num-batches", type=int, default=num_batches,
                        help="distinct global batches, cycled")
    parser.add_argument("--data", default=None,
                        help="Criteo TSV (label, I1..I13, C1..C26 hex); default synthetic")
    parser.add_argument("--max-rows", type=int, default=None, help="rows read from --data")
    parser.add_argument("--lr", type=float, default=0.05, help="Adagrad learning rate")
    parser.add_argument("--seed", type=int, default=0)


def check_launch_args(parser, args):
    """Validates the launch flags (parser.error on bad ones); sets ``args.world_size``."""
    if args.hosts is not None:
        if args.hosts < 1 or args.ranks_per_host < 1:
            parser.error("--hosts and --ranks-per-host must be >= 1")
        for flag, rate in (("--link-mbit", args.link_mbit),
                           ("--slow-host-mbit", args.slow_host_mbit)):
            if rate is not None and not rate > 0:
                parser.error(f"{flag} must be > 0")
        args.world_size = args.hosts * args.ranks_per_host
    else:
        if args.np < 1:
            parser.error("--np must be >= 1")
        args.world_size = args.np
    return args


def network_description(args):
    """The JSON ``network`` entry of a result: where the workers ran."""
    if getattr(args, "hosts", None) is None:
        return {"kind": "loopback", "hosts": 1, "ranks_per_host": args.world_size,
                "link_mbit": None, "pinned": args.pin}
    return {"kind": "emulated_cluster", "hosts": args.hosts,
            "ranks_per_host": args.ranks_per_host, "link_mbit": args.link_mbit,
            "slow_host_mbit": args.slow_host_mbit,
            "how": "tf_fusedemb.testing.cluster: network namespaces on a bridge, each host's "
                   "link limited per direction with tc tbf; ranks pinned to their own cores"}


# ---------------------------------------------------------------------------- launching
def _worker_env():
    env = dict(os.environ, TF_USE_LEGACY_KERAS="1")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + (
        [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def launch_local(module, num_proc, argv, marker, timeout=None, pin=True):
    """Runs ``python -m module argv...`` on ``num_proc`` local Gloo workers (as
    ``horovodrun -np N --gloo -H localhost:N`` does: ``run_local_job``); their lines go
    to stderr, prefixed with their rank. With ``pin``, each worker runs pinned to its
    share of the cores (``tf_fusedemb.testing.cluster.pinned``, which reads its slot from
    the environment the launch gives it).

    Returns:
      (exit code, rank 0's result dict or None); 124 on timeout.
    """
    command = [sys.executable, "-m", module] + list(argv)
    if pin:
        command = [sys.executable, "-m", PIN_MODULE] + command
    print(f"launching {num_proc} local ranks: {' '.join(command)}", file=sys.stderr, flush=True)
    sink = _ClusterSink(None, marker, None)
    try:
        job = run_local_job(command, num_proc, env=_worker_env(), cwd=str(REPO_ROOT),
                            timeout=timeout, output=sink)
    except ClusterTimeout as e:
        print(str(e), file=sys.stderr)
        return 124, None
    return job.returncode, sink.result


def set_link_rate(cluster, mbit):
    """Sets every host of a running ``cluster`` to ``mbit`` Mbit/s each direction: the
    host's egress qdisc (its eth0) and its ingress one (the bridge end of its veth), with
    the same tbf parameters the cluster builds them with."""
    network.set_link_rate(cluster.hosts, mbit)


class _ClusterSink:
    """Where a job's prefixed output lines go: rank 0's result line is kept, link-rate
    requests are served (``cluster``: an emulated one; None for local ranks, which make
    none), everything else is copied to stderr."""

    def __init__(self, cluster, marker, control_dir):
        self.cluster, self.marker, self.control_dir = cluster, marker, control_dir
        self.result, self.error = None, None

    def write(self, text):
        for line in text.splitlines(keepends=True):
            body = line.split(":", 1)[1] if line.startswith("[") and ":" in line else line
            if line.startswith("[0]<stdout>:") and body.startswith(self.marker):
                self.result = json.loads(body[len(self.marker):])
            elif line.startswith("[0]<stdout>:") and body.startswith(LINK_RATE_MARKER):
                self._serve(body[len(LINK_RATE_MARKER):].split())
            else:
                sys.stderr.write(line)
        sys.stderr.flush()

    def flush(self):
        sys.stderr.flush()

    def _serve(self, fields):
        mbit, token = float(fields[0]), fields[1]
        try:
            set_link_rate(self.cluster, mbit)
            print(f"[launcher] link rate of every host set to {mbit:g} Mbit/s",
                  file=sys.stderr, flush=True)
            name = token
        except (subprocess.CalledProcessError, OSError) as e:
            self.error = f"setting the link rate to {mbit:g} Mbit/s failed: {e}"
            print(f"[launcher] {self.error}", file=sys.stderr, flush=True)
            name = token + ".failed"
        pathlib.Path(self.control_dir, name).touch()


def launch_cluster(module, argv, marker, args):
    """Runs ``python -m module argv...`` on every rank of an emulated cluster built from
    ``args`` (hosts, ranks_per_host, link_mbit, slow_host_mbit, timeout).

    Returns:
      (exit code, rank 0's result dict or None); EXIT_UNAVAILABLE (69) when this machine
      cannot build the cluster, 124 on timeout.
    """
    command = [sys.executable, "-m", module] + list(argv)
    try:
        with tempfile.TemporaryDirectory(prefix="fusedemb_link_") as control_dir, \
                EmulatedCluster(hosts=args.hosts, ranks_per_host=args.ranks_per_host,
                                link_mbit=args.link_mbit,
                                slow_host_mbit=args.slow_host_mbit) as cluster:
            rates = ", ".join(f"{h.namespace}@{h.mbit:g}Mbit" for h in cluster.hosts)
            print(f"launching on emulated cluster {cluster.name} ({args.hosts} hosts x "
                  f"{args.ranks_per_host} ranks: {rates}): {' '.join(command)}",
                  file=sys.stderr, flush=True)
            sink = _ClusterSink(cluster, marker, control_dir)
            env = _worker_env()
            env[LINK_CONTROL_ENV] = control_dir
            code = cluster.run(command, timeout=args.timeout, env=env, cwd=str(REPO_ROOT),
                               stdout=sink, stderr=sink)
            return code, sink.result
    except ClusterUnavailable as e:
        print(f"cannot build the emulated cluster here: {e}", file=sys.stderr)
        return EXIT_UNAVAILABLE, None
    except ClusterTimeout as e:
        print(str(e), file=sys.stderr)
        return 124, None


def benchmark_main(module, worker_module, parse_args, marker, argv=None, finish=None):
    """``main`` of a self-launching benchmark: a worker (HOROVOD_RANK set) runs
    ``worker_module.run(args)`` and rank 0 prints its result after ``marker``; a plain
    invocation launches the workers (cluster with ``--hosts``, else ``--np`` local ones),
    calls ``finish(result, args)`` if given (it may add to the result, e.g. a plot) and
    prints rank 0's result (JSON last with ``--json``). Returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    check_renamed_env()
    args = parse_args(argv)
    if "HOROVOD_RANK" in os.environ:
        _raise_priority()
        result = importlib.import_module(worker_module).run(args)
        if result is not None:  # rank 0
            print(marker + json.dumps(result, sort_keys=True), flush=True)
        return 0
    if args.hosts is not None:
        code, result = launch_cluster(module, argv, marker, args)
    else:
        code, result = launch_local(module, args.np, argv, marker, args.timeout, args.pin)
    if code != 0 or result is None:
        print(f"{module} failed: exit code {code}, "
              f"{'no' if result is None else 'a'} result", file=sys.stderr)
        return code or 1
    if finish is not None:
        finish(result, args)
    emit(result, args.json)
    return 0


def check_renamed_env(environ=os.environ):
    """Raises SystemExit naming the new variable when an old name of RENAMED_ENV is set."""
    old = sorted(k for k in RENAMED_ENV if k in environ)
    if old:
        raise SystemExit("renamed environment variable(s): " + ", ".join(
            f"{k} is now {RENAMED_ENV[k]}" for k in old) + " (see the README's table of "
            "environment variables); unset the old name")


def _raise_priority():
    """With ``TF_FUSEDEMB_BENCH_NICE=N`` (N < 0, root), a worker runs at nice N. On a machine
    shared with other jobs this keeps their load out of the timings. Linux's autogroup
    scheduling weighs each session as one unit and every rank starts its own session, so
    the session's autogroup gets N too (a plain nice would change nothing between
    sessions)."""
    value = os.environ.get(BENCH_NICE_ENV)
    if value:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, int(value))
            if os.path.exists("/proc/self/autogroup"):
                with open("/proc/self/autogroup", "w") as f:
                    f.write(value)
        except OSError as e:
            print(f"{BENCH_NICE_ENV}={value} not applied: {e}", file=sys.stderr, flush=True)
    if os.environ.get(COMM_NICE_ENV):
        _raise_comm_threads(int(os.environ[COMM_NICE_ENV]))


def _raise_comm_threads(nice):
    """Starts TensorFlow's thread pools, then Horovod (its background thread and Gloo's),
    and gives the threads Horovod started priority ``nice`` (e.g. -20) over the rank's
    compute threads.

    Why: a rank pinned to ONE core shares it between TensorFlow's compute threads and
    the threads that move its data; each collective wakes those threads several times
    (negotiation, the splits exchange, the transfer), and every wake-up that waits
    behind a compute thread delays both ranks. On a training host, communication
    progresses on cores of its own (the compute is on accelerators); this restores that
    for the emulated hosts' one-core ranks."""
    # In a rank: the launching process loads no TensorFlow; its ranks do.
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tf_fusedemb.comm import get_communicator  # pylint: disable=import-outside-toplevel
    tf.function(lambda: tf.reduce_sum(tf.ones([2])))()  # TensorFlow's pools exist now
    before = set(os.listdir("/proc/self/task"))
    get_communicator()  # Horovod: its background thread, Gloo's threads
    for tid in set(os.listdir("/proc/self/task")) - before:
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)
        except OSError as e:
            print(f"{COMM_NICE_ENV}: thread {tid} not raised: {e}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- worker side
def request_link_rate(comm, mbit, timeout_s=120.0):
    """Worker side: every rank calls it with the same ``mbit``; returns when every host's
    link runs at ``mbit`` Mbit/s and every rank knows it (see the module docstring).

    Raises:
      RuntimeError: not on an emulated cluster launched by this module, or the launcher
        could not set the rate, or it did not answer within ``timeout_s``.
    """
    control_dir = os.environ.get(LINK_CONTROL_ENV)
    if not control_dir:
        raise RuntimeError("changing the link rate needs the emulated cluster: launch with "
                           "--hosts H (tf_fusedemb.benchmarks.launcher)")
    token = comm.allgather_object(uuid.uuid4().hex if comm.rank == 0 else None)[0]
    if comm.rank == 0:
        print(f"{LINK_RATE_MARKER}{mbit:g} {token}", flush=True)
    done = pathlib.Path(control_dir, token)
    failed = pathlib.Path(control_dir, token + ".failed")
    deadline = time.monotonic() + timeout_s
    while not done.exists():
        if failed.exists():
            raise RuntimeError(f"the launcher could not set the link rate to {mbit:g} Mbit/s")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no answer from the launcher to the link-rate request "
                               f"({mbit:g} Mbit/s) in {timeout_s:g} s")
        time.sleep(0.02)
    comm.allgather_object(None)  # nobody starts timing before every rank saw the new rate

