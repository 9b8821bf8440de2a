"""The emulated cluster's exceptions: why it cannot run here, and a job out of time."""


class ClusterError(RuntimeError):
    """Base class of every error of :mod:`tf_fusedemb.testing.cluster`."""


class ClusterUnavailable(ClusterError):
    """This machine cannot build emulated hosts.

    Raised before anything is left behind: not root, ``ip``/``tc``/``taskset`` missing,
    network namespaces, veth pairs, bridges or the ``tbf`` qdisc not creatable, Horovod not
    installed. The message names what is missing; tests skip on it, the command exits 69.
    """


class ClusterTimeout(ClusterError, TimeoutError):
    """A job ran past its timeout; every rank was killed before this was raised.

    Attributes:
        result: the job's JobResult up to the timeout (returncode 124), or None.
    """

    def __init__(self, message: str, result=None):
        super().__init__(message)
        self.result = result
