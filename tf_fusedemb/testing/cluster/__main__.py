"""Command: run a command on every rank of an emulated multi-host cluster.

    python -m tf_fusedemb.testing.cluster --hosts 2 --ranks-per-host 2 --link-mbit 1000 \\
        [--slow-host-mbit 200] [--timeout 600] [--name NAME] [--subnet CIDR] [--no-pin] \\
        -- python train.py ...

Exit status: the job's (0, or the first failing rank's), 124 on timeout, 69 when this
machine cannot build the cluster (the message says why), 128+N after signal N. SIGTERM
and SIGINT stop the ranks and remove the hosts before exiting.
"""
import argparse
import signal
import sys
from typing import List, Optional

from tf_fusedemb.testing.cluster.emulated import EmulatedCluster
from tf_fusedemb.testing.cluster.errors import ClusterTimeout, ClusterUnavailable

EXIT_UNAVAILABLE = 69  # sysexits.h EX_UNAVAILABLE
EXIT_TIMEOUT = 124     # like timeout(1)


class _Signalled(Exception):
    """Raised in the main thread by SIGTERM/SIGINT, so every ``finally`` and the cluster's
    ``with`` run: ranks are killed and the hosts removed."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


def _install_signal_handlers() -> dict:
    """Installs the handlers; returns the previous ones (main() restores them)."""
    def handler(signum, _frame):
        # One-shot: a second Ctrl-C must not interrupt the teardown the first one started.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        raise _Signalled(signum)
    return {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}


def _parse(argv: List[str]) -> argparse.Namespace:
    if "--" not in argv:
        own, command = argv, []
    else:
        cut = argv.index("--")
        own, command = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(
        prog="python -m tf_fusedemb.testing.cluster",
        description="Run COMMAND on every Horovod rank of emulated hosts (network namespaces "
                    "with rate-limited links). Needs root and iproute2.",
        usage="%(prog)s [options] -- COMMAND...")
    parser.add_argument("--hosts", type=int, default=2, help="emulated hosts (default 2)")
    parser.add_argument("--ranks-per-host", type=int, default=2, help="ranks per host (default 2)")
    parser.add_argument("--link-mbit", type=float, default=1000.0,
                        help="each host's link rate, Mbit/s each direction (default 1000)")
    parser.add_argument("--slow-host-mbit", type=float, default=None,
                        help="the last host's link rate instead (a straggler)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds; exit 124 after it")
    parser.add_argument("--name", default=None,
                        help="prefix of namespaces and devices (default fe<pid>)")
    parser.add_argument("--subnet", default=None, help="e.g. 10.77.3.0/24 (default: a free /24 "
                                                       "of 10.77.0.0/16)")
    parser.add_argument("--no-pin", action="store_true",
                        help="do not pin ranks to cores nor set their thread counts")
    args = parser.parse_args(own)
    if not command:
        parser.error("no COMMAND given after --")
    args.command = command
    return args


def main(argv: Optional[List[str]] = None) -> int:
    """Runs the command form; returns the exit status."""
    args = _parse(sys.argv[1:] if argv is None else argv)
    previous = _install_signal_handlers()
    try:
        return _run(args)
    except _Signalled as e:
        print(f"tf_fusedemb.testing.cluster: stopped by signal {e.signum}; cluster removed",
              file=sys.stderr)
        return 128 + e.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run(args: argparse.Namespace) -> int:
    try:
        with EmulatedCluster(hosts=args.hosts, ranks_per_host=args.ranks_per_host,
                             link_mbit=args.link_mbit, slow_host_mbit=args.slow_host_mbit,
                             name=args.name, subnet=args.subnet, pin=not args.no_pin) as cluster:
            rates = ", ".join(f"{h.namespace}={h.address}@{h.mbit:g}Mbit" for h in cluster.hosts)
            print(f"[cluster {cluster.name}] {args.hosts} hosts x {args.ranks_per_host} ranks: "
                  f"{rates}", file=sys.stderr, flush=True)
            code = cluster.run(args.command, timeout=args.timeout)
            if code:
                failed = cluster.last_result.failed_rank if cluster.last_result else "?"
                print(f"[cluster {cluster.name}] rank {failed} exited "
                      f"with status {code}; the other ranks were stopped", file=sys.stderr)
            return code
    except ClusterUnavailable as e:
        print(f"tf_fusedemb.testing.cluster: cannot run here: {e}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except ClusterTimeout as e:
        print(f"tf_fusedemb.testing.cluster: {e}", file=sys.stderr)
        return EXIT_TIMEOUT


if __name__ == "__main__":
    sys.exit(main())
