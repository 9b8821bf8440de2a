"""End to end: ``python -m tf_fusedemb.benchmarks.lookup --json`` relaunches itself under
horovodrun (2 Gloo workers), trains all six variants and prints one JSON object last.
Structure and communication counts are asserted, never speed."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO_ROOT, STACK
from tf_fusedemb.testing.cluster.placement import assign_cpus

VARIANTS = ("fused", "fused_bf16", "fused_tfra_backend", "unfused", "tfra", "tfra_fused")
# The variants without TFRA: all that runs on a stack without it (docs/guide/stacks.md).
OWN_VARIANTS = ("fused", "fused_bf16", "unfused")
RUN_VARIANTS = VARIANTS if STACK == "tf216" else OWN_VARIANTS
# One pytest-xdist worker for the whole file: the benchmark runs once per worker that
# needs its result (a module fixture), about two minutes on the TFRA stack.
pytestmark = pytest.mark.xdist_group("benchmark_lookup")
PER_VARIANT = ("step_ms", "alltoall_rounds_per_step", "graph_alltoall_ops", "bytes_per_step",
               "mean_message_bytes", "messages_per_step", "groups", "loss_first", "loss_last")


@pytest.fixture(scope="module")
def result():
    cmd = [sys.executable, "-m", "tf_fusedemb.benchmarks.lookup", "--json", "--np", "2",
           "--batch-size", "256", "--steps", "2", "--rounds", "2", "--warmup", "1",
           "--num-batches", "2", "--profile", "2", "--timeout", "840",
           "--variants", ",".join(RUN_VARIANTS)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_USE_LEGACY_KERAS="1")
    try:
        out = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                             timeout=870)
    except subprocess.TimeoutExpired as e:
        raise AssertionError("lookup benchmark timed out (a hang?)") from e
    assert out.returncode == 0, f"benchmark failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    lines = out.stdout.strip().splitlines()
    assert lines, f"no stdout; stderr:\n{out.stderr[-3000:]}"
    return json.loads(lines[-1])


@pytest.mark.tfra  # the benchmark's baselines are TFRA's
@pytest.mark.timeout(900)
def test_structure(result):
    assert result["benchmark"] == "lookup"
    env = result["environment"]
    assert env["np"] == 2 and env["batch_size_per_rank"] == 256
    assert env["tf_version"].startswith("2.16")
    assert result["data"]["kind"] == "synthetic"
    assert isinstance(result["method"], dict) and result["method"]["bytes_per_step"]
    assert set(result["variants"]) == set(VARIANTS)
    for name in VARIANTS:
        v = result["variants"][name]
        for key in PER_VARIANT:
            assert key in v, (name, key)
        assert v["step_ms"] > 0, name
        assert len(v["step_ms_by_rank"]) == 2 and min(v["step_ms_by_rank"]) > 0
        assert v["bytes_per_step"] > 0 and v["mean_message_bytes"] > 0, name
        assert np.isfinite(v["loss_first"]) and np.isfinite(v["loss_last"]), name
        assert v["traces"] == 1, name  # variables built before tracing: one trace
    for key in ("speedup_vs_tfra", "speedup_vs_tfra_fused", "speedup_vs_tfra_backend",
                "fused_vs_unfused"):
        assert result[key] > 0, key


@pytest.mark.timeout(900)
def test_local_ranks_run_pinned_to_their_own_cores(result):
    """By default each local rank runs on its share of the cores, as make train's do."""
    assert result["network"]["pinned"] is True
    assert result["environment"]["rank_cpus"] == [list(c) for c in assign_cpus(2)]


@pytest.mark.timeout(900)
def test_profile_accounts_for_every_step(result):
    """--profile: every fused variant's step split into the categories on both ranks;
    ops, collective waits and overhead add up to the step's wall time."""
    profiled = ("fused", "fused_bf16", "fused_tfra_backend", "unfused")
    for name in [n for n in profiled if n in RUN_VARIANTS]:
        for prof in result["variants"][name]["profile_by_rank"]:
            cats = prof["categories_ms"]
            assert set(cats) == {"dense", "exchange", "engine", "pooling_recovery",
                                 "embedding_other", "input", "collective_wait",
                                 "python_overhead"}, name
            assert cats["dense"] > 0 and cats["exchange"] > 0, name
            # the TFRA backend's tables are TFRA's ops, in the layer's scope
            storage = "embedding_other" if name == "fused_tfra_backend" else "engine"
            assert cats[storage] > 0, name
            total = prof["ops_busy_ms"] + cats["collective_wait"] + cats["python_overhead"]
            assert abs(total - prof["wall_ms"]) <= 0.02 * prof["wall_ms"] + 0.5, (name, prof)
            assert prof["ops_per_step"] > 50 and prof["top_ops_ms"], name
        assert result["variants"][name]["graph_ops"] > 100, name
        assert 0 < result["variants"][name]["first_step_s"] < 300, name
    # bf16 mode: the same training up to bf16 rounding, and a measured ratio
    assert result["bf16_speedup"] > 0
    assert result["fused_bf16_max_loss_diff"] < 0.05


@pytest.mark.timeout(900)
def test_bf16_rows_halve_the_row_bytes(result):
    """Per unique key: a 16-byte key message, then a dim-16 row and its gradient: 2 x 64
    bytes in float32, 2 x 32 in bf16. The same keys travel in both variants."""
    v = result["variants"]
    ratio = v["fused_bf16"]["bytes_per_step"] / v["fused"]["bytes_per_step"]
    assert abs(ratio - (16 + 64) / (16 + 128)) < 1e-3, ratio
    assert v["fused_bf16"]["alltoall_rounds_per_step"] == 3


@pytest.mark.timeout(900)
def test_alltoall_rounds(result):
    v = result["variants"]
    assert v["fused"]["groups"] == 1
    # 3 per fused group: keys, rows, row gradients; counted at run time and in the graph.
    assert v["fused"]["alltoall_rounds_per_step"] == 3
    assert v["fused"]["graph_alltoall_ops"] == 3
    assert v["unfused"]["alltoall_rounds_per_step"] == 78
    assert v["unfused"]["graph_alltoall_ops"] == 78


@pytest.mark.tfra  # the benchmark's baselines are TFRA's
@pytest.mark.timeout(900)
def test_tfra_alltoall_rounds(result):
    v = result["variants"]
    assert v["fused_tfra_backend"]["alltoall_rounds_per_step"] == 3  # same step, TFRA tables
    # TFRA: key + row AlltoAll per feature forward, one row-gradient AlltoAll backward.
    assert v["tfra"]["alltoall_rounds_per_step"] >= 52
    assert v["tfra"]["alltoall_rounds_per_step"] == v["tfra"]["graph_alltoall_ops"] == 78
    # TFRA-fused: the fused group's 3 rounds plus the extra category exchange.
    assert v["tfra_fused"]["alltoall_rounds_per_step"] == 4
    assert v["tfra_fused"]["graph_alltoall_ops"] == 4


@pytest.mark.tfra  # the benchmark's baselines are TFRA's
@pytest.mark.timeout(900)
def test_fused_and_unfused_agree(result):
    v = result["variants"]
    # Same unique (category, ID) keys, same owners: the plans move the same bytes...
    assert v["fused"]["bytes_per_step"] == v["unfused"]["bytes_per_step"]
    # ...and train identically (same batches, seeded dense weights, per-key row init).
    assert result["fused_unfused_max_loss_diff"] <= 1e-5
    # The engine and the TFRA backend compute the same step.
    assert result["fused_backends_max_loss_diff"] <= 1e-5
    assert v["fused"]["bytes_per_step"] == v["fused_tfra_backend"]["bytes_per_step"]


def test_criteo_reader(tmp_path):
    from tf_fusedemb.benchmarks import lookup_data
    row = ["1"] + ["3", "", "-2"] + ["0"] * 10 + ["68fd1e64", ""] + ["a"] * 24
    other = ["0"] + ["1"] * 13 + ["ff"] * 26
    path = tmp_path / "train.txt"
    path.write_text("\t".join(row) + "\n" + "\t".join(other) + "\n")
    cols = lookup_data.read_criteo(str(path))
    assert cols["label"].tolist() == [1.0, 0.0]
    assert cols["C1"].tolist() == [0x68FD1E64, 0xFF] and cols["C2"].tolist() == [0, 0xFF]
    assert cols["I2"].tolist() == [0.0, 1.0]
    # 2 ranks x 2 rows per batch over 2 rows: batches cycle the rows.
    batches = lookup_data.make_batches(cols, 2, 2, 1, 2)
    x, y = batches[0]
    assert x["C1"].dtype == np.int64 and x["dense"].shape == (2, 13)
    assert x["C1"].tolist() == [0x68FD1E64, 0xFF] and y.shape == (2, 1)
    np.testing.assert_allclose(x["dense"][0, :3], [np.log1p(3.0), 0.0, 0.0])
