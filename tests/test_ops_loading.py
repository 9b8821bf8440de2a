"""The op library: lazy loading, every op present, op names fixed."""
import subprocess
import sys

import tensorflow as tf

from conftest import REPO_ROOT


def test_import_does_not_load_library_or_horovod():
    code = ("import sys, tf_fusedemb, tf_fusedemb.ops, tf_fusedemb.specs; "
            "from tf_fusedemb.ops import _loader; "
            "assert not _loader.is_loaded(), 'library loaded at import'; "
            "assert 'horovod' not in sys.modules, 'horovod imported'; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def test_library_loads_with_exactly_the_listed_ops():
    import tf_fusedemb
    from tf_fusedemb.ops import _loader
    lib = tf_fusedemb.register_ops()
    assert _loader.is_loaded() and lib is _loader.load_library()  # loaded once
    generated = {n for n in dir(lib) if n.startswith("fused_emb_")
                 and not n.endswith("_eager_fallback")}
    assert generated == {_loader.raw_op(name).__name__ for name in _loader.OP_NAMES}


def test_op_types_in_graphs_are_the_fixed_names():
    from tf_fusedemb import ops

    @tf.function
    def f(k, s):
        u = ops.segment_unique(k, s)
        r = ops.rankwise_sort(u.unique_keys, u.unique_segment_splits, 2)
        m = ops.unpack_key_messages(ops.pack_key_messages(
            r.sorted_keys, r.sorted_segment_ids, r.indices, u.counts, [1, 0]))
        h = ops.category_hash(m.ids, m.tables, ["a", "b"])
        init = ops.hashed_unified_keys(h.lookup_ids, h.lookup_segment_ids, [7, 9])
        rows = tf.zeros([tf.size(r.sorted_keys), 2])
        g, rec = ops.recovery_gather(rows, r.indices, u.inverse)
        p = ops.recovery_pool(rows, rec, tf.range(tf.size(rec, tf.int64) + 1), [0, tf.size(
            rec, tf.int64)], ["mean"])
        counts = ops.exchange_counts(r.rank_splits, r.rank_splits, rows, 0)
        return g, p, h.lookup_keys, init, ops.owner_rank(k, 2), counts, ops.find_keys(k, s)

    graph = f.get_concrete_function(tf.TensorSpec([None], tf.int64),
                                    tf.TensorSpec([None], tf.int64)).graph
    types = {op.type for op in graph.get_operations()}
    from tf_fusedemb.ops import _loader
    # KeyMessageCategoryBits is a constant, read eagerly once (ops.key_messages.category_bits)
    lookup_ops = (set(_loader.OP_NAMES) - {"RecoveryPoolGrad", "KeyMessageCategoryBits"}
                  - set(_loader.ENGINE_OP_NAMES))
    assert {f"FusedEmb>{n}" for n in lookup_ops} <= types
