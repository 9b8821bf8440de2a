"""tf_fusedemb: fused, Horovod-sharded embedding tables for TensorFlow recommenders.

Importing the package is cheap: it loads neither the custom-op library nor Horovod (nor
TensorFlow), it leaves stdout, stderr and file descriptor 2 alone, and it sets no
environment variable: which Keras a model uses is the user's choice, by what they import
(``tf_keras`` with ``tf_fusedemb.layers``, ``keras`` 3 with ``tf_fusedemb.keras3``).
Quieting TensorFlow's known CPU-machine noise is an explicit call,
``tf_fusedemb.quiet.install()`` before TensorFlow is imported (the project's commands make
it). The library is loaded on the first use of an op; call :func:`register_ops` before
``tf.saved_model.load`` of a model that contains tf_fusedemb ops.
"""
import importlib

__version__ = "0.1.0"

_LAZY_SUBMODULES = ("quiet", "ops", "specs", "data", "benchmarks", "keras3")


def register_ops():
    """Loads the op library and registers the gradients of every tf_fusedemb op."""
    # On call: `import tf_fusedemb` loads no TensorFlow (module doc).
    from tf_fusedemb import ops  # pylint: disable=import-outside-toplevel
    return ops.register_ops()


def __getattr__(name):
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"tf_fusedemb.{name}")
    raise AttributeError(f"module 'tf_fusedemb' has no attribute {name!r}")
