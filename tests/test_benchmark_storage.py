"""End to end on small sizes: ``python -m tf_fusedemb.benchmarks.storage --json`` runs its
throughput and memory workers and prints one JSON object last. Structure and the
workload are asserted, never speed; the engine's memory() figure is compared with RSS."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO_ROOT
from tf_fusedemb.benchmarks.storage import BACKENDS, MEMORY_KINDS, ZipfKeys


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    plot = str(tmp_path_factory.mktemp("storage") / "storage.png")
    cmd = [sys.executable, "-m", "tf_fusedemb.benchmarks.storage", "--json", "--rows", "150000",
           "--throughput-rows", "60000", "--batch", "20000", "--repeats", "2", "--threads", "1",
           "--plot", plot]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_USE_LEGACY_KERAS="1")
    out = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=840)
    assert out.returncode == 0, f"benchmark failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.tfra  # the benchmark compares the engine with TFRA
@pytest.mark.timeout(900)
def test_structure(result):
    thr = result["throughput"]["threads_1"]
    for kind in BACKENDS:
        for op in ("update", "lookup", "record"):
            assert thr[kind][f"{op}s_per_s"] > 0 and thr[kind][f"{op}s_per_cpu_s"] > 0
        assert thr[kind]["rows"] >= 60_000
    assert thr["engine"]["rows"] == thr["tfra"]["rows"]  # same batches on both
    for kind in MEMORY_KINDS:
        points = result["memory"][kind]["points"]
        assert points[-1]["rows"] >= 150_000 and points[-1]["bytes_per_row_rss"] > 0
    assert 0 < result["engine_bytes_held_vs_rss"] <= 1.5
    f32, bf16 = (result["memory"][k]["points"][-1] for k in ("engine", "engine_bf16"))
    # dim 16: the row takes 32 bytes less (RSS is measured, and noisier at 150k rows)
    assert 28 <= f32["bytes_held_per_row"] - bf16["bytes_held_per_row"] <= 36
    assert result["bf16_rows_memory_ratio"] > 0
    assert os.path.exists(result["plot"])


@pytest.mark.timeout(300)
def test_fit_memory_worker(tmp_path):
    """RSS per stored row through FusedModel.fit (engine_fit, no TFRA needed): memory()
    follows the measured growth, and a row costs its block and index share."""
    cmd = [sys.executable, "-m", "tf_fusedemb.benchmarks.storage", "--json", "--parts", "memory",
           "--memory-kinds", "engine_fit", "--rows", "400000", "--fit-batch", "20000",
           "--plot", str(tmp_path / "fit.png")]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_USE_LEGACY_KERAS="1")
    out = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, f"benchmark failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    result = json.loads(out.stdout.strip().splitlines()[-1])
    (point,) = result["memory"]["engine_fit"]["points"]
    assert point["rows"] >= 400_000
    # dim 16 Adagrad: a 156-byte block, and the index: 5 bytes a slot at 7/16-7/8 load
    assert 156 < point["bytes_held_per_row"] < 175
    # RSS at 400k rows is noisier than at the 1M-6M of the benchmark (the guide's figures)
    assert 0.8 < point["bytes_held_vs_rss"] < 1.2
    assert result["fit_bytes_per_row"] == {str(point["rows"]): point["bytes_per_row_rss"]}
    assert os.path.exists(result["plot"])


def test_zipf_keys_mix_hits_and_new_keys():
    keys = ZipfKeys(1000, seed=0)
    first = keys.next(0.5)
    assert len(first) == len(np.unique(first)) == 1000  # the first batch is all new
    second = keys.next(0.3)
    assert len(second) == len(np.unique(second)) == 1000
    assert np.isin(second, first).sum() == 700 and keys.next_id == 1300
