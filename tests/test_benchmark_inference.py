"""The inference benchmark's accounting (issue 12), single process against hand-computed
references: the delays a rank sleeps and how they are counted, per-condition statistics
from every rank's samples, and the headline ratios (the masking share's ideal time adds
the delay actually slept, not the one requested); the default ranks fit the machine,
oversubscribed ranks are refused, and one short run on 2 ranks pinned to a core each
keeps the masked delay share within [0, 1] up to noise (issue 21)."""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import REPO_ROOT
from tf_fusedemb.benchmarks import inference
from tf_fusedemb.testing import mpirun
from tf_fusedemb.testing.cluster.placement import available_cpus
from tf_fusedemb.benchmarks.inference_worker import Delay
from tf_fusedemb.benchmarks.inference_worker import summarise as summarise_conditions


def test_random_delay_counts_what_was_slept():
    delay = Delay("random", 0.004, rank=1, size=2, seed=(7,))
    rng = np.random.default_rng([7, 1])  # the draws the delay makes, in numpy
    requested = sum(rng.uniform(0, 0.004) for _ in range(20))
    begin = time.perf_counter()
    for j in range(20):
        delay(j)
    wall = time.perf_counter() - begin
    # A sleep overshoots its request (never returns early): what was slept is counted,
    # not what was asked for.
    assert requested < delay.slept_s <= wall


def test_straggler_is_the_last_rank_and_none_never_sleeps():
    last = Delay("straggler", 0.004, rank=2, size=3, seed=(0,))
    others = [Delay("straggler", 0.004, rank=r, size=3, seed=(0,)) for r in (0, 1)]
    quiet = Delay("none", 0.004, rank=2, size=3, seed=(0,))
    for j in range(5):
        for d in [last, quiet, *others]:
            d(j)
    assert last.slept_s >= 5 * 0.002  # max / 2 every iteration
    assert quiet.slept_s == 0.0 and all(d.slept_s == 0.0 for d in others)


def test_condition_statistics_from_every_ranks_samples():
    # samples[rank][condition] = [(wall s, latencies ms, slept s) per round]
    samples = [{"k0/random": [(2.0, [1.0, 3.0], 0.5), (4.0, [2.0], 0.7)]},
               {"k0/random": [(3.0, [5.0], 0.1), (1.0, [4.0, 6.0], 0.3)]}]
    stats = summarise_conditions(samples, rounds=2, iters=10, batch_size=8)["k0/random"]
    walls = [max(2.0, 3.0), max(4.0, 1.0)]  # a round lasts as long as its slowest rank
    assert stats["iter_ms"] == pytest.approx(np.median(walls) / 10 * 1e3, abs=1e-3)
    assert stats["samples_per_s"] == pytest.approx(8 * 10 / np.median(walls), abs=0.1)
    assert stats["slept_ms"] == pytest.approx(np.mean([0.5, 0.7, 0.1, 0.3]) / 10 * 1e3,
                                              abs=1e-3)
    lat = [1.0, 3.0, 2.0, 5.0, 4.0, 6.0]
    assert stats["latency_p50_ms"] == pytest.approx(np.percentile(lat, 50), abs=1e-3)


def _condition(iter_ms, slept_ms=0.0, samples_per_s=1.0):
    return {"iter_ms": iter_ms, "slept_ms": slept_ms, "samples_per_s": samples_per_s}


def test_masked_share_uses_the_slept_delay():
    lags = [0, 2]
    bls = {"ranks": 1, "max_delay_ms": 8.0, "conditions": {
        "k0/none": _condition(4.0, samples_per_s=200.0),
        "k0/random": _condition(10.0, slept_ms=4.4), "k2/random": _condition(8.6, slept_ms=4.6),
        "k0/straggler": _condition(8.0), "k2/straggler": _condition(8.2),
        "k2/none": _condition(4.1)}}
    hvd = {"conditions": {"k0/none": _condition(5.0, samples_per_s=100.0)}}
    got = inference.summarise(bls, hvd, lags)
    slept = (4.4 + 4.6) / 2
    ideal = 4.0 + slept  # the requested mean (4.0 ms) would give 8.0
    assert got["mean_slept_delay_ms"] == pytest.approx(slept)
    assert got["mean_injected_delay_ms"] == pytest.approx(4.0)
    assert got["masked_delay_share"]["2"] == pytest.approx((10.0 - 8.6) / (10.0 - ideal),
                                                           abs=1e-3)
    assert got["masked_delay_share"]["0"] == 0.0
    assert got["straggler_slowdown"] == {"0": 2.0, "2": pytest.approx(8.2 / 4.1, abs=1e-3)}
    assert got["k0_vs_horovod"] == 2.0 and got["oversubscribed"] is False


def test_default_ranks_fit_the_machine_and_oversubscription_is_refused():
    cores = len(available_cpus())
    assert 2 <= inference.parse_args([]).np <= max(2, min(4, cores))
    with pytest.raises(SystemExit):  # more ranks than cores: the share would mean nothing
        inference.parse_args(["--np", str(cores + 1)])
    shared = {"ranks": 2, "rank_cpus": [[0], [0]], "max_delay_ms": 1.0, "conditions": {}}
    with pytest.raises(ValueError, match="shared cores"):
        inference.summarise(shared, {"conditions": {}}, [0])
    with pytest.raises(ValueError, match="did not have their cores"):  # others used 0.5 core
        inference.check_cores_were_ours((0.0, 10.0, 3.0), (10.0, 18.0, 6.0))
    inference.check_cores_were_ours((0.0, 10.0, 3.0), (10.0, 14.0, 6.0))  # 0.1 core: fine


# Under pytest-xdist (`make test`) another worker always shares the cores, so the
# benchmark would run for two minutes and then refuse: the test is skipped there at once and
# runs where the file runs alone (`pytest tests/test_benchmark_inference.py`).
@pytest.mark.skipif("PYTEST_XDIST_WORKER" in os.environ,
                    reason="needs the cores to itself; run this file alone, without -n")
@pytest.mark.timeout(900)
def test_masked_share_stays_within_0_and_1_on_pinned_ranks():
    """End to end on 2 ranks pinned to a core each: the share is within [0, 1] up to
    noise, i.e. T_ideal <= T_k <= T_sync (module doc of benchmarks.inference) up to how
    much the no-delay iteration moves between bounds (which no bound should change), at
    least 2% of it. Unpinned, ranks borrowed a sleeping rank's core: T_k < T_ideal.
    Skipped when the benchmark refuses because other processes used the cores meanwhile."""
    if len(available_cpus()) < 2 or mpirun.unavailable_reason():
        pytest.skip("needs 2 cores and mpirun with mpi4py")
    out = subprocess.run(
        [sys.executable, "-m", "tf_fusedemb.benchmarks.inference", "--json", "--np", "2",
         "--lags", "0,8", "--iters", "60", "--rounds", "2", "--features", "4"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=840)
    if "did not have their cores to themselves" in out.stderr:  # refused, see the module
        pytest.skip(out.stderr.strip().splitlines()[-1])
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["ranks"] == 2 and result["oversubscribed"] is False
    c = {k: v["iter_ms"] for k, v in result["bls"].items()}
    noise = max(max(abs(c[f"k{k}/none"] - c["k0/none"]) for k in result["lags"]),
                0.02 * c["k0/none"])
    ideal = c["k0/none"] + result["mean_slept_delay_ms"]
    for k in result["lags"]:
        assert ideal - noise <= c[f"k{k}/random"] <= c["k0/random"] + noise, (k, c, noise)

