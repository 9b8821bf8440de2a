"""The fusion planner (FusedRec, equation (1)): features of one spec fused into groups,
and the plan every rank must agree on (its fingerprint)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from tf_fusedemb.specs.hyperparameters import INITIALIZERS, OptimizerSpec
from tf_fusedemb.specs.tables import POLICY_FIELDS, TIER_FIELDS, TableSpec, FeatureSpec
from tf_fusedemb.specs.validation import canonical, check_name, fail, is_int

_PLAN_FORMAT = 1  # bump when to_dict() changes shape: old fingerprints then no longer match


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
        check_name("FusedGroup", self.name)
        object.__setattr__(self, "features", tuple(self.features))
        if not self.features:
            fail("FusedGroup", self.name, "has no features")
        _check_tables(self.features)
        first = self.features[0]
        for f in self.features[1:]:
            if f.table.fusion_key != first.table.fusion_key:
                fail("FusedGroup", self.name, f"FeatureSpec {f.name!r} and FeatureSpec {first.name!r} have "
                                               f"different specs (dim, optimizer, initializer, key_dtype, "
                                               f"storage, SSD tier, row_dtype) and cannot be fused")

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
    row_dtype = property(lambda self: self.features[0].table.row_dtype)

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
                fail("FusionPlan", g.name, "group name is used twice")
            group_names.add(g.name)
            for f in g.features:
                if f.name in index:
                    fail("FeatureSpec", f.name, "feature name is used twice")
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
            init_args = ",".join(f"{init.hparams[k]:g}" for k in INITIALIZERS[init.name])
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
                    for field in POLICY_FIELDS + TIER_FIELDS + ("storage",):
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
    overrides = _checked_overrides(features, overrides, max_group_features)
    chunks = _chunks(_buckets(features, overrides), max_group_features)
    order = {f.name: i for i, f in enumerate(features)}
    chunks = [(n, sorted(fs, key=lambda f: order[f.name])) for n, fs in chunks]
    chunks.sort(key=lambda c: order[c[1][0].name])
    return FusionPlan(tuple(
        FusedGroup(n or f"g{i}_d{fs[0].table.dim}_{fs[0].table.optimizer.name}", tuple(fs))
        for i, (n, fs) in enumerate(chunks)))


def _checked_overrides(features: Tuple[FeatureSpec, ...], overrides: Optional[Mapping[str, str]],
                       max_group_features: Optional[int]) -> Dict[str, str]:
    """plan_fusion's arguments checked (see its Raises); ``overrides`` as a dict."""
    seen: dict = {}
    for f in features:
        if not isinstance(f, FeatureSpec):
            raise ValueError(f"plan_fusion: expected FeatureSpec, got {f!r}")
        if f.name in seen:
            fail("FeatureSpec", f.name, "feature name is used twice")
        seen[f.name] = f
    overrides = dict(overrides or {})
    for name, group in overrides.items():
        if name not in seen:
            fail("FeatureSpec", name, "is named in overrides but is not among the features")
        check_name(f"overrides[{name!r}]", group)
    if max_group_features is not None and (not is_int(max_group_features) or max_group_features <= 0):
        raise ValueError(f"plan_fusion: max_group_features must be an int > 0, got {max_group_features!r}")
    return overrides


def _buckets(features: Tuple[FeatureSpec, ...], overrides: Dict[str, str]) -> dict:
    """{("override", group name) or ("auto", fusion key): [each table's features]}, in
    first-occurrence order. The unit of placement is a table: its features share a group."""
    buckets: dict = {}  # bucket key -> [table feature lists], in first-occurrence order
    for fs in _check_tables(features).values():
        chosen = {overrides[f.name]: f for f in fs if f.name in overrides}
        if len(chosen) > 1:
            (g1, f1), (g2, f2) = list(chosen.items())[:2]
            fail("FeatureSpec", f1.name, f"shares table {f1.table.name!r} with FeatureSpec {f2.name!r} "
                                          f"but overrides put them in groups {g1!r} and {g2!r}")
        key = ("override", next(iter(chosen))) if chosen else ("auto", fs[0].table.fusion_key)
        units = buckets.setdefault(key, [])
        if units and units[0][0].table.fusion_key != fs[0].table.fusion_key:
            fail("FeatureSpec", fs[0].name, f"cannot be fused with FeatureSpec {units[0][0].name!r} in "
                  f"override group {key[1]!r}: different specs (dim, optimizer, initializer, key_dtype, "
                  f"storage, SSD tier)")
        units.append(fs)
    return buckets


def _chunks(buckets: dict, max_group_features: Optional[int]) -> list:
    """[(override group name or None, features)]: each bucket, automatic ones split into
    chunks of at most ``max_group_features`` features (whole tables)."""
    chunks = []  # (override name or None, features in input order)
    for (kind, value), units in buckets.items():
        limit = max_group_features if kind == "auto" and max_group_features else math.inf
        current: list = []
        for fs in units:
            if len(fs) > limit:
                fail("TableSpec", fs[0].table.name, f"is shared by {len(fs)} features, more than "
                                                     f"max_group_features={max_group_features}")
            if current and len(current) + len(fs) > limit:
                chunks.append((None, current))
                current = []
            current = current + list(fs)
        chunks.append((value if kind == "override" else None, current))
    return chunks


def unfused_plan(features: Sequence[FeatureSpec]) -> FusionPlan:
    """The baseline without fusion: one group per table, named after the table (so one group
    per feature unless features share a table), in input order.

    Example::

        >>> t, u = (TableSpec(n, 16, OptimizerSpec.adagrad(0.01)) for n in ("C1", "C2"))
        >>> [g.name for g in unfused_plan([FeatureSpec("C1", t), FeatureSpec("C2", u)]).groups]
        ['C1', 'C2']
    """
    return plan_fusion(features, overrides={f.name: f.table.name for f in features})

