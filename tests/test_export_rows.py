"""SavedModel export's rows: keys and rows are variables (the graph's size does not depend
on the table's), served bit for bit in float32, within the code's bound in bfloat16 and
int8, and looked up for any int64 key. References: numpy (the loaded rows, their
rounding) and the model itself."""
import os

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tf_fusedemb.inference import export_saved_model, export_writer
from tf_fusedemb.inference.key_index import (PAD_KEY, KeyIndex, pad_segment, segment_width,
                                             sorted_rows)
from tf_fusedemb.layers import FusedEmbedding
from tf_fusedemb.ops import hashing
from tf_fusedemb.specs import FeatureSpec, OptimizerSpec, TableSpec

DIM = 16
KINDS = {"u": "scalar", "i": "scalar"}


def table_model(num_rows: int, seed: int = 0):
    """A model whose outputs are the rows of two tables of ``num_rows`` known rows each
    (loaded as a Keras Embedding's weights would be); returns (model, {table: rows})."""
    tf_keras.backend.clear_session()  # the same layer names whatever was built before
    opt = OptimizerSpec.sgd(0.1)
    layer = FusedEmbedding([FeatureSpec("u", TableSpec("u", DIM, opt)),
                            FeatureSpec("i", TableSpec("i", DIM, opt))], name="emb")
    inputs = {n: tf_keras.Input([], dtype=tf.int64, name=n) for n in KINDS}
    emb = layer(inputs)
    model = tf_keras.Model(inputs, {"u_row": emb["u"], "i_row": emb["i"]}, name="rows")
    rng = np.random.default_rng(seed)
    weights = {n: rng.normal(0, 0.5, (num_rows, DIM)).astype(np.float32) for n in KINDS}
    layer.set_embedding_weights(weights)
    return model, weights


def queries(num_rows: int, seed: int = 1):
    """Known IDs (sampled) followed by IDs never stored (>= num_rows, and negative)."""
    rng = np.random.default_rng(seed)
    known = rng.integers(0, num_rows, 200)
    unseen = np.concatenate([rng.integers(num_rows, 2**62, 50), [-1, -(2**63)]])
    return {n: np.concatenate([known, unseen]).astype(np.int64) for n in KINDS}, len(known)


def serve(export_dir, x):
    served = tf.saved_model.load(export_dir).signatures["serving_default"](
        **{n: tf.constant(v) for n, v in x.items()})
    return {n: served[n + "_row"].numpy() for n in KINDS}


def directory_bytes(path):
    return sum(os.path.getsize(os.path.join(root, f))
               for root, _, files in os.walk(path) for f in files)


@pytest.mark.timeout(600)
def test_graph_size_does_not_depend_on_the_table_and_float32_rows_are_exact(tmp_path):
    pb = {}
    for num_rows in (300, 30_000):
        model, weights = table_model(num_rows)
        x, known = queries(num_rows)
        trained = {n: v.numpy() for n, v in model(x, training=False).items()}
        export_dir = export_saved_model(model, str(tmp_path / f"m{num_rows}"), KINDS)
        pb[num_rows] = os.path.getsize(os.path.join(export_dir, "saved_model.pb"))
        served = serve(export_dir, x)
        for n in KINDS:
            np.testing.assert_array_equal(served[n][:known], weights[n][x[n][:known]])
            # Never stored: the deterministic initial row, as the model reads it.
            np.testing.assert_array_equal(served[n], trained[n + "_row"])
    assert abs(pb[30_000] - pb[300]) <= 0.01 * pb[300], pb


@pytest.mark.timeout(600)
def test_bfloat16_and_int8_rows_within_their_bounds(tmp_path):
    num_rows = 5000
    model, weights = table_model(num_rows)
    x, known = queries(num_rows)
    served, sizes = {}, {}
    for row_dtype in ("float32", "bfloat16", "int8"):
        export_dir = export_saved_model(model, str(tmp_path / row_dtype), KINDS,
                                        row_dtype=row_dtype)
        served[row_dtype] = serve(export_dir, x)
        sizes[row_dtype] = directory_bytes(os.path.join(export_dir, "variables"))
    for n in KINDS:
        want = weights[n][x[n][:known]]
        exact = served["float32"][n]
        np.testing.assert_array_equal(exact[:known], want)
        # bfloat16: rounded to nearest, as TF casts.
        np.testing.assert_array_equal(served["bfloat16"][n][:known],
                                      tf.cast(tf.cast(want, tf.bfloat16), tf.float32).numpy())
        # int8: within half a step of the row's scale, max|row| / 127.
        bound = np.abs(want).max(axis=1, keepdims=True) / 127 / 2 * (1 + 1e-6)
        assert (np.abs(served["int8"][n][:known] - want) <= bound).all()
        for row_dtype in ("bfloat16", "int8"):  # never stored: the exact initial rows
            np.testing.assert_array_equal(served[row_dtype][n][known:], exact[known:])
    # Per stored row (dim 16): float32 64 bytes + key 8; bfloat16 32 + 8; int8 16 + 4 + 8.
    assert sizes["bfloat16"] < 0.6 * sizes["float32"], sizes
    assert sizes["int8"] < 0.42 * sizes["float32"], sizes


@pytest.mark.parametrize("num_segments", [1, 3])
def test_key_index_finds_every_int64_key(num_segments):
    """Keys at both ends of int64 (the pad key itself among them), in any segment; keys
    absent are not found. Reference: a numpy dict."""
    rng = np.random.default_rng(0)
    keys = np.unique(np.concatenate([rng.integers(-2**63, 2**63 - 1, 500, dtype=np.int64),
                                     [PAD_KEY, PAD_KEY - 1, -(2**63), 0, -1]]))
    ids = rng.integers(-2**63, 2**63 - 1, len(keys), dtype=np.int64)
    values = rng.normal(size=(len(keys), 3)).astype(np.float32)
    owner = hashing.owner_rank(ids, num_segments)
    width = segment_width([int((owner == r).sum()) for r in range(num_segments)])
    index = KeyIndex([pad_segment(*sorted_rows(keys[owner == r], values[owner == r]),
                                  "float32", width) for r in range(num_segments)], 3, "float32")
    absent = np.array([1, 2, PAD_KEY - 2], np.int64)
    absent = absent[~np.isin(absent, keys)]
    q_ids = np.concatenate([ids, ids[:len(absent)]])
    found, rows = index.lookup(tf.constant(q_ids), tf.constant(np.concatenate([keys, absent])))
    np.testing.assert_array_equal(found.numpy(), np.arange(len(q_ids)) < len(keys))
    np.testing.assert_array_equal(rows.numpy()[:len(keys)], values)
    assert not rows.numpy()[len(keys):].any()


@pytest.mark.timeout(600)
def test_rows_written_in_chunks_equal_rows_written_at_once(tmp_path, monkeypatch):
    """A rank reads and writes its rows a chunk at a time: with chunks of 7 rows (the last
    one partly padding) the export serves and stores exactly what one chunk does."""
    model, _ = table_model(100)
    x, _ = queries(100)
    whole = export_saved_model(model, str(tmp_path / "whole"), KINDS, row_dtype="int8")
    monkeypatch.setattr(export_writer, "CHUNK_ROWS", 7)
    chunked = export_saved_model(model, str(tmp_path / "chunked"), KINDS, row_dtype="int8")
    a, b = serve(whole, x), serve(chunked, x)
    for n in KINDS:
        np.testing.assert_array_equal(a[n], b[n])
    readers = [tf.train.load_checkpoint(os.path.join(p, "variables", "variables"))
               for p in (whole, chunked)]
    names = [n for n in readers[0].get_variable_to_shape_map() if "/index/" in n]
    assert len(names) == 4  # keys, lengths, rows, scales of the one fused group
    for name in names:
        np.testing.assert_array_equal(readers[0].get_tensor(name), readers[1].get_tensor(name))
