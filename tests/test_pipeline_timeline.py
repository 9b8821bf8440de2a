"""tf_fusedemb.benchmarks.timeline_summary (reading Horovod timelines, interval arithmetic)
against hand-written timelines and brute-force references, and the step's ordering
helper ``tf_fusedemb.training.step.after`` (control dependencies, values unchanged)."""
import json

import numpy as np
import pytest
import tensorflow as tf

from tf_fusedemb.benchmarks import timeline_summary as ts
from tf_fusedemb.training.step import after

START = 1_000_000  # epoch µs of the timeline's start


def _timeline(path):
    """Rank 0's timeline of: an AlltoAll (rank 1 ready 3 µs after rank 0, runs 10..40,
    Gloo exchange 15..38) and a grouped AllReduce of two tensors run as one."""
    events = [
        {"name": "process_name", "ph": "M", "pid": 0,
         "args": {"start_time_since_epoch_in_micros": START}},
        {"name": "process_name", "ph": "M", "pid": 1,
         "args": {"name": "fusedemb/g0_d16_adagrad/rows/mb1.0/fusedemb/g0_d16_adagrad/rows/mb1"}},
        {"name": "process_name", "ph": "M", "pid": 2,
         "args": {"name": "fusedemb/dense_grads.0/HorovodGroupedAllreduce_a_0_b_0_1of2"}},
        {"name": "process_name", "ph": "M", "pid": 3,
         "args": {"name": "fusedemb/dense_grads.0/HorovodGroupedAllreduce_a_0_b_0_2of2"}},
        {"ph": "B", "name": "NEGOTIATE_ALLTOALL", "ts": 1, "pid": 1},
        {"ph": "X", "name": "0", "ts": 2, "pid": 1, "dur": 0},
        {"ph": "X", "name": "1", "ts": 5, "pid": 1, "dur": 0},
        {"ph": "E", "ts": 5, "pid": 1},
        {"ph": "B", "name": "ALLTOALL", "ts": 10, "pid": 1},
        {"ph": "B", "name": "MPI_ALLTOALL", "ts": 15, "pid": 1},
        {"ph": "E", "ts": 38, "pid": 1},
        {"ph": "E", "ts": 40, "pid": 1},
    ]
    for pid, shape in ((2, "[3, 4]"), (3, "[4]")):
        events += [{"ph": "B", "name": "ALLREDUCE", "ts": 50 + pid, "pid": pid},
                   {"ph": "B", "name": "GLOO_ALLREDUCE", "ts": 60, "pid": pid},
                   {"ph": "E", "ts": 90, "pid": pid},
                   {"ph": "E", "ts": 95, "pid": pid,
                    "args": {"dtype": "float32", "shape": shape}}]
    with open(path, "w") as f:
        json.dump(events, f)


def test_read_timeline_collectives(tmp_path):
    _timeline(tmp_path / "t.json")
    a2a, part1, part2 = ts.read_timeline(str(tmp_path / "t.json"))
    assert (a2a.kind, a2a.role) == ("ALLTOALL", "g0/rows/mb1")
    assert a2a.ready == {0: START + 2, 1: START + 5}
    assert (a2a.begin, a2a.end, a2a.transfer) == (START + 10, START + 40, 23)
    assert part1.role == part2.role == "dense_grads"
    assert (part1.bytes, part2.bytes) == (48, 16)
    merged = ts._executions([a2a, part1, part2])  # pylint: disable=protected-access
    assert [m["role"] for m in merged] == ["g0/rows/mb1", "dense_grads"]
    assert (merged[1]["tensors"], merged[1]["bytes"]) == (2, 64)


def test_the_two_rank_dense_sum_is_dense_grads_too():
    """With two ranks the dense gradients' sum is an allgather (comm's gather_sum), its
    name under the collective's scope; the top layers' part too."""
    def role(name):
        return ts.Collective(name, "ALLGATHER", {}, 0.0, 1.0, 0.0, 4).role
    assert role("fusedemb/dense_grads.0/gathered_1of4") == "dense_grads"
    assert role("fusedemb/dense_grads/top.3/gathered_3of3") == "dense_grads"
    assert role("fusedemb/g0_d16_adagrad/rows.0/fusedemb/g0_d16_adagrad/rows") == "g0/rows"


def test_truncated_timeline_is_read(tmp_path):
    _timeline(tmp_path / "t.json")
    text = (tmp_path / "t.json").read_text()
    (tmp_path / "cut.json").write_text(text.rstrip("]") + ",")  # writer stopped mid-file
    assert len(ts.read_timeline(str(tmp_path / "cut.json"))) == 3


def _covered(spans, grid):
    return np.any([(grid >= a) & (grid < b) for a, b in spans] or [np.zeros_like(grid, bool)], 0)


@pytest.mark.parametrize("seed", range(5))
def test_interval_arithmetic_matches_a_grid(seed):
    rng = np.random.default_rng(seed)
    def spans(n):
        a = rng.integers(0, 900, n)
        return [(float(x), float(x + d)) for x, d in zip(a, rng.integers(1, 80, n))]
    x, y = spans(12), spans(9)
    grid = np.arange(0, 1000, 1.0) + 0.5
    ux, uy = ts.union(x), ts.union(y)
    assert all(b1 < a2 for (_, b1), (a2, _) in zip(ux, ux[1:]))  # disjoint, sorted
    assert ts.length(ux) == pytest.approx(_covered(x, grid).sum())
    assert ts.intersect(ux, uy) == pytest.approx((_covered(x, grid) & _covered(y, grid)).sum())
    clipped = ts.clip(ux, 200, 600)
    inside = _covered(x, grid) & (grid > 200) & (grid < 600)
    assert ts.length(clipped) == pytest.approx(inside.sum())


def test_after_orders_without_changing_values():
    @tf.function
    def f(a, b):
        marker = tf.identity(a * 2.0, name="marker")
        ragged = tf.RaggedTensor.from_row_splits(b, [0, 1, 3])
        x = {"dense": a + 1.0, "ids": b, "ragged": ragged}
        out = after([marker], x, skip={"ids"})
        return out["dense"], out["ids"], out["ragged"].values
    a, b = tf.constant([1.0, 2.0]), tf.constant([4, 5, 6], tf.int64)
    graph = f.get_concrete_function(a, b).graph
    dense = [op for op in graph.get_operations() if op.type == "Identity"
             and any(c.name.startswith("marker") for c in op.control_inputs)]
    assert len(dense) == 1  # only the plain tensor not in skip is gated
    got = f(a, b)
    np.testing.assert_array_equal(got[0].numpy(), [2.0, 3.0])
    np.testing.assert_array_equal(got[1].numpy(), [4, 5, 6])
    np.testing.assert_array_equal(got[2].numpy(), [4, 5, 6])
    assert after([], {"x": a})["x"] is a  # nothing to wait for: unchanged


@pytest.mark.timeout(600)
def test_trace_command_on_the_cluster(tmp_path):
    """``python -m tf_fusedemb.benchmarks.pipeline_trace`` on 2 emulated hosts: per step,
    every collective the design implies (per micro-batch the key, row and row-gradient
    AlltoAlls; the loss statistics; the dense gradients in two grouped AllReduces), each
    executed once, its transfer inside its execution; a summary and its plot."""
    import os
    import subprocess
    import sys
    from conftest import REPO_ROOT
    from tf_fusedemb.testing.cluster import unavailable_reason
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no emulated cluster on this machine: {reason}")
    cmd = [sys.executable, "-m", "tf_fusedemb.benchmarks.pipeline_trace", "--json",
           "--hosts", "2", "--link-mbit", "1000", "--out", str(tmp_path), "--modes", "sync,fwp2",
           "--batch-size", "256", "--hidden", "32", "--steps", "4", "--num-batches", "2",
           "--timeout", "480"]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_USE_LEGACY_KERAS="1")
    out = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                         timeout=540)
    if out.returncode == 69:
        pytest.skip(f"emulated cluster unavailable: {out.stderr.strip()[-300:]}")
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    expected = {"sync": {"g0/keys", "g0/rows", "g0/rows_grad", "loss_stats", "dense_grads"},
                "fwp2": {f"g0/{r}/mb{i}{g}" for r, g in (("keys", ""), ("rows", ""),
                                                           ("rows", "_grad"))
                         for i in (0, 1)} | {"loss_stats", "dense_grads"}}
    for mode, roles in expected.items():
        got = result["modes"][mode]["collectives"]
        assert set(got) == roles, (mode, sorted(got))
        for role, c in got.items():
            assert c["count_per_step"] == (2.0 if role == "dense_grads" else 1.0), (mode, role)
            assert 0 <= c["transfer_ms"] <= c["exec_ms"] + 0.05
    assert os.path.isfile(result["summary"]) and os.path.isfile(result["plot"])
