"""Sharded push-based inference (tf_fusedemb/inference/distributed.py) with the BLS
alltoallv equals the single-host SavedModel (inference/export.py) to 1e-6.

Reference: one process trains rows (some tables never trained), writes a checkpoint and
exports the core-TF SavedModel, whose predictions of the batches are the reference. Then
``mpirun -np N`` ranks each restore their share of the same checkpoint and predict the
same batches for k in {0, 1, 2, 4}; N in {1, 2, 3}; DLRM (one-hot + mean-pooled multi-hot)
and the sequence model (a sequence feature sharing its table with the target); uneven
batches (one of 1 sample: ranks without samples), samples with no IDs. Each rank holds
about 1/N of the checkpoint's rows, and all of them together hold each row once.
"""
import json

import numpy as np
import pytest

from conftest import REPO_ROOT
from tf_fusedemb.comm import mpirun

pytestmark = pytest.mark.skipif(mpirun.unavailable_reason() is not None,
                                reason=str(mpirun.unavailable_reason()))

LAGS = [0, 1, 2, 4]
WORKER = str(REPO_ROOT / "tests" / "distributed_inference_worker.py")
ENV = {"PYTHONPATH": f"{REPO_ROOT}:{REPO_ROOT / 'tests'}"}


KINDS = ("dlrm", "sequence")


def _reference(kind, root):
    """(checkpoint dir, reference logits float32[sum B], stored rows) of one model."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import distributed_inference_models as dm  # pylint: disable=import-outside-toplevel
    from tf_fusedemb.inference.distributed import stored_rows  # pylint: disable=import-outside-toplevel
    from tf_fusedemb.inference.export import export_saved_model  # pylint: disable=import-outside-toplevel
    from tf_fusedemb.training.checkpoint import CheckpointManager  # pylint: disable=import-outside-toplevel
    model = dm.build_model(kind)
    dm.train_rows(model, kind)
    total = stored_rows(model)
    CheckpointManager(str(root / "ckpt"), model).save(1)
    export_saved_model(model, str(root / "export"), dm.KINDS[kind], dense_features=dm.DENSE[kind])
    serve = tf.saved_model.load(str(root / "export")).signatures["serving_default"]
    logits = np.concatenate([serve(**dm.serving_inputs(kind, b))["logits"].numpy().ravel()
                             for b in dm.batches(kind)])
    return str(root / "ckpt"), logits, total


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """{kind: (checkpoint dir, reference logits, stored rows)}, written in this process."""
    return {kind: _reference(kind, tmp_path_factory.mktemp(kind)) for kind in KINDS}


@pytest.mark.timeout(600)  # generous: 3 ranks share 2 cores (about a minute when idle)
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_sharded_inference_equals_single_host_savedmodel(references, ranks, tmp_path):
    import distributed_inference_models as dm  # pylint: disable=import-outside-toplevel
    from tf_fusedemb.ops.hashing import owner_rank  # pylint: disable=import-outside-toplevel
    argv = [WORKER, json.dumps(LAGS)]
    for kind in KINDS:
        argv += [kind, references[kind][0], str(tmp_path / f"{kind}.npz")]
    proc = mpirun.run_mpirun(ranks, argv, timeout=540, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for kind in KINDS:
        _, want, total_rows = references[kind]
        got = np.load(tmp_path / f"{kind}.npz")
        for lag in LAGS:
            pred = got[f"lag{lag}"]
            assert pred.shape == want.shape, (kind, lag, pred.shape, want.shape)
            np.testing.assert_allclose(pred, want, rtol=0, atol=1e-6,
                                       err_msg=f"{kind} k={lag} N={ranks}")
        # Memory: rank r holds exactly the trained rows whose ID it owns (2 trained
        # tables of IDs 0..TRAINED_IDS-1), about 1/N of them; together every row once.
        owners = owner_rank(np.arange(dm.TRAINED_IDS), ranks)
        expected = [2 * int((owners == r).sum()) for r in range(ranks)]
        assert got["rows"].tolist() == expected and sum(expected) == total_rows, kind
