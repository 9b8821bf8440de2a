"""Admission and eviction per table (issue 13, part 3): training with the policies equals
an independent numpy reference applying the same policies, on 1 and 2 ranks; the
policies' state (rows, slots, counts, last steps) survives checkpoints and resharding;
an export serves evicted and never-admitted keys their initial rows; and over 1,000
steps of a Zipf stream of ever-new IDs the memory stays bounded by the policy while
without one it grows.

The reference knows nothing of the library but the deterministic initial row of a
(table, ID) (``init_rows_np`` of the hashed key: the contract every table honours) and
Adagrad's formula; it keeps one dict of rows and one of statistics per table.

The one-process tests run on both dynamic storage backends (``TableSpec.storage``,
passed explicitly); the two-rank test on the default one.
"""
import os

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from conftest import storage_params
from tf_fusedemb.ops import hashing
from tf_fusedemb.specs import (STORAGES, AdmissionPolicy, EvictionPolicy, FeatureSpec,
                               FusionPlan, InitializerSpec, OptimizerSpec, TableSpec, plan_fusion)
from tf_fusedemb.storage.initializers import init_rows_np
from tf_fusedemb.storage.optimizers import ADAGRAD_EPSILON
from tf_fusedemb.testing import DistributedTestCase
from tf_fusedemb.testing.distributed import BatchLosses, rank_bounds, rank_dataset

NAMES = ("u", "v", "w")
DIM, LR, ACC0 = 4, 0.3, 0.1
INIT = InitializerSpec.uniform(-0.1, 0.1)
# u: admission after 3 accesses and a TTL; w: admission after 2 and a cap evaluated every
# 2 steps; v: no policy. One fused group: policies are per table inside it.
POLICIES = {"u": dict(admission=AdmissionPolicy(3), eviction=EvictionPolicy(ttl_steps=3)),
            "w": dict(admission=AdmissionPolicy(2),
                      eviction=EvictionPolicy(max_rows=12, every_steps=2)),
            "v": {}}
STEPS, HALF, GLOBAL_BATCH = 24, 12, 16


# ---------------------------------------------------------------- model and data
def table_specs(policies=True, storage=None):
    return [TableSpec(n, DIM, OptimizerSpec.adagrad(LR), INIT, storage=storage,
                      **(POLICIES[n] if policies else {}))
            for n in NAMES]


def build_model(policies=True, pipeline=None, storage=None):
    """(compiled FusedModel, its FusedEmbedding): logits = sum of the three embeddings."""
    from tf_fusedemb.layers import FusedEmbedding  # pylint: disable=import-outside-toplevel
    from tf_fusedemb.models import FusedModel  # pylint: disable=import-outside-toplevel
    layer = FusedEmbedding([FeatureSpec(t.name, t) for t in table_specs(policies, storage)])
    inputs = {n: tf_keras.Input([], dtype=tf.int64, name=n) for n in NAMES}
    emb = layer(inputs)
    logits = tf_keras.layers.Dense(1, use_bias=False, kernel_initializer="ones", trainable=False)(
        tf_keras.layers.Concatenate()([emb[n] for n in NAMES]))
    model = FusedModel(inputs, logits)
    model.compile(optimizer=tf_keras.optimizers.SGD(0.1), pipeline=pipeline,
                  loss=tf_keras.losses.BinaryCrossentropy(from_logits=True))
    return model, layer


def data(steps=STEPS):
    """(x {name: int64[steps * G]}, y float32[steps * G, 1]): u's window of IDs moves
    every 4 steps and comes back after 12 (the TTL evicts, evicted IDs return), w spreads
    over 40 IDs (the cap matters), v is plain."""
    rng = np.random.default_rng(7)
    n = steps * GLOBAL_BATCH
    step = np.repeat(np.arange(steps), GLOBAL_BATCH)
    x = {"u": rng.integers(0, 10, n) + (step // 4 % 3) * 5, "v": rng.integers(0, 20, n),
         "w": np.where(rng.random(n) < 0.5, rng.integers(0, 6, n), rng.integers(0, 40, n))}
    return {k: v.astype(np.int64) for k, v in x.items()}, \
        (rng.random((n, 1)) < 0.5).astype(np.float32)


def batches(x, y, first, last):
    """Global batches [first, last) of (x, y)."""
    lo, hi = first * GLOBAL_BATCH, last * GLOBAL_BATCH
    return {k: v[lo:hi] for k, v in x.items()}, y[lo:hi]


# ---------------------------------------------------------------- the reference
class Reference:
    """Plain numpy training with the same policies: rows[table][ID] = [row, accumulator],
    stats[table][ID] = [count, last step]."""

    def __init__(self):
        self.rows = {n: {} for n in NAMES}
        self.stats = {n: {} for n in NAMES}
        self.step = 0
        # The policies did something (the test is not vacuous): updates refused, keys
        # evicted, evicted keys stored again (from their initial row and slots).
        self.refused = self.evicted = self.readmitted = 0
        self.gone = set()

    def row(self, table, i):
        if i in self.rows[table]:
            return self.rows[table][i][0]
        key = hashing.hashed_unified_keys(np.array([i]), [table])
        return init_rows_np(key, DIM, INIT)[0]

    def predict(self, x):
        return sum(np.stack([self.row(n, int(i)) for i in x[n]]).astype(np.float64).sum(1)
                   for n in NAMES)

    def train_step(self, x, y):
        self.step = t = self.step + 1
        z, y = self.predict(x), y[:, 0].astype(np.float64)
        loss = np.mean(np.maximum(z, 0) - z * y + np.log1p(np.exp(-np.abs(z))))
        dz = (1 / (1 + np.exp(-z)) - y) / len(y)
        for n in NAMES:
            min_count = POLICIES[n]["admission"].min_count if "admission" in POLICIES[n] else 0
            for i in x[n]:
                entry = self.stats[n].setdefault(int(i), [0, 0])
                entry[0], entry[1] = entry[0] + 1, t
            for i in sorted(set(x[n].tolist())):
                g = np.full(DIM, dz[x[n] == i].sum(), np.float32)
                if i not in self.rows[n] and self.stats[n][i][0] < min_count:
                    self.refused += 1
                    continue
                self.readmitted += (n, i) in self.gone and i not in self.rows[n]
                row, acc = self.rows[n].get(i, (self.row(n, i), np.full(DIM, ACC0, np.float32)))
                acc = acc + g * g
                self.rows[n][i] = [row + (np.float32(-LR) * g) / np.sqrt(acc + np.float32(ADAGRAD_EPSILON)),
                                   acc]
        self.evict(t)
        return loss

    def evict(self, t):
        for n in NAMES:
            policy = POLICIES[n].get("eviction")
            if policy is None or t % policy.every_steps:
                continue
            stats = self.stats[n]
            gone = [i for i, (_, last) in stats.items()
                    if policy.ttl_steps is not None and t - last > policy.ttl_steps]
            if policy.max_rows is not None:
                alive = sorted((c, last, i) for i, (c, last) in stats.items() if i not in gone)
                gone += [i for _, _, i in alive[:max(0, len(alive) - policy.max_rows)]]
            for i in gone:
                if i in self.rows[n]:
                    self.gone.add((n, i))
                del stats[i]
                self.rows[n].pop(i, None)
                self.evicted += 1

    def stored(self):
        """{table: sorted stored IDs}."""
        return {n: sorted(self.rows[n]) for n in NAMES}


def reference_run(x, y, steps):
    ref, losses, stored = Reference(), [], []
    for s in range(steps):
        losses.append(ref.train_step(*batches(x, y, s, s + 1)))
        stored.append(ref.stored())
    return ref, losses, stored


# ---------------------------------------------------------------- library side
def by_table(rows):
    """{table: {ID: (row, accumulator)}} of StoredRows.arrays() dicts (one per rank)."""
    out = {n: {} for n in NAMES}
    for r in rows:
        for t, i, v, a in zip(r["tables"], r["ids"], r["values"], r["accumulator"]):
            out[NAMES[t]][int(i)] = (v, a)
    return out


def stats_by_table(exports):
    """{table: {ID: (count, last step)}} of AccessStatistics.export() dicts."""
    out = {n: {} for n in NAMES}
    for e in exports:
        for c, i, n, last in zip(e["categories"], e["ids"], e["counts"], e["last_steps"]):
            out[NAMES[c]][int(i)] = (int(n), int(last))
    return out


class StoredIds(tf_keras.callbacks.Callback):
    """After every training batch (and its eviction): {table: stored IDs on this rank}."""

    def __init__(self, layer):
        super().__init__()
        self.layer, self.per_step = layer, []

    def on_train_batch_end(self, batch, logs=None):
        rows = self.layer.groups[0].store.stored_rows()
        self.per_step.append({n: sorted(rows.ids[rows.tables == t].tolist())
                              for t, n in enumerate(NAMES)})


def fit_rank(x, y, first, last, num_ranks=1, rank=0, model=None):
    """Fits global batches [first, last) on this rank's share; returns what the checks
    need: per-batch losses, per-step stored IDs, final rows and statistics."""
    model, layer = model or build_model()
    xs, ys = batches(x, y, first, last)
    shares = [GLOBAL_BATCH // num_ranks] * num_ranks
    losses, ids = BatchLosses(), StoredIds(layer)
    model.fit(rank_dataset((xs, ys), rank_bounds(len(ys), shares, rank)), epochs=1, verbose=0,
              callbacks=[losses, ids])
    out = {"losses": losses.losses, "stored": ids.per_step,
           "rows": layer.groups[0].store.stored_rows().arrays(), "stats": layer.groups[0].store.statistics.export(),
           "step": int(layer.groups[0].store.table.step.numpy())}
    slots = getattr(layer.groups[0].store.table, "slots", None)  # TFRA: one more hash table each
    if slots is not None:  # (the engine keeps the slots in the row's block)
        out["slot_entries"] = int(slots["accumulator"].size().numpy())
    return out


def assert_matches(ref, results, losses=None, stored=None, offset=0):
    """Library results (one per rank) equal the reference: rows, slots, statistics and,
    if given, per-step losses and stored IDs (steps from ``offset``)."""
    if losses is not None:  # Keras logs the epoch's running mean (equal batch sizes)
        want = np.cumsum(losses[offset:]) / np.arange(1, len(losses) - offset + 1)
        for r in results:
            np.testing.assert_allclose(r["losses"], want, rtol=1e-5, atol=1e-6)
    if stored is not None:
        for s, want in enumerate(stored[offset:]):
            got = {n: sorted(sum((r["stored"][s][n] for r in results), [])) for n in NAMES}
            assert got == want, f"stored IDs after step {offset + s + 1}"
    for r in results:  # evicted rows took their slots with them
        assert r.get("slot_entries", len(r["rows"]["keys"])) == len(r["rows"]["keys"])
    rows = by_table([r["rows"] for r in results])
    stats = stats_by_table([r["stats"] for r in results])
    for n in NAMES:
        assert sorted(rows[n]) == sorted(ref.rows[n]), f"table {n}: stored IDs"
        for i, (value, acc) in ref.rows[n].items():
            np.testing.assert_allclose(rows[n][i][0], value, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(rows[n][i][1], acc, rtol=1e-5, atol=1e-6)
        assert stats[n] == {i: tuple(v) for i, v in ref.stats[n].items()}, f"table {n}: stats"


# ---------------------------------------------------------------- specs
def test_policy_specs_validate_and_round_trip():
    with pytest.raises(ValueError, match="min_count must be an int > 0"):
        AdmissionPolicy(0)
    with pytest.raises(ValueError, match="set ttl_steps, max_rows or both"):
        EvictionPolicy()
    with pytest.raises(ValueError, match="max_rows must be an int > 0 or None"):
        EvictionPolicy(max_rows=-1)
    with pytest.raises(ValueError, match="every_steps must be an int > 0"):
        EvictionPolicy(ttl_steps=1, every_steps=0)
    with pytest.raises(ValueError, match="'s': eviction policies need a dynamic table"):
        TableSpec("s", 4, OptimizerSpec.sgd(0.1), vocabulary_size=10,
                  eviction=EvictionPolicy(ttl_steps=5))
    with pytest.raises(ValueError, match="admission must be an AdmissionPolicy"):
        TableSpec("s", 4, OptimizerSpec.sgd(0.1), admission=3)
    with_policies = plan_fusion([FeatureSpec(t.name, t) for t in table_specs()])
    assert FusionPlan.from_dict(with_policies.to_dict()) == with_policies
    assert len(with_policies.groups) == 1  # different policies still fuse
    without = plan_fusion([FeatureSpec(t.name, t) for t in table_specs(False)])
    assert "admission" not in str(without.to_dict())  # old plans keep their fingerprint
    assert with_policies.fingerprint() != without.fingerprint()
    assert with_policies.fingerprint(policies=False) == without.fingerprint()
    _, layer = build_model()
    clone = type(layer).from_config(layer.get_config())
    assert [f.table for f in clone.features] == [f.table for f in layer.features]


# ---------------------------------------------------------------- one process
@pytest.mark.parametrize("storage", storage_params(STORAGES))
def test_training_equals_reference_with_admission_ttl_and_cap(storage):
    x, y = data()
    ref, losses, stored = reference_run(x, y, STEPS)
    assert ref.refused > 20 and ref.evicted > 20 and ref.readmitted > 5, \
        (ref.refused, ref.evicted, ref.readmitted)
    got = fit_rank(x, y, 0, STEPS, model=build_model(storage=storage))
    assert got["step"] == STEPS
    assert_matches(ref, [got], losses, stored)


@pytest.mark.parametrize("storage", storage_params(STORAGES))
def test_checkpoint_restore_continues_the_policy_and_export_serves_initial_rows(tmp_path,
                                                                                storage):
    from tf_fusedemb.inference import export_saved_model  # pylint: disable=import-outside-toplevel
    from tf_fusedemb.training import CheckpointManager  # pylint: disable=import-outside-toplevel
    x, y = data()
    model, layer = build_model(storage=storage)
    first = fit_rank(x, y, 0, HALF, model=(model, layer))
    CheckpointManager(str(tmp_path / "ckpt"), model, model.optimizer).save(HALF)

    fresh, fresh_layer = build_model(storage=storage)
    fresh({n: tf.zeros([0], tf.int64) for n in NAMES})
    CheckpointManager(str(tmp_path / "ckpt"), fresh, fresh.optimizer).restore()
    restored = fresh_layer.groups[0]
    assert int(restored.store.table.step.numpy()) == HALF
    for k, v in first["stats"].items():
        np.testing.assert_array_equal(restored.store.statistics.export()[k], v, err_msg=f"stats {k}")
    for k, v in first["rows"].items():
        np.testing.assert_array_equal(restored.store.stored_rows().arrays()[k], v, err_msg=f"rows {k}")

    # Training on from the restore takes the same admission and eviction decisions.
    ref, losses, stored = reference_run(x, y, STEPS)
    assert_matches(ref, [fit_rank(x, y, HALF, STEPS, model=(fresh, fresh_layer))], losses,
                   stored, offset=HALF)

    # The export: evicted, never admitted and never seen IDs read their initial rows.
    probe = {n: np.concatenate([x[n][-GLOBAL_BATCH:], np.arange(0, 60), [10 ** 9]]) for n in NAMES}
    kinds = {n: "scalar" for n in NAMES}
    want = fresh({n: tf.constant(v) for n, v in probe.items()}, training=False).numpy()[:, 0]
    np.testing.assert_allclose(want, ref.predict(probe), rtol=1e-5, atol=1e-5)
    path = export_saved_model(fresh, str(tmp_path / "export"), kinds)
    served = tf.saved_model.load(path).signatures["serving_default"](
        **{n: tf.constant(v) for n, v in probe.items()})["logits"].numpy()[:, 0]
    np.testing.assert_allclose(served, want, rtol=1e-6, atol=1e-6)


def test_pipelined_fit_refuses_policies():
    model, _ = build_model(pipeline="dbp")
    x, y = data(2)
    with pytest.raises(ValueError, match="policies need the synchronous step"):
        model.fit(x, y, batch_size=GLOBAL_BATCH, verbose=0)


def test_prefetching_pipeline_refuses_policies():
    """NestedPipeline used directly: prefetch with policies fails naming the group; the
    synchronous schedule is accepted."""
    from tf_fusedemb.pipeline import NestedPipeline, PipelineOptions  # pylint: disable=import-outside-toplevel
    model, layer = build_model()
    loss = tf_keras.losses.BinaryCrossentropy(from_logits=True)
    with pytest.raises(ValueError, match=f"policies need the synchronous step.*"
                                         f"{layer.groups[0].group.name}"):
        NestedPipeline(model, loss, tf_keras.optimizers.SGD(0.1), PipelineOptions(prefetch=True))
    NestedPipeline(model, loss, tf_keras.optimizers.SGD(0.1), PipelineOptions())


# ---------------------------------------------------------------- memory
def zipf_stream(steps, batch, seed=3):
    """int64[steps, batch]: Zipf(1.2) popularity; IDs past the head of 100 are new at
    every step (offset by the step), so the stream brings ever-new IDs."""
    rng = np.random.default_rng(seed)
    z = rng.zipf(1.2, (steps, batch)).astype(np.int64)
    return np.where(z <= 100, z, z + np.arange(steps)[:, None] * 10 ** 7)


MEMORY_STEPS, MEMORY_BATCH, CAP, TTL = 1000, 32, 150, 50


def memory_run(policy, storage):
    """Trains one table over the Zipf stream (one step per batch); returns per-step
    layer.memory() of the group, taken after each step's eviction."""
    from tf_fusedemb.layers import FusedEmbedding  # pylint: disable=import-outside-toplevel
    from tf_fusedemb.models import FusedModel  # pylint: disable=import-outside-toplevel
    extra = dict(admission=AdmissionPolicy(2),
                 eviction=EvictionPolicy(ttl_steps=TTL, max_rows=CAP)) if policy else {}
    layer = FusedEmbedding([FeatureSpec("item", TableSpec("item", 8, OptimizerSpec.adagrad(0.1),
                                                          storage=storage, **extra))])
    item = tf_keras.Input([], dtype=tf.int64, name="item")
    out = tf_keras.layers.Dense(1)(layer({"item": item})["item"])
    model = FusedModel({"item": item}, out)
    model.compile(optimizer="sgd", loss=tf_keras.losses.BinaryCrossentropy(from_logits=True))
    ids = zipf_stream(MEMORY_STEPS, MEMORY_BATCH).reshape(-1)
    memory = []
    record = tf_keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda b, logs: memory.append(layer.memory()[layer.groups[0].group.name]))
    model.fit({"item": ids}, (ids % 2).astype(np.float32), batch_size=MEMORY_BATCH, verbose=0,
              shuffle=False, callbacks=[record])
    return memory


@pytest.mark.timeout(600)
@pytest.mark.parametrize("storage", storage_params(STORAGES))
def test_memory_stays_bounded_over_1000_steps_of_new_ids(storage):
    bounded, unbounded = memory_run(True, storage), memory_run(False, storage)
    assert len(bounded) == len(unbounded) == MEMORY_STEPS
    rows = np.array([m["rows"] for m in bounded])
    tracked = np.array([m["tracked_keys"] for m in bounded])
    grown = np.array([m["rows"] for m in unbounded])
    print(f"\nrows after steps 100/500/1000: with policy {rows[[99, 499, 999]].tolist()} "
          f"(tracked keys {tracked[[99, 499, 999]].tolist()}, bytes "
          f"{[bounded[s]['bytes'] for s in (99, 499, 999)]}); without "
          f"{grown[[99, 499, 999]].tolist()} (bytes {[unbounded[s]['bytes'] for s in (99, 499, 999)]})")
    # Bounded: the cap holds after every step (rows and the statistics behind them).
    assert tracked.max() <= CAP and rows.max() <= CAP
    payload = CAP * (8 + 4 * 8 * 2 + 40)  # the TFRA backend's memory() counts the payload
    if storage == "engine":  # the bytes the engine holds: blocks in per-shard arenas and
        # the shards' index arrays, reused after eviction (no growth under the cap)
        assert max(m["bytes"] for m in bounded) <= 2 * payload
        assert bounded[-1]["bytes"] <= 1.25 * bounded[MEMORY_STEPS // 2 - 1]["bytes"]
    else:
        assert max(m["bytes"] for m in bounded) <= payload
    assert rows[-1] > CAP // 3  # and the table is still in use
    # Without a policy every new ID stays: linear growth, far past the cap.
    assert grown[-1] > 10 * CAP and grown[-1] > 1.8 * grown[MEMORY_STEPS // 2 - 1]
    assert unbounded[-1]["bytes"] > 10 * max(m["bytes"] for m in bounded)


# ---------------------------------------------------------------- two ranks
def _two_rank_job(x, y, ckpt_in, ckpt_out):
    """On each of 2 ranks: fit all steps from scratch with the policies and save; then
    restore the one-process checkpoint of step HALF and fit on to the end."""
    from tf_fusedemb.comm import get_communicator  # pylint: disable=import-outside-toplevel
    from tf_fusedemb.training import CheckpointManager  # pylint: disable=import-outside-toplevel
    comm = get_communicator()
    model, layer = build_model()
    scratch = fit_rank(x, y, 0, STEPS, comm.size, comm.rank, (model, layer))
    CheckpointManager(ckpt_out, model, model.optimizer).save(STEPS)
    fresh, fresh_layer = build_model()
    fresh({n: tf.zeros([0], tf.int64) for n in NAMES})
    CheckpointManager(ckpt_in, fresh, fresh.optimizer).restore()
    resumed = fit_rank(x, y, HALF, STEPS, comm.size, comm.rank, (fresh, fresh_layer))
    return {"scratch": scratch, "resumed": resumed}


class TwoRankEvictionTest(DistributedTestCase):
    timeout = 500

    def test_two_ranks_equal_the_reference_and_checkpoints_reshard(self):
        from tf_fusedemb.training import CheckpointManager  # pylint: disable=import-outside-toplevel
        x, y = data()
        ref, losses, stored = reference_run(x, y, STEPS)
        work = self.get_temp_dir()
        model, layer = build_model()
        fit_rank(x, y, 0, HALF, model=(model, layer))
        CheckpointManager(os.path.join(work, "one"), model, model.optimizer).save(HALF)

        ranks = self.run_ranks(_two_rank_job, 2, (x, y, os.path.join(work, "one"),
                                                 os.path.join(work, "two")))
        # Every key lives on one owner; the union over ranks is the reference's table.
        assert_matches(ref, [r["scratch"] for r in ranks], losses, stored)
        assert_matches(ref, [r["resumed"] for r in ranks], losses, stored, offset=HALF)
        assert all(len(r["scratch"]["rows"]["keys"]) for r in ranks)  # both ranks store rows

        # The 2-rank checkpoint restores onto one process with every row and statistic.
        fresh, fresh_layer = build_model()
        fresh({n: tf.zeros([0], tf.int64) for n in NAMES})
        CheckpointManager(os.path.join(work, "two"), fresh, fresh.optimizer).restore()
        group = fresh_layer.groups[0]
        assert_matches(ref, [{"rows": group.store.stored_rows().arrays(), "stats": group.store.statistics.export()}])
