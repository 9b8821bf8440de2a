"""Per-table admission and eviction policies (FusedRec categories): what the owner
ranks decide from the lossless access statistics."""
from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

from tf_fusedemb.specs.validation import number, positive_int

@dataclasses.dataclass(frozen=True)
class AdmissionPolicy:
    """Frequency admission of a table's keys (SOK's frequency filter; TFRA has none).

    A key is admitted once the lossless access statistics have counted ``min_count``
    training accesses of it (all ranks' batches, counted on its owner). Until then its
    lookups read its deterministic initial row, its gradient updates nothing and it has
    no row and no optimizer slots; its accesses are counted all the same. The update of
    the step whose accesses reach ``min_count`` is the first one stored. A stored key (a
    row written by training, a restore or a weight import) is always admitted.

    Args:
        min_count: int > 0; 1 admits every key at its first access (no filter).

    Example::

        >>> AdmissionPolicy(3).to_dict()
        {'min_count': 3}
    """
    min_count: int

    def __post_init__(self) -> None:
        positive_int("AdmissionPolicy", "min_count", self.min_count)

    def to_dict(self) -> dict:
        return {"min_count": self.min_count}

    @classmethod
    def from_dict(cls, d: Mapping) -> "AdmissionPolicy":
        return cls(d["min_count"])


@dataclasses.dataclass(frozen=True)
class EvictionPolicy:
    """Eviction of a table's keys: TTL by the last step a key was seen, and a cap.

    Evaluated by ``GroupStore.enforce_policy`` after a training step t (the group's step
    counter after t's update; ``FusedModel.fit`` runs it after every step) when
    ``t % every_steps == 0``, in this order:

    1. TTL: every key of the table with ``t - last_seen > ttl_steps`` is evicted, where
       ``last_seen`` is the step of its last training access (a key seen at step t
       survives until step t + ttl_steps included);
    2. cap: if the table then tracks more than ``max_rows`` keys over all ranks (stored
       rows plus keys still counting towards admission), the excess with the smallest
       (access count, last_seen, ID) is evicted: least used first, then least recently
       seen, then the smaller ID (a total order, so the choice does not depend on the
       number of ranks).

    An evicted key loses its row, its optimizer slots and its access statistics
    together; seen again, it starts over from its initial row (and, with admission,
    from a count of 0).

    Args:
        ttl_steps: int > 0 or None (no TTL).
        max_rows: int > 0 or None (no cap): keys tracked per table, all ranks together.
        every_steps: int > 0, evaluate every this many steps (default every step;
            between evaluations the table can exceed the cap by the keys those steps add).

    Example::

        >>> EvictionPolicy(ttl_steps=100, max_rows=10_000).to_dict()
        {'ttl_steps': 100, 'max_rows': 10000, 'every_steps': 1}
    """
    ttl_steps: Optional[int] = None
    max_rows: Optional[int] = None
    every_steps: int = 1

    def __post_init__(self) -> None:
        positive_int("EvictionPolicy", "ttl_steps", self.ttl_steps, optional=True)
        positive_int("EvictionPolicy", "max_rows", self.max_rows, optional=True)
        positive_int("EvictionPolicy", "every_steps", self.every_steps)
        if self.ttl_steps is None and self.max_rows is None:
            raise ValueError("EvictionPolicy: set ttl_steps, max_rows or both")

    def to_dict(self) -> dict:
        return {"ttl_steps": self.ttl_steps, "max_rows": self.max_rows,
                "every_steps": self.every_steps}

    @classmethod
    def from_dict(cls, d: Mapping) -> "EvictionPolicy":
        return cls(d.get("ttl_steps"), d.get("max_rows"), d.get("every_steps", 1))

