"""Per-rank storage of fused groups: deterministic initial rows (initializers), row-wise
sparse optimizers (optimizers), and the group table (tables: a TFRA dynamic hash table
or static dense variables).

Importing this package imports TensorFlow but not TFRA; TFRA loads when the first
:class:`DynamicGroupTable` is created.
"""
from tf_fusedemb.storage.initializers import SALT, init_rows, init_rows_np
from tf_fusedemb.storage.optimizers import RowOptimizer
from tf_fusedemb.storage.tables import DynamicGroupTable, GroupTable, StaticGroupTable

__all__ = ["DynamicGroupTable", "GroupTable", "RowOptimizer", "SALT", "StaticGroupTable",
           "init_rows", "init_rows_np"]
