"""End to end on small sizes: ``python -m tf_fusedemb.benchmarks.tiered --json`` runs one
worker per budget and prints one JSON object last with the issue's keys. Structure and
the workload are asserted, never speed: every budget's table holds the same rows, the
tiered ones mostly on SSD, and the all-DRAM run reads nothing from SSD.

The 10% budgets hold the blocks the pipelined fit pins at once (a step's batch, the
next one it prefetches, the previous one's delayed updates) with room to spare: the
engine workload's 312,000 bytes over three 500-key batches' 234,000; the DLRM's
209,788 bytes (its tables grown through 60 batches of 128 rows) over at most 137,592
for three consecutive batches. A budget below the blocks pinned at once fails; near
them, blocks are read back more than once a step: here none is."""
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT


@pytest.mark.timeout(900)
def test_structure(tmp_path):
    cmd = [sys.executable, "-m", "tf_fusedemb.benchmarks.tiered", "--json", "--rows", "20000",
           "--batch", "500", "--steps", "2", "--fractions", "0.1", "--spill-dir", str(tmp_path),
           "--plot", str(tmp_path / "tiered.png"), "--dlrm-batch", "128", "--dlrm-growth", "60"]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_USE_LEGACY_KERAS="1")
    out = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=840)
    assert out.returncode == 0, f"benchmark failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("step_ratio_vs_dram", "rss_ratio_vs_dram", "hit_rate", "prefetch_ratio_vs_dram_step"):
        assert sorted(result[key]) == ["0.1", "1.0"]
    assert set(result["exposed_ssd_ms"]) == {"prefetch", "no_prefetch"}
    assert result["checkpoint_ratio"] > 0
    dram, tiered = result["budgets"]["1.0"], result["budgets"]["0.1"]
    assert dram["ssd_bytes"] == 0 and dram["no_prefetch"]["read_bytes"] == 0
    assert tiered["ssd_bytes"] > 0.8 * 20000 * (28 + 2 * 4 * 16)  # ~90% of the table
    assert 0 <= result["hit_rate"]["0.1"] < 1
    assert 0 <= result["engine_hit_rate"]["0.1"] < 1 and tiered["rereads_per_step"] == 0
    # The prefetch is timed apart from the step: it reads the tiered table's blocks.
    assert tiered["prefetch"]["prefetch_ms"] > 0 and "prefetch_ms" not in tiered["no_prefetch"]
    # The whole step as a user runs it: plain and pipelined fit, per budget.
    for key in ("fit_ratio_vs_dram", "pipelined_ratio_vs_dram", "anon_rss_ratio_vs_dram",
                "fit_rss_ratio_vs_dram"):
        assert sorted(result[key]) == ["0.1", "1.0"], key
    assert result["fit_ratio_vs_dram"]["1.0"] == 1.0
    assert result["pipelined_ratio_vs_dram"]["1.0"] >= 1.0  # against the faster DRAM mode
    fit = result["fit"]
    for mode in ("fit", "pipelined"):
        assert fit["1.0"][mode]["blocks_read_per_step"] == 0 and fit["1.0"][mode]["ssd_bytes"] == 0
        assert fit["0.1"][mode]["blocks_read_per_step"] > 0, mode  # Zipf hits on SSD blocks
        assert fit["0.1"][mode]["rows"] == fit["1.0"][mode]["rows"] >= 20000, mode
        assert 0 <= fit["0.1"][mode]["hit_rate"] < 1, mode  # never below 0: re-reads apart
        assert fit["0.1"][mode]["rereads_per_step"] == 0, mode
    assert sorted(result["per_block_us"]) == ["0.1"]
    assert 8 <= result["dram_bytes_per_cold_key"]["0.1"] <= 24  # the SSD tier's key index
    assert sorted(result["disk_pages_per_block_read"]) == ["0.1"]
    assert result["disk_pages_per_block_read"]["0.1"] >= 0  # from /proc/self/io
    assert fit["0.1"]["fit"]["disk_read_bytes_per_step"] >= 0
    assert result["keys"]["generator"] == "ZipfKeys" and result["keys"]["exponent"] > 1
    assert os.path.exists(result["plot"])
    assert os.listdir(tmp_path) == ["tiered.png"]  # the workers' stores removed
    # The DLRM workload: the same keys under "dlrm", its largest tables tiered.
    dlrm = result["dlrm"]
    assert dlrm["tiered_tables"] == ["C3", "C12", "C21"] and dlrm["batch"] == 128
    for key in ("fit_ratio_vs_dram", "pipelined_ratio_vs_dram", "hit_rate",
                "anon_rss_ratio_vs_dram"):
        assert sorted(dlrm[key]) == ["0.1", "1.0"], key
    assert sorted(dlrm["per_block_us"]) == ["0.1"]
    for mode in ("fit", "pipelined"):
        dram_run, tiered_run = dlrm["fit"]["1.0"][mode], dlrm["fit"]["0.1"][mode]
        assert dram_run["ssd_bytes"] == 0 and dram_run["blocks_read_per_step"] == 0, mode
        assert tiered_run["rows"] == dram_run["rows"], mode  # every row kept, on either tier
        assert tiered_run["ssd_bytes"] > 0 and tiered_run["blocks_spilled_per_step"] > 0, mode
        assert 0 <= tiered_run["hit_rate"] < 1 and tiered_run["rereads_per_step"] == 0, mode
        budgets = tiered_run["budget_bytes"]
        assert sorted(budgets) == ["C12", "C21", "C3"] and all(b > 0 for b in budgets.values())
    assert sum(dlrm["tiered_rows"].values()) < dlrm["fit"]["1.0"]["fit"]["rows"]


def test_a_failed_worker_leaves_no_store(tmp_path):
    """Each worker spills into a directory of its own that the benchmark removes however
    the worker ends: one killed for memory cannot remove its store itself, and a store of a
    50M-row table is 8 GB."""
    from tf_fusedemb.benchmarks.tiered import run_worker
    with pytest.raises(RuntimeError, match="--fit-worker bogus"):
        run_worker(["--worker", "0.1", "--fit-worker", "bogus"], str(tmp_path))
    assert os.listdir(tmp_path) == []
