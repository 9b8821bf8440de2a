"""Where the ranks are: nodes (hosts), rails, and the Horovod process sets over them.

TawPipe (paper 004) groups devices by node: inside a node ranks talk over fast links, between
nodes over a slower network. Here

* a *node* is the set of ranks of one host: ranks ``c * L .. c * L + L - 1`` of node ``c``
  (Horovod's ``cross_rank``), ``L`` = ``local_size``;
* a *rail* is the set of ranks with the same local rank ``l``: ``l, L + l, 2L + l, ...``
  (one per node).

That rank layout is what Horovod's launchers give homogeneous hosts (``get_host_assignments``
fills host after host); :meth:`Topology.from_horovod` checks it on every rank and raises
otherwise (heterogeneous hosts are not supported, as in TawPipe).

Static process sets (one per node, one per rail) must be passed to ``hvd.init``;
:func:`init_horovod` does that. Where Horovod was initialised without them (e.g. by the
user's own ``hvd.init()``), a set-restricted AlltoAll falls back to a global AlltoAll whose
splits are zero for every rank outside the set: the same bytes on the same links, one more
synchronisation of all ranks per round (see ``Communicator.alltoall``).

Tests override the layout with ``TF_FUSEDEMB_TOPOLOGY=HxR`` (H nodes of R ranks) so that
``horovodrun -np H*R`` on one machine runs the hierarchical exchange.
"""
import dataclasses
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

TOPOLOGY_ENV = "TF_FUSEDEMB_TOPOLOGY"          # "HxR": override of the detected layout
PROCESS_SETS_ENV = "TF_FUSEDEMB_PROCESS_SETS"  # "0": no static process sets (fallback)


@dataclasses.dataclass(frozen=True)
class Topology:
    """The layout of ``size = cross_size * local_size`` ranks and this rank's place in it.

    Attributes:
      rank: this rank (global).  local_size: ranks per node (L).  cross_size: nodes (C).
    """
    rank: int
    local_size: int
    cross_size: int

    def __post_init__(self) -> None:
        if self.local_size < 1 or self.cross_size < 1:
            raise ValueError(f"topology needs local_size and cross_size >= 1, got "
                             f"{self.local_size} and {self.cross_size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is outside a topology of {self.cross_size} "
                             f"nodes x {self.local_size} ranks")

    @property
    def size(self) -> int:
        return self.local_size * self.cross_size

    @property
    def local_rank(self) -> int:
        return self.rank % self.local_size

    @property
    def cross_rank(self) -> int:
        return self.rank // self.local_size

    @property
    def is_hierarchical(self) -> bool:
        """True when a two-stage exchange can differ from the flat one: several nodes of
        several ranks (one node, or one rank per node, leaves only the flat exchange)."""
        return self.local_size > 1 and self.cross_size > 1

    def node_of(self, rank: int) -> int:
        return rank // self.local_size

    def node_members(self, node: Optional[int] = None) -> List[int]:
        """Global ranks of ``node`` (default this rank's), in local-rank order."""
        node = self.cross_rank if node is None else node
        return [node * self.local_size + l for l in range(self.local_size)]

    def rail_members(self, local_rank: Optional[int] = None) -> List[int]:
        """Global ranks with local rank ``local_rank`` (default this rank's), node order."""
        local_rank = self.local_rank if local_rank is None else local_rank
        return [c * self.local_size + local_rank for c in range(self.cross_size)]

    def all_sets(self) -> List[List[int]]:
        """Every node's members, then every rail's: the same list on every rank (the
        static process sets of ``hvd.init``). Sets equal to the world or of one rank are
        left out (Horovod rejects duplicates; they are never needed)."""
        if not self.is_hierarchical:
            return []
        return ([self.node_members(c) for c in range(self.cross_size)]
                + [self.rail_members(l) for l in range(self.local_size)])

    def describe(self) -> str:
        return (f"{self.cross_size} node(s) x {self.local_size} rank(s); rank {self.rank} = "
                f"node {self.cross_rank}, local rank {self.local_rank}")

    @classmethod
    def single(cls) -> "Topology":
        return cls(0, 1, 1)

    @classmethod
    def parse(cls, text: str, rank: int) -> "Topology":
        """``"HxR"`` (H nodes x R ranks per node) for ``rank``."""
        try:
            hosts, per_host = (int(v) for v in text.lower().split("x"))
        except ValueError:
            raise ValueError(f"{TOPOLOGY_ENV} must look like '2x4' (nodes x ranks per node), "
                             f"got {text!r}") from None
        return cls(rank, per_host, hosts)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "Topology":
        """The layout before ``hvd.init``: the override, else Horovod's launcher variables
        (HOROVOD_RANK/SIZE/LOCAL_SIZE/CROSS_SIZE), else one rank."""
        rank = int(env.get("HOROVOD_RANK", "0"))
        if env.get(TOPOLOGY_ENV):
            return cls.parse(env[TOPOLOGY_ENV], rank)
        if "HOROVOD_LOCAL_SIZE" not in env:
            return cls(rank, int(env.get("HOROVOD_SIZE", "1")), 1)
        local, cross = int(env["HOROVOD_LOCAL_SIZE"]), int(env.get("HOROVOD_CROSS_SIZE", "1"))
        if local * cross != int(env.get("HOROVOD_SIZE", local * cross)):
            return cls(rank, int(env["HOROVOD_SIZE"]), 1)  # uneven hosts: flat only
        return cls(rank, local, cross)

    @classmethod
    def from_horovod(cls, hvd: Any) -> "Topology":
        """The layout of an initialised Horovod, or the override; checked (every rank
        raises the same error when the hosts are uneven or the ranks not node-major)."""
        override = os.environ.get(TOPOLOGY_ENV)
        if override:
            topo = cls.parse(override, hvd.rank())
            if topo.size != hvd.size():
                raise ValueError(f"{TOPOLOGY_ENV}={override} has {topo.size} ranks but "
                                 f"Horovod has {hvd.size()}")
            return topo
        seen = hvd.allgather_object((hvd.rank(), hvd.local_rank(), hvd.local_size(),
                                     hvd.cross_rank(), hvd.cross_size()),
                                    name="fusedemb/topology")
        local, cross = hvd.local_size(), hvd.cross_size()
        if not all(t[2] * t[4] == hvd.size() and t[0] == t[3] * t[2] + t[1] for t in seen):
            return cls(hvd.rank(), hvd.size(), 1)  # uneven or not node-major: flat only
        return cls(hvd.rank(), local, cross)


def use_process_sets(env: Mapping[str, str] = os.environ) -> bool:
    """Whether ``init_horovod`` creates static process sets (default yes)."""
    return env.get(PROCESS_SETS_ENV, "1") != "0"


def init_horovod(hvd: Any) -> Tuple[Topology, Dict[Tuple[int, ...], Any]]:
    """Initialises Horovod (unless it is already) with one static process set per node
    and per rail; returns ``(topology, {tuple(ranks): ProcessSet})``. The dict is empty
    where Horovod was initialised before (by the caller) or sets are switched off: set
    collectives then fall back to global ones (module docstring)."""
    sets: Dict[Tuple[int, ...], Any] = {}  # members -> hvd.ProcessSet
    if not hvd.is_initialized():
        planned = Topology.from_env()
        if use_process_sets() and planned.is_hierarchical:
            sets = {tuple(m): hvd.ProcessSet(list(m)) for m in planned.all_sets()}
        hvd.init(process_sets=list(sets.values()) or None)
    topo = Topology.from_horovod(hvd)
    if sets and [list(k) for k in sets] != topo.all_sets():
        raise RuntimeError(f"process sets planned for {sorted(sets)} but Horovod's layout is "
                           f"{topo.describe()}")
    return topo, sets
