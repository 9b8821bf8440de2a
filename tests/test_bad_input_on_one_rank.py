"""Issue 19, part 4: an ID out of a static table's range in ONE rank's batch makes every
rank fail the same step with an error naming the feature, the bad ID and that rank (the
report travels in the key exchange, no extra collective), not only the bad rank while the
others wait in the exchange until Horovod shuts down with its generic message."""
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tf_fusedemb.testing import DistributedTestCase

BAD_ID = 777


def _features():
    from tf_fusedemb.specs import FeatureSpec, OptimizerSpec, TableSpec
    opt = OptimizerSpec.sgd(0.1)
    return [FeatureSpec("a", TableSpec("a", 4, opt)),
            FeatureSpec("s", TableSpec("s", 4, opt, vocabulary_size=50)),
            FeatureSpec("t", TableSpec("t", 4, opt, vocabulary_size=30))]


def _model():
    from tf_fusedemb.layers import FusedEmbedding
    from tf_fusedemb.models import FusedModel
    features = _features()
    inputs = {f.name: tf_keras.Input([], dtype=tf.int64, name=f.name) for f in features}
    out = FusedEmbedding(features, name="emb")(inputs)
    x = tf_keras.layers.Concatenate(name="cat")([out[f.name] for f in features])
    model = FusedModel(inputs, tf_keras.layers.Dense(1, name="head")(x), name="m")
    model.compile(tf_keras.optimizers.SGD(0.1), "mse")
    return model


def _batch(rank, bad_rank):
    """Rank ``bad_rank``'s 's' holds BAD_ID at position 5 (after good IDs)."""
    x = {"a": np.arange(8, dtype=np.int64) + 100 * rank,
         "s": np.arange(8, dtype=np.int64) + rank, "t": np.arange(8, dtype=np.int64)}
    if rank == bad_rank:
        x["s"][5] = BAD_ID
    return x, np.ones((8, 1), np.float32)


def _fit_with_bad_input_on(bad_rank):
    """Every rank fits one step; returns the error each rank saw (None: it trained)."""
    from tf_fusedemb.comm import get_communicator
    comm = get_communicator()
    model = _model()
    x, y = _batch(comm.rank, bad_rank)
    try:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    except tf.errors.InvalidArgumentError as e:
        return "InvalidArgumentError: " + str(e).replace("\\'", "'")
    return None


def _lookup_with_bad_input_on(bad_rank):
    """The layer called directly (eager) on 2 x 2 ranks with the hierarchical exchange."""
    from tf_fusedemb.comm import get_communicator
    from tf_fusedemb.layers import FusedEmbedding
    comm = get_communicator()
    layer = FusedEmbedding(_features(), exchange="hierarchical")
    x, _ = _batch(comm.rank, bad_rank)
    kinds = sorted({g.exchange.kind for g in layer.groups})
    try:
        layer({k: tf.constant(v) for k, v in x.items()})
    except tf.errors.InvalidArgumentError as e:
        return kinds, "InvalidArgumentError: " + str(e).replace("\\'", "'")
    return kinds, None


def _expected(bad_rank, size):
    return (f"feature 's': ID {BAD_ID} is out of range [0, 50) of its static table (in the "
            f"input of rank {bad_rank} of {size}; group 'g1_d4_sgd')")


class BadInputOnOneRankTest(DistributedTestCase):

    @pytest.mark.timeout(400)
    def test_every_rank_names_the_bad_id_of_rank_one(self):
        errors = self.run_ranks(_fit_with_bad_input_on, 2, (1,), timeout=300)
        for rank, error in enumerate(errors):
            self.assertIsNotNone(error, f"rank {rank} trained")
            self.assertIn(_expected(1, 2), error, f"rank {rank}")
            self.assertNotIn("Horovod has been shut down", error)

    @pytest.mark.timeout(400)
    def test_the_hierarchical_exchange_passes_the_report_to_every_rank(self):
        results = self.run_ranks(_lookup_with_bad_input_on, 4, (3,), timeout=300,
                                 env={"TF_FUSEDEMB_TOPOLOGY": "2x2"})
        for rank, (kinds, error) in enumerate(results):
            self.assertEqual(kinds, ["hierarchical"])
            self.assertIsNotNone(error, f"rank {rank} looked its keys up")
            self.assertIn(_expected(3, 4), error, f"rank {rank}")
