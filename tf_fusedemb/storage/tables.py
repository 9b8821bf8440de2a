"""The group tables: one import point for the abstract :class:`GroupTable` and its two
implementations, :class:`DynamicGroupTable` (TFRA hash tables, any int64 key) and
:class:`StaticGroupTable` (dense variables of the rows a rank owns, keys in
[0, vocabulary_size), sharded by ``rank``/``num_ranks`` like the dynamic tables' keys).

Example::

    table = DynamicGroupTable("g0_d16_adagrad", 16, InitializerSpec(), OptimizerSpec.adagrad(0.1))
    rows = table.lookup(keys)                       # float32[u, 16], new keys not inserted
    table.apply_gradients(keys, grads)              # keys unique; inserts new keys
"""
from tf_fusedemb.storage.dynamic_table import DynamicGroupTable
from tf_fusedemb.storage.group_table import GroupTable
from tf_fusedemb.storage.static_table import StaticGroupTable

__all__ = ["DynamicGroupTable", "GroupTable", "StaticGroupTable"]
