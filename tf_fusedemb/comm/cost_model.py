"""Flat or hierarchical exchange per fused group, by predicted time per training step.

Per step a group exchanges, for each of a rank's ``u`` unique keys, a key message (16 B),
a row and a gradient row (4 * dim B each): ``b = 16 + 8 * dim`` bytes per key. Owners are
uniform over the N = C * L ranks (``mix64``), so per node and step:

* flat: ``L * u * (C-1)/C * b`` bytes leave the node, ``L * u * (L-1)/N * b`` stay in it;
  3 AlltoAll rounds;
* hierarchical: ``L * u * (L-1)/L * b`` bytes inside the node (stage 1), ``d * L * u *
  (C-1)/C * b`` between nodes (stage 2), where ``d`` is the node-level dedup ratio (keys
  crossing nodes after / before node dedup: :func:`node_dedup_ratio` on a sample, or the
  owners' access statistics); 6 rounds, plus the dedup's compute on ``u`` keys.

Predicted time = inter bytes / inter-node bandwidth + intra bytes / intra-node bandwidth
+ rounds * round latency (+ dedup compute). Links are per node (a host's egress is shared
by its ranks, as on the emulated cluster).
"""
import dataclasses
import time
from typing import List, Mapping, Optional, Sequence, Union

import numpy as np
import tensorflow as tf

from tf_fusedemb import ops
from tf_fusedemb.comm.communicator import Communicator
from tf_fusedemb.comm.topology import Topology
from tf_fusedemb.ops import hashing

KEY_MESSAGE_BYTES = 16  # (ID, count|table) as two int64


@dataclasses.dataclass(frozen=True)
class LinkCosts:
    """Declared (or measured) link speeds of a node, in Mbit/s, and fixed costs."""
    intra_mbit: float = 40000.0
    inter_mbit: float = 10000.0
    round_latency_s: float = 5e-4
    dedup_s_per_key: float = 1e-7

    def __post_init__(self) -> None:
        for field in ("intra_mbit", "inter_mbit"):
            if not getattr(self, field) > 0:
                raise ValueError(f"LinkCosts.{field} must be positive, got {getattr(self, field)}")


@dataclasses.dataclass(frozen=True)
class TrafficHints:
    """What the planner assumes about a step's keys: ``unique_keys_per_rank`` (u, per
    group or one value) and ``dedup_ratio`` (d, per group or one value; 1.0 = no node
    dedup, which makes the flat exchange win)."""
    unique_keys_per_rank: Union[float, Mapping[str, float]] = 4096.0
    dedup_ratio: Union[float, Mapping[str, float]] = 1.0
    links: LinkCosts = LinkCosts()

    def to_dict(self) -> dict:
        """JSON-able fields (a layer's Keras config); :meth:`from_dict` reads them back."""
        def plain(value):
            return ({str(k): float(v) for k, v in value.items()} if isinstance(value, Mapping)
                    else float(value))
        return {"unique_keys_per_rank": plain(self.unique_keys_per_rank),
                "dedup_ratio": plain(self.dedup_ratio),
                "links": {f.name: float(getattr(self.links, f.name))
                          for f in dataclasses.fields(LinkCosts)}}

    @classmethod
    def from_dict(cls, config: Mapping) -> "TrafficHints":
        config = dict(config)
        if "links" in config:
            config["links"] = LinkCosts(**config["links"])
        return cls(**config)

    def of(self, field: str, group: str) -> float:
        value = getattr(self, field)
        return float(value.get(group, 1.0 if field == "dedup_ratio" else 4096.0)
                     if isinstance(value, Mapping) else value)


@dataclasses.dataclass(frozen=True)
class ExchangeEstimate:
    """Predicted per-step costs of one group's two exchanges and the choice."""
    group: str
    kind: str
    flat_s: float
    hierarchical_s: Optional[float]
    flat_inter_bytes: float
    hierarchical_inter_bytes: Optional[float]
    reason: str = ""

    def summary(self) -> str:
        if self.hierarchical_s is None or self.hierarchical_inter_bytes is None:  # both or neither
            return f"{self.kind} ({self.reason})"
        return (f"{self.kind} (predicted flat {self.flat_s * 1e3:.2f} ms, hierarchical "
                f"{self.hierarchical_s * 1e3:.2f} ms; inter-node {self.flat_inter_bytes / 1e3:.0f}"
                f" vs {self.hierarchical_inter_bytes / 1e3:.0f} kB per node)")


def estimate(group: str, dim: int, topology: Topology, hints: TrafficHints = TrafficHints(),
             forced: Optional[str] = None) -> ExchangeEstimate:
    """Costs of ``group`` (row width ``dim``) on ``topology``; the cheaper kind unless
    ``forced`` ("flat" | "hierarchical")."""
    u, d = hints.of("unique_keys_per_rank", group), hints.of("dedup_ratio", group)
    links = hints.links
    C, L, N = topology.cross_size, topology.local_size, topology.size  # noqa: N806
    b = KEY_MESSAGE_BYTES + 8 * dim
    inter_bps, intra_bps = links.inter_mbit * 1e6 / 8, links.intra_mbit * 1e6 / 8
    flat_inter = L * u * (C - 1) / C * b
    flat_s = (flat_inter / inter_bps + L * u * (L - 1) / N * b / intra_bps
              + 3 * links.round_latency_s)
    if not topology.is_hierarchical:
        reason = "one node" if C == 1 else "one rank per node"
        if forced == "hierarchical":
            raise ValueError(f"group '{group}': a hierarchical exchange needs several nodes of "
                             f"several ranks, the topology is {topology.describe()}")
        return ExchangeEstimate(group, "flat", flat_s, None, flat_inter, None, reason)
    hier_inter = d * flat_inter
    hier_s = (hier_inter / inter_bps + L * u * (L - 1) / L * b / intra_bps
              + 6 * links.round_latency_s + u * links.dedup_s_per_key)
    kind = forced or ("hierarchical" if hier_s < flat_s else "flat")
    return ExchangeEstimate(group, kind, flat_s, hier_s, flat_inter, hier_inter,
                            "forced" if forced else "cost")


def node_dedup_ratio(ids_per_rank: Sequence[np.ndarray], tables_per_rank: Sequence[np.ndarray],
                     topology: Topology) -> float:
    """Keys crossing nodes with perfect node-level dedup over keys crossing nodes without
    it (flat), for one step's keys (numpy, independent of the exchange's code).

    Args:
      ids_per_rank: N arrays int64[n_r], the IDs rank r looks up (any order, duplicates).
      tables_per_rank: N arrays int[n_r], their table (category) indices.
      topology: the layout (only its shape is used).
    """
    N, L = topology.size, topology.local_size  # noqa: N806
    if len(ids_per_rank) != N or len(tables_per_rank) != N:
        raise ValueError(f"need the keys of all {N} ranks, got {len(ids_per_rank)}")
    flat = 0
    node_keys: List[List[np.ndarray]] = [[] for _ in range(topology.cross_size)]
    for r, (ids, tables) in enumerate(zip(ids_per_rank, tables_per_rank)):
        ids = np.asarray(ids, np.int64).reshape(-1)
        keys = np.unique(np.stack([np.asarray(tables, np.int64).reshape(-1), ids], 1), axis=0)
        off = hashing.owner_rank(keys[:, 1], N) // L != r // L
        flat += int(off.sum())
        node_keys[r // L].append(keys[off])
    hier = sum(len(np.unique(np.concatenate(k), axis=0)) for k in node_keys)
    return hier / flat if flat else 1.0


def measure_node_stage_s_per_key(num_keys: int, dim: int, repeats: int = 5,
                                 seed: int = 0) -> float:
    """Seconds per key of the local work a hierarchical exchange adds to a flat one,
    measured on this rank (median of ``repeats``): on ``num_keys`` key messages from the
    node mates (a fifth of them repeated, as node dedup finds on Criteo-like keys), the
    node-level dedup (``segment_unique``, the counts' segment sum), the second owner sort
    (``rankwise_sort``), and the rows' fan-out (``recovery_gather``, float32[num_keys, dim])
    with its gradient (the node-level reduction). On shared cores this, not the bytes,
    can decide the choice: the model's ``dedup_s_per_key``."""
    n = max(int(num_keys), 1)
    rng = np.random.default_rng(seed)
    ids = tf.constant(rng.integers(0, max(int(n * 0.8), 1), n), tf.int64)
    splits = tf.constant([0, n], tf.int64)

    @tf.function
    def node_stage(ids):
        uniq = ops.segment_unique(ids, splits)
        counts = tf.math.unsorted_segment_sum(tf.ones_like(ids), uniq.inverse,
                                              tf.size(uniq.unique_keys))
        owner = ops.rankwise_sort(uniq.unique_keys, uniq.unique_segment_splits, 8)
        rows = tf.ones([tf.size(uniq.unique_keys), dim], tf.float32)
        with tf.GradientTape() as tape:
            tape.watch(rows)
            fanned, _ = ops.recovery_gather(rows, owner.indices, uniq.inverse)
        return tf.reduce_sum(tape.gradient(fanned, rows)) + tf.cast(tf.reduce_sum(counts),
                                                                      tf.float32)
    return _median_seconds(lambda: node_stage(ids).numpy(), repeats) / n


def _median_seconds(run, repeats, before=lambda: None) -> float:
    """Median wall time of ``run()`` over ``repeats`` calls after a first (trace and warm)
    one; ``before()`` runs untimed ahead of each."""
    run()
    times = []
    for _ in range(repeats):
        before()
        begin = time.perf_counter()
        run()
        times.append(time.perf_counter() - begin)
    return float(np.median(times))


def measure_link_costs(comm: "Communicator", inter_mbit: float, nbytes: float = 4e6, repeats: int = 5,
                       dedup_s_per_key: Optional[float] = None,
                       keys_per_rank: int = 4096, dim: int = 16) -> LinkCosts:
    """LinkCosts with the intra-node bandwidth, the round latency and the node stage's
    compute per key MEASURED on ``comm`` (every rank calls it; collectives), the
    inter-node bandwidth declared. ``dedup_s_per_key`` given: used instead of measuring
    it (:func:`measure_node_stage_s_per_key` on ``keys_per_rank`` keys of ``dim``).

    The node's bandwidth: an AlltoAll inside the node in which every rank sends
    ``nbytes / (L - 1)`` to each node mate (median of ``repeats``); the latency: an
    AlltoAll of one row per rank over all ranks. On shared cores the intra-node "link" is
    the CPU's copy through loopback, far below a NIC's speed: measuring it is what lets
    the planner see the node stage's cost."""
    topo = comm.topology

    def timed(splits, members, name):
        x = tf.ones([int(sum(splits)), 16], tf.float32)
        fn = tf.function(lambda x: comm.alltoall(x, tf.constant(splits, tf.int32), name,
                                                 None, members)[0][:1])
        return _median_seconds(lambda: fn(x).numpy(), repeats,
                               before=lambda: comm.allgather_object(None))  # start together
    latency = timed([1] * comm.size, None, "fusedemb/calibrate/latency")
    intra = LinkCosts.intra_mbit
    if topo.local_size > 1:
        rows = int(nbytes / 64 / (topo.local_size - 1))
        members = topo.node_members()
        splits = [0 if m == comm.rank else rows for m in members]
        seconds = timed(splits, members, "fusedemb/calibrate/node")
        node_bytes = topo.local_size * (topo.local_size - 1) * rows * 64
        # Latency not subtracted: on loaded cores the two are alike and the difference
        # can vanish (an absurd bandwidth); the whole round is the conservative figure.
        intra = node_bytes * 8 / max(seconds, 1e-6) / 1e6
    if dedup_s_per_key is None:
        comm.allgather_object(None)  # every rank computes at once, as in a step
        dedup_s_per_key = measure_node_stage_s_per_key(keys_per_rank, dim, repeats)
    # Every rank must plan alike: rank 0's figures for all.
    intra, latency, dedup = comm.allgather_object((intra, latency, dedup_s_per_key))[0]
    return LinkCosts(intra_mbit=intra, inter_mbit=inter_mbit, round_latency_s=latency,
                     dedup_s_per_key=dedup)
