"""tf_fusedemb: fused, Horovod-sharded embedding tables for TensorFlow recommenders.

Importing the package is cheap: it loads neither the custom-op library nor Horovod.
The library is loaded on the first use of an op; call :func:`register_ops` before
``tf.saved_model.load`` of a model that contains tf_fusedemb ops.
"""
import importlib

__version__ = "0.1.0"

_LAZY_SUBMODULES = ("ops", "specs", "data", "benchmarks")


def register_ops():
    """Loads the op library and registers the gradients of every tf_fusedemb op."""
    from tf_fusedemb.ops import _loader  # pylint: disable=import-outside-toplevel
    return _loader.register_ops()


def __getattr__(name):
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"tf_fusedemb.{name}")
    raise AttributeError(f"module 'tf_fusedemb' has no attribute {name!r}")
