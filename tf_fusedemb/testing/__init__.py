"""Helpers for users' and the project's own tests.

``tf_fusedemb.testing.cluster`` builds an emulated multi-host cluster (network namespaces,
rate-limited links) and launches Horovod ranks in it. Importing this package imports
neither TensorFlow nor Horovod.
"""
