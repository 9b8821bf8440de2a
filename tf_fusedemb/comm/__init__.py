"""Communication: the Horovod (or single-process) communicator, counted AlltoAlls (by link
class), the topology (nodes, rails, process sets), the flat/hierarchical cost model,
cross-rank consistency checks. Horovod is imported only when a communicator needs it."""
from tf_fusedemb.comm.communicator import (Communicator, LocalCommunicator, HorovodCommunicator,
                                           communicator_scope, get_communicator)
from tf_fusedemb.comm.cost_model import LinkCosts, TrafficHints
from tf_fusedemb.comm.counters import CommCounters
from tf_fusedemb.comm.topology import Topology
from tf_fusedemb.comm.watchdog import PeerLostError

__all__ = ["CommCounters", "Communicator", "HorovodCommunicator", "LinkCosts",
           "LocalCommunicator", "PeerLostError", "Topology", "TrafficHints", "communicator_scope",
           "get_communicator"]
