"""Dataset profiles: the few fitted numbers a synthetic generator needs to look like real logs.

A profile is fitted once from a real sample (`python -m tf_fusedemb.data.fit_profile`) and shipped
as JSON inside the package, so benchmarks and tests get realistic key distributions even where
the real data is absent. Only numpy/stdlib are imported here.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any, Dict, Tuple, Union

__all__ = ["CategoricalProfile", "DenseProfile", "DatasetProfile", "load_profile", "PACKAGED_PROFILES"]

# Profile names shipped with the package -> JSON file next to this module.
PACKAGED_PROFILES = {"criteo": "criteo_profile.json"}

# IDs are packed as (feature_index + 1) << ID_RANK_BITS | rank before scrambling (see synthetic.py),
# so a vocabulary must fit in ID_RANK_BITS bits.
ID_RANK_BITS = 40


def _check_fraction(owner: str, field: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and 0.0 <= value <= 1.0):
        raise ValueError(f"profile feature {owner!r}: {field} must be a fraction in [0, 1], got {value!r}")


@dataclasses.dataclass(frozen=True)
class CategoricalProfile:
    """One categorical feature.

    The model is: a row is empty with probability `empty_fraction`; otherwise it takes the
    feature's most frequent value with probability `top_fraction`, else a value of rank
    r in 1..vocab_size-1 with probability proportional to r**-zipf_exponent.

    Attributes:
      name: feature name, e.g. "C1".
      observed_cardinality: distinct non-empty values in the fitted sample.
      empty_fraction: fraction of rows with no value.
      top_fraction: share of the non-empty rows taken by the most frequent value.
      zipf_exponent: skew s of the remaining values (0 = uniform).
      vocab_size: extrapolated number of distinct values (top value + Zipf ranks).
      num_nonempty: non-empty rows in the fitted sample (the sample size the fit describes).
    """

    name: str
    observed_cardinality: int
    empty_fraction: float
    top_fraction: float
    zipf_exponent: float
    vocab_size: int
    num_nonempty: int = 0

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"categorical profile needs a non-empty name, got {self.name!r}")
        _check_fraction(self.name, "empty_fraction", self.empty_fraction)
        _check_fraction(self.name, "top_fraction", self.top_fraction)
        s = self.zipf_exponent
        if not (isinstance(s, (int, float)) and math.isfinite(s) and 0.0 <= s <= 10.0):
            raise ValueError(f"profile feature {self.name!r}: zipf_exponent must be in [0, 10], got {s!r}")
        if not (isinstance(self.vocab_size, int) and 2 <= self.vocab_size <= 2**ID_RANK_BITS):
            raise ValueError(
                f"profile feature {self.name!r}: vocab_size must be an int in [2, 2**{ID_RANK_BITS}], "
                f"got {self.vocab_size!r}")
        if not (isinstance(self.observed_cardinality, int) and 0 <= self.observed_cardinality <= self.vocab_size):
            raise ValueError(
                f"profile feature {self.name!r}: observed_cardinality must be an int in [0, vocab_size="
                f"{self.vocab_size}], got {self.observed_cardinality!r}")


@dataclasses.dataclass(frozen=True)
class DenseProfile:
    """One integer-valued dense feature (Criteo I1..I13).

    A row is empty with probability `empty_fraction`; a present value is negative (uniform integer
    in [negative_min, -1]) with probability `negative_fraction`, zero with `zero_fraction`, else a
    positive integer x with log1p(x) ~ Normal(log1p_mean, log1p_std), clipped to [1, max_value].
    """

    name: str
    empty_fraction: float
    negative_fraction: float
    zero_fraction: float
    log1p_mean: float
    log1p_std: float
    negative_min: float = -1.0
    max_value: float = 1.0

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"dense profile needs a non-empty name, got {self.name!r}")
        for f in ("empty_fraction", "negative_fraction", "zero_fraction"):
            _check_fraction(self.name, f, getattr(self, f))
        if self.negative_fraction + self.zero_fraction > 1.0 + 1e-9:
            raise ValueError(f"profile feature {self.name!r}: negative_fraction + zero_fraction exceed 1")
        for f in ("log1p_mean", "log1p_std", "negative_min", "max_value"):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and math.isfinite(v)):
                raise ValueError(f"profile feature {self.name!r}: {f} must be a finite number, got {v!r}")
        if self.log1p_std < 0 or self.negative_min > -1 or self.max_value < 1:
            raise ValueError(
                f"profile feature {self.name!r}: need log1p_std >= 0, negative_min <= -1, max_value >= 1")


@dataclasses.dataclass(frozen=True)
class DatasetProfile:
    """A whole dataset: categorical and dense feature profiles (in column order) and the label rate."""

    name: str
    categorical: Tuple[CategoricalProfile, ...]
    dense: Tuple[DenseProfile, ...]
    label_positive_rate: float
    num_rows: int = 0
    source: str = ""
    method: str = ""

    def __post_init__(self):
        object.__setattr__(self, "categorical", tuple(self.categorical))
        object.__setattr__(self, "dense", tuple(self.dense))
        if not self.categorical:
            raise ValueError(f"profile {self.name!r} has no categorical features")
        names = [f.name for f in self.categorical] + [f.name for f in self.dense]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"profile {self.name!r}: duplicate feature names {dup}")
        _check_fraction(self.name, "label_positive_rate", self.label_positive_rate)

    @property
    def categorical_names(self) -> Tuple[str, ...]:
        return tuple(f.name for f in self.categorical)

    @property
    def dense_names(self) -> Tuple[str, ...]:
        return tuple(f.name for f in self.dense)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "DatasetProfile":
        """Builds and validates a profile from its JSON form; raises ValueError on any defect."""
        if not isinstance(d, dict):
            raise ValueError(f"profile must be a JSON object, got {type(d).__name__}")
        try:
            cat = tuple(CategoricalProfile(**f) for f in d["categorical"])
            dense = tuple(DenseProfile(**f) for f in d.get("dense", ()))
            return cls(name=d["name"], categorical=cat, dense=dense,
                       label_positive_rate=d["label_positive_rate"], num_rows=d.get("num_rows", 0),
                       source=d.get("source", ""), method=d.get("method", ""))
        except (KeyError, TypeError) as e:  # missing or unexpected fields: say which
            raise ValueError(f"malformed profile {d.get('name', '?')!r}: {type(e).__name__}: {e}") from None


def load_profile(name_or_path: Union[str, os.PathLike, DatasetProfile] = "criteo") -> DatasetProfile:
    """Loads a packaged profile by name ("criteo") or a profile JSON file by path.

    Raises:
      ValueError: unknown name, missing or unreadable file, or a profile that fails validation.
    """
    if isinstance(name_or_path, DatasetProfile):
        return name_or_path
    key = os.fspath(name_or_path)
    if key in PACKAGED_PROFILES:
        path = Path(__file__).resolve().parent / PACKAGED_PROFILES[key]
    elif key.endswith(".json") or os.sep in key or Path(key).is_file():
        path = Path(key)
    else:
        raise ValueError(f"unknown profile {key!r}: known names are {sorted(PACKAGED_PROFILES)}, "
                         "or pass the path of a profile .json file")
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"profile file not found: {path}") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read profile {path}: {e}") from None
    return DatasetProfile.from_dict(data)
