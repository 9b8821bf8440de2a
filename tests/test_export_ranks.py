"""SavedModel export from every rank of a 2-rank job (each rank writes its own rows, a
tiered table among them) equals the one-process export of the same model, restored from
the job's checkpoint: the same predictions bit for bit and the same rows key by key."""
import os

import numpy as np
import tensorflow as tf
import tf_keras

from tf_fusedemb.comm import get_communicator
from tf_fusedemb.inference import export_saved_model
from tf_fusedemb.layers import FusedEmbedding
from tf_fusedemb.specs import FeatureSpec, OptimizerSpec, TableSpec
from tf_fusedemb.testing.distributed import DistributedTestCase
from tf_fusedemb.training.checkpoint import CheckpointManager

DIM, ROWS = 4, 3000
KINDS = {"u": "scalar", "i": "scalar"}


def build_model():
    """Two groups, one tiered (a budget far below its rows: most live in the SSD tier),
    their rows loaded from a seeded matrix, a seeded dense head."""
    tf_keras.backend.clear_session()
    opt = OptimizerSpec.adagrad(0.1)
    layer = FusedEmbedding([FeatureSpec("u", TableSpec("u", DIM, opt)),
                            FeatureSpec("i", TableSpec("i", DIM, opt, memory_budget_bytes=8192))],
                           name="emb")
    inputs = {n: tf_keras.Input([], dtype=tf.int64, name=n) for n in KINDS}
    emb = layer(inputs)
    head = tf_keras.layers.Dense(1, kernel_initializer=tf_keras.initializers.GlorotUniform(1))
    model = tf_keras.Model(inputs, head(tf_keras.layers.Concatenate()([emb["u"], emb["i"]])),
                           name="ranked")
    rng = np.random.default_rng(0)
    layer.set_embedding_weights({n: rng.normal(0, 0.3, (ROWS, DIM)).astype(np.float32)
                                 for n in KINDS})
    return model, layer


def export_on_every_rank(checkpoint_dir, export_dir, unshared_root):
    """One rank: save a checkpoint and export; then export to a directory of its own (as
    if the ranks did not share it). Returns (SSD bytes of the tiered group, the error)."""
    rank = get_communicator().rank
    model, layer = build_model()
    CheckpointManager(checkpoint_dir, model).save(1)
    export_saved_model(model, export_dir, KINDS)
    export_saved_model(model, export_dir + "-int8", KINDS, row_dtype="int8")
    try:
        export_saved_model(model, os.path.join(unshared_root, f"rank{rank}", "m"), KINDS)
        error = None
    except ValueError as e:
        error = str(e)
    return sum(m["ssd_bytes"] for m in layer.memory().values()), error


def stored_rows(export_dir):
    """{(group, key): row (and its int8 scale)} of an export's index variables."""
    reader = tf.train.load_checkpoint(os.path.join(export_dir, "variables", "variables"))
    out, g = {}, 0
    while reader.has_tensor(f"serving_groups_/{g}/index/keys/.ATTRIBUTES/VARIABLE_VALUE"):
        def var(name):
            return reader.get_tensor(f"serving_groups_/{g}/index/{name}/.ATTRIBUTES/VARIABLE_VALUE")
        keys, lengths, rows = var("keys"), var("lengths"), var("rows")
        scales = var("scales") if reader.has_tensor(
            f"serving_groups_/{g}/index/scales/.ATTRIBUTES/VARIABLE_VALUE") else 0 * keys
        for s, length in enumerate(lengths):
            out.update({(g, int(k)): (r.tolist(), float(c)) for k, r, c in zip(
                keys[s, :length], rows[s, :length], scales[s, :length])})
        g += 1
    return out


class ExportFromRanksTest(DistributedTestCase):
    timeout = 420

    def test_two_rank_export_equals_the_one_process_export(self):
        work = self.get_temp_dir()
        ckpt, ranked, unshared = (os.path.join(work, d) for d in ("ckpt", "ranked", "unshared"))
        results = self.run_ranks(export_on_every_rank, 2, (ckpt, ranked, unshared))
        self.assertGreater(results[0][0] + results[1][0], 0)  # the tiered group spilled
        for _, error in results:  # an unshared directory fails on every rank, in one line
            self.assertIn("1 of 2 ranks do not see rank 0's", error)
            self.assertNotIn("\n", error)

        model, _ = build_model()
        CheckpointManager(ckpt, model).restore()
        one = export_saved_model(model, os.path.join(work, "one"), KINDS)
        one_int8 = export_saved_model(model, os.path.join(work, "one-int8"), KINDS,
                                      row_dtype="int8")
        rng = np.random.default_rng(1)
        x = {n: np.concatenate([rng.integers(0, ROWS, 300), rng.integers(ROWS, 10**9, 30)])
             for n in KINDS}
        want = model(x, training=False).numpy()
        served = [tf.saved_model.load(path).signatures["serving_default"](
            **{n: tf.constant(v) for n, v in x.items()})["logits"].numpy() for path in (one, ranked)]
        # The two exports are one graph: bit-equal. The eager model may round its Dense
        # differently from the graph's fused MatMul+BiasAdd (CPU-dependent): 1e-6.
        self.assertAllEqual(served[1], served[0])
        for logits in served:
            self.assertAllClose(logits, want, rtol=1e-6, atol=1e-7)
        for path_one, path_ranked in ((one, ranked), (one_int8, ranked + "-int8")):
            rows_one, rows_ranked = stored_rows(path_one), stored_rows(path_ranked)
            self.assertLen(rows_one, 2 * ROWS)
            self.assertEqual(rows_ranked, rows_one)
