"""Concurrency evidence for the storage engine: parallel upserts and records from 8
threads into one engine (each kernel also runs its shards on TF's intra-op pool) across
many index doublings, with readers meanwhile, lose no row and no count; and the
standalone C++ stress program (tests/engine_stress_test.cc, also run under TSan and
ASan/UBSan by `make sanitize`) passes."""
import os
import shutil
import subprocess
import threading

import numpy as np
import pytest
import tensorflow as tf

from conftest import REPO_ROOT
from tf_fusedemb.specs import InitializerSpec, OptimizerSpec
from tf_fusedemb.storage.engine_table import EngineGroupTable

WRITERS, ROUNDS, BATCH = 8, 3, 8192
UNIVERSE = 320_000  # distinct keys; each written by 2 of the 8 threads, ROUNDS times


def _run_threads(targets):
    errors = []

    def guarded(fn):
        def run():
            try:
                fn()
            except Exception as e:  # pylint: disable=broad-except  (reported below)
                errors.append(e)
        return run

    threads = [threading.Thread(target=guarded(fn)) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]


def _slice_keys(t):
    """Keys of writer t: writers 2s and 2s+1 share slice s of the universe."""
    per = UNIVERSE // (WRITERS // 2)
    return (np.arange((t // 2) * per, (t // 2 + 1) * per, dtype=np.int64) * 7919 + 11)


@pytest.mark.parametrize("num_shards", [2, 16])
def test_parallel_upserts_lose_no_row(num_shards):
    """SGD lr 1 from zero rows with gradient 1: after the run every key's row must be
    exactly -2 * ROUNDS, and every read meanwhile a whole number of updates."""
    table = EngineGroupTable(f"stress{num_shards}", 4, InitializerSpec.zeros(),
                             OptimizerSpec.sgd(1.0), num_shards=num_shards)
    engine = table.engine
    done = threading.Event()
    torn = []

    def writer(t):
        def run():
            rng = np.random.default_rng(t)
            for _ in range(ROUNDS):
                keys = rng.permutation(_slice_keys(t))
                for lo in range(0, len(keys), BATCH):
                    batch = keys[lo:lo + BATCH]
                    engine.apply_gradients(batch, batch, np.ones((len(batch), 4), np.float32), 1)
        return run

    def reader():
        rng = np.random.default_rng(99)
        while not done.is_set():
            keys = rng.integers(0, UNIVERSE, 4096) * 7919 + 11
            rows = engine.lookup(keys, keys).numpy()
            ok = (rows == rows[:, :1]).all() and (rows <= 0).all() and (rows >= -2 * ROUNDS).all() \
                and (rows == np.round(rows)).all()
            if not ok:
                torn.append(rows)

    readers = [threading.Thread(target=reader) for _ in range(2)]
    for r in readers:
        r.start()
    try:
        _run_threads([writer(t) for t in range(WRITERS)])
    finally:
        done.set()
        for r in readers:
            r.join()
    assert not torn
    keys = np.arange(UNIVERSE, dtype=np.int64) * 7919 + 11
    rows = engine.lookup(keys, keys).numpy()
    wrong = np.flatnonzero((rows != -2.0 * ROUNDS).any(axis=1))
    assert wrong.size == 0, f"{wrong.size} of {UNIVERSE} keys wrong, e.g. {keys[wrong[:5]]}"
    assert int(table.size()) == UNIVERSE
    exported = table.export()
    np.testing.assert_array_equal(exported["keys"].numpy(), np.sort(keys))


def test_parallel_records_lose_no_count():
    """8 threads record the same keys' accesses (and 2 threads update rows) at once:
    counts are exact, every key is tracked once."""
    table = EngineGroupTable("stress_stats", 2, InitializerSpec.zeros(), OptimizerSpec.sgd(1.0))
    engine = table.engine

    def recorder(t):
        def run():
            keys = _slice_keys(t)
            for _ in range(ROUNDS):
                for lo in range(0, len(keys), BATCH):
                    k = keys[lo:lo + BATCH]
                    engine.record(k, k % 3, k, np.ones(len(k), np.int64), 5,
                                  overwrite_last_step=True)
        return run

    def updater(t):
        def run():
            keys = _slice_keys(2 * t)
            for lo in range(0, len(keys), BATCH):
                k = keys[lo:lo + BATCH]
                engine.apply_gradients(k, k, np.ones((len(k), 2), np.float32), 1)
        return run

    _run_threads([recorder(t) for t in range(WRITERS)] + [updater(t) for t in range(2)])
    keys = np.arange(UNIVERSE, dtype=np.int64) * 7919 + 11
    found = engine.find(keys)
    np.testing.assert_array_equal(found.counts.numpy(), np.full(UNIVERSE, 2 * ROUNDS))
    np.testing.assert_array_equal(found.tables.numpy(), keys % 3)
    np.testing.assert_array_equal(found.last_steps.numpy(), np.full(UNIVERSE, 5))
    size = engine.size()
    assert int(size.tracked) == UNIVERSE
    assert int(size.stored) == 2 * (UNIVERSE // (WRITERS // 2))


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_standalone_cpp_stress_program(tmp_path):
    """tests/engine_stress_test.cc, built plainly (make sanitize runs it under TSan and
    ASan/UBSan): arena arithmetic, model-based test, 8-thread upserts."""
    flags = tf.sysconfig.get_compile_flags() + tf.sysconfig.get_link_flags()
    binary = str(tmp_path / "engine_stress_test")
    subprocess.run(["g++", "-O2", "-std=c++17", "-pthread", "-Icustom_ops",
                    "tests/engine_stress_test.cc", "-o", binary, *flags,
                    f"-Wl,-rpath,{tf.sysconfig.get_lib()}"],
                   cwd=REPO_ROOT, check=True, timeout=300)
    out = subprocess.run([binary, "80000", "2"], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert out.returncode == 0 and "all passed" in out.stdout, out.stdout + out.stderr[-3000:]
