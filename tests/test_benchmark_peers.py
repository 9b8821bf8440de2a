"""The peer benchmark's own parts (the TorchRec runs need its environment and are not in
CI): the batches it dumps for TorchRec are the lookup benchmark's, each feature's IDs
renumbered one-to-one; the speedups are the ratios the benchmark names; a missing TorchRec
environment fails with one line naming the fix; TorchRec's ranks run pinned as ours do."""
import os
import subprocess
import sys

import numpy as np
import pytest

from tf_fusedemb.benchmarks import lookup_data, peers
from tf_fusedemb.testing.cluster.placement import assign_cpus


def test_dumped_batches_are_the_lookup_benchmarks_renumbered_one_to_one(tmp_path):
    args = peers.parse_args(["--np", "2", "--batch-size", "64", "--num-batches", "3"])
    sizes = peers.dump_batches(args, str(tmp_path))
    columns = lookup_data.synthetic_columns(64, 2, 3, 0)
    for rank in range(2):
        dumped = np.load(tmp_path / f"rank{rank}.npz")
        assert list(dumped["table_sizes"]) == [sizes[c] for c in lookup_data.CATEGORICAL]
        for t, (x, y) in enumerate(lookup_data.make_batches(columns, 64, 2, rank, 3)):
            np.testing.assert_array_equal(dumped[f"b{t}_dense"], x["dense"])
            np.testing.assert_array_equal(dumped[f"b{t}_label"], y)
            for c in lookup_data.CATEGORICAL:
                ids = dumped[f"b{t}_{c}"]
                assert ids.min() >= 0 and ids.max() < sizes[c]
                # one-to-one: equal renumbered IDs exactly where the original IDs are equal
                np.testing.assert_array_equal(ids[:, None] == ids[None, :],
                                              x[c][:, None] == x[c][None, :])
    for c in lookup_data.CATEGORICAL:  # each table holds exactly the IDs the batches touch
        assert sizes[c] == len(np.unique(columns[c][:64 * 2 * 3]))


def test_speedups_are_torchrec_time_over_ours():
    medians = {"fused": 80.0, "fused_bf16": 50.0, "torchrec_table_wise": 84.0,
               "torchrec_table_wise_bf16": 60.0, "torchrec_row_wise": 100.0,
               "torchrec_row_wise_bf16": 70.0}
    got = peers.speedups(medians)
    assert got == {"speedup_vs_torchrec_best": 60.0 / 50.0,
                   "speedup_vs_torchrec_fp32": 84.0 / 80.0}


def test_speedup_by_round_is_each_rounds_own_ratio():
    runs = {"fused": [80.0, 40.0], "fused_bf16": [50.0, 50.0],
            "torchrec_table_wise": [84.0, 84.0], "torchrec_table_wise_bf16": [60.0, 30.0],
            "torchrec_row_wise": [100.0, 60.0], "torchrec_row_wise_bf16": [70.0, 70.0]}
    got = peers.speedups_by_round(runs)
    assert got == [{"speedup_vs_torchrec_best": 60.0 / 50.0,
                    "speedup_vs_torchrec_fp32": 84.0 / 80.0},
                   {"speedup_vs_torchrec_best": 30.0 / 40.0,
                    "speedup_vs_torchrec_fp32": 60.0 / 40.0}]


def test_a_missing_torchrec_environment_names_the_fix(tmp_path):
    with pytest.raises(SystemExit, match="make peers-env"):
        peers.check_peer_python(str(tmp_path / "no-python"))


def test_torchrecs_ranks_run_through_the_pinning_wrapper_unless_told_not_to(tmp_path):
    config = peers.PeerConfig("table_wise", False)
    pinned = peers.peer_command(peers.parse_args([]), config, "B")
    unpinned = peers.peer_command(peers.parse_args(["--no-pin"]), config, "B")
    # pinned: torchrun runs the wrapper, which runs the worker with the peer interpreter
    at = pinned.index("--no-python")
    assert pinned[at + 1:at + 5] == [sys.executable, "-m", "tf_fusedemb.testing.cluster.pinned",
                                     pinned[0]]
    assert pinned[:at] + pinned[at + 5:] == unpinned
    assert "--no-python" not in unpinned and str(peers.WORKER) in unpinned
    # the wrapper's part of that command, run as torchrun's second rank would run it
    env = dict(os.environ, LOCAL_RANK="1", LOCAL_WORLD_SIZE="2")
    out = subprocess.run(pinned[at + 1:at + 4] + [sys.executable, "-c",
                         "import os; print(sorted(os.sched_getaffinity(0)))"],
                         env=env, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == str(list(assign_cpus(2)[1]))
