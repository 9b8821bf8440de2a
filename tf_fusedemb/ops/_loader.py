"""Lazy loader of tf_fusedemb/_fusedemb_ops-tfX.Y.so, the build for the running TensorFlow X.Y.

The library is loaded on the first call of an op wrapper, never at import, so
``import tf_fusedemb`` stays cheap and works before the library is built.

``TF_FUSEDEMB_OPS_LIBRARY=/path/to/lib.so`` loads another build of the same ops instead,
e.g. the AddressSanitizer/UBSan build of ``make sanitize``.
"""
import os
import threading
from typing import Any, Callable, Optional

import tensorflow as tf

# Named after the TensorFlow it was built against (setup.py): a build for another version
# does not load, and each stack of docs/guide/stacks.md builds its own in this directory.
_TF_VERSION = ".".join(tf.__version__.split(".")[:2])
LIBRARY_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            f"_fusedemb_ops-tf{_TF_VERSION}.so")
LIBRARY_ENV = "TF_FUSEDEMB_OPS_LIBRARY"
# The embedding storage engine's ops (custom_ops/embedding_engine_ops.cc).
ENGINE_OP_NAMES = ("EngineHandle", "EngineLookup", "EngineApplyGradients", "EngineRecord",
                   "EngineFind", "EngineGatherRows", "EngineWriteRows", "EngineRemoveRows",
                   "EngineForget", "EngineExport", "EngineStoredKeys", "EngineSize", "EnginePin",
                   "EngineUnpin", "EnginePrefetch", "EngineWriteCheckpoint",
                   "EngineRecordsChangesFor", "EngineWriteDelta", "EngineReadCheckpoint")
OP_NAMES = ("SegmentUnique", "RankwiseSort", "OwnerRank", "CategoryHash",
            "PackKeyMessages", "UnpackKeyMessages", "HashedUnifiedKeys", "KeyMessageCategoryBits",
            "RecoveryGather", "RecoveryPool", "RecoveryPoolGrad", "ExchangeCounts", "FindKeys") + ENGINE_OP_NAMES

_lock = threading.Lock()
_library: Optional[Any] = None  # the module of raw ops tf.load_op_library returns


def is_loaded() -> bool:
    """True once the op library has been loaded into this process."""
    return _library is not None


def library_path() -> str:
    """The library to load: ``$TF_FUSEDEMB_OPS_LIBRARY`` if set, else the built-in one."""
    return os.environ.get(LIBRARY_ENV) or LIBRARY_PATH


# Not converted by AutoGraph: the first op call may come from inside a traced function, and
# AutoGraph cannot read the source of os.path.exists (frozen in Python 3.11) and warns.
@tf.autograph.experimental.do_not_convert
def load_library() -> Any:
    """Loads the op library once (thread-safe) and returns its module of raw ops."""
    global _library
    if _library is None:
        with _lock:
            if _library is None:
                path = library_path()
                if not os.path.exists(path):
                    how = (f"unset {LIBRARY_ENV} or build it" if path != LIBRARY_PATH else
                           "build it with `make setup` or `python setup.py build_ext --inplace`")
                    raise FileNotFoundError(f"tf_fusedemb op library not found at {path}; {how}")
                _library = tf.load_op_library(path)
    return _library


def raw_op(name: str) -> Callable[..., Any]:
    """The generated Python function of op ``FusedEmb>{name}``."""
    snake = "fused_emb_" + "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")
    return getattr(load_library(), snake)

