"""Where a tiered group's SSD tier lives: a fresh directory per group and rank.

``TableSpec.spill_dir`` names the parent (None: ``tempfile.gettempdir()``, i.e. $TMPDIR,
because tables are made before any run or checkpoint directory is known); each engine
gets its own ``fusedemb_<group>_XXXXXXXX`` directory in it, fresh because ranks on one
host and groups in one process share the parent. The engine empties it when made and
removes it when destroyed; a process that ends with its tables alive (TensorFlow does not
destroy resources at exit) removes it at interpreter exit. Nothing in it outlives the
process, since checkpoints hold every block of both tiers (a SIGKILLed run's leftovers may
be deleted).

Example::

    path = make_spill_path("g0", ("user", "item"), "/mnt/ssd")   # /mnt/ssd/fusedemb_g0_k2x9...
"""
import atexit
import os
import re
import shutil
import tempfile
from typing import Optional, Sequence

__all__ = ["MIN_FREE_SPILL_BYTES", "make_spill_path"]

# A spill directory needs this much free space when its table is made, so that a full disk
# fails at construction, naming the tables and the path, not in a later training step.
MIN_FREE_SPILL_BYTES = 64 << 20


def make_spill_path(group: str, tables: Sequence[str], spill_dir: Optional[str]) -> str:
    """A fresh directory for the SSD tier of ``group`` (holding ``tables``) in
    ``spill_dir`` (None: the system temporary directory).

    Raises:
        ValueError: one line naming the tables and the directory, when the directory
            cannot be made or written, or its disk has under MIN_FREE_SPILL_BYTES free.
    """
    parent = tempfile.gettempdir() if spill_dir is None else spill_dir
    owner = f"table{'s' if len(tables) > 1 else ''} {', '.join(tables)} (group {group})"
    try:
        os.makedirs(parent, exist_ok=True)
        path = tempfile.mkdtemp(prefix=f"fusedemb_{re.sub(r'[^A-Za-z0-9_.-]', '_', group)}_",
                                dir=parent)
        free = shutil.disk_usage(path).free
    except OSError as e:
        raise ValueError(f"{owner}: cannot use spill_dir {parent!r} for the SSD tier: "
                         f"{e.strerror or e}") from None
    if free < MIN_FREE_SPILL_BYTES:
        os.rmdir(path)
        raise ValueError(f"{owner}: spill_dir {parent!r} has {free} bytes free, under the "
                         f"{MIN_FREE_SPILL_BYTES} the SSD tier needs to start")
    # The engine's destructor removes it too; at exit TensorFlow destroys no resource.
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path
