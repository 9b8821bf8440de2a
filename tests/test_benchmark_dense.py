"""``python -m tf_fusedemb.benchmarks.dense --json``: the four forms of the dense step
run and report side-by-side times and ratios (structure only, never speed), and each
form computes float32 gradients of every weight."""
import json
import subprocess
import sys

import numpy as np
import tensorflow as tf

from conftest import REPO_ROOT
from tf_fusedemb.benchmarks import dense


def test_benchmark_prints_the_four_forms():
    out = subprocess.run([sys.executable, "-m", "tf_fusedemb.benchmarks.dense", "--json",
                          "--batch-size", "256", "--repeats", "3"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result["variants"]) == {"float32", "float32_xla", "mixed_bfloat16",
                                       "mixed_bfloat16_xla"}
    assert all(v["median_ms"] > 0 for v in result["variants"].values())
    for key in ("bf16_speedup", "xla_speedup_float32", "xla_speedup_bf16"):
        assert result[key] > 0, key


def test_the_steps_compute_the_gradients():
    x = tf.random.stateless_normal([64, 20], seed=[0, 1])
    y = tf.cast(tf.random.stateless_uniform([64, 1], seed=[0, 2]) < 0.5, tf.float32)
    grads = [dense.dense_step(p, jit, x, y)() for p in dense.POLICIES for jit in (False, True)]
    assert [g.shape for g in grads[0]] == [(20, 256), (256,), (256, 128), (128,), (128, 1), (1,)]
    for g in grads:
        assert all(np.isfinite(a).all() for a in g) and g[0].dtype == np.float32
