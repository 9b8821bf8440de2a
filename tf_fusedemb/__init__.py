"""tf_fusedemb: fused, Horovod-sharded embedding tables for TensorFlow recommenders.

Importing the package is cheap: it loads neither the custom-op library nor Horovod (nor
TensorFlow); it sets the environment defaults and output filters of ``tf_fusedemb.quiet``.
The library is loaded on the first use of an op; call :func:`register_ops` before
``tf.saved_model.load`` of a model that contains tf_fusedemb ops.
"""
import importlib

from tf_fusedemb import quiet as _quiet

# Before TensorFlow loads: Keras 2 for tf.keras, no known CPU-machine noise (see quiet.py).
_quiet.install()

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
