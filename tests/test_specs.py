"""Tests of tf_fusedemb.specs: validation, the fusion planner and plan serialisation."""
import doctest
import json
import subprocess
import sys

import pytest

from tf_fusedemb import specs
from tf_fusedemb.specs import (FeatureSpec, FusedGroup, FusionPlan, InitializerSpec, OptimizerSpec,
                               TableSpec, plan_fusion, unfused_plan)

ADAGRAD = OptimizerSpec.adagrad(0.01)


def feature(name, dim=16, optimizer=ADAGRAD, table=None, **kw):
    """A feature with its own table named like the feature (unless ``table`` is given)."""
    table_kw = {k: kw.pop(k) for k in ("initializer", "vocabulary_size", "key_dtype") if k in kw}
    return FeatureSpec(name, TableSpec(table or name, dim, optimizer, **table_kw), **kw)


def criteo(n=26, **kw):
    return [feature(f"C{i}", **kw) for i in range(1, n + 1)]


# ---------------------------------------------------------------- specs and validation

def test_module_imports_without_tensorflow():
    code = "import sys, tf_fusedemb.specs; assert 'tensorflow' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_docstring_examples():
    assert doctest.testmod(specs).failed == 0


def test_optimizer_defaults_constructors_and_slots():
    assert OptimizerSpec("adam", 1e-3) == OptimizerSpec.adam(1e-3)
    assert OptimizerSpec("adagrad", 1, {"initial_accumulator_value": 0}) == OptimizerSpec.adagrad(1.0, 0.0)
    assert OptimizerSpec.adam(1e-3).hparams == {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-7}
    assert OptimizerSpec.ftrl(0.1, l1=0.5).hparams["l1"] == 0.5
    assert [OptimizerSpec(n, 0.1).slot_names for n in ("sgd", "adagrad", "adam", "ftrl")] == [
        (), ("accumulator",), ("m", "v"), ("accumulator", "linear")]
    assert OptimizerSpec.adam(1e-3, beta1=0.8) != OptimizerSpec.adam(1e-3)
    assert len({OptimizerSpec.sgd(0.1), OptimizerSpec.sgd(0.1), OptimizerSpec.sgd(0.2)}) == 2
    assert sorted([OptimizerSpec.sgd(0.2), OptimizerSpec.adam(0.1)])[0].name == "adam"


def test_initializer_defaults():
    assert InitializerSpec() == InitializerSpec.uniform(-0.05, 0.05)
    assert TableSpec("t", 4, ADAGRAD).initializer == InitializerSpec.uniform()
    assert InitializerSpec.truncated_normal(stddev=0.1).hparams == {"mean": 0.0, "stddev": 0.1}
    assert InitializerSpec.zeros().hparams == {}


@pytest.mark.parametrize("make, words", [
    (lambda: OptimizerSpec("rmsprop", 0.1), ["OptimizerSpec 'rmsprop'", "name"]),
    (lambda: OptimizerSpec.sgd(0), ["OptimizerSpec 'sgd'", "learning_rate"]),
    (lambda: OptimizerSpec.sgd(float("nan")), ["learning_rate", "finite"]),
    (lambda: OptimizerSpec.adam(0.1, beta1=1.0), ["OptimizerSpec 'adam'", "beta1"]),
    (lambda: OptimizerSpec("adam", 0.1, {"beta3": 0.5}), ["unknown hyper-parameter 'beta3'"]),
    (lambda: OptimizerSpec.ftrl(0.1, l2=-1), ["OptimizerSpec 'ftrl'", "l2"]),
    (lambda: InitializerSpec("glorot"), ["InitializerSpec 'glorot'", "name"]),
    (lambda: InitializerSpec.uniform(0.1, -0.1), ["InitializerSpec 'uniform'", "minval"]),
    (lambda: InitializerSpec.normal(stddev=0), ["InitializerSpec 'normal'", "stddev"]),
    (lambda: TableSpec("t1", 0, ADAGRAD), ["TableSpec 't1'", "dim"]),
    (lambda: TableSpec("t1", True, ADAGRAD), ["TableSpec 't1'", "dim"]),
    (lambda: TableSpec("t1", 8, "adagrad"), ["TableSpec 't1'", "optimizer"]),
    (lambda: TableSpec("t1", 8, ADAGRAD, initializer="uniform"), ["TableSpec 't1'", "initializer"]),
    (lambda: TableSpec("t1", 8, ADAGRAD, vocabulary_size=0), ["TableSpec 't1'", "vocabulary_size"]),
    (lambda: TableSpec("t1", 8, ADAGRAD, key_dtype="string"), ["TableSpec 't1'", "key_dtype"]),
    (lambda: TableSpec("a/b", 8, ADAGRAD), ["TableSpec", "name", "'a/b'"]),
    (lambda: TableSpec("", 8, ADAGRAD), ["TableSpec", "name"]),
    (lambda: feature("C3", combiner="max"),
     ["FeatureSpec 'C3': combiner 'max' is not one of ('sum', 'mean', 'sqrtn') or None"]),
    (lambda: feature("hist", combiner=None), ["FeatureSpec 'hist'", "max_len", "sequence"]),
    (lambda: feature("hist", combiner=None, max_len=0), ["FeatureSpec 'hist'", "max_len"]),
    (lambda: feature("C4", combiner="sum", max_len=5), ["FeatureSpec 'C4'", "max_len"]),
    (lambda: FeatureSpec("C5", "table"), ["FeatureSpec 'C5'", "table"]),
    (lambda: FeatureSpec("C/6", TableSpec("t", 8, ADAGRAD)), ["FeatureSpec", "name", "'C/6'"]),
])
def test_validation_messages_name_the_spec_and_field(make, words):
    with pytest.raises(ValueError) as err:
        make()
    for w in words:
        assert w in str(err.value)


def test_feature_spec_properties_and_key_dtype_normalisation():
    class FakeDType:  # stands in for tf.int32 / np.dtype("int32"), which have .name
        name = "int32"
    t = TableSpec("t", 8, ADAGRAD, key_dtype=FakeDType())
    assert t.key_dtype == "int32" and not t.is_static
    seq = FeatureSpec("hist", t, combiner=None, max_len=20)
    assert seq.is_sequence and seq.dim == 8 and not FeatureSpec("x", t).is_sequence


# ---------------------------------------------------------------- the planner

def test_criteo_26_features_fuse_into_one_group():
    plan = plan_fusion(criteo())
    assert plan.num_groups == 1
    g = plan.groups[0]
    assert g.name == "g0_d16_adagrad" and g.num_features == 26
    assert g.feature_names == tuple(f"C{i}" for i in range(1, 27))
    assert (g.dim, g.optimizer, g.initializer, g.key_dtype, g.is_static) == (
        16, ADAGRAD, InitializerSpec(), "int64", False)
    assert plan.group_of("C7") is g and g.vocabulary_sizes == (None,) * 26


def test_mixed_specs_group_in_first_occurrence_order():
    adam = OptimizerSpec.adam(1e-3)
    feats = [feature("a", 16), feature("b", 32), feature("c", 16), feature("d", 16, adam),
             feature("e", 32), feature("f", 16, initializer=InitializerSpec.normal()),
             feature("g", 16, vocabulary_size=100), feature("h", 16, key_dtype="int32"),
             feature("i", 16, OptimizerSpec.adagrad(0.02)), feature("j", 16, vocabulary_size=7),
             feature("k", 16, combiner=None, max_len=4)]  # pooling does not split a group
    plan = plan_fusion(feats)
    assert [(g.name, g.feature_names) for g in plan.groups] == [
        ("g0_d16_adagrad", ("a", "c", "k")), ("g1_d32_adagrad", ("b", "e")), ("g2_d16_adam", ("d",)),
        ("g3_d16_adagrad", ("f",)), ("g4_d16_adagrad", ("g", "j")), ("g5_d16_adagrad", ("h",)),
        ("g6_d16_adagrad", ("i",))]
    static = plan.group_of("j")
    assert static.is_static and static.vocabulary_sizes == (100, 7)  # each feature keeps its range
    assert plan.feature_names == ("a", "c", "k", "b", "e", "d", "f", "g", "j", "h", "i")
    assert "g1_d32_adagrad" in plan.describe() and "b, e" in plan.describe()
    with pytest.raises(KeyError, match="'zz'"):
        plan.group_of("zz")


def test_duplicate_feature_names_rejected():
    with pytest.raises(ValueError, match="FeatureSpec 'C1': feature name is used twice"):
        plan_fusion(criteo(3) + [feature("C1")])


def test_overrides_honored():
    plan = plan_fusion(criteo(4), overrides={"C2": "hot", "C4": "hot"})
    assert [(g.name, g.feature_names) for g in plan.groups] == [
        ("g0_d16_adagrad", ("C1", "C3")), ("hot", ("C2", "C4"))]


def test_conflicting_override_rejected_naming_both_features():
    feats = [feature("u", 16), feature("v", 32)]
    with pytest.raises(ValueError) as err:
        plan_fusion(feats, overrides={"u": "x", "v": "x"})
    assert "'u'" in str(err.value) and "'v'" in str(err.value) and "'x'" in str(err.value)
    with pytest.raises(ValueError, match="'nope'"):
        plan_fusion(feats, overrides={"nope": "x"})
    with pytest.raises(ValueError, match="name"):
        plan_fusion(feats, overrides={"u": "a/b"})
    with pytest.raises(ValueError, match="group name is used twice"):
        plan_fusion(criteo(2), overrides={"C2": "g0_d16_adagrad"})


def test_shared_table_features_stay_together():
    item = TableSpec("item", 16, ADAGRAD)
    feats = [FeatureSpec("target_item", item), feature("user"),
             FeatureSpec("history", item, combiner=None, max_len=50), feature("ctx", 32)]
    g = plan_fusion(feats).group_of("history")
    assert g.feature_names == ("target_item", "user", "history")
    assert g.shared_tables == {"item": ("target_item", "history")}
    assert [t.name for t in g.tables] == ["item", "user"] and g.table_index == (0, 1, 0)
    # An override of one feature takes the features sharing its table along ...
    g = plan_fusion(feats, overrides={"history": "items"}).group_of("target_item")
    assert (g.name, g.feature_names) == ("items", ("target_item", "history"))
    # ... and two overrides that would split the table are an error.
    with pytest.raises(ValueError, match="'target_item': shares table 'item' with FeatureSpec 'history'"):
        plan_fusion(feats, overrides={"history": "a", "target_item": "b"})
    # One table name must mean one spec.
    with pytest.raises(ValueError, match="FeatureSpec 'b'.*table 'item'.*FeatureSpec 'a'"):
        plan_fusion([FeatureSpec("a", item), FeatureSpec("b", TableSpec("item", 8, ADAGRAD))])
    # A hand-built plan cannot split a table either.
    with pytest.raises(ValueError, match="different groups"):
        FusionPlan((FusedGroup("x", (feats[0],)), FusedGroup("y", (feats[2],))))


def test_fused_group_rejects_mixed_specs():
    with pytest.raises(ValueError, match="FeatureSpec 'b' and FeatureSpec 'a'"):
        FusedGroup("g", (feature("a", 16), feature("b", 8)))


def test_max_group_features_splits_without_splitting_tables():
    plan = plan_fusion(criteo(5), max_group_features=2)
    assert [g.feature_names for g in plan.groups] == [("C1", "C2"), ("C3", "C4"), ("C5",)]
    assert [g.name for g in plan.groups] == ["g0_d16_adagrad", "g1_d16_adagrad", "g2_d16_adagrad"]
    t = TableSpec("t", 16, ADAGRAD)
    feats = [feature("a"), FeatureSpec("b", t), FeatureSpec("c", t)]
    assert [g.feature_names for g in plan_fusion(feats, max_group_features=2).groups] == [("a",), ("b", "c")]
    with pytest.raises(ValueError, match="TableSpec 't'.*3 features"):
        plan_fusion(feats + [FeatureSpec("d", t)], max_group_features=2)


def test_determinism_and_fingerprint():
    a, b = plan_fusion(criteo()), plan_fusion(criteo())
    assert a == b and a.fingerprint() == b.fingerprint() and len(a.fingerprint()) == 64
    assert a.fingerprint() != plan_fusion(criteo(dim=8)).fingerprint()
    assert a.fingerprint() != plan_fusion(criteo(optimizer=OptimizerSpec.adagrad(0.02))).fingerprint()
    assert a.fingerprint() != plan_fusion(criteo(combiner="mean")).fingerprint()
    # Order is part of the plan: every rank must pass the features in the same order.
    assert a.fingerprint() != plan_fusion(criteo()[::-1]).fingerprint()
    # int vs float hyper-parameters canonicalise to the same plan.
    ints = [feature(f"C{i}", optimizer=OptimizerSpec("adagrad", 1)) for i in range(3)]
    floats = [feature(f"C{i}", optimizer=OptimizerSpec.adagrad(1.0)) for i in range(3)]
    assert plan_fusion(ints).fingerprint() == plan_fusion(floats).fingerprint()


def test_to_dict_from_dict_round_trip():
    item = TableSpec("item", 32, OptimizerSpec.ftrl(0.05, l1=0.01), InitializerSpec.normal(0.0, 0.01),
                     vocabulary_size=1000, key_dtype="int32")
    feats = criteo(4) + [FeatureSpec("target", item, "mean"),
                         FeatureSpec("hist", item, None, 20), feature("x", 8, OptimizerSpec.adam(1e-3))]
    plan = plan_fusion(feats, overrides={"C3": "solo"})
    restored = FusionPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert restored == plan and restored.fingerprint() == plan.fingerprint()
    assert restored.describe() == plan.describe()
    with pytest.raises(ValueError, match="format"):
        FusionPlan.from_dict({"format": 99, "groups": []})


def test_unfused_plan_one_group_per_table():
    shared = TableSpec("shared", 16, ADAGRAD)
    feats = criteo(3) + [FeatureSpec("s1", shared), FeatureSpec("s2", shared)]
    plan = unfused_plan(feats)
    assert [(g.name, g.feature_names) for g in plan.groups] == [
        ("C1", ("C1",)), ("C2", ("C2",)), ("C3", ("C3",)), ("shared", ("s1", "s2"))]
    assert unfused_plan(criteo(26)).num_groups == 26 and plan_fusion([]).num_groups == 0


# ---------------------------------------------------------------- storage backends

def test_storage_is_validated_and_defaults_per_kind():
    assert TableSpec("t", 4, ADAGRAD).storage == specs.DEFAULT_STORAGE
    assert TableSpec("t", 4, ADAGRAD, vocabulary_size=10).storage == "static"
    for storage in specs.STORAGES:
        assert TableSpec("t", 4, ADAGRAD, storage=storage).storage == storage
    with pytest.raises(ValueError, match=r"TableSpec 'clicks': storage 'rocksdb' is not one of "
                                         r"\('engine', 'tfra'\)"):
        TableSpec("clicks", 4, ADAGRAD, storage="rocksdb")
    with pytest.raises(ValueError, match="TableSpec 'v': storage 'engine' is for dynamic tables"):
        TableSpec("v", 4, ADAGRAD, vocabulary_size=10, storage="engine")


def test_tables_of_different_storage_never_fuse():
    engine = [FeatureSpec(f"E{i}", TableSpec(f"E{i}", 16, ADAGRAD, storage="engine"))
              for i in range(2)]
    tfra = [FeatureSpec(f"T{i}", TableSpec(f"T{i}", 16, ADAGRAD, storage="tfra")) for i in range(2)]
    plan = plan_fusion([engine[0], tfra[0], engine[1], tfra[1]])
    assert [(g.feature_names, g.storage) for g in plan.groups] == [
        (("E0", "E1"), "engine"), (("T0", "T1"), "tfra")]
    with pytest.raises(ValueError, match="different specs .*storage"):
        plan_fusion([engine[0], tfra[0]], overrides={"E0": "g", "T0": "g"})
    with pytest.raises(ValueError, match="different specs .*storage"):
        FusedGroup("g", (engine[0], tfra[0]))


def test_storage_round_trips_and_is_outside_the_layout_fingerprint():
    def plan(storage):
        return plan_fusion([FeatureSpec(n, TableSpec(n, 8, ADAGRAD, storage=storage))
                            for n in ("a", "b")])
    other = next(s for s in specs.STORAGES if s != specs.DEFAULT_STORAGE)
    default, explicit, chosen = plan(None), plan(specs.DEFAULT_STORAGE), plan(other)
    assert default == explicit and default.fingerprint() == explicit.fingerprint()
    assert "storage" not in str(default.to_dict())  # the default keeps old plans' dicts
    restored = FusionPlan.from_dict(json.loads(json.dumps(chosen.to_dict())))
    assert restored == chosen and restored.groups[0].storage == other
    assert FeatureSpec.from_dict(chosen.groups[0].features[0].to_dict()).table.storage == other
    # Ranks must agree on it; a checkpoint restores onto either backend.
    assert chosen.fingerprint() != default.fingerprint()
    assert chosen.fingerprint(policies=False) == default.fingerprint(policies=False)
    assert "storage" not in str(chosen.to_dict(policies=False))
