"""A table larger than memory trains inside a memory cgroup, with the results of a run that
holds every row in DRAM.

The limit is set as a user would set it: the table's DRAM budget, plus the process's
fixed overhead (TensorFlow, the model, one batch's tensors: the peak of the same job over
a table of 1,000 rows, measured in an unlimited cgroup), plus the SSD tier's index of
cold keys, plus 10%. The overhead is the smaller peak of two runs
(``measure_overhead``: the first process after heavy file I/O is charged for reading
TensorFlow's libraries back into the page cache, which would leave a limit that binds
nothing). The tiered table then grows to more than 10x its budget inside
that limit: no process is OOM-killed, and its losses and rows equal, bit for bit, those of
the same job without a budget (run outside any cgroup), which is the reference. That
same job without a budget, run inside the limit, is OOM-killed: the limit binds.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tf_fusedemb.testing.memory_limit import (LimitedRun, MemoryLimit, MemoryLimitUnavailable,
                                              measure_overhead)

WORKER = os.path.join(os.path.dirname(__file__), "memory_limit_worker.py")
STEPS, BATCH, DISTINCT = 64, 16_000, 1_200_000
BUDGET = 4_000_000  # bytes of DRAM for the table's blocks: 1.6x one batch's blocks
BLOCK_BYTES = 28 + 2 * 4 * 16  # header, row, Adagrad accumulator
# The SSD tier's own memory, which a table of 1,000 rows barely allocates: its DRAM index
# of cold keys, at most 24 bytes per key (custom_ops/slot_table.h), for at most every key
# the job draws.
STORE_BYTES_PER_KEY = 24
STORE_BYTES = STORE_BYTES_PER_KEY * STEPS * BATCH


def worker_argv(out, distinct, budget=None, spill_dir=None):
    argv = [sys.executable, WORKER, str(out), "--distinct", str(distinct), "--steps",
            str(STEPS), "--batch", str(BATCH)]
    if budget is not None:
        argv += ["--budget-bytes", str(budget), "--spill-dir", str(spill_dir)]
    return argv


def run_in_cgroup(limit_bytes, argv) -> LimitedRun:
    try:
        with MemoryLimit(limit_bytes) as limit:
            return limit.run(argv, timeout=400)
    except MemoryLimitUnavailable as e:
        pytest.skip(f"no memory cgroup on this machine: {e}")


@pytest.mark.timeout(900)
def test_a_table_10x_its_budget_trains_exactly_inside_a_memory_limit(tmp_path):
    try:
        overhead = measure_overhead([worker_argv(tmp_path / f"small{i}.npz", 1000, BUDGET,
                                                 tmp_path / f"spill_small{i}")
                                     for i in range(2)], timeout=400)
    except MemoryLimitUnavailable as e:
        pytest.skip(f"no memory cgroup on this machine: {e}")
    limit_bytes = int((BUDGET + overhead.peak_bytes + STORE_BYTES) * 1.1)

    tiered = run_in_cgroup(limit_bytes, worker_argv(tmp_path / "tiered.npz", DISTINCT, BUDGET,
                                                    tmp_path / "spill"))
    assert tiered.oom_kills == 0 and tiered.returncode == 0, \
        (limit_bytes, tiered.peak_bytes, tiered.oom_kills, tiered.stderr[-3000:])
    plain = subprocess.run(worker_argv(tmp_path / "plain.npz", DISTINCT), capture_output=True,
                           text=True, timeout=400)
    assert plain.returncode == 0, plain.stderr[-3000:]

    got, want = np.load(tmp_path / "tiered.npz"), np.load(tmp_path / "plain.npz")
    memory, = json.loads(str(got["memory"])).values()
    assert memory["rows"] * BLOCK_BYTES >= 10 * BUDGET, memory  # the table: > 10x its budget
    assert memory["ssd_bytes"] > 0, memory
    print(f"limit {limit_bytes} B, peak {tiered.peak_bytes} B, fixed overhead "
          f"{overhead.peak_bytes} B, table {memory}")
    np.testing.assert_array_equal(got["losses"], want["losses"])
    np.testing.assert_array_equal(got["sample_keys"], want["sample_keys"])
    np.testing.assert_array_equal(got["sample_rows"], want["sample_rows"])
    # The untiered job does not fit inside the limit: the limit binds.
    untiered = run_in_cgroup(limit_bytes, worker_argv(tmp_path / "untiered.npz", DISTINCT))
    assert untiered.oom_kills >= 1 and untiered.returncode == -9, \
        (limit_bytes, untiered.peak_bytes, untiered.returncode, memory)


@pytest.mark.timeout(120)
def test_the_limit_kills_a_process_that_outgrows_it_and_says_so():
    """The measuring tool itself: 200 MB of touched anonymous memory under a 64 MiB limit
    is OOM-killed and counted; the same under no limit runs and its peak covers it."""
    grow = [sys.executable, "-c", "b = bytearray(200 << 20); print(len(b))"]
    killed = run_in_cgroup(64 << 20, grow)
    assert killed.returncode == -9 and killed.oom_kills >= 1, killed
    free = run_in_cgroup(None, grow)
    assert free.returncode == 0 and free.oom_kills == 0, free
    assert free.peak_bytes >= 200 << 20, free


@pytest.mark.timeout(120)
def test_the_command_reports_the_peak_and_exits_as_the_command_did():
    """``python -m tf_fusedemb.testing.memory_limit``: the command's output passes through,
    one MEMORY_LIMIT line follows, and the status is the command's (137 when killed)."""
    try:
        MemoryLimit(None)
    except MemoryLimitUnavailable as e:
        pytest.skip(f"no memory cgroup on this machine: {e}")
    tool = [sys.executable, "-m", "tf_fusedemb.testing.memory_limit"]
    grow = ["--", sys.executable, "-c", "b = bytearray(200 << 20); print('grown', len(b))"]
    killed = subprocess.run(tool + ["--limit-mb", "64"] + grow, capture_output=True, text=True,
                            timeout=100)
    report = json.loads(killed.stdout.split("MEMORY_LIMIT ", 1)[1])
    assert killed.returncode == 137 and report["oom_kills"] >= 1, killed
    assert report["limit_bytes"] == 64 << 20 and "grown" not in killed.stdout
    free = subprocess.run(tool + grow, capture_output=True, text=True, timeout=100)
    report = json.loads(free.stdout.split("MEMORY_LIMIT ", 1)[1])
    assert free.returncode == 0 and "grown 209715200" in free.stdout, free
    assert report["oom_kills"] == 0 and report["peak_bytes"] >= 200 << 20, report
    assert report["limit_bytes"] is None


@pytest.mark.timeout(120)
def test_the_overhead_is_the_smallest_peak_and_a_failed_run_is_named():
    """``measure_overhead``: of a run that touches 200 MB and one that touches nothing, the
    second; a run that fails raises with its command, and no command is an error."""
    try:
        MemoryLimit(None)
    except MemoryLimitUnavailable as e:
        pytest.skip(f"no memory cgroup on this machine: {e}")
    big = [sys.executable, "-c", "b = bytearray(200 << 20); print(len(b))"]
    small = [sys.executable, "-c", "print(1)"]
    run = measure_overhead([big, small], timeout=100)
    assert run.returncode == 0 and run.stdout == "1\n" and run.peak_bytes < 200 << 20, run
    with pytest.raises(RuntimeError, match="exited 3"):
        measure_overhead([small, [sys.executable, "-c", "raise SystemExit(3)"]], timeout=100)
    with pytest.raises(ValueError, match="at least one"):
        measure_overhead([], timeout=100)
