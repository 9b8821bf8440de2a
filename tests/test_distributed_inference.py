"""Sharded push-based inference (tf_fusedemb/inference/distributed.py) with the BLS
alltoallv equals the single-host SavedModel (inference/export.py) to 1e-6.

Reference: one process trains rows (some tables never trained), writes a checkpoint and
exports the core-TF SavedModel, whose predictions of the batches are the reference. Then
``mpirun -np N`` ranks each restore their share of the same checkpoint and predict the
same batches for k in {0, 1, 2, 4}; N in {1, 2, 3}; DLRM (one-hot + mean-pooled multi-hot)
and the sequence model (a sequence feature sharing its table with the target); uneven
batches (one of 1 sample: ranks without samples), samples with no IDs. Each rank holds
about 1/N of the checkpoint's rows, and all of them together hold each row once. On 2
and 3 ranks also: a DLRM over static-vocabulary tables, whose ranks each allocate only
their own ~1/N of the vocabulary's rows (not every row), and the sequence model fed
tf.SparseTensor list features.

In process, with a one-rank loopback exchange: SparseTensor inputs; an over-long
sequence is refused naming the feature, its length and max_len; a model whose static
tables were not built for the predictor's rank is refused.
"""
import json

import numpy as np
import pytest
import tensorflow as tf

from conftest import REPO_ROOT
from tf_fusedemb.testing import mpirun

pytestmark = pytest.mark.skipif(mpirun.unavailable_reason() is not None,
                                reason=str(mpirun.unavailable_reason()))

LAGS = [0, 1, 2, 4]
WORKER = str(REPO_ROOT / "tests" / "distributed_inference_worker.py")
ENV = {"PYTHONPATH": f"{REPO_ROOT}:{REPO_ROOT / 'tests'}"}


KINDS = ("dlrm", "static", "sequence")
SHARDED_ONLY = ("static", "sequence+sparse")  # run on N >= 2 only (N = 1 shards nothing)


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
    if kind == "static":  # one process allocates every row of the vocabulary
        from tf_fusedemb.inference.distributed import resident_rows  # pylint: disable=import-outside-toplevel
        assert resident_rows(model) == dm.STATIC_TABLES * dm.VOCAB
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
    kinds = [k for k in KINDS if ranks > 1 or k not in SHARDED_ONLY]
    kinds += [k for k in SHARDED_ONLY if ranks > 1 and k not in kinds]
    argv = [WORKER, json.dumps(LAGS)]
    for kind in kinds:
        argv += [kind, references[dm.model_kind(kind)][0], str(tmp_path / f"{kind}.npz")]
    proc = mpirun.run_mpirun(ranks, argv, timeout=540, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for kind in kinds:
        _, want, total_rows = references[dm.model_kind(kind)]
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
        if dm.model_kind(kind) == "static":
            # Allocated rows: each rank only the vocabulary IDs it owns in every table
            # (about 1/N of them), all ranks together each row once.
            vocab_owners = owner_rank(np.arange(dm.VOCAB), ranks)
            allocated = [dm.STATIC_TABLES * int((vocab_owners == r).sum()) for r in range(ranks)]
            assert got["resident"].tolist() == allocated, (kind, got["resident"], allocated)
            assert sum(allocated) == dm.STATIC_TABLES * dm.VOCAB
            assert max(allocated) < dm.STATIC_TABLES * dm.VOCAB * (1.5 / ranks), allocated


class Loopback:
    """The exchange of one rank: ``finish(j)`` returns what ``start(j)`` sent."""

    def __init__(self):
        self.sent = {}

    def start(self, j, sends):
        assert len(sends) == 1
        self.sent[j] = list(sends)

    def finish(self, j):
        return self.sent.pop(j)


def _one_rank_predictor(kind, checkpoint_dir):
    import distributed_inference_models as dm  # pylint: disable=import-outside-toplevel
    from tf_fusedemb.inference.distributed import (ShardedPredictor, for_rank,  # pylint: disable=import-outside-toplevel
                                                   restore_shard)
    with for_rank(0, 1):
        model = dm.build_model(kind)
    restore_shard(model, checkpoint_dir, 0, 1)
    predictor = ShardedPredictor(model, 0, 1, Loopback())
    predictor.capacity_bytes(max(dm.BATCH_SIZES))
    return predictor


@pytest.mark.timeout(300)
def test_sparse_inputs_equal_single_host_savedmodel(references):
    import distributed_inference_models as dm  # pylint: disable=import-outside-toplevel
    from tf_fusedemb.inference.distributed import run_bounded_lag  # pylint: disable=import-outside-toplevel
    ckpt, want, _ = references["sequence"]
    predictor = _one_rank_predictor("sequence", ckpt)
    batches = dm.batches("sequence+sparse")
    assert isinstance(batches[0]["history"], tf.SparseTensor)
    got = dict(run_bounded_lag(predictor, batches, 1))
    np.testing.assert_allclose(np.concatenate([got[j] for j in range(len(batches))]), want,
                               rtol=0, atol=1e-6)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("form", ["ragged", "sparse", "dense"])
def test_over_long_sequence_names_feature_length_and_limit(references, form):
    import distributed_inference_models as dm  # pylint: disable=import-outside-toplevel
    predictor = _one_rank_predictor("sequence", references["sequence"][0])
    batch = dict(dm.batches("sequence")[0])
    too_long = dm.HISTORY_LEN + 2
    history = tf.RaggedTensor.from_row_lengths(
        tf.range(too_long + 1, dtype=tf.int64), tf.constant([1, too_long] + [0] * 7, tf.int64))
    if form == "sparse":
        history = history.to_sparse()
    elif form == "dense":  # every sample padded to the long length
        history = history.to_tensor()
    batch["history"] = history
    with pytest.raises(ValueError, match=rf"feature 'history'.* {too_long} IDs.*"
                                         rf"max_len={dm.HISTORY_LEN}"):
        predictor.push(0, batch)


@pytest.mark.timeout(300)
def test_static_tables_not_built_for_the_rank_are_refused():
    import distributed_inference_models as dm  # pylint: disable=import-outside-toplevel
    from tf_fusedemb.inference.distributed import ShardedPredictor, check_sharded, for_rank  # pylint: disable=import-outside-toplevel
    model = dm.build_model("static")  # one process: every row of the vocabulary
    with pytest.raises(ValueError, match=r"static group .* built for rank 0 of 1.*for_rank\(1, 2\)"):
        ShardedPredictor(model, 1, 2, Loopback())
    with for_rank(1, 2):
        model = dm.build_model("static")
    check_sharded(model, 1, 2)  # built for rank 1 of 2: accepted
