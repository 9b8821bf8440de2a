"""Topology (nodes, rails, process sets), link-class counters and the flat/hierarchical
cost model (issue 11, parts 1, 4 and 5), against values computed by hand or in numpy."""
import dataclasses
import json

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from horovod_launch import horovodrun
from tf_fusedemb import ops
from tf_fusedemb.comm import CommCounters, LocalCommunicator
from tf_fusedemb.comm.cost_model import (LinkCosts, TrafficHints, estimate,
                                         measure_node_stage_s_per_key, node_dedup_ratio)
from tf_fusedemb.comm.topology import Topology
from tf_fusedemb.layers import FusedEmbedding
from tf_fusedemb.ops import hashing
from tf_fusedemb.specs import FeatureSpec, OptimizerSpec, TableSpec

PROBE = "tests/topology_probe.py"


def test_topology_layout_members_and_sets():
    t = Topology(rank=5, local_size=2, cross_size=3)
    assert (t.size, t.local_rank, t.cross_rank) == (6, 1, 2)
    assert t.node_members() == [4, 5] and t.rail_members() == [1, 3, 5]
    assert t.all_sets() == [[0, 1], [2, 3], [4, 5], [0, 2, 4], [1, 3, 5]]
    assert t.is_hierarchical
    assert not Topology(0, 4, 1).is_hierarchical and Topology(0, 4, 1).all_sets() == []
    assert not Topology(0, 1, 4).is_hierarchical


def test_topology_from_environment_and_override():
    env = {"HOROVOD_RANK": "3", "HOROVOD_SIZE": "8", "HOROVOD_LOCAL_SIZE": "4",
           "HOROVOD_CROSS_SIZE": "2"}
    assert Topology.from_env(env) == Topology(3, 4, 2)
    assert Topology.from_env(dict(env, TF_FUSEDEMB_TOPOLOGY="4x2")) == Topology(3, 2, 4)
    uneven = dict(env, HOROVOD_SIZE="7")  # hosts of 4 and 3 ranks: flat only
    assert not Topology.from_env(uneven).is_hierarchical
    assert Topology.from_env({}) == Topology.single()
    with pytest.raises(ValueError, match="nodes x ranks per node"):
        Topology.parse("2by2", 0)
    with pytest.raises(ValueError, match="outside"):
        Topology(4, 2, 2)


def test_counters_by_link_class():
    c = CommCounters("g", link_classes=True)
    # A 4-rank world of 2 nodes, this rank is 1 (node 0 = ranks 0, 1).
    c.record(tf.constant([2, 0, 3, 1]), tf.constant([1, 5, 0, 4]), tf.zeros([9, 2], tf.float32),
             rank=1, same_node=[True, True, False, False])  # rows of 8 bytes
    c.record(tf.constant([0, 7]), tf.constant([6, 7]), tf.zeros([7], tf.int32), rank=1,
             same_node=[True, True])  # a node-stage round, intra only; 4-byte keys
    s = c.snapshot()
    assert s["rounds"] == 2 and s["intra_rounds"] == 2 and s["inter_rounds"] == 1
    assert s["intra_bytes_sent"] == 2 * 8 and s["inter_bytes_sent"] == 4 * 8
    assert s["intra_bytes_received"] == 1 * 8 + 6 * 4 and s["inter_bytes_received"] == 4 * 8
    assert s["bytes_sent"] == s["intra_bytes_sent"] + s["inter_bytes_sent"]
    assert s["intra_messages"] == 1 and s["inter_messages"] == 2
    assert set(CommCounters("h").snapshot()) == {"rounds", "bytes_sent", "bytes_received",
                                                 "messages"}


@pytest.mark.parametrize("seed", range(5))
def test_exchange_counts_equal_numpy(seed):
    """ops.exchange_counts against numpy's masks and sums, on random sets of 1-9 ranks."""
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, 10))
    rank = int(rng.integers(0, k))
    send, recv = rng.integers(0, 4, k), rng.integers(0, 4, k)  # zeros included
    same = rng.random(k) < 0.5
    same[rank] = True
    like = tf.zeros([3, 5, 2], tf.float16)  # 5 * 2 * 2 = 20 bytes a row
    got = ops.exchange_counts(send.astype(np.int32), recv.astype(np.int32), like, rank,
                              same.tolist()).numpy()
    others = np.arange(k) != rank

    def fields(peers, rounds):
        return [rounds, 20 * send[peers].sum(), 20 * recv[peers].sum(), (send[peers] > 0).sum()]
    intra, inter = others & same, ~same
    want = fields(others, 1) + fields(intra, int(intra.any())) + fields(inter, int(inter.any()))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(
        ops.exchange_counts(send.astype(np.int32), recv.astype(np.int32), like, rank).numpy(),
        want[:4])


def test_exchange_counts_reject_mismatched_splits():
    with pytest.raises(tf.errors.InvalidArgumentError, match="differ in length"):
        ops.exchange_counts([1, 2], [1], tf.zeros([1]), 0)
    with pytest.raises(tf.errors.InvalidArgumentError, match="outside the set"):
        ops.exchange_counts([1, 2], [1, 2], tf.zeros([1]), 2)
    with pytest.raises(tf.errors.InvalidArgumentError, match="same_node has 1"):
        ops.exchange_counts([1, 2], [1, 2], tf.zeros([1]), 0, [True])


def test_cost_model_prefers_hierarchical_on_slow_inter_node_links():
    two_by_four = Topology(0, 4, 2)
    hints = TrafficHints(unique_keys_per_rank=50000, dedup_ratio=0.64,
                         links=LinkCosts(intra_mbit=40000, inter_mbit=300))
    slow = estimate("g", 16, two_by_four, hints)
    assert slow.kind == "hierarchical" and slow.hierarchical_s < slow.flat_s
    assert slow.hierarchical_inter_bytes == pytest.approx(0.64 * slow.flat_inter_bytes)
    # The flat inter-node bytes per node: L * u * (C-1)/C * (16 + 8 * dim).
    assert slow.flat_inter_bytes == pytest.approx(4 * 50000 * 0.5 * (16 + 128))
    fast = estimate("g", 16, two_by_four, TrafficHints(50000, 0.64, LinkCosts(inter_mbit=1e6)))
    assert fast.kind == "flat"
    no_dedup = estimate("g", 16, two_by_four, TrafficHints(50000, 1.0, hints.links))
    assert no_dedup.kind == "flat"  # the same inter-node bytes plus a node stage
    one_host = estimate("g", 16, Topology(0, 4, 1), hints)
    assert one_host.kind == "flat" and one_host.hierarchical_s is None
    with pytest.raises(ValueError, match="several nodes"):
        estimate("g", 16, Topology(0, 4, 1), hints, forced="hierarchical")


def test_node_stage_cost_is_measured_per_key_and_moves_the_choice():
    """The node stage's compute per key is a measured, plausible figure (a CPU does the
    dedup, sort and fan-out of a key in well under 100 us and in more than 1 ns), and a
    costly node stage turns the planner to flat where the bytes alone favour
    hierarchical."""
    per_key = measure_node_stage_s_per_key(2000, 16, repeats=2)
    assert 1e-9 < per_key < 1e-4, per_key
    two_by_four = Topology(0, 4, 2)
    links = LinkCosts(intra_mbit=40000, inter_mbit=300)
    cheap = estimate("g", 16, two_by_four, TrafficHints(50000, 0.64, links))
    costly = estimate("g", 16, two_by_four, TrafficHints(50000, 0.64, dataclasses.replace(
        links, dedup_s_per_key=cheap.flat_s / 50000)))
    assert cheap.kind == "hierarchical" and costly.kind == "flat"
    assert costly.hierarchical_s == pytest.approx(cheap.hierarchical_s + cheap.flat_s - 50000
                                                  * links.dedup_s_per_key)


def test_node_dedup_ratio_matches_a_set_count():
    rng = np.random.default_rng(0)
    topo = Topology(0, 2, 2)
    ids = [rng.integers(0, 30, 50) for _ in range(4)]
    tables = [rng.integers(0, 2, 50) for _ in range(4)]
    flat, nodes = 0, [set(), set()]
    for r in range(4):
        keys = {(int(t), int(i)) for t, i in zip(tables[r], ids[r])
                if hashing.owner_rank([i], 4)[0] // 2 != r // 2}
        flat += len(keys)
        nodes[r // 2] |= keys
    assert node_dedup_ratio(ids, tables, topo) == pytest.approx(
        (len(nodes[0]) + len(nodes[1])) / flat)


class _FakeWorld(LocalCommunicator):
    """A communicator that only describes a 2 x 2 world (nothing is exchanged)."""
    rank, size = 0, 4
    topology = Topology(0, 2, 2)

    def allgather_object(self, obj):
        return [obj] * self.size


def test_layer_describes_the_chosen_exchange_per_group():
    t8 = TableSpec("t8", 8, OptimizerSpec.sgd(0.1))
    t4 = TableSpec("t4", 4, OptimizerSpec.sgd(0.1))
    feats = [FeatureSpec("a", t8), FeatureSpec("b", t4)]
    slow = TrafficHints(50000, {"g0_d8_sgd": 0.5, "g1_d4_sgd": 1.0}, LinkCosts(inter_mbit=300))
    layer = FusedEmbedding(feats, communicator=_FakeWorld(), traffic=slow)
    kinds = {g.group.name: g.exchange.kind for g in layer.groups}
    assert kinds == {"g0_d8_sgd": "hierarchical", "g1_d4_sgd": "flat"}
    text = layer.describe()
    assert "exchange: hierarchical (predicted flat" in text and "exchange: flat (predicted" in text
    single = FusedEmbedding(feats, communicator=LocalCommunicator(), traffic=slow)
    assert "exchange: flat (one node)" in single.describe()
    with pytest.raises(ValueError, match="exchange must be"):
        FusedEmbedding(feats, communicator=_FakeWorld(), exchange="ring")


def test_traffic_hints_survive_model_from_json():
    """The layer's ``traffic`` hints are part of its Keras config: a model rebuilt from its
    JSON plans its exchanges under the same hints."""
    t8 = TableSpec("t8", 8, OptimizerSpec.sgd(0.1))
    feats = [FeatureSpec("a", t8), FeatureSpec("b", TableSpec("t4", 4, OptimizerSpec.sgd(0.1)))]
    hints = TrafficHints({"g0_d8_sgd": 20000.0}, {"g0_d8_sgd": 0.5, "g1_d4_sgd": 0.9},
                         LinkCosts(intra_mbit=20000, inter_mbit=300, round_latency_s=1e-3))
    inputs = {f.name: tf_keras.Input([], dtype=tf.int64, name=f.name) for f in feats}
    out = FusedEmbedding(feats, exchange={"g1_d4_sgd": "flat"}, traffic=hints,
                         name="emb")(inputs)
    model = tf_keras.Model(inputs, tf_keras.layers.Concatenate()(list(out.values())))
    again = tf_keras.models.model_from_json(model.to_json())
    layer = again.get_layer("emb")
    assert layer.traffic == hints and isinstance(layer.traffic.links, LinkCosts)
    assert layer.exchange == {"g1_d4_sgd": "flat"}
    assert json.loads(again.to_json()) == json.loads(model.to_json())
    assert TrafficHints.from_dict(TrafficHints().to_dict()) == TrafficHints()


class _DisagreeingWorld(_FakeWorld):
    """A 2 x 2 world whose rank 2 chose the flat exchange for ``g0_d8_sgd`` (e.g. other
    hints or another exchange= there)."""

    def __init__(self):
        self.gathers = 0

    def allgather_object(self, obj):
        self.gathers += 1
        everyone = [obj] * self.size
        if isinstance(obj, dict) and "exchanges" in obj:
            everyone[2] = dict(obj, exchanges=dict(obj["exchanges"], g0_d8_sgd="flat"))
        return everyone


def test_ranks_that_choose_different_exchanges_fail_naming_the_group():
    """The per-group flat/hierarchical choice is made locally at construction (no
    collective) and compared across ranks at the first call all ranks make
    (``agree_across_ranks``): where the ranks differ, each raises (instead of hanging in
    mismatched collectives). The real 2-process case is in test_fused_embedding_layer."""
    feats = [FeatureSpec("a", TableSpec("t8", 8, OptimizerSpec.sgd(0.1))),
             FeatureSpec("b", TableSpec("t4", 4, OptimizerSpec.sgd(0.1)))]
    world = _DisagreeingWorld()
    layer = FusedEmbedding(feats, communicator=world, exchange="hierarchical")
    assert world.gathers == 0  # the constructor ran no collective
    with pytest.raises(ValueError, match=r"group 'g0_d8_sgd': the ranks chose different "
                                         r"exchanges \(rank 0: hierarchical, rank 1: "
                                         r"hierarchical, rank 2: flat"):
        layer.agree_across_ranks()
    with pytest.raises(ValueError, match="exchange must be"):  # a local error stays local
        FusedEmbedding(feats, communicator=_FakeWorld(), exchange="ring")
    agreed = FusedEmbedding(feats, communicator=_FakeWorld(), exchange="hierarchical")
    agreed.agree_across_ranks()
    assert {g.exchange.kind for g in agreed.groups} == {"hierarchical"}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("process_sets", ["1", "0"])
def test_node_and_rail_alltoalls_on_four_ranks(process_sets, monkeypatch):
    """4 local ranks seen as 2 nodes x 2: static process sets made at hvd.init (or, with
    them off, the world AlltoAll with zero splits outside the set) deliver and send back
    the gradients exactly, and the counters split the traffic by link class."""
    monkeypatch.setenv("TF_FUSEDEMB_TOPOLOGY", "2x2")
    monkeypatch.setenv("TF_FUSEDEMB_PROCESS_SETS", process_sets)
    out = horovodrun([PROBE], 4, timeout=240)
    results = [json.loads(l.split("RESULT ", 1)[1]) for l in out.splitlines() if "RESULT " in l]
    assert sorted(r["rank"] for r in results) == [0, 1, 2, 3]
    for r in results:
        assert r["failures"] == [], r
        assert r["node"] == [2 * (r["rank"] // 2), 2 * (r["rank"] // 2) + 1]
        assert r["rail"] == [r["rank"] % 2, r["rank"] % 2 + 2]
        want_sets = [[0, 1], [0, 2], [1, 3], [2, 3]] if process_sets == "1" else []
        assert r["process_sets"] == want_sets
        c = r["counters"]  # node, rail and world rounds, each with its gradient round
        assert (c["rounds"], c["intra_rounds"], c["inter_rounds"]) == (6, 4, 4)
        assert c["bytes_sent"] == c["intra_bytes_sent"] + c["inter_bytes_sent"]
