"""TFRA's CPU tables insert on one thread once tf_fusedemb's storage is imported: its
parallel insert can lose rows when libcuckoo resizes (tf_fusedemb/storage/serial_insert.py,
docs/tfra_cuckoo_race/)."""
import os
import subprocess
import sys
import textwrap

import pytest

from tf_fusedemb.storage import serial_insert


@pytest.mark.tfra
def test_storage_sets_tfra_insert_parallelism_to_one():
    import tf_fusedemb.storage.dynamic_table  # noqa: F401  pylint: disable=import-outside-toplevel
    assert os.environ[serial_insert.INSERT_THREADS_ENV] == "1"


def test_a_user_value_is_overridden_with_a_warning(monkeypatch):
    monkeypatch.setenv(serial_insert.INSERT_THREADS_ENV, "8")
    with pytest.warns(RuntimeWarning, match="can lose rows"):
        serial_insert.make_inserts_serial()
    assert os.environ[serial_insert.INSERT_THREADS_ENV] == "1"


@pytest.mark.tfra
def test_bulk_load_on_eight_threads_keeps_every_row():
    """324k rows into one table with 8 intra-op threads: every row stored, exactly."""
    script = textwrap.dedent("""
        import numpy as np, tensorflow as tf
        tf.config.threading.set_intra_op_parallelism_threads(8)
        from tf_fusedemb.specs import InitializerSpec, OptimizerSpec
        from tf_fusedemb.storage import DynamicGroupTable
        rng = np.random.default_rng(0)
        keys = np.unique(rng.integers(-2**63, 2**63 - 1, 324382, dtype=np.int64))
        rows = rng.standard_normal((len(keys), 16)).astype(np.float32)
        table = DynamicGroupTable("g", 16, InitializerSpec(), OptimizerSpec.adagrad(0.1))
        table.load({"keys": keys, "values": rows})
        got, exists = table.values.lookup(keys, return_exists=True)
        assert int(table.size()) == len(keys), int(table.size())
        assert bool(tf.reduce_all(exists)), int(tf.reduce_sum(1 - tf.cast(exists, tf.int32)))
        np.testing.assert_array_equal(got.numpy(), rows)
        np.testing.assert_array_equal(table.export()["keys"].numpy(), np.sort(keys))
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != serial_insert.INSERT_THREADS_ENV}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=600, env=env)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]
