"""Communication: the Horovod (or single-process) communicator, counted AlltoAlls,
cross-rank consistency checks. Horovod is imported only when a communicator needs it."""
from tf_fusedemb.comm.communicator import (Communicator, LocalCommunicator, HorovodCommunicator,
                                           get_communicator)
from tf_fusedemb.comm.counters import CommCounters
from tf_fusedemb.comm.watchdog import PeerLostError

__all__ = ["CommCounters", "Communicator", "HorovodCommunicator", "LocalCommunicator",
           "PeerLostError", "get_communicator"]
