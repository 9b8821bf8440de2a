"""Units of tf_fusedemb.pipeline against numpy / plain-TF references, single process:
key-set ops, micro-batch slicing, options, rank-invariant tracing, NestedPipeline's
errors and its single-process equality with train_step."""
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tf_fusedemb.layers import FusedEmbedding
from tf_fusedemb.models import train_step
from tf_fusedemb.pipeline import NestedPipeline, PipelineOptions, make_pipeline
from tf_fusedemb.pipeline.auto import AutoPipeline, candidate_options, measuring_plan
from tf_fusedemb.training import keysets
from tf_fusedemb.training.micro_batches import (micro_batch_parts, micro_batch_slices,
                                                slice_rows)
from tf_fusedemb.training.tracing import RankInvariantFunction, relaxed_spec
from tf_fusedemb.specs import FeatureSpec, InitializerSpec, OptimizerSpec, TableSpec


@pytest.mark.parametrize("k,v", [(0, 0), (5, 0), (0, 4), (50, 30), (1000, 700)])
def test_find_keys_matches_numpy(k, v):
    rng = np.random.default_rng(k + v)
    table = rng.choice(np.arange(-2000, 2000), v, replace=False).astype(np.int64)
    keys = rng.integers(-2000, 2000, k).astype(np.int64)
    found, index = keysets.find_keys(keys, table)
    want = np.isin(keys, table)
    np.testing.assert_array_equal(found.numpy(), want)
    np.testing.assert_array_equal(table[index.numpy()[want]], keys[want])


def test_find_keys_int64_extremes():
    table = np.array([np.iinfo(np.int64).max, np.iinfo(np.int64).min, 0], np.int64)
    keys = np.array([0, np.iinfo(np.int64).min, 7, np.iinfo(np.int64).max], np.int64)
    found, index = keysets.find_keys(keys, table)
    np.testing.assert_array_equal(found.numpy(), [True, True, False, True])
    np.testing.assert_array_equal(index.numpy()[[0, 1, 3]], [2, 1, 0])


def test_find_keys_gives_the_first_of_equal_table_keys_in_one_op():
    rng = np.random.default_rng(3)
    table = rng.integers(-20, 20, 60).astype(np.int64)  # with repeats
    keys = rng.integers(-30, 30, 200).astype(np.int64)
    found, index = keysets.find_keys(keys, table)
    first = {}
    for i, t in enumerate(table):
        first.setdefault(int(t), i)
    np.testing.assert_array_equal(found.numpy(), [int(k) in first for k in keys])
    np.testing.assert_array_equal(index.numpy(), [first.get(int(k), 0) for k in keys])
    graph = tf.function(keysets.find_keys).get_concrete_function(
        tf.TensorSpec([None], tf.int64), tf.TensorSpec([None], tf.int64)).graph
    assert [op.type for op in graph.get_operations()
            if op.type not in ("Placeholder", "Identity")] == ["FusedEmb>FindKeys"]
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match="table_keys must"):
        keysets.find_keys(keys, table.reshape(6, 10))


def test_coalesce_sums_equal_keys():
    keys = np.array([5, 3, 5, 9, 3, 5], np.int64)
    grads = np.arange(12, dtype=np.float32).reshape(6, 2)
    init = keys * 10
    u, g, i = keysets.coalesce(keys, grads, init)
    np.testing.assert_array_equal(u.numpy(), [5, 3, 9])
    np.testing.assert_allclose(g.numpy(), [grads[[0, 2, 5]].sum(0), grads[[1, 4]].sum(0),
                                           grads[3]])
    np.testing.assert_array_equal(i.numpy(), [50, 30, 90])


@pytest.mark.parametrize("b,n", [(10, 4), (3, 4), (0, 2), (8, 8), (7, 1)])
def test_micro_batch_slices_partition_the_batch(b, n):
    bounds = [(int(lo), int(hi)) for lo, hi in micro_batch_slices(b, n)]
    assert bounds[0][0] == 0 and bounds[-1][1] == b
    assert all(bounds[i][1] == bounds[i + 1][0] for i in range(n - 1))
    assert max(hi - lo for lo, hi in bounds) - min(hi - lo for lo, hi in bounds) <= 1


def test_slice_rows_dense_ragged_sparse_and_nests():
    dense = tf.reshape(tf.range(12), [6, 2])
    ragged = tf.ragged.constant([[1], [], [2, 3], [4], [5, 6, 7], []], tf.int64)
    sparse = ragged.to_sparse()
    out = slice_rows({"d": dense, "r": ragged, "s": sparse, "n": None, "l": [dense]}, 2, 5)
    np.testing.assert_array_equal(out["d"].numpy(), dense.numpy()[2:5])
    assert out["r"].to_list() == [[2, 3], [4], [5, 6, 7]]
    assert tf.RaggedTensor.from_sparse(out["s"]).to_list() == [[2, 3], [4], [5, 6, 7]]
    assert out["n"] is None and isinstance(out["l"], list)


@pytest.mark.parametrize("b,n,static", [(10, 4, True), (10, 4, False), (3, 4, True),
                                         (3, 4, False), (0, 2, False)])
def test_micro_batch_parts_equal_numpy_row_ranges(b, n, static):
    """Dense tensors are cut by one Split, ragged ones by two (values, row lengths), in
    nests: every part equals numpy's rows [i*b//n, (i+1)*b//n), with static shapes where
    b is an int."""
    dense = np.arange(b * 3, dtype=np.float32).reshape(b, 3)
    lists = [[k] * (k % 3) for k in range(b)]
    ragged = tf.RaggedTensor.from_row_lengths(
        tf.constant([k for row in lists for k in row], tf.int64),
        tf.constant([len(row) for row in lists], tf.int64))
    size = (lambda: b) if static else (lambda: tf.constant(b, tf.int64))
    parts = micro_batch_parts(({"d": dense, "r": ragged}, [dense], None), n, size)
    assert len(parts) == n
    for i, (x, (d,), w) in enumerate(parts):
        lo, hi = i * b // n, (i + 1) * b // n
        np.testing.assert_array_equal(x["d"].numpy(), dense[lo:hi])
        np.testing.assert_array_equal(d.numpy(), dense[lo:hi])
        assert x["r"].to_list() == lists[lo:hi] and w is None
        if static:
            assert x["d"].shape[0] == hi - lo


def test_options_validation_and_parse():
    assert PipelineOptions.parse("dbp,fwp=4") == PipelineOptions(prefetch=True, micro_batches=4)
    assert PipelineOptions.parse("sync") == PipelineOptions()
    assert PipelineOptions(prefetch=True).uses_vertical
    assert not PipelineOptions.parse("dbp,novertical").uses_vertical
    with pytest.raises(ValueError, match="micro_batches"):
        PipelineOptions(micro_batches=0)
    with pytest.raises(ValueError, match="needs prefetch"):
        PipelineOptions(vertical=True)
    with pytest.raises(ValueError, match="unknown pipeline option 'fast'"):
        PipelineOptions.parse("dbp,fast")
    measured = PipelineOptions.parse("dbp,fwp=2,exchange=auto")
    assert measured == PipelineOptions(prefetch=True, micro_batches=2, exchange="auto")
    assert measured.label == "dbp,fwp=2,exchange=auto" and measured.is_measured
    assert not PipelineOptions(exchange="flat").is_measured
    with pytest.raises(ValueError, match="exchange must be one of"):
        PipelineOptions.parse("exchange=ring")


def test_auto_candidates_cover_schedules_and_exchanges():
    labels = [o.label for o in candidate_options(PipelineOptions(prefetch=True,
                                                                 micro_batches="auto"))]
    assert labels == ["sync", "dbp", "dbp,fwp=2", "dbp,fwp=4"]
    labels = [o.label for o in candidate_options(PipelineOptions(micro_batches="auto",
                                                                 exchange="auto"), (1, 2))]
    assert labels == ["exchange=flat", "exchange=hierarchical", "fwp=2,exchange=flat",
                      "fwp=2,exchange=hierarchical"]
    labels = [o.label for o in candidate_options(PipelineOptions(prefetch=True, exchange="auto"),
                                                 exchanges=("flat",))]
    assert labels == ["dbp,exchange=flat"]  # one node: nothing to choose


def test_measuring_plan_interleaves_candidates_and_times_each_blocks_middle_step():
    """An untimed block of 3 per candidate, then rounds of one block of each, the order
    rotated each round, each block's middle step timed; one candidate: no measuring."""
    plan = measuring_plan(["sync", "dbp"], rounds=2)
    assert [(p.label, p.position, p.timed) for p in plan] == [
        ("sync", 0, False), ("sync", 1, False), ("sync", 2, False),
        ("dbp", 0, False), ("dbp", 1, False), ("dbp", 2, False),
        ("sync", 0, False), ("sync", 1, True), ("sync", 2, False),
        ("dbp", 0, False), ("dbp", 1, True), ("dbp", 2, False),
        ("dbp", 0, False), ("dbp", 1, True), ("dbp", 2, False),
        ("sync", 0, False), ("sync", 1, True), ("sync", 2, False)]
    assert measuring_plan(["exchange=flat"]) == []
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        AutoPipeline(_Net(), _loss, tf_keras.optimizers.SGD(0.1),
                     PipelineOptions(micro_batches="auto"), rounds=0)


def test_measured_exchange_on_one_node_keeps_flat_and_trains_like_train_step():
    """exchange="auto" on one rank: the one candidate (flat) is kept from the first step,
    unmeasured, and the steps equal plain train_step's; a hierarchical request names the
    topology."""
    data = _batches(7)
    ref, ref_opt = _Net(), tf_keras.optimizers.SGD(0.1)
    ref_losses = [float(train_step(ref, x, y, _loss, ref_opt).loss) for x, y in data]
    net = _Net()
    pipe = make_pipeline(net, _loss, tf_keras.optimizers.SGD(0.1), PipelineOptions(exchange="auto"))
    losses = [float(loss) for loss, _ in pipe.run(data)]
    assert pipe.chosen == "exchange=flat" and pipe.timings == {}
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for k, want in _rows(ref).items():
        np.testing.assert_allclose(_rows(net)[k], want, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="'hierarchical' exchange; this topology"):
        NestedPipeline(_Net(), _loss, tf_keras.optimizers.SGD(0.1),
                       PipelineOptions(exchange="hierarchical")).step(*_batches(1)[0])
    with pytest.raises(ValueError, match="use tf_fusedemb.pipeline.make_pipeline"):
        NestedPipeline(_Net(), _loss, tf_keras.optimizers.SGD(0.1),
                       PipelineOptions(exchange="auto"))


def test_relaxed_spec_and_single_trace_per_structure():
    assert relaxed_spec(tf.zeros([5, 3])) == tf.TensorSpec([None, 3], tf.float32)
    assert relaxed_spec(tf.constant(1)) == tf.TensorSpec([], tf.int32)
    assert relaxed_spec(None) is None
    fn = RankInvariantFunction(lambda x, y: tf.reduce_sum(x) + tf.cast(tf.size(y), tf.float32))
    for n in (1, 4, 9, 2):  # shapes that would make reduce_retracing retrace
        fn(tf.ones([n, 3]), tf.ragged.constant([[1]] * n))
    assert fn.tracing_count() == 1


def test_rank_invariant_function_traces_again_for_what_its_signature_tells_apart():
    fn = RankInvariantFunction(lambda x, extra: tf.reduce_sum(x["a"]) + (
        0.0 if extra is None else tf.reduce_sum(tf.cast(extra, tf.float32))))
    calls = [({"a": tf.ones([2, 3])}, None, 6.0),
             ({"a": tf.ones([7, 3])}, None, 21.0),  # leading dim: same trace
             ({"a": tf.ones([2, 4])}, None, 8.0),  # inner dim
             ({"a": tf.ones([2])}, None, 2.0),  # rank
             ({"a": tf.constant(5.0)}, None, 5.0),  # a scalar is not a vector
             ({"a": tf.ones([2, 3], tf.float64)}, None, 6.0),  # dtype
             ({"a": tf.ones([2, 3])}, tf.constant([1, 2]), 9.0),  # None vs a tensor
             ({"a": tf.ones([3, 3])}, tf.constant([4]), 13.0)]
    assert [float(fn(x, extra)) for x, extra, _ in calls] == [c[2] for c in calls]
    assert fn.tracing_count() == 6


def _specs():
    opt = OptimizerSpec.adam(0.05)
    init = InitializerSpec.uniform(-0.1, 0.1)
    return [FeatureSpec(n, TableSpec(n, 4, opt, init), "sum") for n in ("u", "v")]


class _Net(tf_keras.Model):
    def __init__(self, transform=False):
        super().__init__()
        self.emb = FusedEmbedding(_specs())
        self.out = tf_keras.layers.Dense(1, kernel_initializer=tf_keras.initializers.Ones())
        self.transform = transform

    def call(self, x, training=False):
        x = {k: (v + 1 if self.transform else v) for k, v in x.items()}
        e = self.emb(x)
        return self.out(tf.concat([e["u"], e["v"]], 1))


def _loss(y, p):
    return tf_keras.losses.mean_squared_error(y, p)


def _batches(n, b=8):
    rng = np.random.default_rng(0)
    return [({"u": tf.constant(rng.integers(0, 6, b), tf.int64),
              "v": tf.constant(rng.integers(0, 50, b), tf.int64)},
             tf.constant(rng.random((b, 1)), tf.float32)) for _ in range(n)]


def _rows(model):
    x = {"u": tf.range(6, dtype=tf.int64), "v": tf.range(50, dtype=tf.int64)}
    return {k: v.numpy() for k, v in model.emb(x).items()}


@pytest.mark.parametrize("options", ["dbp", "dbp,fwp=3", "fwp=2", "dbp,novertical"])
def test_pipeline_equals_train_step_single_process(options):
    data = _batches(6)
    ref, ref_opt = _Net(), tf_keras.optimizers.SGD(0.1)
    ref_losses = [float(train_step(ref, x, y, _loss, ref_opt).loss) for x, y in data]
    net, opt = _Net(), tf_keras.optimizers.SGD(0.1)
    pipe = NestedPipeline(net, _loss, opt, PipelineOptions.parse(options))
    losses = [float(loss) for loss, _ in pipe.run(data)]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for k, want in _rows(ref).items():
        np.testing.assert_allclose(_rows(net)[k], want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(net.out.kernel.numpy(), ref.out.kernel.numpy(), rtol=1e-5)


def test_vertical_rows_pending_until_flush():
    data = _batches(2)
    net = _Net()
    pipe = NestedPipeline(net, _loss, tf_keras.optimizers.SGD(0.1), PipelineOptions(prefetch=True))
    pipe.step(*data[0], next_x=data[1][0])
    pending = sum(int(tf.size(p.keys)) for p in pipe._pending)
    assert pending > 0  # keys of batch 0 that batch 1 does not use wait for the flush
    before = sum(int(g.store.table.size()) for g in net.emb.groups)
    pipe.flush()
    assert sum(int(g.store.table.size()) for g in net.emb.groups) == before + pending
    assert pipe._pending is None


def test_transformed_inputs_fail_clearly_with_prefetch():
    data = _batches(2)
    pipe = NestedPipeline(_Net(transform=True), _loss, tf_keras.optimizers.SGD(0.1),
                          PipelineOptions(prefetch=True))
    with pytest.raises(tf.errors.InvalidArgumentError, match="other IDs than the pipeline"):
        list(pipe.run(data))


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="no FusedEmbedding layer"):
        NestedPipeline(tf_keras.Sequential([tf_keras.layers.Dense(1)]), _loss,
                       tf_keras.optimizers.SGD(0.1))
    pipe = NestedPipeline(_Net(), _loss, tf_keras.optimizers.SGD(0.1),
                          PipelineOptions(prefetch=True))
    x, y = _batches(1)[0]
    with pytest.raises(ValueError, match="feature 'u'"):
        pipe.step({"v": x["v"]}, y)
