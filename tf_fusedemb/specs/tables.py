"""A table (rows of one spec) and a feature (one sparse input reading a table)."""
from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

from tf_fusedemb.specs.hyperparameters import InitializerSpec, OptimizerSpec
from tf_fusedemb.specs.policies import AdmissionPolicy, EvictionPolicy
from tf_fusedemb.specs.validation import check_name, fail, is_int

COMBINERS = ("sum", "mean", "sqrtn")
KEY_DTYPES = ("int64", "int32")
POLICY_FIELDS = ("admission", "eviction")  # TableSpec fields outside the storage layout
# TableSpec fields of the SSD tier: where rows live, not what they are (a checkpoint of a
# tiered table restores onto an untiered one and back).
TIER_FIELDS = ("memory_budget_bytes", "spill_dir")
ROW_DTYPES = ("float32", "bfloat16")  # how the storage engine stores a table's rows
# The storage backends of a dynamic table (tf_fusedemb.storage.backend); a static table
# keeps its dense variables ("static"). Which backend holds the rows is outside the
# storage layout too: a checkpoint written with one restores onto the other.
STORAGES = ("engine", "tfra")
DEFAULT_STORAGE = "engine"  # of dynamic tables, when TableSpec(storage=None)
STATIC_STORAGE = "static"


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
            (a file of block slots), invisibly to results. A table setting, not a layer one, because
            tables differ in size; the tables fused into one group share one engine
            whose budget is the sum of theirs, and tiered tables fuse only with tiered
            tables of the same ``spill_dir``. It must hold the blocks a step pins at
            once (one batch's keys, up to three batches' with the pipelined fit), or
            the step fails in one line naming the tables and the sizes.
        spill_dir: where the SSD tier's stores go (one fresh subdirectory per group and
            rank, removed when its table is). None: the system temporary directory
            (``tempfile.gettempdir()``, i.e. $TMPDIR), because the table is made before
            any run or checkpoint directory is known; name a directory on a local SSD
            with room for the table. Nothing in it outlives the process (checkpoints
            hold every row): a killed run's leftovers may be deleted.
        row_dtype: how the rows are stored, one of ``ROW_DTYPES``. "bfloat16" (engine
            storage only) halves the row bytes of every block: each row is rounded to
            nearest even (as ``tf.cast``) whenever it is stored, while its optimizer slots
            and the optimizer's math stay float32 and lookups return float32. Training
            then equals float32 training with that rounding after every update, not
            float32 training itself. Tables of different row dtypes never fuse.
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
    row_dtype: str = "float32"

    def __post_init__(self) -> None:
        check_name("TableSpec", self.name)
        if not is_int(self.dim) or self.dim <= 0:
            fail("TableSpec", self.name, f"dim must be an int > 0, got {self.dim!r}")
        if not isinstance(self.optimizer, OptimizerSpec):
            fail("TableSpec", self.name, f"optimizer must be an OptimizerSpec, got {self.optimizer!r}")
        if not isinstance(self.initializer, InitializerSpec):
            fail("TableSpec", self.name, f"initializer must be an InitializerSpec, got {self.initializer!r}")
        v = self.vocabulary_size
        if v is not None and (not is_int(v) or v <= 0):
            fail("TableSpec", self.name, f"vocabulary_size must be None (dynamic) or an int > 0, got {v!r}")
        dtype = getattr(self.key_dtype, "name", self.key_dtype)  # tf.int64 / np.int64 -> "int64"
        if dtype not in KEY_DTYPES:
            fail("TableSpec", self.name, f"key_dtype {self.key_dtype!r} is not one of {KEY_DTYPES}")
        object.__setattr__(self, "key_dtype", dtype)
        for field, cls in (("admission", AdmissionPolicy), ("eviction", EvictionPolicy)):
            value = getattr(self, field)
            if value is not None and not isinstance(value, cls):
                fail("TableSpec", self.name, f"{field} must be an {cls.__name__} or None, "
                                              f"got {value!r}")
            if value is not None and v is not None:
                fail("TableSpec", self.name, f"{field} policies need a dynamic table "
                                              f"(vocabulary_size=None): a static table's "
                                              f"memory is fixed")
        object.__setattr__(self, "storage", self._resolved_storage())
        self._check_tier()
        self._check_row_dtype()

    def _check_row_dtype(self) -> None:
        """float32, or bfloat16 rows of an engine table."""
        dtype = getattr(self.row_dtype, "name", self.row_dtype)  # tf.bfloat16 -> "bfloat16"
        if dtype not in ROW_DTYPES:
            fail("TableSpec", self.name, f"row_dtype {self.row_dtype!r} is not one of {ROW_DTYPES}")
        if dtype != "float32" and self.storage != "engine":
            fail("TableSpec", self.name, f"row_dtype {dtype!r} needs storage 'engine' (a dynamic "
                                          f"table on the storage engine), got {self.storage!r}")
        object.__setattr__(self, "row_dtype", dtype)

    def _check_tier(self) -> None:
        """A budget: an int >= 0 of an engine table; a spill_dir only with a budget."""
        b = self.memory_budget_bytes
        if b is None:
            if self.spill_dir is not None:
                fail("TableSpec", self.name, "spill_dir needs a memory_budget_bytes")
            return
        if not is_int(b) or b < 0:
            fail("TableSpec", self.name, f"memory_budget_bytes must be None or an int >= 0, got {b!r}")
        if self.storage != "engine":
            fail("TableSpec", self.name, f"memory_budget_bytes needs storage 'engine' (a dynamic "
                                          f"table on the storage engine), got {self.storage!r}")
        if self.spill_dir is not None and not isinstance(self.spill_dir, str):
            fail("TableSpec", self.name, f"spill_dir must be a str or None, got {self.spill_dir!r}")

    def _resolved_storage(self) -> str:
        """``storage`` checked: "static" for a static table, else one of STORAGES."""
        s = self.storage
        if self.is_static:
            if s not in (None, STATIC_STORAGE):
                fail("TableSpec", self.name, f"storage {s!r} is for dynamic tables "
                                              f"(vocabulary_size=None); a static table keeps "
                                              f"its own dense storage (storage=None)")
            return STATIC_STORAGE
        if s is None:
            return DEFAULT_STORAGE
        if s not in STORAGES:
            fail("TableSpec", self.name, f"storage {s!r} is not one of {STORAGES}")
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
                self.storage, self.memory_budget_bytes is not None, self.spill_dir,
                self.row_dtype)

    def to_dict(self) -> dict:
        # Policies only when set: a plan without them keeps its old dict and fingerprint.
        d = {"name": self.name, "dim": self.dim, "optimizer": self.optimizer.to_dict(),
             "initializer": self.initializer.to_dict(), "vocabulary_size": self.vocabulary_size,
             "key_dtype": self.key_dtype}
        for field in POLICY_FIELDS:
            if getattr(self, field) is not None:
                d[field] = getattr(self, field).to_dict()
        if not self.is_static and self.storage != DEFAULT_STORAGE:
            d["storage"] = self.storage  # the default left out, like absent policies
        for field in TIER_FIELDS:
            if getattr(self, field) is not None:
                d[field] = getattr(self, field)
        if self.row_dtype != "float32":
            d["row_dtype"] = self.row_dtype
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> "TableSpec":
        return cls(d["name"], d["dim"], OptimizerSpec.from_dict(d["optimizer"]),
                   InitializerSpec.from_dict(d["initializer"]), d.get("vocabulary_size"),
                   d.get("key_dtype", "int64"),
                   AdmissionPolicy.from_dict(d["admission"]) if d.get("admission") else None,
                   EvictionPolicy.from_dict(d["eviction"]) if d.get("eviction") else None,
                   d.get("storage"), d.get("memory_budget_bytes"), d.get("spill_dir"),
                   d.get("row_dtype", "float32"))


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
        check_name("FeatureSpec", self.name)
        if not isinstance(self.table, TableSpec):
            fail("FeatureSpec", self.name, f"table must be a TableSpec, got {self.table!r}")
        if self.combiner is not None and self.combiner not in COMBINERS:
            fail("FeatureSpec", self.name, f"combiner {self.combiner!r} is not one of {COMBINERS} or None")
        if self.combiner is None and (not is_int(self.max_len) or self.max_len <= 0):
            fail("FeatureSpec", self.name, f"max_len must be an int > 0 for a sequence feature "
                                            f"(combiner=None), got {self.max_len!r}")
        if self.combiner is not None and self.max_len is not None:
            fail("FeatureSpec", self.name, f"max_len is only for sequence features (combiner=None); "
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
