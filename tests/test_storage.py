"""tf_fusedemb.storage: deterministic initial rows, row-wise optimizers, group tables.

The table tests run on every backend of ``tf_fusedemb.storage.backend``: "dynamic" (TFRA),
"engine" (the storage engine) and "static" (dense variables)."""
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from conftest import storage_params
from tf_fusedemb.specs import InitializerSpec, OptimizerSpec
from tf_fusedemb.storage import (DynamicGroupTable, RowOptimizer, StaticGroupTable, init_rows,
                                 init_rows_np)
from tf_fusedemb.storage.engine_table import EngineGroupTable

INITS = [InitializerSpec.uniform(), InitializerSpec.uniform(-1.0, 3.0), InitializerSpec.normal(0.1, 0.3),
         InitializerSpec.truncated_normal(), InitializerSpec.truncated_normal(-1.0, 2.0),
         InitializerSpec.zeros()]
OPTS = [OptimizerSpec.sgd(0.1), OptimizerSpec.adagrad(0.1, 0.2), OptimizerSpec.adam(0.01, 0.8, 0.95),
        OptimizerSpec.ftrl(0.1, -0.5, 0.1, l1=0.01, l2=0.02)]
EDGE_KEYS = np.array([0, 1, -1, 2**62, -2**63, 2**63 - 1, 12345678901234, 7], np.int64)
KEYS_SPEC = tf.TensorSpec([None], tf.int64)
GRADS_SPEC = tf.TensorSpec([None, None], tf.float32)


# ------------------------------------------------------------------ initializers
@pytest.mark.parametrize("spec", INITS, ids=lambda s: f"{s.name}{tuple(s.hparams.values())}")
@pytest.mark.parametrize("dim", [1, 7, 16])
def test_init_tf_equals_numpy(spec, dim):
    keys = np.concatenate([EDGE_KEYS, np.random.default_rng(dim).integers(-2**63, 2**63 - 1, 5000)])
    want = init_rows_np(keys, dim, spec)
    assert want.dtype == np.float32 and want.shape == (keys.size, dim)
    np.testing.assert_array_equal(init_rows(tf.constant(keys), dim, spec).numpy(), want)
    traced = tf.function(lambda k: init_rows(k, dim, spec), input_signature=[KEYS_SPEC])
    np.testing.assert_array_equal(traced(tf.constant(keys)).numpy(), want)
    assert traced(tf.constant([], tf.int64)).shape == (0, dim)


@pytest.mark.parametrize("spec,mean,std,lo,hi", [
    (InitializerSpec.uniform(-0.05, 0.05), 0.0, 0.1 / np.sqrt(12), -0.05, 0.05),
    (InitializerSpec.uniform(1.0, 3.0), 2.0, 2 / np.sqrt(12), 1.0, 3.0),
    (InitializerSpec.normal(0.1, 0.3), 0.1, 0.3, -np.inf, np.inf),
    # A standard normal truncated to [-2, 2] has std 0.8796 (tf.keras does not rescale).
    (InitializerSpec.truncated_normal(0.5, 2.0), 0.5, 0.87962 * 2.0, 0.5 - 4.0, 0.5 + 4.0),
])
def test_init_statistics(spec, mean, std, lo, hi):
    keys = np.arange(100_000, dtype=np.int64)  # consecutive IDs: the hash must decorrelate them
    rows = init_rows(tf.constant(keys), 8, spec).numpy().astype(np.float64)
    assert abs(rows.mean() - mean) < 0.01 * std
    assert abs(rows.std() - std) < 0.01 * std
    assert rows.min() >= lo and rows.max() <= hi
    if np.isfinite(lo):  # the range is actually used, not just a corner of it
        assert rows.min() < lo + 0.01 * (hi - lo) and rows.max() > hi - 0.01 * (hi - lo)
    for j in range(8):  # every column has the distribution, columns are uncorrelated
        assert abs(rows[:, j].mean() - mean) < 0.02 * std
        assert abs(np.corrcoef(rows[:, j], rows[:, (j + 1) % 8])[0, 1]) < 0.02
    assert abs(np.corrcoef(rows[:-1, 0], rows[1:, 0])[0, 1]) < 0.02  # neighbouring keys


def test_init_zeros():
    assert not init_rows(tf.constant(EDGE_KEYS), 5, InitializerSpec.zeros()).numpy().any()


def test_init_depends_on_key_only():
    spec = InitializerSpec.normal()
    a = init_rows(tf.constant([5, 7, 9], tf.int64), 6, spec).numpy()
    b = init_rows(tf.constant([9, 1, 5, 5, 123], tf.int64), 6, spec).numpy()
    np.testing.assert_array_equal(a[[2, 0, 0]], b[[0, 2, 3]])
    assert len({r.tobytes() for r in b[[0, 1, 2, 4]]}) == 4  # different keys, different rows
    # A wider table extends the rows: column j depends on (key, j) only.
    np.testing.assert_array_equal(init_rows_np([5, 7], 3, spec), init_rows_np([5, 7], 6, spec)[:, :3])


# ------------------------------------------------------------------ optimizers
def assert_close(got, want, err_msg=""):
    """1e-6 relative to the array's scale: float32 kernels may round in another order, and
    FTRL's linear slot cancels (a few ulp of a large term on a small result)."""
    want = np.asarray(want)
    scale = max(1.0, float(np.abs(want).max())) if want.size else 1.0
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * scale, err_msg=err_msg)


def run_keras(keras_opt, table, steps):
    """Applies IndexedSlices gradients to a dense tf.Variable; returns (table, slots by name)."""
    var = tf.Variable(table)
    for idx, grad in steps:
        keras_opt.apply_gradients([(tf.IndexedSlices(tf.constant(grad), tf.constant(idx),
                                                     tf.constant(table.shape, tf.int64)), var)])
    # Slot variables are named ".../accumulator/..." (new optimizers) or ".../accumulator:0"
    # (legacy); keep those of our slot names (SGD also builds an unused momentum "m").
    variables = keras_opt.variables() if callable(keras_opt.variables) else keras_opt.variables
    slots = {n: v.numpy() for v in variables for n in ("accumulator", "linear")
             if v.shape == table.shape and f"/{n}" in v.name}
    return var.numpy(), slots


def run_rows(spec, table, steps):
    """Same updates through RowOptimizer.apply on gathered rows (in a tf.function)."""
    opt = RowOptimizer.from_spec(spec)
    rows = table.copy()
    slots = {n: np.full(table.shape, v, np.float32) for n, v in opt.initial_slot_values.items()}
    apply = tf.function(opt.apply)
    for step, (idx, grad) in enumerate(steps, 1):
        new, new_slots = apply(rows[idx], {n: s[idx] for n, s in slots.items()}, tf.constant(grad),
                               tf.constant(step, tf.int64))
        rows[idx] = new.numpy()
        for n in slots:
            slots[n][idx] = new_slots[n].numpy()
    return rows, slots


def random_steps(seed, num_rows, dim, touched_rows, num_steps=5, fixed=False):
    rng = np.random.default_rng(seed)
    fixed_idx = np.sort(rng.choice(touched_rows, touched_rows // 2, replace=False))
    steps = []
    for _ in range(num_steps):
        idx = fixed_idx if fixed else rng.choice(touched_rows, rng.integers(1, touched_rows), replace=False)
        steps.append((idx.astype(np.int64), rng.normal(size=(idx.size, dim)).astype(np.float32)))
    return rng.normal(size=(num_rows, dim)).astype(np.float32), steps


@pytest.mark.parametrize("spec,keras_opt", [
    (OptimizerSpec.sgd(0.1), lambda: tf_keras.optimizers.SGD(0.1)),
    (OptimizerSpec.adagrad(0.1, 0.2), lambda: tf_keras.optimizers.Adagrad(0.1, initial_accumulator_value=0.2)),
    (OptimizerSpec.adagrad(0.5), lambda: tf_keras.optimizers.Adagrad(0.5)),
    # tf_keras.optimizers.legacy.Ftrl runs TF's sparse kernel (ResourceSparseApplyFtrl).
    (OptimizerSpec.ftrl(0.1, -0.5, 0.1, 0.01, 0.02), lambda: tf_keras.optimizers.legacy.Ftrl(0.1, -0.5, 0.1, 0.01, 0.02)),
    (OptimizerSpec.ftrl(0.3, -0.7, 0.5, 0.0, 0.1), lambda: tf_keras.optimizers.legacy.Ftrl(0.3, -0.7, 0.5, 0.0, 0.1)),
], ids=["sgd", "adagrad", "adagrad_default", "ftrl_l1_l2", "ftrl_power"])
def test_optimizer_matches_keras_sparse(spec, keras_opt):
    table, steps = random_steps(0, num_rows=12, dim=5, touched_rows=9)
    want, want_slots = run_keras(keras_opt(), table, steps)
    got, got_slots = run_rows(spec, table, steps)
    assert_close(got, want)
    np.testing.assert_array_equal(want[9:], table[9:])  # untouched rows stay, in keras too
    assert set(got_slots) == set(spec.slot_names) == set(want_slots)
    for n in spec.slot_names:
        assert_close(got_slots[n], want_slots[n], err_msg=n)
        np.testing.assert_array_equal(want_slots[n][9:], got_slots[n][9:])
        np.testing.assert_array_equal(got_slots[n][9:], RowOptimizer.from_spec(spec).initial_slot_values[n])


def test_ftrl_matches_keras_v2_on_touched_rows():
    """tf_keras.optimizers.Ftrl (the new optimizer) densifies IndexedSlices: it rewrites
    never-touched rows to FTRL's closed form (0), so it is compared on a fixed row set
    touched at every step; there it agrees operation for operation."""
    spec = OptimizerSpec.ftrl(0.1, -0.5, 0.1, 0.01, 0.02)
    table, steps = random_steps(1, num_rows=12, dim=5, touched_rows=9, fixed=True)
    want, want_slots = run_keras(tf_keras.optimizers.Ftrl(0.1, -0.5, 0.1, 0.01, 0.02), table, steps)
    got, got_slots = run_rows(spec, table, steps)
    idx = steps[0][0]
    assert_close(got[idx], want[idx])
    for n in spec.slot_names:
        assert_close(got_slots[n], want_slots[n])
    untouched = np.setdiff1d(np.arange(12), idx)
    np.testing.assert_array_equal(got[untouched], table[untouched])  # lazy: they stay


def np_lazy_adam(table, steps, lr, b1, b2, eps):
    """tensorflow_addons LazyAdam in float64 numpy: only touched rows' m and v move. The
    hyper-parameters are float32 constants there (1 - float32(0.999) != 0.001), so here too."""
    lr, b1, b2, eps = (np.float64(np.float32(x)) for x in (lr, b1, b2, eps))
    var, m, v = table.astype(np.float64), np.zeros(table.shape), np.zeros(table.shape)
    for t, (idx, g) in enumerate(steps, 1):
        m[idx] = b1 * m[idx] + (1 - b1) * g
        v[idx] = b2 * v[idx] + (1 - b2) * g * g
        lr_t = lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        var[idx] -= lr_t * m[idx] / (np.sqrt(v[idx]) + eps)
    return var, {"m": m, "v": v}


@pytest.mark.parametrize("spec", [OptimizerSpec.adam(0.01), OptimizerSpec.adam(0.1, 0.8, 0.95, 1e-3)])
def test_lazy_adam_matches_numpy(spec):
    table, steps = random_steps(2, num_rows=12, dim=5, touched_rows=9)
    p = spec.hparams
    want, want_slots = np_lazy_adam(table, steps, spec.learning_rate, p["beta1"], p["beta2"], p["epsilon"])
    got, got_slots = run_rows(spec, table, steps)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    for n in ("m", "v"):
        np.testing.assert_allclose(got_slots[n], want_slots[n], rtol=1e-5, atol=1e-8)
    np.testing.assert_array_equal(got[9:], table[9:])


@pytest.mark.parametrize("spec", OPTS, ids=lambda s: s.name)
def test_initial_slots(spec):
    opt = RowOptimizer.from_spec(spec)
    assert opt.slot_names == spec.slot_names
    slots = tf.function(lambda n: opt.initial_slots(n, 3))(tf.constant(4, tf.int64))
    assert set(slots) == set(spec.slot_names)
    want = {"accumulator": spec.hparams.get("initial_accumulator_value"), "linear": 0.0, "m": 0.0, "v": 0.0}
    for n, s in slots.items():
        assert s.dtype == tf.float32 and s.shape == (4, 3)
        np.testing.assert_array_equal(s.numpy(), np.float32(want[n]))
    assert all(s.shape == (0, 3) for s in opt.initial_slots(0, 3).values())


# ------------------------------------------------------------------ tables
VOCAB = 64


KINDS = ["dynamic", "engine", "static"]  # TFRA, the storage engine, dense variables


def make_table(kind, spec, init=InitializerSpec.normal(), dim=4, name="g0_d4", **kwargs):
    if kind == "dynamic":
        return DynamicGroupTable(name, dim, init, spec, **kwargs)
    if kind == "engine":
        return EngineGroupTable(name, dim, init, spec, **kwargs)
    return StaticGroupTable(name, dim, init, spec, vocabulary_size=VOCAB, **kwargs)


class RefTable:
    """Dict-based reference: RowOptimizer.apply on rows taken from a dict or init_rows_np."""

    def __init__(self, spec, init, dim):
        self.opt, self.init, self.dim = RowOptimizer.from_spec(spec), init, dim
        self.rows, self.slots, self.step = {}, {}, 0

    def lookup(self, keys, init_keys=None):
        init_keys = keys if init_keys is None else init_keys
        init = init_rows_np(init_keys, self.dim, self.init)
        return np.array([self.rows.get(k, r) for k, r in zip(keys, init)], np.float32).reshape(-1, self.dim)

    def apply(self, keys, grads, init_keys=None):
        self.step += 1
        rows = self.lookup(keys, init_keys)
        fresh = {n: np.full(self.dim, v, np.float32) for n, v in self.opt.initial_slot_values.items()}
        slots = {n: np.array([self.slots.get(k, fresh)[n] for k in keys], np.float32).reshape(-1, self.dim)
                 for n in self.opt.slot_names}
        new, new_slots = self.opt.apply(tf.constant(rows), {n: tf.constant(s) for n, s in slots.items()},
                                        tf.constant(grads), tf.constant(self.step, tf.int64))
        for i, k in enumerate(keys):
            self.rows[k] = new.numpy()[i]
            self.slots[k] = {n: s.numpy()[i] for n, s in new_slots.items()}


def key_batches(seed, num_steps=5, high=VOCAB):
    rng = np.random.default_rng(seed)
    for _ in range(num_steps):
        keys = rng.choice(high // 2, rng.integers(0, 12), replace=False).astype(np.int64)  # may be empty
        yield keys, rng.normal(size=(keys.size, 4)).astype(np.float32)


def assert_exports_equal(a, b, slot_names):
    assert set(a) == set(b) == {"keys", "values", *slot_names}
    np.testing.assert_array_equal(a["keys"].numpy(), b["keys"].numpy())
    for n in ("values", *slot_names):
        assert_close(a[n].numpy(), b[n].numpy(), err_msg=n)


@pytest.mark.parametrize("kind", storage_params(KINDS))
@pytest.mark.parametrize("init", [InitializerSpec.uniform(), InitializerSpec.truncated_normal(),
                                  InitializerSpec.zeros()], ids=lambda s: s.name)
def test_lookup_new_keys_is_init_and_not_inserted(kind, init):
    table = make_table(kind, OptimizerSpec.sgd(0.1), init)
    keys = np.array([3, 1, 3, 60, 0], np.int64)  # duplicates are fine for lookup
    np.testing.assert_array_equal(table.lookup(keys).numpy(), init_rows_np(keys, 4, init))
    traced = tf.function(table.lookup, input_signature=[KEYS_SPEC])
    np.testing.assert_array_equal(traced(tf.constant(keys)).numpy(), init_rows_np(keys, 4, init))
    assert traced(tf.constant([], tf.int64)).shape == (0, 4)
    assert table.size().numpy() == 0 and table.export()["keys"].shape == (0,)


@pytest.mark.parametrize("kind", storage_params(KINDS))
@pytest.mark.parametrize("spec", OPTS, ids=lambda s: s.name)
def test_apply_gradients_matches_row_optimizer(kind, spec):
    table, ref = make_table(kind, spec), RefTable(spec, InitializerSpec.normal(), 4)
    apply = tf.function(lambda k, g: [table.apply_gradients(k, g), None][1],
                        input_signature=[KEYS_SPEC, GRADS_SPEC])
    every_key = np.arange(VOCAB, dtype=np.int64)
    touched = set()
    for keys, grads in key_batches(3):
        apply(tf.constant(keys), tf.constant(grads))
        ref.apply(keys, grads)
        touched.update(keys.tolist())
        assert_close(table.lookup(every_key).numpy(), ref.lookup(every_key))
    assert table.step.numpy() == 5 and table.size().numpy() == len(touched)
    untouched = np.array(sorted(set(every_key.tolist()) - touched), np.int64)
    np.testing.assert_array_equal(table.lookup(untouched).numpy(), init_rows_np(untouched, 4, InitializerSpec.normal()))
    exported = table.export()
    np.testing.assert_array_equal(exported["keys"].numpy(), sorted(touched))
    for n in spec.slot_names:
        want = np.stack([ref.slots[k][n] for k in sorted(touched)])
        assert_close(exported[n].numpy(), want, err_msg=n)


@pytest.mark.tfra
@pytest.mark.parametrize("spec", OPTS, ids=lambda s: s.name)
def test_dynamic_and_static_agree(spec):
    dyn, eng, sta = (make_table(k, spec) for k in KINDS)
    every_key = np.arange(VOCAB, dtype=np.int64)
    for keys, grads in key_batches(4, num_steps=6):
        for table in (dyn, eng, sta):
            table.apply_gradients(keys, grads)
        assert_close(dyn.lookup(every_key).numpy(), sta.lookup(every_key).numpy())
        assert_close(eng.lookup(every_key).numpy(), sta.lookup(every_key).numpy())
    assert dyn.size().numpy() == eng.size().numpy() == sta.size().numpy()
    assert_exports_equal(dyn.export(), sta.export(), spec.slot_names)
    assert_exports_equal(eng.export(), sta.export(), spec.slot_names)


@pytest.mark.parametrize("kind", storage_params(KINDS))
def test_contains_and_remove_are_the_interface(kind):
    """contains/remove are declared by GroupTable (the backend interface); a static
    table answers contains and refuses remove (its memory is fixed)."""
    table = make_table(kind, OptimizerSpec.adagrad(0.1))
    table.apply_gradients([3, 7], tf.ones([2, 4]))
    np.testing.assert_array_equal(table.contains([7, 5, 3]).numpy(), [True, False, True])
    if kind == "static":
        with pytest.raises(ValueError, match="StaticGroupTable 'g0_d4'.*cannot be removed"):
            table.remove([3])
        return
    table.remove([3, 9])
    np.testing.assert_array_equal(table.contains([7, 3]).numpy(), [True, False])
    assert table.size().numpy() == 1
    np.testing.assert_array_equal(table.lookup([3]).numpy(),
                                  init_rows_np(np.array([3]), 4, InitializerSpec.normal()))


@pytest.mark.tfra
def test_init_keys_seed_new_rows():
    """Storage keys may be packed per group; the initial row follows the plan-independent init key."""
    spec, init = OptimizerSpec.adagrad(0.1), InitializerSpec.uniform()
    storage = np.array([5, 9, 2], np.int64)
    unified = np.array([-77, 2**40 + 1, 123456], np.int64)
    dyn, ref = make_table("dynamic", spec, init), RefTable(spec, init, 4)
    np.testing.assert_array_equal(dyn.lookup(storage, unified).numpy(), init_rows_np(unified, 4, init))
    grads = np.ones((3, 4), np.float32)
    dyn.apply_gradients(storage[:2], grads[:2], init_keys=unified[:2])
    ref.apply(storage[:2], grads[:2], unified[:2])
    np.testing.assert_array_equal(dyn.lookup(storage, unified).numpy(), ref.lookup(storage, unified))
    # Static: the init key of each row is fixed at creation, by a callable or a tensor.
    for init_keys in (lambda idx: idx * 7 + 3, np.arange(VOCAB, dtype=np.int64) * 7 + 3):
        sta = make_table("static", spec, init, init_keys=init_keys)
        np.testing.assert_array_equal(sta.lookup(storage).numpy(), init_rows_np(storage * 7 + 3, 4, init))
    with pytest.raises(ValueError, match="'g0_d4'.*init_keys"):
        make_table("static", spec, init, init_keys=np.arange(3))


@pytest.mark.parametrize("kind", storage_params(KINDS))
def test_eager_and_two_functions(kind):
    spec = OptimizerSpec.adam(0.01)
    table, ref = make_table(kind, spec), RefTable(spec, InitializerSpec.normal(), 4)

    @tf.function(input_signature=[KEYS_SPEC, GRADS_SPEC])
    def train_a(keys, grads):
        table.apply_gradients(keys, grads)
        return table.size()

    @tf.function  # traced separately, with static shapes
    def train_b(keys, grads):
        before = table.lookup(keys)  # reads see the state before the update, ...
        table.apply_gradients(keys, grads)
        return before, table.lookup(keys)  # ... and after it, in program order

    sizes = tf.function(lambda: table.size()), tf.function(lambda: tf.identity(table.size()))
    batches = list(key_batches(5, num_steps=6))
    for i, (keys, grads) in enumerate(batches):
        if i % 3 == 0:
            assert table.apply_gradients(keys, grads) is None  # eager: no op to return
        elif i % 3 == 1:
            train_a(tf.constant(keys), tf.constant(grads))
        else:
            before, after = train_b(tf.constant(keys), tf.constant(grads))
            assert_close(before.numpy(), ref.lookup(keys))
        ref.apply(keys, grads)
        if i % 3 == 2:
            assert_close(after.numpy(), ref.lookup(keys))
        assert sizes[0]().numpy() == sizes[1]().numpy() == table.size().numpy() == len(ref.rows)
    every_key = np.arange(VOCAB, dtype=np.int64)
    assert_close(table.lookup(every_key).numpy(), ref.lookup(every_key))
    assert table.step.numpy() == 6
    assert_exports_equal(tf.function(table.export)(), table.export(), spec.slot_names)


@pytest.mark.parametrize("kind", storage_params(KINDS))
def test_graph_mode_returns_op(kind):
    with tf.Graph().as_default():
        table = make_table(kind, OptimizerSpec.sgd(0.1))
        op = table.apply_gradients(tf.constant([1, 2], tf.int64), tf.ones([2, 4]))
        assert isinstance(op, tf.Operation)


@pytest.mark.parametrize("bad", [[1, VOCAB], [-1], [2**40]])
def test_static_out_of_range_names_table(bad):
    table = StaticGroupTable("clicks_d4", 4, InitializerSpec.uniform(), OptimizerSpec.sgd(0.1), vocabulary_size=VOCAB)
    match = rf"StaticGroupTable clicks_d4: keys must lie in \[0, {VOCAB}\)"
    with pytest.raises(tf.errors.InvalidArgumentError, match=match):
        table.lookup(bad)
    with pytest.raises(tf.errors.InvalidArgumentError, match=match):
        tf.function(table.lookup, input_signature=[KEYS_SPEC])(tf.constant(bad, tf.int64))
    grads = tf.ones([len(bad), 4])
    with pytest.raises(tf.errors.InvalidArgumentError, match=match):
        tf.function(lambda k, g: [table.apply_gradients(k, g), None][1])(tf.constant(bad, tf.int64), grads)
    assert table.size().numpy() == 0


@pytest.mark.parametrize("src_kind", storage_params(KINDS))
@pytest.mark.parametrize("dst_kind", storage_params(KINDS))
def test_export_load_round_trip(src_kind, dst_kind):
    spec = OptimizerSpec.ftrl(0.1, l1=0.01)
    src, dst = make_table(src_kind, spec, name="src"), make_table(dst_kind, spec, name="dst")
    for keys, grads in key_batches(6):
        src.apply_gradients(keys, grads)
    exported = src.export()
    tf.function(lambda: [dst.load(exported), None][1])()
    assert_exports_equal(dst.export(), exported, spec.slot_names)
    # Both continue identically (the step counter travels separately).
    dst.step.assign(src.step)
    keys, grads = np.array([1, 2, 40], np.int64), np.full((3, 4), 0.5, np.float32)
    src.apply_gradients(keys, grads)
    dst.apply_gradients(keys, grads)
    assert_exports_equal(dst.export(), src.export(), spec.slot_names)


@pytest.mark.parametrize("kind", storage_params(KINDS))
def test_load_without_slots_starts_them_fresh(kind):
    spec = OptimizerSpec.adagrad(0.1, 0.3)
    table = make_table(kind, spec)
    table.load({"keys": tf.constant([4, 8], tf.int64), "values": tf.ones([2, 4])})
    out = table.export()
    np.testing.assert_array_equal(out["values"].numpy(), 1.0)
    np.testing.assert_array_equal(out["accumulator"].numpy(), np.float32(0.3))


@pytest.mark.parametrize("kind", storage_params(KINDS))
def test_explicit_step_and_empty_batch(kind):
    spec = OptimizerSpec.adam(0.1)
    split, whole = make_table(kind, spec), make_table(kind, spec)
    keys, grads = np.array([3, 9, 4], np.int64), np.ones((3, 4), np.float32)
    whole.apply_gradients(keys, grads)
    step = split.advance_step()  # one batch, applied in two parts with the same step
    split.apply_gradients(keys[:1], grads[:1], step=step)
    split.apply_gradients(keys[1:], grads[1:], step=step)
    assert split.step.numpy() == whole.step.numpy() == 1
    assert_exports_equal(split.export(), whole.export(), spec.slot_names)
    whole.apply_gradients(np.zeros([0], np.int64), np.zeros([0, 4], np.float32))  # no keys: valid
    assert whole.step.numpy() == 2 and whole.size().numpy() == 3


@pytest.mark.tfra
def test_validate_unique():
    table = make_table("dynamic", OptimizerSpec.sgd(0.1), validate_unique=True)
    with pytest.raises(tf.errors.InvalidArgumentError, match="DynamicGroupTable g0_d4: apply_gradients needs unique keys"):
        table.apply_gradients([1, 2, 1], tf.ones([3, 4]))
    table.apply_gradients([1, 2], tf.ones([2, 4]))


@pytest.mark.tfra
def test_bad_arguments_name_table():
    table = make_table("dynamic", OptimizerSpec.sgd(0.1), name="ads")
    with pytest.raises(TypeError, match="'ads': grads must be float32"):
        table.apply_gradients([1], tf.ones([1, 4], tf.float64))
    with pytest.raises(ValueError, match=r"'ads': grads must be float32\[u, 4\]"):
        table.apply_gradients([1], tf.ones([1, 3]))
    with pytest.raises(TypeError, match="'ads': keys must be int64"):
        table.lookup(tf.constant([1.0]))
    with pytest.raises(ValueError, match="dim must be an int > 0"):
        DynamicGroupTable("x", 0, InitializerSpec(), OptimizerSpec.sgd(0.1))
    with pytest.raises(ValueError, match="vocabulary_size"):
        StaticGroupTable("x", 2, InitializerSpec(), OptimizerSpec.sgd(0.1), vocabulary_size=0)


@pytest.mark.tfra
def test_same_name_tables_are_independent():
    """A rebuilt model reuses group names; its tables must not share rows with the old ones."""
    a, b = make_table("dynamic", OptimizerSpec.sgd(0.1)), make_table("dynamic", OptimizerSpec.sgd(0.1))
    a.apply_gradients([1], tf.ones([1, 4]))
    assert a.size().numpy() == 1 and b.size().numpy() == 0
    assert a.values.name == "g0_d4-values" and a.slots == {}
    c = make_table("dynamic", OptimizerSpec.ftrl(0.1), name="g1")
    assert sorted(v.name for v in c.slots.values()) == ["g1-accumulator", "g1-linear"]


@pytest.mark.parametrize("kind", storage_params(["dynamic", "static"]))
def test_checkpoint_round_trip(kind, tmp_path):
    spec = OptimizerSpec.adagrad(0.1)
    src, dst = make_table(kind, spec), make_table(kind, spec)
    for keys, grads in key_batches(7):
        src.apply_gradients(keys, grads)
    path = tf.train.Checkpoint(table=src).save(str(tmp_path / "ckpt"))
    tf.train.Checkpoint(table=dst).restore(path).assert_consumed()
    assert dst.step.numpy() == src.step.numpy() == 5
    assert_exports_equal(dst.export(), src.export(), spec.slot_names)


def test_static_initialised_in_chunks():
    vocab = (1 << 18) + 3  # more than one creation chunk
    table = StaticGroupTable("big", 2, InitializerSpec.normal(), OptimizerSpec.sgd(0.1), vocabulary_size=vocab)
    keys = np.array([0, (1 << 18) - 1, 1 << 18, vocab - 1], np.int64)
    np.testing.assert_array_equal(table.lookup(keys).numpy(), init_rows_np(keys, 2, InitializerSpec.normal()))
