"""The topology benchmark runs end to end (4 local ranks seen as 2 nodes x 2, small
batches) and prints its JSON last; the hierarchical exchange's inter-node bytes reach the
bound of perfect node dedup counted from the keys alone in numpy."""
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT


@pytest.mark.timeout(400)
def test_topology_benchmark_prints_its_figures():
    cmd = [sys.executable, "-m", "tf_fusedemb.benchmarks.topology", "--json", "--topology",
           "2x2", "--batch-size", "512", "--steps", "1", "--rounds", "1", "--also", "",
           "--real-batch-size", "128", "--timeout", "300"]
    out = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=360,
                         env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_USE_LEGACY_KERAS="1"))
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("inter_node_bytes_ratio", "dedup_bound", "speedup_hier_vs_flat",
                "hier_comm_share", "planner_vs_best", "inter_node_bytes_ratio_real"):
        assert key in result, key
    assert 0 < result["dedup_bound"] < 1
    assert result["inter_node_bytes_ratio"] == pytest.approx(result["dedup_bound"], abs=0.03)
    flat, hier = (result["bytes_per_step"][k] for k in ("flat", "hierarchical"))
    assert (flat["rounds"], hier["rounds"]) == (3, 6)
    assert hier["inter_bytes_sent"] < flat["inter_bytes_sent"]
