"""End to end: ``python -m tf_fusedemb.benchmarks.pipeline --json`` relaunches itself on 2
Gloo workers, runs every pipelining variant and prints one JSON object last. Structure and
the key counts are asserted (against numpy), never speed."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO_ROOT

VARIANTS = ("sync", "dbp", "fwp2", "fwp4", "fwp8", "dbp_fwp4", "dbp_fwp4_cluster")


@pytest.fixture(scope="module")
def result():
    cmd = [sys.executable, "-m", "tf_fusedemb.benchmarks.pipeline", "--json", "--np", "2",
           "--batch-size", "256", "--steps", "3", "--rounds", "1", "--hidden", "32",
           "--num-batches", "2", "--timeout", "840"]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_USE_LEGACY_KERAS="1")
    try:
        out = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                             timeout=870)
    except subprocess.TimeoutExpired as e:
        raise AssertionError("pipeline benchmark timed out (a hang?)") from e
    assert out.returncode == 0, f"benchmark failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(900)
def test_reports_every_figure(result):
    assert result["benchmark"] == "pipeline" and result["world_size"] == 2
    assert set(result["step_ms"]) == set(VARIANTS)
    assert all(v > 0 for v in result["step_ms"].values())
    assert result["speedup_vs_sync"]["sync"] == 1.0
    assert result["speedup_nested_vs_sync"] == pytest.approx(
        result["step_ms"]["sync"] / result["step_ms"]["dbp_fwp4"], rel=1e-2)
    assert set(result["exposed_comm_ratio"]) == {"1", "2", "4", "8"}
    assert all(0.0 <= r <= 1.0 for r in result["exposed_comm_ratio"].values())
    assert 0.0 <= result["exposed_lookup_ms"]["dbp"] <= result["lookup_ms"]


@pytest.mark.timeout(900)
def test_unique_key_counts(result):
    """Rank 0's batches are rows [0, 256) and [512, 768) of the synthetic rows (global batch
    512): their per-micro-batch unique keys, recomputed with numpy, give the reported mean."""
    from tf_fusedemb.benchmarks.lookup_data import CATEGORICAL, synthetic_columns
    cols = synthetic_columns(256, 2, 2, 0)
    total = []
    for start in (0, 512):
        n4 = sum(len(np.unique(cols[c][start + i * 64:start + (i + 1) * 64]))
                 for c in CATEGORICAL for i in range(4))
        total.append(n4)
    counts = result["unique_keys_per_batch"]
    assert counts["4"]["plain"] == pytest.approx(np.mean(total), abs=0.1)
    assert counts["1"]["plain"] == counts["1"]["clustered"]  # one micro-batch: nothing to gain
    plain = [counts[n]["plain"] for n in ("1", "2", "4", "8")]
    assert plain == sorted(plain)  # smaller micro-batches dedupe less
    assert result["clustering_unique_key_reduction"] > 0
