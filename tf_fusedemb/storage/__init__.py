"""Per-rank storage of fused groups: deterministic initial rows (initializers), row-wise
sparse optimizers (optimizers), the group table (tables: a TFRA dynamic hash table or
static dense variables; engine_table: the storage engine) and the backend interface
that chooses among them per table (backend, ``TableSpec.storage``).

Importing this package imports TensorFlow but not TFRA; TFRA loads when the first
:class:`DynamicGroupTable` is created.
"""
from tf_fusedemb.storage.backend import BACKENDS, GroupStorage, StorageBackend, backend_for
from tf_fusedemb.storage.initializers import SALT, init_rows, init_rows_np
from tf_fusedemb.storage.optimizers import RowOptimizer
from tf_fusedemb.storage.tables import DynamicGroupTable, GroupTable, StaticGroupTable

__all__ = ["BACKENDS", "DynamicGroupTable", "GroupStorage", "GroupTable", "RowOptimizer", "SALT",
           "StaticGroupTable", "StorageBackend", "backend_for", "init_rows", "init_rows_np"]
