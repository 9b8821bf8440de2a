"""tf_fusedemb: fused, Horovod-sharded embedding tables for TensorFlow recommenders.

Importing the package is cheap: it loads neither the custom-op library nor Horovod (nor
TensorFlow), and it leaves stdout, stderr and file descriptor 2 alone; it only sets
``TF_USE_LEGACY_KERAS=1`` unless set (tf.keras must be Keras 2, as TFRA and Horovod need).
Quieting TensorFlow's known CPU-machine noise is an explicit call,
``tf_fusedemb.quiet.install()`` before TensorFlow is imported (the project's commands make
it). The library is loaded on the first use of an op; call :func:`register_ops` before
``tf.saved_model.load`` of a model that contains tf_fusedemb ops.
"""
import importlib

from tf_fusedemb import quiet

# Before TensorFlow loads: Keras 2 for tf.keras. No output filter (see quiet.py).
quiet.set_keras_default()

__version__ = "0.1.0"

_LAZY_SUBMODULES = ("ops", "specs", "data", "benchmarks")


def register_ops():
    """Loads the op library and registers the gradients of every tf_fusedemb op."""
    # On call: `import tf_fusedemb` loads no TensorFlow (module doc).
    from tf_fusedemb import ops  # pylint: disable=import-outside-toplevel
    return ops.register_ops()


def __getattr__(name):
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"tf_fusedemb.{name}")
    raise AttributeError(f"module 'tf_fusedemb' has no attribute {name!r}")
