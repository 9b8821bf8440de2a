"""The embedding storage engine (custom_ops/embedding_engine*.{h,cc}, storage/engine_table.py)
against independent references: the numpy and TF initial rows, the TF optimizer formulas
of storage/optimizers.py, and the TFRA-backed DynamicGroupTable + AccessStatistics fed
the same sequence of lookups, updates, records, removes and exports."""
import gc

import numpy as np
import pytest
import tensorflow as tf

from tf_fusedemb import ops
from tf_fusedemb.ops import _loader
from tf_fusedemb.ops.embedding_engine import EmbeddingEngine
from tf_fusedemb.specs import InitializerSpec, OptimizerSpec
from tf_fusedemb.storage import initializers
from tf_fusedemb.storage.engine_table import EngineGroupTable, EngineStatistics
from tf_fusedemb.storage.initializers import init_rows, init_rows_np
from tf_fusedemb.storage.optimizers import RowOptimizer
from tf_fusedemb.storage.statistics import AccessStatistics
from tf_fusedemb.storage.tables import DynamicGroupTable

OPTIMIZERS = {
    "sgd": OptimizerSpec.sgd(0.3),
    "adagrad": OptimizerSpec.adagrad(0.1, initial_accumulator_value=0.2),
    "ftrl": OptimizerSpec.ftrl(0.2, learning_rate_power=-0.5, initial_accumulator_value=0.1,
                               l1=0.01, l2=0.02),
    "ftrl_p03": OptimizerSpec.ftrl(0.1, learning_rate_power=-0.3),
    "adam": OptimizerSpec.adam(0.01, beta1=0.8, beta2=0.99, epsilon=1e-6),
}
INITIALIZERS = {
    "uniform": InitializerSpec.uniform(-0.05, 0.05),
    "uniform_odd": InitializerSpec.uniform(-0.3, 1.7),
    "normal": InitializerSpec.normal(0.1, 0.7),
    "truncated_normal": InitializerSpec.truncated_normal(0.0, 0.05),
    "zeros": InitializerSpec.zeros(),
}
CATEGORIES = ["a", "b", "c"]


def _close(got, want, err_msg=""):
    """Equal to 1e-6, relative to each value or to the array's largest magnitude: FTRL's
    linear slot is a difference of large terms, so an ulp of float32 pow (glibc's powf
    here, Eigen's in TF) shows up at the magnitude of the terms, not of the result."""
    want = np.asarray(want)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6,
                               atol=1e-6 * max(1.0, float(np.abs(want).max(initial=0))),
                               err_msg=err_msg)


def _engine_table(dim=8, opt="adagrad", init="uniform", name="t", **kw):
    return EngineGroupTable(name, dim, INITIALIZERS[init], OPTIMIZERS[opt], **kw)


def _keys(rng, n, low=-2**62, high=2**62):
    return np.unique(rng.integers(low, high, n, dtype=np.int64))


# ---------------------------------------------------------------- initial rows
@pytest.mark.parametrize("init", sorted(INITIALIZERS))
def test_initial_rows_equal_init_rows(init):
    """Bit-equal to init_rows_np and to init_rows (TF) for 50k keys; log/cos of two libms
    may differ by an ulp in rare values (normal, truncated normal): counted, must be rare."""
    rng = np.random.default_rng(1)
    keys = np.concatenate([_keys(rng, 50_000), [0, -1, 2**63 - 1, -2**63, 1, 2]])
    spec = INITIALIZERS[init]
    table = EngineGroupTable("init_" + init, 16, spec, OPTIMIZERS["sgd"])
    got = table.lookup(keys).numpy()
    mismatches = {}
    for ref_name, ref in (("numpy", init_rows_np(keys, 16, spec)),
                          ("tf", init_rows(tf.constant(keys), 16, spec).numpy())):
        diff = got.view(np.int32) != ref.view(np.int32)
        mismatches[ref_name] = int(diff.sum())
        if init in ("uniform", "uniform_odd", "zeros"):
            assert mismatches[ref_name] == 0, (ref_name, np.argwhere(diff)[:5])
        else:
            # An ulp of float64 in log/cos moves a float32 result only on a rounding edge.
            assert mismatches[ref_name] <= 5, mismatches
            np.testing.assert_array_max_ulp(got, ref, maxulp=1)
    print(f"\ninitializer {init}: values differing from init_rows_np / init_rows "
          f"(of {got.size}): {mismatches}")
    assert int(table.size()) == 0  # lookups insert nothing


# ---------------------------------------------------------------- optimizers
def _tf_reference_step(opt, rows, slots, grads, step):
    new_rows, new_slots = opt.apply(tf.constant(rows), {n: tf.constant(v) for n, v in slots.items()},
                                    tf.constant(grads), tf.constant(step, tf.int64))
    return new_rows.numpy(), {n: v.numpy() for n, v in new_slots.items()}


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_optimizers_equal_tf_formulas(opt_name):
    """40 steps on random subsets of 300 keys: rows and slots equal the TF formulas
    (RowOptimizer.apply on the same rows) to 1e-6."""
    spec, dim = OPTIMIZERS[opt_name], 8
    table = EngineGroupTable("opt_" + opt_name, dim, INITIALIZERS["normal"], spec)
    opt = RowOptimizer.from_spec(spec)
    rng = np.random.default_rng(2)
    universe = _keys(rng, 300)
    ref_rows = {}
    ref_slots = {n: {} for n in opt.slot_names}
    for step in range(1, 41):
        keys = rng.choice(universe, 120, replace=False)
        grads = rng.normal(0, 1, (len(keys), dim)).astype(np.float32)
        init = init_rows_np(keys, dim, table.initializer)
        rows = np.stack([ref_rows.get(k, init[i]) for i, k in enumerate(keys)])
        slots = {n: np.stack([ref_slots[n].get(k, np.full(dim, v, np.float32)) for k in keys])
                 for n, v in opt.initial_slot_values.items()}
        want, want_slots = _tf_reference_step(opt, rows, slots, grads, step)
        _, got = table.apply_gradients(keys, grads, return_rows=True)
        _close(got.numpy(), want)
        for i, k in enumerate(keys):
            ref_rows[k] = want[i]
            for n in opt.slot_names:
                ref_slots[n][k] = want_slots[n][i]
    exported = table.export()
    order = exported["keys"].numpy()
    np.testing.assert_array_equal(order, np.sort(list(ref_rows)))
    _close(exported["values"].numpy(), [ref_rows[k] for k in order])
    for n in opt.slot_names:
        _close(exported[n].numpy(), [ref_slots[n][k] for k in order], n)


# ---------------------------------------------------------------- against TFRA + AccessStatistics
def _hashed(rng, n):
    """A CategoryHashResult of n received (id, category) pairs, and their accesses."""
    ids = tf.constant(rng.integers(0, 60, n), tf.int64)
    cats = tf.constant(rng.integers(0, len(CATEGORIES), n), tf.int32)
    return ops.category_hash(ids, cats, CATEGORIES), tf.constant(rng.integers(1, 4, n), tf.int64)


def _admitted_by(stats, table, min_counts):
    """The admission rule (TableSpec.admission's documented semantics), written here for
    the reference table."""
    def admitted(keys):
        cats, _ = stats.key_metadata(keys)
        need = tf.where(cats >= 0, tf.gather(min_counts, tf.maximum(cats, 0)), 0)
        return tf.logical_or(stats.counts_of(keys) >= need, table.contains(keys))
    return admitted


def _assert_same_state(eng, ref, eng_stats, ref_stats, probe):
    e, r = eng.export(), ref.export()
    np.testing.assert_array_equal(e["keys"].numpy(), r["keys"].numpy())
    for n in ["values"] + list(ref.slot_names):
        _close(e[n].numpy(), r[n].numpy(), n)
    _close(eng.lookup(probe).numpy(), ref.lookup(probe).numpy())
    assert int(eng.size()) == int(ref.size())
    np.testing.assert_array_equal(eng.contains(probe).numpy(), ref.contains(probe).numpy())
    es, rs = eng_stats.export(), ref_stats.export()
    for k in rs:
        np.testing.assert_array_equal(es[k], rs[k], err_msg=k)
    np.testing.assert_array_equal(eng_stats.known_keys(), ref_stats.known_keys())
    assert int(eng_stats.size()) == int(ref_stats.size())
    assert eng_stats.metrics() == ref_stats.metrics()
    for c in CATEGORIES:
        assert eng_stats.top_k(c, 5) == ref_stats.top_k(c, 5)
    for got, want in zip(eng_stats.key_metadata(probe), ref_stats.key_metadata(probe)):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    np.testing.assert_array_equal(eng_stats.counts_of(probe).numpy(),
                                  ref_stats.counts_of(probe).numpy())


@pytest.mark.tfra  # the reference is the TFRA-backed DynamicGroupTable
@pytest.mark.parametrize("opt_name,admission", [("adagrad", False), ("adam", True),
                                                ("ftrl", True), ("sgd", False)])
def test_same_sequence_as_dynamic_table_and_access_statistics(opt_name, admission):
    """Records, updates (with and without admission), lookups, row removals, statistics
    removals, registers and loads: the engine pair and the TFRA pair agree at every step
    (rows to 1e-6, statistics exactly)."""
    spec, dim = OPTIMIZERS[opt_name], 4
    eng = EngineGroupTable(f"seq_{opt_name}", dim, INITIALIZERS["uniform"], spec)
    ref = DynamicGroupTable(f"seq_{opt_name}", dim, INITIALIZERS["uniform"], spec)
    eng_stats = EngineStatistics("seq", CATEGORIES, eng.engine)
    ref_stats = AccessStatistics("seq", CATEGORIES)
    min_counts = tf.constant([1, 3, 5], tf.int64)
    if admission:
        eng.set_admission(min_counts)
        ref.set_admission_filter(_admitted_by(ref_stats, ref, min_counts))
    rng = np.random.default_rng(3)
    direct_keys = tf.constant([11, 12, 13], tf.int64)  # never recorded: never filtered
    for step in range(1, 26):
        hashed, accesses = _hashed(rng, 80)
        for stats in (eng_stats, ref_stats):
            stats.record(hashed, accesses, None if step % 7 == 0 else ref.step + 1)
        keys = tf.concat([hashed.lookup_keys, direct_keys], 0)
        grads = tf.constant(rng.normal(0, 1, (keys.shape[0], dim)), tf.float32)
        _, got = eng.apply_gradients(keys, grads, return_rows=True)
        _, want = ref.apply_gradients(keys, grads, return_rows=True)
        _close(got.numpy(), want.numpy())
        if step % 5 == 0:  # eviction-like: rows and statistics of some keys leave
            gone = ref_stats.known_keys()[::4]
            for table, stats in ((eng, eng_stats), (ref, ref_stats)):
                table.remove(tf.constant(gone))
                stats.remove(gone)
        if step % 6 == 0:  # rows only (statistics stay), then a register of others
            gone = tf.constant(ref_stats.known_keys()[1::5])
            eng.remove(gone)
            ref.remove(gone)
            new = np.array([101, 102, 103], np.int64) * (step + 1)
            for stats in (eng_stats, ref_stats):
                stats.register(new, [0, 1, 2], [7, 8, 9], step=step)
        if step % 8 == 0:
            keys = np.array([5000, 5001], np.int64) + step
            for stats in (eng_stats, ref_stats):
                stats.load(keys, [3, 4], [2, 0], [1, 2], last_steps=[step, step + 1])
                stats.load(keys[:1], [1], [1], [5])
        probe = tf.concat([keys, tf.constant(rng.integers(-50, 50, 20), tf.int64)], 0)
        _assert_same_state(eng, ref, eng_stats, ref_stats, probe)
    assert int(eng.size()) > 0 and int(eng_stats.size()) > 0


def test_admission_semantics():
    """A tracked key below its table's min_count is not stored and returns its initial
    row; it is stored once its count is reached; stored and never-recorded keys always
    are."""
    t = _engine_table(dim=4, opt="sgd")
    stats = EngineStatistics("adm", CATEGORIES, t.engine)
    t.set_admission([2, 1, 1])
    t.engine.record([1, 2], [0, 1], [10, 20], [1, 1], 1, overwrite_last_step=True)
    keys = tf.constant([1, 2, 3], tf.int64)  # 1: count 1 < 2; 2: admitted; 3: never recorded
    _, rows = t.apply_gradients(keys, tf.ones([3, 4]), return_rows=True)
    init = init_rows_np([1, 2, 3], 4, t.initializer)
    np.testing.assert_array_equal(rows.numpy()[0], init[0])
    np.testing.assert_allclose(rows.numpy()[1:], init[1:] - 0.3, rtol=1e-6)
    np.testing.assert_array_equal(t.contains(keys).numpy(), [False, True, True])
    assert int(stats.size()) == 2 and int(t.size()) == 2
    t.engine.record([1], [0], [10], [1], 2, overwrite_last_step=True)  # count 2 reached
    t.apply_gradients(keys, tf.ones([3, 4]))
    np.testing.assert_array_equal(t.contains(keys).numpy(), [True, True, True])
    np.testing.assert_allclose(t.lookup([1]).numpy()[0], init[0] - 0.3, rtol=1e-6)
    t.set_admission(None)
    with pytest.raises(ValueError, match="min_counts"):
        t.set_admission([-1])


def test_admission_table_outside_min_counts_is_an_error():
    t = _engine_table(dim=2, opt="sgd")
    t.engine.record([4], [2], [4], [1], 1, overwrite_last_step=True)
    t.set_admission([1])
    with pytest.raises(tf.errors.InvalidArgumentError, match="table 2.*min_counts has 1"):
        t.apply_gradients([4], tf.ones([1, 2]))


# ---------------------------------------------------------------- export / load / graph mode
@pytest.mark.parametrize("opt_name", ["adam", "sgd"])
def test_export_load_round_trip(opt_name):
    rng = np.random.default_rng(4)
    src = _engine_table(dim=6, opt=opt_name, name="src")
    src_stats = EngineStatistics("src", CATEGORIES, src.engine)
    keys = _keys(rng, 500, -1000, 1000)
    src.apply_gradients(keys, rng.normal(0, 1, (len(keys), 6)).astype(np.float32))
    src_stats.register(keys[:100], np.arange(100) % 3, keys[:100] * 2, step=3)
    exported, stats = src.export(), src_stats.export()
    dst = _engine_table(dim=6, opt=opt_name, name="dst")
    dst_stats = EngineStatistics("dst", CATEGORIES, dst.engine)
    dst.load(exported)
    dst_stats.load(stats["keys"], stats["counts"], stats["categories"], stats["ids"],
                   stats["last_steps"])
    again = dst.export()
    for k in exported:
        np.testing.assert_array_equal(again[k].numpy(), exported[k].numpy(), err_msg=k)
    for k, v in dst_stats.export().items():
        np.testing.assert_array_equal(v, stats[k], err_msg=k)
    some = tf.constant(np.concatenate([keys[::7], [10**6]]))  # export of candidate keys
    partial = src.export(some)
    np.testing.assert_array_equal(partial["keys"].numpy(), np.sort(keys[::7]))
    np.testing.assert_array_equal(partial["values"].numpy(),
                                  src.lookup(partial["keys"]).numpy())


@pytest.mark.parametrize("budget", [None, 0, 4000])
def test_stored_keys_are_the_exported_keys(budget, tmp_path):
    """The engine's key list (what an export enumerates its rows by) holds exactly the keys
    its full export holds, sorted, from either tier: none only recorded (statistics
    without a row), none removed, none twice when a block was read back from the SSD tier."""
    rng = np.random.default_rng(9)
    table = _engine_table(dim=4, name=f"keys{budget}", memory_budget_bytes=budget,
                          spill_path=None if budget is None else str(tmp_path / "spill"))
    stats = EngineStatistics("keys", CATEGORIES, table.engine)
    keys = _keys(rng, 3000)
    grads = rng.normal(0, 1, (len(keys), 4)).astype(np.float32)
    for at in range(0, len(keys), 50):  # 3,000 bytes of blocks an update: within the budget
        table.apply_gradients(keys[at:at + 50], grads[at:at + 50])
    table.lookup(keys[::3])  # read back from the SSD tier where there is one
    table.remove(keys[:50])
    recorded_only = _keys(rng, 40, 2**62, 2**63 - 1)
    stats.register(recorded_only, np.zeros(40, np.int64), recorded_only, step=1)
    want = np.sort(np.setdiff1d(keys, keys[:50]))
    np.testing.assert_array_equal(table.stored_keys(stats.known_keys), want)
    np.testing.assert_array_equal(table.export()["keys"].numpy(), want)
    np.testing.assert_array_equal(table.engine.stored_keys().numpy(), want)


def test_graph_mode_equals_eager():
    rng = np.random.default_rng(5)
    eager, graph = _engine_table(name="eager"), _engine_table(name="graph")
    stats = EngineStatistics("graph", CATEGORIES, graph.engine)

    @tf.function
    def train_step(keys, grads, hashed, accesses):
        stats.record(hashed, accesses, graph.step + 1)
        _, rows = graph.apply_gradients(keys, grads, return_rows=True)
        return rows, graph.lookup(keys)

    for _ in range(5):
        hashed, accesses = _hashed(rng, 50)
        keys = hashed.lookup_keys
        grads = tf.constant(rng.normal(0, 1, (keys.shape[0], 8)), tf.float32)
        rows, looked = train_step(keys, grads, hashed, accesses)
        _, want = eager.apply_gradients(keys, grads, return_rows=True)
        np.testing.assert_array_equal(rows.numpy(), want.numpy())
        np.testing.assert_array_equal(looked.numpy(), want.numpy())
    assert int(stats.size()) == int(graph.size())


# ---------------------------------------------------------------- errors, memory, lifetime
def test_clear_errors():
    t = _engine_table(dim=4)
    with pytest.raises(ValueError, match=r"grads must be float32\[u, 4\]"):
        t.apply_gradients([1, 2], tf.ones([2, 3]))
    with pytest.raises(TypeError, match="keys must be int64"):
        t.lookup(tf.constant([1.0]))
    with pytest.raises(tf.errors.InvalidArgumentError, match="init_keys must have one entry per key"):
        t.engine.lookup([1, 2], [1])
    with pytest.raises(tf.errors.InvalidArgumentError, match="tables.*not in"):
        t.engine.record([1], [-1], [1], [1], 0, overwrite_last_step=False)
    with pytest.raises(tf.errors.InvalidArgumentError, match="counts.*negative"):
        t.engine.record([1], [0], [1], [-1], 0, overwrite_last_step=False)
    with pytest.raises(tf.errors.InvalidArgumentError, match="does not fit the engine's int32"):
        t.engine.record([1], [0], [1], [1], 2**31, overwrite_last_step=True)
    assert int(t.engine.size().tracked) == 0  # refused before any write
    with pytest.raises(tf.errors.InvalidArgumentError, match="key 77 has no stored row"):
        t.engine.gather_rows([77])
    with pytest.raises(ValueError, match="num_shards must be a power of two"):
        EngineGroupTable("bad", 4, InitializerSpec(), OPTIMIZERS["sgd"], num_shards=3)
    with pytest.raises(tf.errors.InvalidArgumentError, match="unknown optimizer 'rmsprop'"):
        _loader.raw_op("EngineHandle")(dim=4, optimizer="rmsprop", learning_rate=0.1,
                                       initializer="zeros", init_params=["0", "0"],
                                       shared_name="bad_opt")
    with pytest.raises(tf.errors.InvalidArgumentError, match="unknown initializer 'ones'"):
        _loader.raw_op("EngineHandle")(dim=4, optimizer="sgd", learning_rate=0.1,
                                       initializer="ones", init_params=["0", "0"],
                                       shared_name="bad_init")
    with pytest.raises(tf.errors.InvalidArgumentError, match="dim 5 differs from the engine's dim 4"):
        _loader.raw_op("EngineLookup")(t.engine.resource_handle, [1], [1], dim=5)


def test_statistics_and_rows_are_one_block():
    """Removing a row keeps its statistics and vice versa; a block leaves when both go."""
    t = _engine_table(dim=2, opt="sgd")
    stats = EngineStatistics("one", CATEGORIES, t.engine)
    t.apply_gradients([1, 2], tf.ones([2, 2]))
    stats.register([2, 3], [0, 1], [20, 30], step=4)
    size = t.engine.size()
    assert (int(size.stored), int(size.tracked)) == (2, 2)
    t.remove([2])
    assert int(stats.size()) == 2 and int(t.size()) == 1
    np.testing.assert_array_equal(stats.key_metadata([2])[1].numpy(), [20])
    stats.remove(np.array([1, 2, 3], np.int64))  # 1 untracked: ignored
    assert int(stats.size()) == 0 and int(t.size()) == 1
    np.testing.assert_array_equal(t.contains([1, 2, 3]).numpy(), [True, False, False])
    export = t.engine.export(stored_only=False, with_rows=False)
    np.testing.assert_array_equal(export.keys.numpy(), [1])  # blocks of 2 and 3 are gone


def test_bytes_held_grows_with_rows():
    t = _engine_table(dim=16, num_shards=4)
    assert int(t.bytes_held()) == 0
    t.apply_gradients(np.arange(20_000, dtype=np.int64), tf.zeros([20_000, 16]))
    held = int(t.bytes_held())
    # 28-byte header + 2 x 64 bytes payload, plus a 5-byte index slot per capacity
    # (5,000 keys per shard: capacity 8,191, 8.2 bytes per key).
    assert 156 * 20_000 <= held <= 168 * 20_000, held


def test_engine_is_destroyed_with_its_object():
    t = _engine_table(dim=2, name="lifetime")
    t.apply_gradients([1, 2, 3], tf.ones([3, 2]))
    attrs = dict(t.engine._attrs)  # pylint: disable=protected-access

    def stored_via_new_handle():
        handle = _loader.raw_op("EngineHandle")(**attrs)
        stored = int(_loader.raw_op("EngineSize")(handle)[0])
        tf.raw_ops.DestroyResourceOp(resource=handle, ignore_lookup_error=True)
        return stored

    assert int(_loader.raw_op("EngineSize")(t.engine.resource_handle)[0]) == 3
    del t
    gc.collect()
    assert stored_via_new_handle() == 0  # the old engine is gone: a fresh one is empty


def test_two_tables_of_one_name_do_not_share_rows():
    a, b = _engine_table(name="same"), _engine_table(name="same")
    a.apply_gradients([1], tf.ones([1, 8]))
    assert int(a.size()) == 1 and int(b.size()) == 0


def test_init_params_are_exact_float64():
    """The initializer's float64 parameters reach the kernel exactly (text attrs)."""
    spec = InitializerSpec.uniform(-0.1, 0.1 + 1e-12)
    loc, scale = initializers._params(spec)  # pylint: disable=protected-access
    engine = EmbeddingEngine("exact", 4, spec, (loc, scale), OPTIMIZERS["sgd"])
    keys = np.arange(1000, dtype=np.int64)
    np.testing.assert_array_equal(engine.lookup(keys, keys).numpy(), init_rows_np(keys, 4, spec))
