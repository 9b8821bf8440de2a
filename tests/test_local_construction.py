"""Issue 19, part 2: no collective in a constructor. A FusedEmbedding (and a model holding
one) is built, configured, rebuilt from its config and cloned on ONE rank of a running
job without waiting for the others; the ranks compare their plans and exchange choices at
the first call they make together, where a difference still fails on every rank naming
the feature or the group."""
import os
import time

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tf_fusedemb.testing import DistributedTestCase

LOCAL_LIMIT_S = 60  # what rank 1 alone may take to build, round-trip and clone (it is ~2 s)


def _features(dim_a=4):
    from tf_fusedemb.specs import FeatureSpec, OptimizerSpec, TableSpec
    opt = OptimizerSpec.sgd(0.1)
    return [FeatureSpec("a", TableSpec("a", dim_a, opt)),
            FeatureSpec("b", TableSpec("b", 4, opt)),
            FeatureSpec("s", TableSpec("s", 4, opt, vocabulary_size=50))]


def _model(features):
    """A functional FusedModel; every layer named, so every rank traces the same op names
    whatever else it built before."""
    from tf_fusedemb.layers import FusedEmbedding
    from tf_fusedemb.models import FusedModel
    inputs = {f.name: tf_keras.Input([], dtype=tf.int64, name=f.name) for f in features}
    out = FusedEmbedding(features, name="emb")(inputs)
    x = tf_keras.layers.Concatenate(name="cat")([out[f.name] for f in features])
    return FusedModel(inputs, tf_keras.layers.Dense(1, name="head")(x), name="m")


def _batch(rank):
    rng = np.random.default_rng(rank)
    x = {name: rng.integers(0, 50, 8).astype(np.int64) for name in ("a", "b", "s")}
    return x, rng.normal(size=(8, 1)).astype(np.float32)


def _fit_error(model, rank):
    """The message of the error of the first ``fit`` step, or None when it trained."""
    model.compile(tf_keras.optimizers.SGD(0.1), "mse")
    x, y = _batch(rank)
    try:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    except Exception as e:  # pylint: disable=broad-except  (the message is the result)
        return f"{type(e).__name__}: {e}"
    return None


def _rank_one_alone(work):
    """Rank 1 builds, round-trips and clones while rank 0 makes no collective call (it
    waits for rank 1's file): any collective on rank 1's path would hang it. Then both
    ranks train a model whose feature 'a' differs (fails on both), then agreeing models
    (rank 1 trains its clone)."""
    from tf_fusedemb.comm import get_communicator
    from tf_fusedemb.layers import FusedEmbedding
    comm = get_communicator()  # hvd.init: every rank
    result = {"rank": comm.rank}
    done = os.path.join(work, "rank1_alone_done")
    clone = None
    if comm.rank == 1:
        begin = time.monotonic()
        model = _model(_features())
        layer = model.get_layer("emb")
        config = layer.get_config()
        again = FusedEmbedding.from_config(config)
        result["config_round_trip"] = again.get_config() == config
        rebuilt = tf_keras.models.model_from_json(model.to_json())
        result["rebuilt_features"] = [f.name for f in rebuilt.get_layer("emb").features]
        clone = tf_keras.models.clone_model(model)
        result["clone_features"] = [f.name for f in clone.get_layer("emb").features]
        result["local_s"] = time.monotonic() - begin
        with open(done, "w"):
            pass
    else:
        deadline = time.monotonic() + LOCAL_LIMIT_S
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.1)
        result["rank1_finished_alone"] = os.path.exists(done)
        if not result["rank1_finished_alone"]:
            return result  # rank 1 is stuck in a collective: the job fails or times out
    result["mismatch"] = _fit_error(_model(_features(6 if comm.rank == 1 else 4)), comm.rank)
    result["agreed"] = _fit_error(clone if clone is not None else _model(_features()),
                                  comm.rank)
    return result


def _different_exchanges():
    """4 ranks as 2 nodes x 2: rank 2 asks for the flat exchange, the others for the
    hierarchical one; the layers are built without a collective, the first call fails."""
    from tf_fusedemb.comm import get_communicator
    from tf_fusedemb.layers import FusedEmbedding
    comm = get_communicator()
    layer = FusedEmbedding(_features()[:2], exchange="flat" if comm.rank == 2 else "hierarchical")
    kinds = sorted({g.exchange.kind for g in layer.groups})
    try:
        layer({"a": tf.constant([1, 2], tf.int64), "b": tf.constant([3], tf.int64)})
    except ValueError as e:
        return kinds, str(e)
    return kinds, None


class LocalConstructionTest(DistributedTestCase):

    @pytest.mark.timeout(400)
    def test_rank_one_alone_builds_and_clones_and_the_first_step_compares(self):
        ranks = self.run_ranks(_rank_one_alone, 2, (self.get_temp_dir(),), timeout=300)
        zero, one = ranks
        self.assertTrue(zero["rank1_finished_alone"], zero)
        self.assertLess(one["local_s"], LOCAL_LIMIT_S)
        self.assertTrue(one["config_round_trip"])
        self.assertEqual(one["rebuilt_features"], ["a", "b", "s"])
        self.assertEqual(one["clone_features"], ["a", "b", "s"])
        for rank, got in enumerate(ranks):
            # Each rank's own message: the other rank's feature 'a' differs (dim 6 vs 4).
            self.assertIsNotNone(got["mismatch"], f"rank {rank} trained a mismatched model")
            self.assertIn(f"rank {1 - rank} has a different feature set or specs than rank "
                          f"{rank}", got["mismatch"])
            self.assertIn("specs differ for ['a']", got["mismatch"])
            self.assertIsNone(got["agreed"], f"rank {rank}")

    @pytest.mark.timeout(400)
    def test_ranks_choosing_different_exchanges_fail_naming_the_group(self):
        ranks = self.run_ranks(_different_exchanges, 4, timeout=300,
                               env={"TF_FUSEDEMB_TOPOLOGY": "2x2"})
        for rank, (kinds, error) in enumerate(ranks):
            self.assertEqual(kinds, ["flat"] if rank == 2 else ["hierarchical"])
            self.assertIsNotNone(error, f"rank {rank} ran the lookup")
            self.assertIn("group 'g0_d4_sgd': the ranks chose different exchanges (rank 0: "
                          "hierarchical, rank 1: hierarchical, rank 2: flat, rank 3: "
                          "hierarchical", error)
