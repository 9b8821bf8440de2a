"""Validation shared by the specs: one-line ValueErrors naming the spec and its field,
and hyper-parameters in canonical form (sorted (key, float) pairs, hashable)."""
from __future__ import annotations

import math
from typing import Any, Mapping, Tuple, TypeGuard, Union

# Hyper-parameters as given (a mapping or (key, value) pairs); a spec stores them canonical, as a
# sorted tuple of (key, float) pairs, so that it stays hashable and ordered.
HParams = Union[Tuple[Tuple[str, float], ...], Mapping[str, float]]

_NONNEG = (lambda v: v >= 0, ">= 0")
_CHECKS = {
    "initial_accumulator_value": _NONNEG, "l1": _NONNEG, "l2": _NONNEG,
    "beta1": (lambda v: 0 <= v < 1, "in [0, 1)"), "beta2": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "epsilon": (lambda v: v > 0, "> 0"), "learning_rate_power": (lambda v: v <= 0, "<= 0"),
    "stddev": (lambda v: v > 0, "> 0"),
}



def fail(kind: str, name: Any, msg: str):
    raise ValueError(f"{kind} {name!r}: {msg}")


def is_int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def number(kind: str, name: str, field: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        fail(kind, name, f"{field} must be a finite number, got {v!r}")
    return float(v)  # 0 and 0.0 must give the same JSON, hence the same fingerprint


def check_name(kind: str, name) -> None:
    # '/' is reserved: reports spell a key as "feature/ID".
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(f"{kind}: name must be a non-empty str without '/', got {name!r}")


def canonical(kind: str, name: str, defaults: Mapping[str, float], given) -> tuple:
    """Merges ``given`` (mapping or (key, value) pairs) over ``defaults``: sorted, validated."""
    params = dict(defaults)
    for key, value in dict(given).items():
        if key not in defaults:
            fail(kind, name, f"unknown hyper-parameter {key!r}; expected one of {tuple(defaults)}")
        params[key] = number(kind, name, key, value)
        check, rule = _CHECKS.get(key, (None, ""))
        if check is not None and not check(params[key]):
            fail(kind, name, f"{key} must be {rule}, got {value!r}")
    return tuple(sorted(params.items()))



def positive_int(kind: str, field: str, v, optional: bool = False):
    if v is None and optional:
        return
    if not is_int(v) or v <= 0:
        raise ValueError(f"{kind}: {field} must be an int > 0{' or None' if optional else ''}, "
                         f"got {v!r}")

