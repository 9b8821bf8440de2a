"""StaticKeys: the key arithmetic of a static-vocabulary group, as data.

A static group stores its tables' rows one after another: table ``t``'s ID ``i`` is key
``offsets[t] + i`` in [0, vocabulary_size). The exchange routes a key by its instance ID
(``hashing.owner_rank(i, N)``), and a row starts from ``init_rows`` of its
plan-independent init key ``mix64(i ^ tag[t])``, the hashed key a dynamic table would give
it, so a table's rows are the same whichever group or storage holds it. The group's key
codec (``tf_fusedemb.layers.group_keys``) and its static table both use this one record.
"""
from typing import NamedTuple, Sequence, Tuple

import numpy as np
import numpy.typing as npt

from tf_fusedemb.ops import hashing


class StaticKeys(NamedTuple):
    """offsets: int64[T], the first key of each table; tags: uint64[T], each table's hash
    tag (``hashing.category_tags``); vocabulary_size: the group's keys in all."""
    offsets: np.ndarray
    tags: np.ndarray
    vocabulary_size: int

    @classmethod
    def of(cls, sizes: Sequence[int], tags: npt.ArrayLike) -> "StaticKeys":
        """The key space of tables with ``sizes`` rows each and hash ``tags`` uint64[T]."""
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        return cls(offsets, np.asarray(tags).view(np.uint64), int(sum(sizes)))

    def keys(self, ids: npt.ArrayLike, tables: npt.ArrayLike) -> np.ndarray:
        """Keys int64[n] of instance ``ids`` int64[n] of tables ``tables`` int64[n]."""
        return self.offsets[np.asarray(tables, np.int64)] + np.asarray(ids, np.int64)

    def identity(self, keys: npt.ArrayLike) -> Tuple[np.ndarray, np.ndarray]:
        """(table index int64[n], instance ID int64[n]) of ``keys`` int64[n]."""
        keys = np.asarray(keys, np.int64)
        tables = np.searchsorted(self.offsets, keys, side="right") - 1
        return tables, keys - self.offsets[tables]

    def owner_ids(self, keys: npt.ArrayLike) -> np.ndarray:
        """The instance IDs int64[n] of ``keys`` int64[n], which decide their owner rank."""
        return self.identity(keys)[1]

    def init_keys(self, keys: npt.ArrayLike) -> np.ndarray:
        """Plan-independent init keys int64[n] of ``keys`` int64[n]: ``mix64(id ^ tag)``."""
        tables, ids = self.identity(keys)
        return hashing.tagged_keys(ids, self.tags[tables])
