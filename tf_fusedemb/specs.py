"""Embedding specifications and the fusion planner (FusedRec, equation (1)).

FusedRec fuses the features whose embedding specification ``spec(E) = (dim,
optimizer, initializer)`` matches into one group, so that a group needs one
SegmentUnique, one table per rank and 3 AlltoAll rounds per step instead of 3
per feature. This module is pure standard library (importing it never imports
TensorFlow); every rank runs :func:`plan_fusion` on the same feature list and
must get the same plan, which :meth:`FusionPlan.fingerprint` lets it check.

Example::

    >>> t = TableSpec("C1", dim=16, optimizer=OptimizerSpec.adagrad(0.01))
    >>> u = TableSpec("C2", dim=16, optimizer=OptimizerSpec.adagrad(0.01))
    >>> plan = plan_fusion([FeatureSpec("C1", t), FeatureSpec("C2", u)])
    >>> [(g.name, g.feature_names) for g in plan.groups]
    [('g0_d16_adagrad', ('C1', 'C2'))]
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, TypeGuard, Union

# Hyper-parameters as given (a mapping or (key, value) pairs); a spec stores them canonical, as a
# sorted tuple of (key, float) pairs, so that it stays hashable and ordered.
HParams = Union[Tuple[Tuple[str, float], ...], Mapping[str, float]]

__all__ = ["OptimizerSpec", "InitializerSpec", "AdmissionPolicy", "EvictionPolicy", "TableSpec",
           "FeatureSpec", "FusedGroup", "FusionPlan", "describe_plan_difference", "plan_fusion",
           "unfused_plan", "COMBINERS", "KEY_DTYPES", "STORAGES", "DEFAULT_STORAGE"]

COMBINERS = ("sum", "mean", "sqrtn")
KEY_DTYPES = ("int64", "int32")
_POLICY_FIELDS = ("admission", "eviction")  # TableSpec fields outside the storage layout
# TableSpec fields of the SSD tier: where rows live, not what they are (a checkpoint of a
# tiered table restores onto an untiered one and back).
_TIER_FIELDS = ("memory_budget_bytes", "spill_dir")
# The storage backends of a dynamic table (tf_fusedemb.storage.backend); a static table
# keeps its dense variables ("static"). Which backend holds the rows is outside the
# storage layout too: a checkpoint written with one restores onto the other.
STORAGES = ("engine", "tfra")
DEFAULT_STORAGE = "engine"  # of dynamic tables, when TableSpec(storage=None)
_STATIC_STORAGE = "static"
_PLAN_FORMAT = 1  # bump when to_dict() changes shape: old fingerprints then no longer match

# Hyper-parameter defaults follow tf.keras optimizers (Adam epsilon 1e-7, accumulators 0.1).
_OPTIMIZERS = {
    "sgd": {},
    "adagrad": {"initial_accumulator_value": 0.1},
    "adam": {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-7},
    "ftrl": {"learning_rate_power": -0.5, "initial_accumulator_value": 0.1, "l1": 0.0, "l2": 0.0},
}
_SLOTS = {"sgd": (), "adagrad": ("accumulator",), "adam": ("m", "v"), "ftrl": ("accumulator", "linear")}
_INITIALIZERS = {
    "uniform": {"minval": -0.05, "maxval": 0.05},  # tf.keras.layers.Embedding's default
    "normal": {"mean": 0.0, "stddev": 0.05},
    "truncated_normal": {"mean": 0.0, "stddev": 0.05},
    "zeros": {},
}
_NONNEG = (lambda v: v >= 0, ">= 0")
_CHECKS = {
    "initial_accumulator_value": _NONNEG, "l1": _NONNEG, "l2": _NONNEG,
    "beta1": (lambda v: 0 <= v < 1, "in [0, 1)"), "beta2": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "epsilon": (lambda v: v > 0, "> 0"), "learning_rate_power": (lambda v: v <= 0, "<= 0"),
    "stddev": (lambda v: v > 0, "> 0"),
}


def _fail(kind: str, name: Any, msg: str):
    raise ValueError(f"{kind} {name!r}: {msg}")


def _is_int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(kind: str, name: str, field: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        _fail(kind, name, f"{field} must be a finite number, got {v!r}")
    return float(v)  # 0 and 0.0 must give the same JSON, hence the same fingerprint


def _check_name(kind: str, name) -> None:
    # '/' is reserved: reports spell a key as "feature/ID".
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(f"{kind}: name must be a non-empty str without '/', got {name!r}")


def _canonical(kind: str, name: str, defaults: Mapping[str, float], given) -> tuple:
    """Merges ``given`` (mapping or (key, value) pairs) over ``defaults``: sorted, validated."""
    params = dict(defaults)
    for key, value in dict(given).items():
        if key not in defaults:
            _fail(kind, name, f"unknown hyper-parameter {key!r}; expected one of {tuple(defaults)}")
        params[key] = _number(kind, name, key, value)
        check, rule = _CHECKS.get(key, (None, ""))
        if check is not None and not check(params[key]):
            _fail(kind, name, f"{key} must be {rule}, got {value!r}")
    return tuple(sorted(params.items()))


@dataclasses.dataclass(frozen=True, order=True)
class OptimizerSpec:
    """Sparse optimizer of a table; part of the fusion key (hashable, ordered).

    Args:
        name: one of "sgd", "adagrad", "adam", "ftrl".
        learning_rate: float > 0.
        params: hyper-parameters, a mapping or (key, value) pairs; missing ones take the
            tf.keras defaults, so ``OptimizerSpec("adam", 1e-3) == OptimizerSpec.adam(1e-3)``.
            Stored as a sorted tuple of (key, float) pairs.

    Example::

        >>> OptimizerSpec.adam(1e-3, beta1=0.8).hparams["beta1"]
        0.8
        >>> OptimizerSpec.ftrl(0.1).slot_names
        ('accumulator', 'linear')
    """
    name: str
    learning_rate: float
    params: HParams = ()

    def __post_init__(self) -> None:
        if self.name not in _OPTIMIZERS:
            _fail("OptimizerSpec", self.name, f"name is not one of {tuple(_OPTIMIZERS)}")
        lr = _number("OptimizerSpec", self.name, "learning_rate", self.learning_rate)
        if lr <= 0:
            _fail("OptimizerSpec", self.name, f"learning_rate must be > 0, got {self.learning_rate!r}")
        object.__setattr__(self, "learning_rate", lr)
        object.__setattr__(self, "params", _canonical(
            "OptimizerSpec", self.name, _OPTIMIZERS[self.name], self.params))

    @classmethod
    def sgd(cls, learning_rate: float) -> "OptimizerSpec":
        return cls("sgd", learning_rate)

    @classmethod
    def adagrad(cls, learning_rate: float, initial_accumulator_value: float = 0.1) -> "OptimizerSpec":
        return cls("adagrad", learning_rate, {"initial_accumulator_value": initial_accumulator_value})

    @classmethod
    def adam(cls, learning_rate: float, beta1: float = 0.9, beta2: float = 0.999,
             epsilon: float = 1e-7) -> "OptimizerSpec":
        """Lazy (row-wise) Adam: Keras's Adam formula (``tf_keras.optimizers.Adam``, same
        defaults) applied to the rows a batch touched only, with the bias correction of
        the table's step counter (one step per batch).

        How it differs from Keras's Adam on an ``Embedding``: Keras keeps updating every
        row at every step (untouched rows still move by their decaying momentum ``m``);
        here an untouched row and its ``m``/``v`` stay exactly as they are (as in
        tensorflow_addons' LazyAdam and TFRA/SOK sparse Adam). Training equals Keras's
        Adam when every row is touched at every step, and otherwise differs by design
        (tested against Keras's formula on the touched rows)."""
        return cls("adam", learning_rate, {"beta1": beta1, "beta2": beta2, "epsilon": epsilon})

    @classmethod
    def ftrl(cls, learning_rate: float, learning_rate_power: float = -0.5,
             initial_accumulator_value: float = 0.1, l1: float = 0.0, l2: float = 0.0) -> "OptimizerSpec":
        return cls("ftrl", learning_rate, {"learning_rate_power": learning_rate_power, "l1": l1, "l2": l2,
                                           "initial_accumulator_value": initial_accumulator_value})

    @property
    def hparams(self) -> dict:
        return dict(self.params)

    @property
    def slot_names(self) -> tuple:
        """Per-row optimizer state kept next to each embedding row, e.g. ("m", "v") for adam."""
        return _SLOTS[self.name]

    def to_dict(self) -> dict:
        return {"name": self.name, "learning_rate": self.learning_rate, "params": self.hparams}

    @classmethod
    def from_dict(cls, d: Mapping) -> "OptimizerSpec":
        return cls(d["name"], d["learning_rate"], d.get("params", {}))


@dataclasses.dataclass(frozen=True, order=True)
class InitializerSpec:
    """Initial value distribution of new rows; part of the fusion key.

    Args:
        name: one of "uniform" (minval < maxval), "normal" / "truncated_normal" (mean,
            stddev > 0), "zeros".
        params: mapping or (key, value) pairs; missing ones take the defaults
            (uniform(-0.05, 0.05) and stddev 0.05, like tf.keras).

    Example::

        >>> InitializerSpec.normal(stddev=0.01).hparams
        {'mean': 0.0, 'stddev': 0.01}
    """
    name: str = "uniform"
    params: HParams = ()

    def __post_init__(self) -> None:
        if self.name not in _INITIALIZERS:
            _fail("InitializerSpec", self.name, f"name is not one of {tuple(_INITIALIZERS)}")
        params = _canonical("InitializerSpec", self.name, _INITIALIZERS[self.name], self.params)
        object.__setattr__(self, "params", params)
        p = dict(params)
        if self.name == "uniform" and not p["minval"] < p["maxval"]:
            _fail("InitializerSpec", self.name, f"minval must be < maxval, got {p['minval']} >= {p['maxval']}")

    @classmethod
    def uniform(cls, minval: float = -0.05, maxval: float = 0.05) -> "InitializerSpec":
        return cls("uniform", {"minval": minval, "maxval": maxval})

    @classmethod
    def normal(cls, mean: float = 0.0, stddev: float = 0.05) -> "InitializerSpec":
        return cls("normal", {"mean": mean, "stddev": stddev})

    @classmethod
    def truncated_normal(cls, mean: float = 0.0, stddev: float = 0.05) -> "InitializerSpec":
        return cls("truncated_normal", {"mean": mean, "stddev": stddev})

    @classmethod
    def zeros(cls) -> "InitializerSpec":
        return cls("zeros")

    @property
    def hparams(self) -> dict:
        return dict(self.params)

    def to_dict(self) -> dict:
        return {"name": self.name, "params": self.hparams}

    @classmethod
    def from_dict(cls, d: Mapping) -> "InitializerSpec":
        return cls(d["name"], d.get("params", {}))


def _positive_int(kind: str, field: str, v, optional: bool = False):
    if v is None and optional:
        return
    if not _is_int(v) or v <= 0:
        raise ValueError(f"{kind}: {field} must be an int > 0{' or None' if optional else ''}, "
                         f"got {v!r}")


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
        _positive_int("AdmissionPolicy", "min_count", self.min_count)

    def to_dict(self) -> dict:
        return {"min_count": self.min_count}

    @classmethod
    def from_dict(cls, d: Mapping) -> "AdmissionPolicy":
        return cls(d["min_count"])


@dataclasses.dataclass(frozen=True)
class EvictionPolicy:
    """Eviction of a table's keys: TTL by the last step a key was seen, and a cap.

    Evaluated by ``GroupLookup.enforce_policy`` after a training step t (the group's step
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
        _positive_int("EvictionPolicy", "ttl_steps", self.ttl_steps, optional=True)
        _positive_int("EvictionPolicy", "max_rows", self.max_rows, optional=True)
        _positive_int("EvictionPolicy", "every_steps", self.every_steps)
        if self.ttl_steps is None and self.max_rows is None:
            raise ValueError("EvictionPolicy: set ttl_steps, max_rows or both")

    def to_dict(self) -> dict:
        return {"ttl_steps": self.ttl_steps, "max_rows": self.max_rows,
                "every_steps": self.every_steps}

    @classmethod
    def from_dict(cls, d: Mapping) -> "EvictionPolicy":
        return cls(d.get("ttl_steps"), d.get("max_rows"), d.get("every_steps", 1))


@dataclasses.dataclass(frozen=True)
class TableSpec:
    """One logical embedding table: rows of ``dim`` values, one per ID.

    Args:
        name: non-empty, no '/'. Features naming the same table share its rows.
        dim: int > 0.
        optimizer: the table's sparse optimizer.
        initializer: default uniform(-0.05, 0.05), as tf.keras.layers.Embedding.
        vocabulary_size: None for a dynamic hash table (any ID); an int > 0 for a static
            table, whose IDs must lie in [0, vocabulary_size).
        key_dtype: "int64" or "int32" (a tf/numpy dtype with that ``.name`` is accepted).
        admission: optional AdmissionPolicy of the table's keys (dynamic tables only).
        eviction: optional EvictionPolicy of the table's keys (dynamic tables only).
            Policies are per table (a FusedRec category): tables with different
            policies still fuse into one group.
        storage: the backend holding a dynamic table's rows, one of ``STORAGES``:
            "engine" (our storage engine, one block per key) or "tfra" (TFRA hash
            tables); None means ``DEFAULT_STORAGE``. A static table keeps its dense
            storage (None or "static"). Tables of different storage never fuse.
        memory_budget_bytes: None keeps every row in DRAM. An int >= 0 (engine storage
            only) bounds the DRAM the table's blocks (row, slots, statistics) and index
            take on each rank; the other blocks are spilled whole to an SSD tier
            (RocksDB), invisibly to results. A table setting, not a layer one, because
            tables differ in size; the tables fused into one group share one engine
            whose budget is the sum of theirs, and tiered tables fuse only with tiered
            tables of the same ``spill_dir``.
        spill_dir: where the SSD tier's stores go (one fresh subdirectory per group and
            rank, removed when its table is). None: the system temporary directory
            (``tempfile.gettempdir()``, i.e. $TMPDIR), because the table is made before
            any run or checkpoint directory is known; name a directory on a local SSD
            with room for the table. Nothing in it outlives the process (checkpoints
            hold every row): a killed run's leftovers may be deleted.
    """
    name: str
    dim: int
    optimizer: OptimizerSpec
    initializer: InitializerSpec = dataclasses.field(default_factory=InitializerSpec)
    vocabulary_size: Optional[int] = None
    key_dtype: str = "int64"
    admission: Optional[AdmissionPolicy] = None
    eviction: Optional[EvictionPolicy] = None
    storage: Optional[str] = None
    memory_budget_bytes: Optional[int] = None
    spill_dir: Optional[str] = None

    def __post_init__(self) -> None:
        _check_name("TableSpec", self.name)
        if not _is_int(self.dim) or self.dim <= 0:
            _fail("TableSpec", self.name, f"dim must be an int > 0, got {self.dim!r}")
        if not isinstance(self.optimizer, OptimizerSpec):
            _fail("TableSpec", self.name, f"optimizer must be an OptimizerSpec, got {self.optimizer!r}")
        if not isinstance(self.initializer, InitializerSpec):
            _fail("TableSpec", self.name, f"initializer must be an InitializerSpec, got {self.initializer!r}")
        v = self.vocabulary_size
        if v is not None and (not _is_int(v) or v <= 0):
            _fail("TableSpec", self.name, f"vocabulary_size must be None (dynamic) or an int > 0, got {v!r}")
        dtype = getattr(self.key_dtype, "name", self.key_dtype)  # tf.int64 / np.int64 -> "int64"
        if dtype not in KEY_DTYPES:
            _fail("TableSpec", self.name, f"key_dtype {self.key_dtype!r} is not one of {KEY_DTYPES}")
        object.__setattr__(self, "key_dtype", dtype)
        for field, cls in (("admission", AdmissionPolicy), ("eviction", EvictionPolicy)):
            value = getattr(self, field)
            if value is not None and not isinstance(value, cls):
                _fail("TableSpec", self.name, f"{field} must be an {cls.__name__} or None, "
                                              f"got {value!r}")
            if value is not None and v is not None:
                _fail("TableSpec", self.name, f"{field} policies need a dynamic table "
                                              f"(vocabulary_size=None): a static table's "
                                              f"memory is fixed")
        object.__setattr__(self, "storage", self._resolved_storage())
        self._check_tier()

    def _check_tier(self) -> None:
        """A budget: an int >= 0 of an engine table; a spill_dir only with a budget."""
        b = self.memory_budget_bytes
        if b is None:
            if self.spill_dir is not None:
                _fail("TableSpec", self.name, "spill_dir needs a memory_budget_bytes")
            return
        if not _is_int(b) or b < 0:
            _fail("TableSpec", self.name, f"memory_budget_bytes must be None or an int >= 0, got {b!r}")
        if self.storage != "engine":
            _fail("TableSpec", self.name, f"memory_budget_bytes needs storage 'engine' (a dynamic "
                                          f"table on the storage engine), got {self.storage!r}")
        if self.spill_dir is not None and not isinstance(self.spill_dir, str):
            _fail("TableSpec", self.name, f"spill_dir must be a str or None, got {self.spill_dir!r}")

    def _resolved_storage(self) -> str:
        """``storage`` checked: "static" for a static table, else one of STORAGES."""
        s = self.storage
        if self.is_static:
            if s not in (None, _STATIC_STORAGE):
                _fail("TableSpec", self.name, f"storage {s!r} is for dynamic tables "
                                              f"(vocabulary_size=None); a static table keeps "
                                              f"its own dense storage (storage=None)")
            return _STATIC_STORAGE
        if s is None:
            return DEFAULT_STORAGE
        if s not in STORAGES:
            _fail("TableSpec", self.name, f"storage {s!r} is not one of {STORAGES}")
        return s

    @property
    def has_policy(self) -> bool:
        return self.admission is not None or self.eviction is not None

    @property
    def is_static(self) -> bool:
        return self.vocabulary_size is not None

    @property
    def fusion_key(self) -> tuple:
        """FusedRec's spec(E) = (dim, optimizer, initializer), plus what one fused table
        cannot mix: the key dtype and its storage (static, or a dynamic backend). The
        optimizer compares with its learning rate and hyper-parameters: one group takes one
        optimizer step."""
        return (self.dim, self.optimizer, self.initializer, self.key_dtype, self.is_static,
                self.storage, self.memory_budget_bytes is not None, self.spill_dir)

    def to_dict(self) -> dict:
        # Policies only when set: a plan without them keeps its old dict and fingerprint.
        d = {"name": self.name, "dim": self.dim, "optimizer": self.optimizer.to_dict(),
             "initializer": self.initializer.to_dict(), "vocabulary_size": self.vocabulary_size,
             "key_dtype": self.key_dtype}
        for field in _POLICY_FIELDS:
            if getattr(self, field) is not None:
                d[field] = getattr(self, field).to_dict()
        if not self.is_static and self.storage != DEFAULT_STORAGE:
            d["storage"] = self.storage  # the default left out, like absent policies
        for field in _TIER_FIELDS:
            if getattr(self, field) is not None:
                d[field] = getattr(self, field)
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> "TableSpec":
        return cls(d["name"], d["dim"], OptimizerSpec.from_dict(d["optimizer"]),
                   InitializerSpec.from_dict(d["initializer"]), d.get("vocabulary_size"),
                   d.get("key_dtype", "int64"),
                   AdmissionPolicy.from_dict(d["admission"]) if d.get("admission") else None,
                   EvictionPolicy.from_dict(d["eviction"]) if d.get("eviction") else None,
                   d.get("storage"), d.get("memory_budget_bytes"), d.get("spill_dir"))


@dataclasses.dataclass(frozen=True)
class FeatureSpec:
    """One sparse input feature (a FusedRec "category") looked up in ``table``.

    Args:
        name: non-empty, no '/'; the key of the feature in the layer's input/output dicts.
        table: the table it reads; several features may share one table.
        combiner: "sum", "mean" or "sqrtn" pools a multi-hot feature (ids: [B, None],
            ragged) to [B, dim]; None makes it a sequence feature, output [B, max_len, dim].
        max_len: required (> 0) for a sequence feature, must be None otherwise: pooled
            features are never silently truncated.

    Example::

        >>> t = TableSpec("item", 32, OptimizerSpec.adam(1e-3))
        >>> FeatureSpec("history", t, combiner=None, max_len=50).is_sequence
        True
    """
    name: str
    table: TableSpec
    combiner: Optional[str] = "sum"
    max_len: Optional[int] = None

    def __post_init__(self) -> None:
        _check_name("FeatureSpec", self.name)
        if not isinstance(self.table, TableSpec):
            _fail("FeatureSpec", self.name, f"table must be a TableSpec, got {self.table!r}")
        if self.combiner is not None and self.combiner not in COMBINERS:
            _fail("FeatureSpec", self.name, f"combiner {self.combiner!r} is not one of {COMBINERS} or None")
        if self.combiner is None and (not _is_int(self.max_len) or self.max_len <= 0):
            _fail("FeatureSpec", self.name, f"max_len must be an int > 0 for a sequence feature "
                                            f"(combiner=None), got {self.max_len!r}")
        if self.combiner is not None and self.max_len is not None:
            _fail("FeatureSpec", self.name, f"max_len is only for sequence features (combiner=None); "
                                            f"got max_len={self.max_len!r} with combiner {self.combiner!r}")

    @property
    def is_sequence(self) -> bool:
        return self.combiner is None

    @property
    def dim(self) -> int:
        return self.table.dim

    def to_dict(self) -> dict:
        return {"name": self.name, "table": self.table.to_dict(), "combiner": self.combiner,
                "max_len": self.max_len}

    @classmethod
    def from_dict(cls, d: Mapping) -> "FeatureSpec":
        return cls(d["name"], TableSpec.from_dict(d["table"]), d.get("combiner"), d.get("max_len"))


def _check_tables(features: Sequence[FeatureSpec]) -> dict:
    """Maps table name -> [features]; one name must mean one TableSpec everywhere."""
    by_table: dict = {}
    for f in features:
        first = by_table.setdefault(f.table.name, [f])[0]
        if f is not first:
            if f.table != first.table:
                raise ValueError(f"FeatureSpec {f.name!r}: table {f.table.name!r} differs from the "
                                 f"table of the same name used by FeatureSpec {first.name!r}")
            by_table[f.table.name].append(f)
    return by_table


@dataclasses.dataclass(frozen=True)
class FusedGroup:
    """Features fused into one lookup: one SegmentUnique, one table per rank, one AlltoAll.

    Every spec field (``dim``, ``optimizer``, ``initializer``, ``key_dtype``) is derived
    from the features, which must share one fusion key. In the fused table a row is
    addressed by (category, ID) with category = ``table_index[i]`` of feature i, so
    features sharing a table share rows; ``vocabulary_sizes`` is per feature: each static
    feature keeps its own ID range [0, vocabulary_sizes[i]).
    """
    name: str
    features: tuple

    def __post_init__(self) -> None:
        _check_name("FusedGroup", self.name)
        object.__setattr__(self, "features", tuple(self.features))
        if not self.features:
            _fail("FusedGroup", self.name, "has no features")
        _check_tables(self.features)
        first = self.features[0]
        for f in self.features[1:]:
            if f.table.fusion_key != first.table.fusion_key:
                _fail("FusedGroup", self.name, f"FeatureSpec {f.name!r} and FeatureSpec {first.name!r} have "
                                               f"different specs (dim, optimizer, initializer, key_dtype, "
                                               f"storage, SSD tier) and cannot be fused")

    dim = property(lambda self: self.features[0].table.dim)
    optimizer = property(lambda self: self.features[0].table.optimizer)
    initializer = property(lambda self: self.features[0].table.initializer)
    key_dtype = property(lambda self: self.features[0].table.key_dtype)
    is_static = property(lambda self: self.features[0].table.is_static)
    storage = property(lambda self: self.features[0].table.storage)  # "engine" | "tfra" | "static"
    feature_names = property(lambda self: tuple(f.name for f in self.features))
    num_features = property(lambda self: len(self.features))
    vocabulary_sizes = property(lambda self: tuple(f.table.vocabulary_size for f in self.features))

    @property
    def tables(self) -> tuple:
        """Distinct TableSpecs, in order of first use."""
        return tuple({f.table.name: f.table for f in self.features}.values())

    @property
    def memory_budget_bytes(self) -> Optional[int]:
        """The DRAM budget of the group's engine on each rank: the sum of its tables'
        ``memory_budget_bytes`` (None: no SSD tier; fused tables are all tiered or none)."""
        budgets = [t.memory_budget_bytes for t in self.tables]
        return None if budgets[0] is None else sum(budgets)

    spill_dir = property(lambda self: self.features[0].table.spill_dir)

    @property
    def table_index(self) -> tuple:
        """Per feature, the index of its table in ``tables`` (its category id for lookup)."""
        names = [t.name for t in self.tables]
        return tuple(names.index(f.table.name) for f in self.features)

    @property
    def shared_tables(self) -> dict:
        """Table name -> feature names, for the tables read by more than one feature."""
        by_table = _check_tables(self.features)
        return {t: tuple(f.name for f in fs) for t, fs in by_table.items() if len(fs) > 1}


@dataclasses.dataclass(frozen=True)
class FusionPlan:
    """The groups of a model's features; identical on every rank (compare ``fingerprint()``).

    Example::

        >>> t = TableSpec("t", 8, OptimizerSpec.sgd(0.1))
        >>> plan = plan_fusion([FeatureSpec("a", t), FeatureSpec("b", t)])
        >>> FusionPlan.from_dict(plan.to_dict()) == plan  # JSON-able, round trips
        True
        >>> plan.group_of("b").name, plan.group_of("b").shared_tables
        ('g0_d8_sgd', {'t': ('a', 'b')})
    """
    groups: tuple
    _index: dict = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", tuple(self.groups))
        index, group_names = {}, set()
        for g in self.groups:
            if g.name in group_names:
                _fail("FusionPlan", g.name, "group name is used twice")
            group_names.add(g.name)
            for f in g.features:
                if f.name in index:
                    _fail("FeatureSpec", f.name, "feature name is used twice")
                index[f.name] = g
        # A table split over two groups would hold two diverging copies of its rows.
        for t, fs in _check_tables([f for g in self.groups for f in g.features]).items():
            if len({index[f.name].name for f in fs}) > 1:
                raise ValueError(f"FeatureSpec {fs[0].name!r} and FeatureSpec {fs[-1].name!r} share "
                                 f"table {t!r} but are in different groups")
        object.__setattr__(self, "_index", index)

    @property
    def feature_names(self) -> tuple:
        """All feature names, group by group."""
        return tuple(self._index)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def group_of(self, feature_name: str) -> FusedGroup:
        if feature_name not in self._index:
            raise KeyError(f"FeatureSpec {feature_name!r} is not in the fusion plan")
        return self._index[feature_name]

    def describe(self, exchanges: Optional[Mapping[str, Any]] = None) -> str:
        """A readable table: one line per group. With ``exchanges`` ({group name:
        ``tf_fusedemb.comm.cost_model.ExchangeEstimate``}, e.g. ``FusedEmbedding.exchanges``)
        each group's line is followed by one naming its exchange (flat or hierarchical) and
        the predicted costs of both."""
        rows = [("group", "dim", "optimizer", "initializer", "vocab", "features")]
        for g in self.groups:
            init = g.initializer  # params in constructor order: uniform(minval,maxval)
            init_args = ",".join(f"{init.hparams[k]:g}" for k in _INITIALIZERS[init.name])
            rows.append((g.name, str(g.dim), f"{g.optimizer.name}(lr={g.optimizer.learning_rate:g})",
                         f"{init.name}({init_args})",
                         f"static/{g.key_dtype}" if g.is_static
                         else f"dynamic/{g.key_dtype}/{g.storage}",
                         ", ".join(g.feature_names)))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[5] for r in rows]
        if exchanges is not None:  # the exchange on its own line: feature lists are long
            lines = [lines[0]] + [part for g, line in zip(self.groups, lines[1:])
                                  for part in (line, f"    exchange: {exchanges[g.name].summary()}")]
        return "\n".join(lines)

    def to_dict(self, policies: bool = True) -> dict:
        """JSON-able; ``policies=False`` leaves the tables' admission/eviction policies
        and storage backends out (the storage layout alone, what a checkpoint must match:
        rows saved from one backend restore onto another)."""
        d: Dict[str, Any] = {"format": _PLAN_FORMAT, "groups": [
            {"name": g.name, "features": [f.to_dict() for f in g.features]} for g in self.groups]}
        if not policies:
            for g in d["groups"]:
                for f in g["features"]:
                    for field in _POLICY_FIELDS + _TIER_FIELDS + ("storage",):
                        f["table"].pop(field, None)
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> "FusionPlan":
        if d.get("format") != _PLAN_FORMAT:
            raise ValueError(f"FusionPlan: unsupported format {d.get('format')!r}, expected {_PLAN_FORMAT}")
        return cls(tuple(FusedGroup(g["name"], tuple(FeatureSpec.from_dict(f) for f in g["features"]))
                         for g in d["groups"]))

    def fingerprint(self, policies: bool = True) -> str:
        """sha256 hex of the canonical JSON of ``to_dict()``; equal on ranks with equal plans.

        ``policies=False`` leaves the tables' admission/eviction policies and storage
        backends out: the fingerprint of the storage layout alone (a checkpoint restores
        under changed policies and onto another backend; a plan without policies on the
        default backend has the same fingerprint either way)."""
        d = self.to_dict(policies)
        blob = json.dumps(d, sort_keys=True, separators=(",", ":"), allow_nan=False)
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def describe_plan_difference(mine: Mapping, other: Mapping, here: str = "here",
                             there: str = "there") -> str:
    """How two ``FusionPlan.to_dict()`` dicts differ, in one line naming the features and
    the first differing field of each, e.g. ``specs differ for ['a'] (feature 'a':
    table.dim 4 here, 6 there)``; ``here``/``there`` name the two sides."""
    def features(plan):
        return {f["name"]: (g["name"], f) for g in plan["groups"] for f in g["features"]}
    a, b = features(mine), features(other)
    parts = []
    if set(a) != set(b):
        parts.append(f"features only {here} {sorted(set(a) - set(b))}, only {there} "
                     f"{sorted(set(b) - set(a))}")
    changed = sorted(n for n in set(a) & set(b) if a[n][1] != b[n][1])
    if changed:
        details = []
        for n in changed:
            field, x, y = next(_field_differences(a[n][1], b[n][1]))
            details.append(f"feature '{n}': {field} {x!r} {here}, {y!r} {there}")
        parts.append(f"specs differ for {changed} ({'; '.join(details)})")
    moved = [n for n in a if n in b and a[n][1] == b[n][1] and a[n][0] != b[n][0]]
    if moved:
        parts.append(f"feature '{moved[0]}' is in group '{a[moved[0]][0]}' {here}, "
                     f"'{b[moved[0]][0]}' {there}")
    return "; ".join(parts) or (f"the grouping or feature order differs ({here} "
                                f"{list(a)}, {there} {list(b)})")


def _field_differences(a, b, path=""):
    """Yields (dotted field, value in a, value in b) where two nested dicts differ."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        for key in sorted(set(a) | set(b), key=str):
            yield from _field_differences(a.get(key), b.get(key),
                                          f"{path}.{key}" if path else str(key))
    elif a != b:
        yield path, a, b


def plan_fusion(features: Sequence[FeatureSpec], overrides: Optional[Mapping[str, str]] = None,
                max_group_features: Optional[int] = None) -> FusionPlan:
    """Groups features by fusion key (dim, optimizer, initializer, key_dtype, storage).

    Args:
        features: the model's features; names must be unique.
        overrides: feature name -> group name chosen by the user. Overridden features go to
            that group (features sharing a table follow); its features must share one key.
            Useful to keep a hot feature apart, or to name groups.
        max_group_features: splits automatic groups into chunks of at most this many
            features (tables are never split). Override groups are taken as given.

    Returns:
        A deterministic plan: groups ordered by their first feature in ``features``, features
        in input order. Automatic groups are named ``g{i}_d{dim}_{optimizer}``, i = the
        group's position in the plan.

    Raises:
        ValueError: duplicate feature names, one table name with two specs, an unknown
            feature in ``overrides``, an override fusing features with different keys, or
            one table's features overridden to two groups.
    """
    features = tuple(features)
    seen: dict = {}
    for f in features:
        if not isinstance(f, FeatureSpec):
            raise ValueError(f"plan_fusion: expected FeatureSpec, got {f!r}")
        if f.name in seen:
            _fail("FeatureSpec", f.name, "feature name is used twice")
        seen[f.name] = f
    overrides = dict(overrides or {})
    for name, group in overrides.items():
        if name not in seen:
            _fail("FeatureSpec", name, "is named in overrides but is not among the features")
        _check_name(f"overrides[{name!r}]", group)
    if max_group_features is not None and (not _is_int(max_group_features) or max_group_features <= 0):
        raise ValueError(f"plan_fusion: max_group_features must be an int > 0, got {max_group_features!r}")

    # The unit of placement is a table: its features must share one group.
    buckets: dict = {}  # bucket key -> [table feature lists], in first-occurrence order
    for fs in _check_tables(features).values():
        chosen = {overrides[f.name]: f for f in fs if f.name in overrides}
        if len(chosen) > 1:
            (g1, f1), (g2, f2) = list(chosen.items())[:2]
            _fail("FeatureSpec", f1.name, f"shares table {f1.table.name!r} with FeatureSpec {f2.name!r} "
                                          f"but overrides put them in groups {g1!r} and {g2!r}")
        key = ("override", next(iter(chosen))) if chosen else ("auto", fs[0].table.fusion_key)
        units = buckets.setdefault(key, [])
        if units and units[0][0].table.fusion_key != fs[0].table.fusion_key:
            _fail("FeatureSpec", fs[0].name, f"cannot be fused with FeatureSpec {units[0][0].name!r} in "
                  f"override group {key[1]!r}: different specs (dim, optimizer, initializer, key_dtype, "
                  f"storage, SSD tier)")
        units.append(fs)

    order = {f.name: i for i, f in enumerate(features)}
    chunks = []  # (override name or None, features in input order)
    for (kind, value), units in buckets.items():
        limit = max_group_features if kind == "auto" and max_group_features else math.inf
        current: list = []
        for fs in units:
            if len(fs) > limit:
                _fail("TableSpec", fs[0].table.name, f"is shared by {len(fs)} features, more than "
                                                     f"max_group_features={max_group_features}")
            if current and len(current) + len(fs) > limit:
                chunks.append((None, current))
                current = []
            current = current + list(fs)
        chunks.append((value if kind == "override" else None, current))
    chunks = [(n, sorted(fs, key=lambda f: order[f.name])) for n, fs in chunks]
    chunks.sort(key=lambda c: order[c[1][0].name])
    return FusionPlan(tuple(
        FusedGroup(n or f"g{i}_d{fs[0].table.dim}_{fs[0].table.optimizer.name}", tuple(fs))
        for i, (n, fs) in enumerate(chunks)))


def unfused_plan(features: Sequence[FeatureSpec]) -> FusionPlan:
    """The baseline without fusion: one group per table, named after the table (so one group
    per feature unless features share a table), in input order.

    Example::

        >>> t, u = (TableSpec(n, 16, OptimizerSpec.adagrad(0.01)) for n in ("C1", "C2"))
        >>> [g.name for g in unfused_plan([FeatureSpec("C1", t), FeatureSpec("C2", u)]).groups]
        ['C1', 'C2']
    """
    return plan_fusion(features, overrides={f.name: f.table.name for f in features})
