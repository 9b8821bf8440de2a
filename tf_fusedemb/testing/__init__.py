"""Helpers for users' and the project's own tests.

``tf_fusedemb.testing.DistributedTestCase`` (a ``tf.test.TestCase``) runs a function on N
Horovod ranks (``run_ranks``) and checks that a model trains on N ranks as on one process
(``assertEquivalentToSingleProcess``); see ``tf_fusedemb.testing.distributed``.
``tf_fusedemb.testing.cluster`` builds an emulated multi-host cluster (network namespaces,
rate-limited links) and launches Horovod ranks in it. Importing this package imports
neither TensorFlow nor Horovod (``DistributedTestCase`` loads TensorFlow on first access).
"""
import importlib

__all__ = ["DistributedTestCase"]


def __getattr__(name):
    if name == "DistributedTestCase":
        return importlib.import_module("tf_fusedemb.testing.distributed").DistributedTestCase
    raise AttributeError(f"module 'tf_fusedemb.testing' has no attribute {name!r}")
