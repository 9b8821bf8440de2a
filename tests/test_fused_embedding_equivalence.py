"""FusedEmbedding training on 1, 2 and 3 ranks equals a single-process reference with one
ordinary table per feature: per-step losses and final parameters to 1e-5 relative."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import equivalence_model as em
from conftest import REPO_ROOT, storage_params
from horovod_launch import horovodrun
from tf_fusedemb.specs import STORAGES

STEPS = 20
SCRIPT = "tests/mp_train_equivalence.py"


def reference_run(steps=STEPS):
    ref = em.Reference(em.feature_specs())
    losses = []
    for t in range(steps):
        feats, labels = em.global_batch(t)
        x, y = em.to_tensors(feats, labels, 0, em.GLOBAL_BATCH)
        losses.append(ref.train_step(x, y))
    tables = {n: v.numpy() for n, v in ref.tables.items()}
    return losses, ref.dense_weights(), tables


def parse_result(stdout):
    return parse_results(stdout, 1)[0]


def parse_results(stdout, runs):
    """The RESULT of each of a launch's ``runs`` (mp_train_equivalence's ``--each``)."""
    lines = [l for l in stdout.splitlines() if "RESULT " in l]
    assert len(lines) == runs, stdout[-3000:]
    results = [json.loads(l.split("RESULT ", 1)[1]) for l in lines]
    assert [r["run"] for r in results] == list(range(runs)), "runs out of order"
    return results


def assert_equivalent(result, num_ranks, reference=None):
    """``reference``: (losses, dense weights, tables) of the single-process run
    (default: reference_run())."""
    losses, dense, tables = reference or reference_run()
    np.testing.assert_allclose(result["losses"], losses, rtol=1e-5, err_msg="per-step losses")
    for got, want in zip(result["dense"], dense):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7, err_msg="dense weights")
    for name, want in tables.items():
        np.testing.assert_allclose(result["tables"][name], want, rtol=1e-5, atol=1e-7,
                                   err_msg=f"table {name}")
    # the dense head (4) and the FusedEmbedding layer's row-update marker: rows are no variables
    assert result["num_trainable"] == 5, "only the dense head and the row-update marker"


def run_single_process(*args):
    out = subprocess.run([sys.executable, SCRIPT, *args], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=600,
                         env={k: v for k, v in os.environ.items() if not k.startswith("HOROVOD")})
    assert out.returncode == 0, out.stderr[-3000:]
    return parse_result(out.stdout)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("storage", storage_params(STORAGES))
def test_single_process_equals_reference(storage):
    result = run_single_process("--steps", str(STEPS), "--storage", storage)
    assert_equivalent(result, 1)
    assert all(c["rounds"] == 0 for c in result["counters"].values())
    # The plan fused a, b, c (dim 8, adagrad) and s, d (dim 4, adam); e is static.
    assert sorted(map(sorted, result["groups"])) == [["a", "b", "c"], ["d", "s"], ["e"]]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("num_proc", [2, 3])
def test_multi_rank_equals_reference(num_proc):
    # Step 7 gives the last rank an empty batch; table e is owned by rank 0 only, so the
    # other ranks receive no keys for its group.
    result = parse_result(horovodrun([SCRIPT, "--steps", str(STEPS), "--empty-step", "7"],
                                     num_proc, timeout=800))
    assert_equivalent(result, num_proc)
    for group, counters in result["counters"].items():
        assert counters["rounds"] == 3 * STEPS, (group, counters)  # keys, rows, gradients
    totals = {n: c for access in result["access"].values() for n, c in access.items()}
    assert totals["e"] > 0  # rank 0 owns every e key


@pytest.mark.timeout(900)
@pytest.mark.parametrize("num_proc", [1, 2])
def test_keras_fit_equals_reference(num_proc):
    args = [SCRIPT, "--steps", "8", "--keras-fit"]
    result = (parse_result(horovodrun(args, num_proc, timeout=800)) if num_proc > 1
              else run_single_process(*args[1:]))
    losses, dense, tables = reference_run(steps=8)
    np.testing.assert_allclose(result["losses"], losses, rtol=1e-5)
    for got, want in zip(result["dense"], dense):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    for name, want in tables.items():
        np.testing.assert_allclose(result["tables"][name], want, rtol=1e-5, atol=1e-7)


@pytest.mark.timeout(300)
def test_mismatched_specs_fail_clearly_on_every_rank():
    with pytest.raises(AssertionError) as err:
        horovodrun([SCRIPT, "--steps", "1", "--mismatch"], 2, timeout=240)
    message = str(err.value)
    assert "timed out" not in message
    assert "different feature set or specs" in message and "specs differ for ['a']" in message
