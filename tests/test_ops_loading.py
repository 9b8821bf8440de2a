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


def test_library_loads_and_registers_every_op():
    import tf_fusedemb
    from tf_fusedemb.ops import _loader
    lib = tf_fusedemb.register_ops()
    assert _loader.is_loaded()
    registered = {op.name for op in lib.OP_LIST.op}
    assert registered == {f"FusedEmb>{name}" for name in _loader.OP_NAMES}
    for name in _loader.OP_NAMES:
        assert callable(_loader.raw_op(name)), name
    assert lib is _loader.load_library()  # loaded once


def test_op_names_are_fixed():
    from tf_fusedemb.ops import segment_unique

    @tf.function
    def f(k, s):
        return segment_unique(k, s).unique_keys

    graph = f.get_concrete_function(tf.TensorSpec([None], tf.int64),
                                    tf.TensorSpec([None], tf.int64)).graph
    assert "FusedEmb>SegmentUnique" in {op.type for op in graph.get_operations()}
