"""Several hosts on one machine, for tests and benchmarks of multi-host behaviour.

``EmulatedCluster(hosts=H, ranks_per_host=R, link_mbit=M)`` builds H hosts as network
namespaces joined by veth pairs to one bridge, each host's link limited to M Mbit/s per
direction with ``tc tbf`` (optionally one slower host), and runs Horovod jobs there: ranks
are started with ``ip netns exec HOST`` and rendezvous through Horovod's own server, each
pinned to its own core(s). It needs root and iproute2; elsewhere :class:`ClusterUnavailable`
says what is missing. Command form::

    python -m tf_fusedemb.testing.cluster --hosts 2 --ranks-per-host 2 --link-mbit 1000 \\
        [--slow-host-mbit M] -- python train.py ...

Modules: ``network`` (namespaces, bridge, tc, leftovers), ``placement`` (cores, thread
counts), ``launcher`` (rendezvous, processes, output), ``emulated`` (EmulatedCluster),
``errors``, ``__main__`` (the command).
"""
from tf_fusedemb.testing.cluster.emulated import EmulatedCluster
from tf_fusedemb.testing.cluster.errors import ClusterError, ClusterTimeout, ClusterUnavailable
from tf_fusedemb.testing.cluster.launcher import JobResult
from tf_fusedemb.testing.cluster.network import Host, check_available



def unavailable_reason():
    """Why no emulated cluster can run on this machine, or None when one can (for
    ``pytest.mark.skipif`` in users' and our own tests)."""
    try:
        check_available()
        # Horovod is optional: its absence is a reason this machine cannot run a cluster.
        import horovod.runner.gloo_run  # noqa: F401  pylint: disable=unused-import,import-outside-toplevel
    except (ClusterUnavailable, ImportError) as e:
        return str(e)
    return None


__all__ = ["unavailable_reason", "EmulatedCluster", "ClusterError", "ClusterTimeout", "ClusterUnavailable",
           "JobResult", "Host", "check_available"]
