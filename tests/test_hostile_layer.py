"""Hostile input for FusedEmbedding (one process): property tests (hypothesis).

Random dense, ragged and sparse inputs (empty samples, all-duplicate IDs, int64 extremes,
negative IDs, SparseTensors in any index order) must give exactly the rows a plain
per-feature reference gives (the deterministic initial row of each (table, ID)); hostile
inputs (wrong dtypes or ranks, IDs out of a static table, over-long sequences, broken
SparseTensors, missing or unknown features) must raise an error naming the feature. Also:
the feature-set check across ranks (with a fake 2-rank communicator) and NaN/inf dense
features of a model (DLRM).
"""
import re

import numpy as np
import pytest
import tensorflow as tf

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tf_fusedemb.comm.communicator import LocalCommunicator  # noqa: E402
from tf_fusedemb.layers import FusedEmbedding  # noqa: E402
from tf_fusedemb.ops import hashing  # noqa: E402
from tf_fusedemb.specs import FeatureSpec, InitializerSpec, OptimizerSpec, TableSpec  # noqa: E402
from tf_fusedemb.storage.initializers import init_rows_np  # noqa: E402

OPT = OptimizerSpec.adagrad(0.1)
INIT = InitializerSpec.uniform(-0.1, 0.1)
VOCAB = 50
I64, I32 = np.iinfo(np.int64), np.iinfo(np.int32)

T_ONE = TableSpec("t_one", 4, OPT, INIT)
T_MULTI = TableSpec("t_multi", 4, OPT, INIT)  # read by "multi" and "shared"
T_STATIC = TableSpec("t_static", 4, OPT, INIT, vocabulary_size=VOCAB)
T_SEQ = TableSpec("t_seq", 4, OPT, INIT)
T_I32 = TableSpec("t_i32", 4, OPT, INIT, key_dtype="int32")
T_WIDE = TableSpec("t_wide", 8, OPT, INIT)
FEATURES = [
    FeatureSpec("one", T_ONE, "sum"),
    FeatureSpec("multi", T_MULTI, "mean"),
    FeatureSpec("shared", T_MULTI, "sqrtn"),
    FeatureSpec("static", T_STATIC, "sum"),
    FeatureSpec("seq", T_SEQ, None, max_len=4),
    FeatureSpec("i32", T_I32, "mean"),
    FeatureSpec("wide", T_WIDE, "sqrtn"),
]
SPECS = {f.name: f for f in FEATURES}
LAYER = FusedEmbedding(FEATURES, name="hostile")
RAGGED_SIGNATURE = {f.name: tf.RaggedTensorSpec([None, None], tf.int64, ragged_rank=1)
                    for f in FEATURES}
LAYER_FN = tf.function(LAYER, input_signature=[RAGGED_SIGNATURE])
ERRORS = (tf.errors.InvalidArgumentError, ValueError)


# ------------------------------------------------------------------------------ reference
def reference(spec, samples, dense_length=None):
    """What one ordinary table per feature gives: pooled [B, dim] or sequence [B, L, dim]."""
    dim = spec.dim
    out = []
    for ids in samples:
        keys = hashing.hashed_unified_keys(np.array(ids, np.int64), [spec.table.name] * len(ids))
        rows = init_rows_np(keys, dim, INIT).astype(np.float64)
        if spec.is_sequence:
            length = spec.max_len if dense_length is None else dense_length
            padded = np.zeros((length, dim))
            padded[:len(ids)] = rows
            out.append(padded)
        elif not ids:
            out.append(np.zeros(dim))
        else:
            scale = {"sum": 1.0, "mean": 1.0 / len(ids), "sqrtn": 1.0 / np.sqrt(len(ids))}
            out.append(rows.sum(0) * scale[spec.combiner])
    if spec.is_sequence:
        length = spec.max_len if dense_length is None else dense_length
        return np.array(out).reshape(len(samples), length, dim)
    return np.array(out).reshape(len(samples), dim)


# ----------------------------------------------------------------------------- strategies
def id_values(spec, dtype):
    if spec.table.is_static:
        return st.one_of(st.integers(0, 3), st.sampled_from([0, VOCAB - 1]),
                         st.integers(0, VOCAB - 1))
    info = I32 if (dtype == np.int32 or spec.table.key_dtype == "int32") else I64
    return st.one_of(st.integers(-3, 3), st.sampled_from([int(info.min), int(info.max), -1, 0]),
                     st.integers(int(info.min), int(info.max)))


@st.composite
def feature_input(draw, spec, batch, forms=("dense1", "dense2", "ragged", "sparse")):
    """(input value, per-sample ID lists, dense length or None) for one feature."""
    dtype = draw(st.sampled_from([np.int32, np.int64]))
    max_len = spec.max_len or 5
    form = draw(st.sampled_from(forms))
    if form == "dense2" and spec.is_sequence:
        length = draw(st.integers(0, max_len + 2))  # a dense sequence keeps its own L
    else:
        length = draw(st.integers(0, max_len))
    values = id_values(spec, dtype)
    if form == "dense1":
        samples = [[draw(values)] for _ in range(batch)]
        if spec.is_sequence:
            form = "ragged"  # [B] is one row per sample, not a sequence
    elif form == "dense2":
        samples = [draw(st.lists(values, min_size=length, max_size=length))
                   for _ in range(batch)]
    else:
        samples = [draw(st.lists(values, max_size=max_len)) for _ in range(batch)]
    samples = [[s[0]] * len(s) if s and draw(st.booleans()) else s for s in samples]  # all dups
    if form == "dense1":
        return tf.constant(np.array([s[0] for s in samples], dtype).reshape(batch)), samples, None
    if form == "dense2":
        flat = np.array([x for s in samples for x in s], dtype).reshape(batch, length)
        return tf.constant(flat), samples, length if spec.is_sequence else None
    if form == "ragged":
        flat = np.array([x for s in samples for x in s], dtype)
        splits = np.cumsum([0] + [len(s) for s in samples]).astype(
            draw(st.sampled_from([np.int32, np.int64])))
        return tf.RaggedTensor.from_row_splits(flat, splits), samples, None
    # SparseTensor [B, L]: pooled features may leave gaps between columns; any index order.
    width = max_len + (0 if spec.is_sequence else 3)
    indices, vals = [], []
    for b, s in enumerate(samples):
        cols = (list(range(len(s))) if spec.is_sequence else
                sorted(draw(st.lists(st.integers(0, width - 1), min_size=len(s),
                                     max_size=len(s), unique=True))))
        indices += [[b, c] for c in cols]
        vals += s
    order = draw(st.permutations(range(len(vals))))
    indices = np.array(indices, np.int64).reshape(-1, 2)[list(order)]
    vals = np.array(vals, dtype)[list(order)]
    return tf.SparseTensor(indices, vals, [batch, width]), samples, None


@st.composite
def layer_inputs(draw, forms=("dense1", "dense2", "ragged", "sparse"), min_batch=0):
    batch = draw(st.integers(min_batch, 4))
    inputs, want = {}, {}
    for spec in FEATURES:
        value, samples, dense_length = draw(feature_input(spec, batch, forms))
        inputs[spec.name] = value
        want[spec.name] = reference(spec, samples, dense_length)
    return inputs, want


def to_ragged64(value):
    """A ragged int64 [B, None] of the same samples (for the ragged tf.function signature)."""
    if isinstance(value, tf.SparseTensor):
        value = tf.RaggedTensor.from_sparse(tf.sparse.reorder(value))
    elif not isinstance(value, tf.RaggedTensor):
        value = tf.convert_to_tensor(value)
        value = tf.RaggedTensor.from_tensor(value[:, None] if value.shape.rank == 1 else value)
    return tf.cast(value, tf.int64).with_row_splits_dtype(tf.int64)


# -------------------------------------------------------------------------- equal reference
@settings(max_examples=40)
@given(layer_inputs())
def test_layer_matches_reference_for_every_input_form(case):
    inputs, want = case
    out = LAYER(inputs)
    assert set(out) == set(want)
    for name, w in want.items():
        np.testing.assert_allclose(out[name].numpy(), w, rtol=1e-5, atol=1e-6, err_msg=name)


@settings(max_examples=15)
@given(layer_inputs(forms=("ragged",)))
def test_layer_in_tf_function_with_unknown_shapes_matches_reference(case):
    inputs, want = case
    out = LAYER_FN({k: to_ragged64(v) for k, v in inputs.items()})
    for name, w in want.items():
        np.testing.assert_allclose(out[name].numpy(), w, rtol=1e-5, atol=1e-6, err_msg=name)


PACKED_FEATURES = [FeatureSpec("pa", T_ONE, "sum"), FeatureSpec("pb", T_MULTI, "mean")]
PACKED = FusedEmbedding(PACKED_FEATURES, key_mode="packed", name="packed")
PACKED_BITS = hashing.default_id_bits(2)


@settings(max_examples=20)
@given(st.data())
def test_packed_keys_match_reference_or_name_the_feature(data):
    batch = data.draw(st.integers(0, 4))
    fits = st.one_of(st.integers(0, 3), st.just((1 << PACKED_BITS) - 1))
    hostile = st.sampled_from([-1, int(I64.min), 1 << PACKED_BITS, int(I64.max)])
    inputs, want, bad = {}, {}, None
    for spec in PACKED_FEATURES:
        samples = [data.draw(st.lists(st.one_of(fits, hostile) if bad is None else fits,
                                      max_size=3)) for _ in range(batch)]
        if any(x < 0 or x >= 1 << PACKED_BITS for s in samples for x in s):
            bad = spec.name
        flat = np.array([x for s in samples for x in s], np.int64)
        inputs[spec.name] = tf.RaggedTensor.from_row_lengths(flat, [len(s) for s in samples])
        want[spec.name] = reference(spec, samples)
    if bad is not None:
        with pytest.raises(ERRORS, match=f"feature '{bad}': .*out of range .*key_mode='packed'"):
            PACKED(inputs)
        return
    out = PACKED(inputs)
    for name, w in want.items():
        np.testing.assert_allclose(out[name].numpy(), w, rtol=1e-5, atol=1e-6, err_msg=name)


# ------------------------------------------------------------------ errors name the feature
def sparse(indices, values, shape):
    return tf.SparseTensor(np.array(indices, np.int64).reshape(-1, 2), values, shape)


CORRUPTIONS = {
    # name -> (feature it applies to or None for any, make(B) -> bad value, message regex)
    "float": (None, lambda b: tf.zeros([b], tf.float32), "IDs must be int32 or int64"),
    "float64 ragged": (None, lambda b: tf.ragged.constant([[1.0]] * b, tf.float64), "IDs must"),
    "string": (None, lambda b: tf.constant(["x"] * b), "IDs must be int32 or int64"),
    "bool": (None, lambda b: tf.constant([True] * b), "IDs must be int32 or int64"),
    "uint8": (None, lambda b: tf.zeros([b], tf.uint8), "IDs must be int32 or int64"),
    "int16 numpy": (None, lambda b: np.zeros([b], np.int16), "IDs must be int32 or int64"),
    "uint64 sparse": (None, lambda b: sparse([[0, 0]], tf.constant([1], tf.uint64), [b, 1]),
                      "IDs must be int32 or int64"),
    "scalar": (None, lambda b: tf.constant(1, tf.int64), r"expected a \[B\] or \[B, L\]"),
    "rank 3": (None, lambda b: tf.zeros([b, 1, 1], tf.int64), r"expected a \[B\] or \[B, L\]"),
    "ragged rank 2": (None, lambda b: tf.RaggedTensor.from_row_lengths(
        tf.ragged.constant([[1]] * b, tf.int64), [1] * b), r"must be \[B, None\]"),
    "sparse rank 3": (None, lambda b: tf.SparseTensor([[0, 0, 0]], tf.constant([1], tf.int64),
                                                      [b, 1, 1]), r"must be \[B, L\]"),
    "sparse repeated": (None, lambda b: sparse([[0, 0], [0, 0]], tf.constant([1, 2], tf.int64),
                                               [b, 2]), "repeated index"),
    "sparse row >= B": (None, lambda b: sparse([[b, 0]], tf.constant([1], tf.int64), [b, 2]),
                        "row index >= B"),
    "sparse column >= L": (None, lambda b: sparse([[0, 2]], tf.constant([1], tf.int64), [b, 2]),
                           "column index >= L"),
    "sparse negative": (None, lambda b: sparse([[0, -1]], tf.constant([1], tf.int64), [b, 2]),
                        "negative index"),
    "sparse gap in sequence": ("seq", lambda b: sparse([[0, 1]], tf.constant([1], tf.int64),
                                                       [b, 3]), "left-aligned"),
    "None": (None, lambda b: None, "got None"),
    "2**63 in a list": (None, lambda b: [2 ** 63] * b, "cannot convert"),
    "non-rectangular list": (None, lambda b: [[1, 2], [3]] + [[1]] * (b - 2), "cannot convert"),
    "static too large": ("static", lambda b: tf.constant([VOCAB] * b, tf.int64),
                         rf"ID {VOCAB} is out of range \[0, {VOCAB}\)"),
    "static negative": ("static", lambda b: tf.constant([-1] * b, tf.int32), "ID -1 is out of"),
    "static int64 max": ("static", lambda b: tf.constant([int(I64.max)] * b),
                         f"ID {int(I64.max)} is out of range"),
    "int32 table, int64 ID": ("i32", lambda b: tf.constant([2 ** 31] * b, tf.int64),
                              f"ID {2 ** 31} is out of range .*key_dtype='int32'"),
    "int32 table, int64 min": ("i32", lambda b: tf.constant([int(I64.min)] * b),
                               "key_dtype='int32'"),
    "sequence too long": ("seq", lambda b: tf.ragged.constant([[1] * 5] * b, tf.int64),
                          "longer than max_len=4"),
}


@settings(max_examples=50)
@given(layer_inputs(min_batch=2), st.sampled_from(sorted(CORRUPTIONS)),
       st.sampled_from(sorted(SPECS)))
def test_hostile_feature_input_raises_an_error_naming_the_feature(case, corruption, name):
    """The other features are valid random input of any form; one is corrupted."""
    inputs, want = case
    batch = len(want["one"])
    target, make, message = CORRUPTIONS[corruption]
    name = target or name
    inputs = dict(inputs, **{name: make(batch)})
    with pytest.raises(ERRORS) as info:
        LAYER(inputs)
    text = message_of(info)
    assert f"feature '{name}'" in text, text[:600]
    assert re.search(message, text), (message, text[:600])


def message_of(info):
    """The error text, with graph-mode assert messages' escaped quotes undone."""
    return str(info.value).replace("\\'", "'")


def layer_inputs_of_batch(b):
    return {f.name: tf.ragged.constant([[1, 2]] * b, tf.int64) for f in FEATURES}


@pytest.mark.parametrize("corruption", ["static too large", "sequence too long",
                                        "sparse repeated", "int32 table, int64 ID"])
def test_run_time_checks_also_fire_in_tf_function(corruption):
    target, make, message = CORRUPTIONS[corruption]
    target = target or "multi"
    inputs = layer_inputs_of_batch(2)
    value = make(2)
    if corruption == "sparse repeated":
        inputs[target], fn = value, tf.function(LAYER)
    else:
        inputs[target], fn = to_ragged64(value), LAYER_FN
    with pytest.raises(ERRORS) as info:
        fn(inputs)
    assert re.search(f"feature '{target}'.*{message}", message_of(info)), message_of(info)[-800:]


@settings(max_examples=30)
@given(st.sets(st.sampled_from(sorted(SPECS))), st.sets(st.sampled_from(["zz", "extra", "One"])))
def test_missing_and_unknown_features_are_named(drop, extra):
    inputs = layer_inputs_of_batch(2)
    for name in drop:
        del inputs[name]
    for name in extra:
        inputs[name] = tf.constant([1, 2], tf.int64)
    if not drop and not extra:
        assert set(LAYER(inputs)) == set(SPECS)
        return
    with pytest.raises(ValueError) as info:
        LAYER(inputs)
    text = str(info.value)
    assert f"missing features {sorted(drop)}" in text and f"unexpected features {sorted(extra)}" \
        in text, text[:500]


@pytest.mark.parametrize("bad", [tf.constant([1, 2], tf.int64), [tf.constant([1], tf.int64)],
                                 None, 3])
def test_a_non_dict_input_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="expected a dict"):
        LAYER(bad)


def test_batch_sizes_may_differ_per_feature_and_each_equals_its_reference():
    """The layer looks features up independently: no cross-feature batch check (a model's
    own concat/interaction rejects mismatched batches)."""
    inputs = layer_inputs_of_batch(2)
    inputs["one"] = tf.constant([7, 8, 9], tf.int64)
    out = LAYER(inputs)
    np.testing.assert_allclose(out["one"], reference(SPECS["one"], [[7], [8], [9]]), rtol=1e-5)
    np.testing.assert_allclose(out["multi"], reference(SPECS["multi"], [[1, 2]] * 2), rtol=1e-5)


# --------------------------------------------------------- feature sets across (fake) ranks
class TwoRankComm(LocalCommunicator):
    """Rank 0 of a pretend 2-rank world whose rank 1 built the layer from ``other``."""
    size = 2

    def __init__(self, other_plan):
        self.other = other_plan
        self.rank = 0
        self.gathers = 0

    def allgather_object(self, obj):
        self.gathers += 1
        return [obj, dict(obj, plan=self.other)]


@pytest.mark.parametrize("change", ["drop", "add", "rename", "combiner", "dim", "order"])
def test_different_feature_sets_on_ranks_are_named(change):
    """The cross-rank check of the first call (the real 2-process case is in the
    multi-rank tests): every rank raises, naming the features that differ, instead of
    hanging; constructing the layer runs no collective."""
    mine = FEATURES[:3]
    theirs = {
        "drop": mine[:2],
        "add": mine + [FEATURES[4]],
        "rename": [FeatureSpec("renamed", T_ONE, "sum")] + mine[1:],
        "combiner": [FeatureSpec("one", T_ONE, "mean")] + mine[1:],
        "dim": [FeatureSpec("one", TableSpec("t_one", 8, OPT, INIT), "sum")] + mine[1:],
        "order": [mine[1], mine[0], mine[2]],
    }[change]
    other = FusedEmbedding(theirs).plan.to_dict()
    comm = TwoRankComm(other)
    layer = FusedEmbedding(mine, communicator=comm)
    assert comm.gathers == 0
    with pytest.raises(ValueError, match="rank 1 has a different feature set") as info:
        layer({f.name: tf.constant([1], tf.int64) for f in mine})
    text = str(info.value)
    expected = {"drop": "shared", "add": "seq", "rename": "renamed", "combiner": "one",
                "dim": "one", "order": "feature order"}[change]
    assert expected in text, text


# ------------------------------------------------------------- NaN/inf dense features (DLRM)
@settings(max_examples=15)
@given(st.integers(1, 5), st.data())
def test_nan_and_inf_dense_features_stay_in_their_samples(batch, data):
    """A NaN/inf dense feature may make only its own sample's output non-finite: the other
    samples equal the output of the same batch with finite values, and each sample equals
    the model run on that sample alone (no cross-sample leak through the lookup)."""
    model = dlrm()
    special = st.sampled_from([np.nan, np.inf, -np.inf, 3.4e38, -0.0])
    dense = np.array(data.draw(st.lists(st.one_of(st.floats(-10, 10), special),
                                        min_size=2 * batch, max_size=2 * batch)), np.float32)
    dense = dense.reshape(2, batch)
    ids = np.array(data.draw(st.lists(st.integers(-2 ** 63, 2 ** 63 - 1), min_size=2 * batch,
                                      max_size=2 * batch)), np.int64).reshape(2, batch)
    feats = {"c1": tf.constant(ids[0]), "c2": tf.constant(ids[1]),
             "d1": tf.constant(dense[0]), "d2": tf.constant(dense[1])}
    out = model(feats).numpy().reshape(-1)
    bad = ~np.isfinite(dense).all(0)
    clean = dict(feats, d1=tf.constant(np.where(bad, 0.0, dense[0]).astype(np.float32)),
                 d2=tf.constant(np.where(bad, 0.0, dense[1]).astype(np.float32)))
    np.testing.assert_allclose(out[~bad], model(clean).numpy().reshape(-1)[~bad], rtol=1e-5,
                               atol=1e-6)
    for i in range(batch):
        one = {k: v[i:i + 1] for k, v in feats.items()}
        np.testing.assert_allclose(out[i], model(one).numpy().reshape(-1)[0], rtol=1e-5,
                                   atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("value,message", [
    (tf.constant(["a", "b"]), "dense feature 'd1' must be numeric"),
    (tf.zeros([2, 3]), r"dense feature 'd1' must be \[B\] or \[B, 1\]"),
    (tf.zeros([3]), "dense feature 'd2' has batch size 2 but dense feature 'd1' has 3"),
    (None, "dense feature 'd1' is not a numeric tensor"),
])
def test_bad_dense_features_are_named(value, message):
    model = dlrm()
    feats = {"c1": tf.constant([1, 2], tf.int64), "c2": tf.constant([3, 4], tf.int64),
             "d2": tf.constant([1.0, 2.0]), "d1": value}
    with pytest.raises(ValueError, match=message):
        model(feats)
    del feats["d1"]
    with pytest.raises(ValueError, match=r"missing input features \['d1'\]"):
        model(feats)


_DLRM = []


def dlrm():
    if not _DLRM:
        from tf_fusedemb.models import DLRM  # pylint: disable=import-outside-toplevel
        cat = [FeatureSpec(n, TableSpec(n, 4, OPT, INIT)) for n in ("c1", "c2")]
        _DLRM.append(DLRM(cat, ["d1", "d2"], bottom_mlp=(8, 4), top_mlp=(8,)))
    return _DLRM[0]
