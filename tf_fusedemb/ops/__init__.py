"""tf_fusedemb custom ops: Python wrappers, gradients and their pure-TF references.

Importing this module registers the gradients but does not load the op library; the
library loads on the first call of a wrapper (see :mod:`tf_fusedemb.ops._loader`).
"""
from typing import Any

from tf_fusedemb.ops._loader import is_loaded, load_library
from tf_fusedemb.ops.category_hash import (CategoryHashResult, category_hash,
                                           category_key_strings, collision_partner)
from tf_fusedemb.ops.exchange_counts import exchange_counts
from tf_fusedemb.ops.find_keys import find_keys
from tf_fusedemb.ops.key_messages import (KeyMessages, hashed_unified_keys, pack_key_messages,
                                          unpack_key_messages)
from tf_fusedemb.ops.rankwise_sort import RankwiseSortResult, owner_rank, rankwise_sort
from tf_fusedemb.ops.recovery import (finish_pooling, recover_features, recovery_gather,
                                      recovery_pool)
from tf_fusedemb.ops.segment_unique import SegmentUniqueResult, segment_unique


def register_ops() -> Any:
    """Loads the library; importing this package registered every op's gradient. Call
    before loading a SavedModel."""
    return load_library()


__all__ = [
    "CategoryHashResult", "KeyMessages", "RankwiseSortResult", "SegmentUniqueResult",
    "category_hash", "category_key_strings", "collision_partner", "exchange_counts", "find_keys", "hashed_unified_keys",
    "is_loaded", "load_library", "owner_rank", "pack_key_messages", "rankwise_sort",
    "finish_pooling", "recover_features", "recovery_gather", "recovery_pool", "register_ops", "segment_unique",
    "unpack_key_messages",
]
