"""``FusedEmbedding``: a dict of features in, a dict of embeddings out, fused and sharded."""
import dataclasses
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import numpy.typing as npt
import tensorflow as tf
import tf_keras

from tf_fusedemb.comm import Communicator, get_communicator
from tf_fusedemb.comm.cost_model import TrafficHints, estimate
from tf_fusedemb.layers.group_lookup import GroupLookup
from tf_fusedemb.layers.key_probe import FeatureKey, ServedFeature
from tf_fusedemb.layers.lookup_context import NO_CONTEXT, GroupName, LookupContext
from tf_fusedemb.layers.routed_lookup import RoutedLookup
from tf_fusedemb.layers.inputs import flatten_feature, to_tensor
from tf_fusedemb.layers.keras_mismatch import KerasKind, refuse_other_keras
from tf_fusedemb.layers.row_update import MARKER_NAME, MarkerAtZero, check_marker
from tf_fusedemb.ops import hashing
from tf_fusedemb.specs import FeatureSpec, FusionPlan, describe_plan_difference, plan_fusion
from tf_fusedemb.storage.backend import StatisticsStorage


if TYPE_CHECKING:
    class _KerasLayer(tf_keras.layers.Layer):
        """What FusedEmbeddingMixin is mixed into, to the type checker: a Keras Layer (of
        tf_keras or Keras 3; their methods it calls and overrides have one shape)."""
else:
    _KerasLayer = object


class FusedEmbeddingMixin(_KerasLayer):
    """What FusedEmbedding is, whichever Keras it is a layer of: ``FusedEmbedding`` here
    (tf_keras) and ``tf_fusedemb.keras3.FusedEmbedding`` (Keras 3) mix it into their
    Keras's ``Layer`` (the documentation is FusedEmbedding's)."""

    def __init__(self, features: Sequence[FeatureSpec], plan: Optional[FusionPlan] = None,
                 key_mode: str = "hashed", communicator: Optional[Communicator] = None,
                 exchange: Union[None, str, Mapping[str, str]] = None,
                 traffic: Optional[TrafficHints] = None, wire_dtype: str = "float32",
                 **kwargs: Any):
        super().__init__(**kwargs)  # the Keras Layer's
        self._setup(features, plan, key_mode, communicator, exchange, traffic, wire_dtype)

    # Which Keras the concrete class is a layer of (its messages name the other's class).
    keras_kind: KerasKind

    def _is_symbolic_tensor(self, value: Any) -> bool:
        """Whether ``value`` is a symbolic tensor of this layer's Keras."""
        raise NotImplementedError

    def _setup(self, features, plan, key_mode, communicator, exchange, traffic,
               wire_dtype) -> None:
        self.features = tuple(features)
        self.plan = plan if plan is not None else plan_fusion(self.features)
        if set(self.plan.feature_names) != {f.name for f in self.features}:
            raise ValueError(f"plan covers {sorted(self.plan.feature_names)} but the layer's "
                             f"features are {sorted(f.name for f in self.features)}")
        self.key_mode = key_mode
        self._comm = communicator or get_communicator()
        self.exchange, self.traffic = exchange, traffic
        # Chosen locally (a function of the plan, topology and arguments);
        # the ranks compare plans and choices at the first call they make together
        # (``agree_across_ranks``): a constructor runs no collective, so a model can be
        # built, cloned or rebuilt from its config on one rank alone.
        self.exchanges = _choose_exchanges(self.plan, self._comm.topology, exchange,
                                           traffic or TrafficHints())
        self.wire_dtype = wire_dtype  # checked by GroupLookup
        self.groups = [GroupLookup(g, self._comm, key_mode, self.exchanges[g.name].kind,
                                   wire_dtype) for g in self.plan.groups]
        self._agreed = self._comm.size == 1
        self._said_own_exchange: Tuple[str, ...] = ()  # features logged (note_own_exchange)
        # Installed by a training step for one forward pass (see lookup_context).
        self.lookup_context = NO_CONTEXT
        # The row-update marker (see tf_fusedemb.layers.row_update): always 0, trainable,
        # so differentiating the layer's variables differentiates its lookups. Made with
        # the layer, so code that builds an optimizer's slots before the first call sees it.
        # On several ranks its constraint refuses a bare optimizer inside the first step.
        self.row_update_marker = self.add_weight(
            name=MARKER_NAME, shape=(), dtype="float32", initializer="zeros", trainable=True,
            constraint=MarkerAtZero(self._comm.size) if self._comm.size > 1 else None)

    def agree_across_ranks(self) -> None:
        """Checks (once) that every rank built this layer with the same features, specs and
        fusion plan, and chose the same exchange per group: one ``allgather_object``, run
        eagerly even while a step is being traced. Collective: every rank calls it at the
        same point; the layer's first call (or ``route``) with real tensors does, so a
        training loop need not, unless it runs a collective of its own first (e.g. a
        broadcast of dense weights whose shapes follow from the embeddings). Where ranks
        differ, every rank raises the same ValueError naming the features or the group
        (instead of hanging in, or failing inside, mismatched collectives).

        Skipped in one process and once the ranks agreed; not needed while the lookup
        context substitutes every group (serving, sharded inference: no collective)."""
        if self._agreed:
            return
        if all(self._lookup_for(g) is not g for g in self.groups):
            return  # serving or sharded inference: this pass runs no collective lookup
        mine = {"plan": self.plan.to_dict(), "wire_dtype": self.wire_dtype,
                "exchanges": {name: c.kind for name, c in self.exchanges.items()}}
        with tf.init_scope():  # eager, also when the first call is being traced
            everyone = self._comm.allgather_object(mine)
        for rank, other in enumerate(everyone):
            if other["plan"] != mine["plan"]:
                diff = describe_plan_difference(mine["plan"], other["plan"], "here",
                                                f"on rank {rank}")
                raise ValueError(
                    f"FusedEmbedding '{self.name}': rank {rank} has a different feature set "
                    f"or specs than rank {self._comm.rank}: {diff}. Every rank must build "
                    "the layer with identical FeatureSpecs.")
        for name in mine["exchanges"]:
            kinds = [other["exchanges"][name] for other in everyone]
            if len(set(kinds)) > 1:
                raise ValueError(
                    f"FusedEmbedding '{self.name}': group '{name}': the ranks chose different "
                    f"exchanges ({', '.join(f'rank {r}: {k}' for r, k in enumerate(kinds))}; "
                    f"this is rank {self._comm.rank}, {self._comm.topology.describe()}). "
                    f"Every rank must see the same topology, exchange= and "
                    "traffic= (e.g. link costs measured on one rank and shared).")
        wires = [other["wire_dtype"] for other in everyone]
        if len(set(wires)) > 1:
            raise ValueError(
                f"FusedEmbedding '{self.name}': the ranks built it with different wire_dtype "
                f"({', '.join(f'rank {r}: {w}' for r, w in enumerate(wires))}); every rank "
                "must pass the same")
        self._agreed = True

    def note_own_exchange(self, feature: str) -> bool:
        """Whether ``feature``'s own exchange (its IDs not computable ahead, see
        ``keys_ahead``) is news: True the first time it is noted."""
        if feature in self._said_own_exchange:
            return False
        self._said_own_exchange += (feature,)
        return True

    # AutoGraph is off from here down (here, call, and what they call): the layer is written
    # with TensorFlow's own control flow, and converting it in a user's tf.function (a
    # custom loop, Keras's train function, a @tf.function call) cost seconds of tracing
    # per model for nothing.
    @tf.autograph.experimental.do_not_convert
    def __call__(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        refuse_other_keras(self, self.keras_kind, inputs)
        # Keras converts Python/numpy leaves of the input dict one element at a time before
        # call(), so e.g. a list holding 2**63 would fail with no feature named: convert
        # them here, per feature, first.
        if isinstance(inputs, Mapping):
            inputs = {k: to_tensor(k, v) if isinstance(v, (list, tuple, np.ndarray, int))
                      else v for k, v in inputs.items()}
        if not self._symbolic(inputs):  # building a functional model (or cloning it) is local
            self.agree_across_ranks()
        return super().__call__(inputs, *args, **kwargs)

    def _check_inputs(self, inputs):
        """The input must be a dict with exactly the layer's features (same on every rank,
        see ``agree_across_ranks``): a missing or unknown feature is an error."""
        if not isinstance(inputs, Mapping):
            raise ValueError(f"FusedEmbedding '{self.name}': expected a dict {{feature name: "
                             f"IDs}} of the features {sorted(f.name for f in self.features)}, "
                             f"got {type(inputs).__name__}")
        names = {f.name for f in self.features}
        given = set(inputs)
        if given != names:
            raise ValueError(f"FusedEmbedding '{self.name}': missing features "
                             f"{sorted(names - given, key=str)}, unexpected features "
                             f"{sorted(given - names, key=str)}")

    def _flat_features(self, lookup, inputs):
        """FlatFeatures of one group's features, validated (IDs in range: static tables,
        packed keys)."""
        id_bits = None
        if lookup.key_mode == "packed" and not lookup.group.is_static:
            id_bits = hashing.default_id_bits(len(lookup.table_names))
        # The distributed lookup reports an ID out of range to every rank (route);
        # substitutes (serving, sharded inference) check here.
        return [flatten_feature(f, inputs[f.name], id_bits,
                                defer_range_check=lookup.defers_range_check)
                for f in lookup.group.features]

    def route(self, inputs: Mapping[str, tf.Tensor],
              context: LookupContext = NO_CONTEXT) -> List[RoutedLookup]:
        """Key routing of ``inputs`` ahead of the forward pass (used by pipelines): one
        RoutedLookup per group, in ``self.groups`` order; collective names take
        ``context.suffix``."""
        self._check_inputs(inputs)
        self.agree_across_ranks()
        return [lookup.route(self._flat_features(lookup, inputs), context)
                for lookup in self.groups]

    @tf.autograph.experimental.do_not_convert
    def call(self, inputs: Mapping[str, tf.Tensor],
             training: Optional[bool] = None) -> Dict[str, tf.Tensor]:
        # Access statistics count training lookups (and direct calls), never those of
        # evaluate/predict (training=False): eviction and reports must not see eval data.
        record = training is not False
        self._check_inputs(inputs)
        if self.lookup_context.probe is not None:  # a probe pass looks nothing up
            probe = self.lookup_context.probe
            return {name: probe.stand_in(None, ids, shape)
                    for name, (ids, shape) in self._output_shapes_of(inputs).items()}
        marker = self._marker(record, refuse_eviction=training is True)
        outputs = {}
        for group in self.groups:
            outputs.update(self._group_outputs(group, inputs, record, marker,
                                               self.lookup_context))
        return outputs

    def _group_outputs(self, group: GroupLookup, inputs: Mapping[str, Any], record: bool,
                       marker: Optional[tf.Tensor], context: LookupContext
                       ) -> Dict[str, tf.Tensor]:
        """{feature: embeddings} of one group's features, looked up by the group (or its
        substitute: serving, sharded inference, which train nothing) during this pass."""
        lookup = self._lookup_for(group)
        feats = lookup.group.features
        flats = self._flat_features(lookup, inputs)
        embs = lookup(flats, [f.combiner for f in feats], context, record, marker)
        return {spec.name: _shape_output(spec, flat, emb)
                for spec, flat, emb in zip(feats, flats, embs)}

    @tf.autograph.experimental.do_not_convert
    def lookup_feature(self, name: str, ids: Any, training: Optional[bool] = None) -> tf.Tensor:
        """The embeddings of the one feature ``name`` for ``ids`` (int [B] or [B, L], or
        ragged/sparse as in ``call``): float32[B, dim] pooled, [B, L, dim] sequence. What
        a ``ShardedEmbedding`` looking up its feature in this layer calls.

        A training step of ours that computed the feature's IDs ahead (every table's keys
        first, one exchange per group: ``tf_fusedemb.layers.keys_ahead``) has served them
        already; else the feature makes an exchange of its own (its group's other features
        take no IDs in it), as on plain Keras paths."""
        context = self.lookup_context
        key = FeatureKey(self.name, name)
        spec = self._feature(name)
        served = context.served_for(key)
        if served is not None:
            return served.checked(ids)
        if context.probe is not None:
            return context.probe.stand_in(key, ids, self._output_shapes_of({name: ids})[name][1])
        if not self._symbolic(ids):
            self.agree_across_ranks()
        record = training is not False
        marker = self._marker(record, refuse_eviction=training is True)
        group = next(g for g in self.groups if spec in g.group.features)
        if record and len(group.group.features) > 1 and group.group.optimizer.counts_steps:
            raise ValueError(
                f"feature '{name}' of '{self.name}' is exchanged on its own, and its group "
                f"'{group.group.name}' uses {group.group.optimizer.name}, whose update counts "
                "steps: the group would step once per feature. Give each table its own "
                "FusedEmbedding (ShardedEmbedding without tables=), or train with FusedModel "
                "where every feature's keys are computed ahead")
        # Collective names per feature: several features of one group may each make an
        # exchange in one step.
        own = dataclasses.replace(context, suffix=f"{context.suffix}/{name}") \
            if len(self.features) > 1 else context
        inputs = {f.name: ids if f.name == name else _no_ids(f) for f in group.group.features}
        return self._group_outputs(group, inputs, record, marker, own)[name]

    def route_ahead(self, ids: Mapping[str, tf.Tensor], context: LookupContext
                    ) -> List[Optional[RoutedLookup]]:
        """Key routing and row retrieval, ahead of the forward pass, of the features in
        ``ids`` ({feature: int [B] or [B, L]}, computed ahead): per group (in
        ``self.groups`` order) its RoutedLookup with ``rows`` (the group's other features
        take no IDs), None where ``ids`` holds none of its features or a substitute
        serves it."""
        self.agree_across_ranks()
        routed: List[Optional[RoutedLookup]] = []
        for group in self.groups:
            names = [f.name for f in group.group.features if f.name in ids]
            if not names or self._lookup_for(group) is not group:
                routed.append(None)
                continue
            r = group.route(self._flat_features(group, self._with_no_ids(group, ids)), context)
            routed.append(r.with_rows(group.retrieve(r)))
        return routed

    def serve_ahead(self, routed: Sequence[Optional[RoutedLookup]], ids: Mapping[str, tf.Tensor],
                    context: LookupContext) -> List[ServedFeature]:
        """The embeddings of the features in ``ids`` from their groups' ``routed``
        lookups (``route_ahead``'s): one row exchange per group. The caller differentiates
        the rows (``routed[j].rows``) and applies their update."""
        served: List[ServedFeature] = []
        for group, r in zip(self.groups, routed):
            if r is None:
                continue
            feats = group.group.features
            flats = self._flat_features(group, self._with_no_ids(group, ids))
            embs = group.serve(r, r.rows, flats, [f.combiner for f in feats], context)
            served += [ServedFeature(FeatureKey(self.name, f.name), ids[f.name],
                                     _shape_output(f, flat, emb))
                       for f, flat, emb in zip(feats, flats, embs) if f.name in ids]
        return served

    def _with_no_ids(self, group: GroupLookup, ids: Mapping[str, tf.Tensor]) -> Dict[str, Any]:
        """``ids`` for the group's features, empty ones where ``ids`` has none."""
        return {f.name: ids[f.name] if f.name in ids else _no_ids(f) for f in group.group.features}

    def _feature(self, name: str) -> FeatureSpec:
        for f in self.features:
            if f.name == name:
                return f
        raise ValueError(f"FusedEmbedding '{self.name}': no feature {name!r}; its features "
                         f"are {sorted(f.name for f in self.features)}")

    def _output_shapes_of(self, inputs: Mapping[str, Any]) -> Dict[str, Tuple[Any, tf.Tensor]]:
        """{feature: (its IDs, the shape int32[2 or 3] of its embeddings)} of ``inputs``,
        for a probe pass (which returns zeros of those shapes)."""
        out = {}
        for name, ids in inputs.items():
            spec = self._feature(name)
            if isinstance(ids, (tf.RaggedTensor, tf.SparseTensor)):
                batch = tf.cast(ids.nrows() if isinstance(ids, tf.RaggedTensor)
                                else ids.dense_shape[0], tf.int32)
                shape = tf.stack([batch, spec.max_len, spec.dim]) if spec.is_sequence \
                    else tf.stack([batch, spec.dim])
            else:
                ids = tf.convert_to_tensor(ids)
                dims = tf.shape(ids)
                shape = tf.concat([dims, [spec.dim]], 0) if spec.is_sequence \
                    else tf.stack([dims[0], spec.dim])
            out[name] = (ids, shape)
        return out

    def _lookup_for(self, group: GroupLookup) -> Any:
        """What gives ``group``'s embeddings in this pass (``LookupContext.lookup_for``)."""
        return self.lookup_context.lookup_for(GroupName(self.name, group.group.name), group)

    def _marker(self, training: bool, refuse_eviction: bool = False) -> Optional[tf.Tensor]:
        """The row-update marker's value for a training pass of a trainable layer, else
        None. Outside a step of ours on several ranks it is checked to be 0: an optimizer
        that applied its gradient did not average the dense gradients
        (``row_update.check_marker``). ``refuse_eviction``: a training pass (not a
        functional model's construction) refuses tables with eviction outside our step."""
        if not training or not self.trainable:
            return None
        value = tf.convert_to_tensor(self.row_update_marker)
        outside_our_step = not self.lookup_context.in_our_step
        if outside_our_step and refuse_eviction and self.has_eviction:
            # Eviction runs between steps (enforce_policies), which only FusedModel.fit
            # calls: trained elsewhere, the tables would never evict.
            raise ValueError(f"FusedEmbedding '{self.name}': tables with an EvictionPolicy "
                             "train in tf_fusedemb.models.FusedModel (its fit evicts after "
                             "every step); this model trains it outside FusedModel")
        if self._comm.size > 1 and outside_our_step:
            with tf.control_dependencies([check_marker(value, self._comm.size)]):
                value = tf.identity(value)
        return value

    def set_embedding_weights(self, weights: Mapping[str, npt.ArrayLike]) -> None:
        """Loads whole tables, e.g. the weights of the Keras Embeddings this layer replaces
        (``{feature or table name: float32[V, dim]}``, row i = ID i). A collective:
        every rank calls it with the same names and shapes; rank 0's matrices are
        broadcast (unseeded Keras Embeddings draw different weights on every rank), and
        each rank keeps the rows it owns (eager)."""
        tables = {f.name: f.table.name for f in self.features}
        tables.update({f.table.name: f.table.name for f in self.features})
        for name, matrix in weights.items():
            if name not in tables:
                raise ValueError(f"FusedEmbedding '{self.name}': no feature or table {name!r}")
            lookup = next(g for g in self.groups if tables[name] in g.table_names)
            rows = self._comm.broadcast(tf.constant(matrix, tf.float32), 0,
                                        f"fusedemb/embedding_weights/{name}").numpy()
            lookup.store.load_rows(tables[name], np.arange(len(rows)), rows)

    @property
    def communicator(self) -> Communicator:
        """The Communicator this layer's lookups run over (rank, size, collectives)."""
        return self._comm

    def describe(self) -> str:
        """The fusion plan with each group's exchange and its predicted costs."""
        return self.plan.describe(self.exchanges)

    def comm_counters(self) -> Dict[str, Dict[str, int]]:
        """{group name: cumulative counter snapshot} (eager)."""
        return {g.group.name: g.counters.snapshot() for g in self.groups}

    @property
    def has_eviction(self) -> bool:
        """Whether some table of the layer has an EvictionPolicy."""
        return any(g.store.has_eviction for g in self.groups)

    def enforce_policies(self) -> dict:
        """Runs every group's eviction (``GroupStore.enforce_policy``) after a training
        step; ``FusedModel.fit`` calls it after every step, a custom loop calls it after
        each ``train_step`` on every rank. Eager. Returns {group name: keys evicted on
        this rank}."""
        return {g.group.name: g.store.enforce_policy() for g in self.groups}

    def memory(self) -> dict:
        """{group name: GroupStore.memory()} of this rank: stored rows, tracked keys,
        payload bytes (eager)."""
        return {g.group.name: g.store.memory() for g in self.groups}

    def statistics(self, group_name: Optional[str] = None) -> StatisticsStorage:
        """AccessStatistics of a group (by name, default the only/first group)."""
        for g in self.groups:
            if group_name in (None, g.group.name):
                return g.store.statistics
        raise ValueError(f"no group {group_name!r}; groups: {[g.group.name for g in self.groups]}")

    def global_statistics(self) -> dict:
        """{group name: {metric: value over the whole job}}: each group's
        ``AccessStatistics.metrics()`` summed over the ranks (every key has one owner, so
        the sums are the job's accesses per table, unique and received keys of the last
        step, hash collisions). A collective: every rank calls it (eager)."""
        out = {}
        for g in self.groups:
            mine = g.store.statistics.metrics()
            names = sorted(mine)
            summed = self._comm.allreduce_sum(
                tf.constant([mine[n] for n in names], tf.int64),
                f"fusedemb/statistics/{g.group.name}").numpy()
            out[g.group.name] = dict(zip(names, summed.tolist()))
        return out

    def get_config(self) -> Dict[str, Any]:
        config = super().get_config()
        config.update(features=[f.to_dict() for f in self.features],
                      plan=self.plan.to_dict(), key_mode=self.key_mode,
                      wire_dtype=self.wire_dtype)
        if self.exchange is not None:  # a str or a mapping (Keras wraps a dict attribute)
            config.update(exchange=self.exchange if isinstance(self.exchange, str)
                          else dict(self.exchange))
        if self.traffic is not None:
            config.update(traffic=self.traffic.to_dict())
        return config

    @classmethod
    def from_config(cls, config: Dict[str, Any]) -> Any:
        config = dict(config)
        config["features"] = [FeatureSpec.from_dict(f) for f in config["features"]]
        config["plan"] = FusionPlan.from_dict(config["plan"])
        if isinstance(config.get("traffic"), Mapping):
            config["traffic"] = TrafficHints.from_dict(config["traffic"])
        return cls(**config)


    def _symbolic(self, inputs: Any) -> bool:
        """Whether ``inputs`` hold Keras symbolic tensors (a functional model being built,
        cloned or rebuilt from its config): no lookup runs, nothing to agree on yet."""
        for leaf in tf.nest.flatten(inputs):
            try:
                if self._is_symbolic_tensor(leaf):
                    return True
            except ValueError:  # not a tensor at all: the layer's input checks name it
                pass
        return False

    def output_shapes(self, input_shapes: Mapping[str, Any]) -> Dict[str, tuple]:
        """{feature name: output shape} for {feature name: input shape}: (B, dim) pooled,
        (B, L, dim) sequence (L = max_len for ragged/sparse, else the input's)."""
        out: Dict[str, tuple] = {}
        for f in self.features:
            if f.name not in input_shapes:  # one feature of a shared layer (ShardedEmbedding)
                continue
            shape = tuple(input_shapes[f.name])
            if not f.is_sequence:
                out[f.name] = (shape[0], f.dim)
            else:
                length = shape[1] if len(shape) > 1 and shape[1] is not None else f.max_len
                out[f.name] = (shape[0], length, f.dim)
        return out


# Registered as "tf_fusedemb>FusedEmbedding": a model config holding it survives
# tf_keras.models.model_from_json / load_model without custom_objects.
@tf_keras.saving.register_keras_serializable(package="tf_fusedemb")
class FusedEmbedding(FusedEmbeddingMixin, tf_keras.layers.Layer):
    """Embeddings of many features, fused into groups and sharded over Horovod ranks.

    Features whose tables share (dim, optimizer, initializer, key dtype, storage: static
    or a dynamic backend, ``TableSpec.storage``) are fused into one group
    (``tf_fusedemb.specs.plan_fusion``); each group makes one AlltoAll for keys, one for
    rows and, in training, one for gradients. Single-process (no Horovod) and
    ``horovodrun -np N`` run the same code. Constructing the layer (or
    ``from_config``, ``clone_model``) runs no collective, so one rank may build models
    alone; the ranks compare their features and exchange choices at the layer's first
    call with real tensors (``agree_across_ranks``).

    Args:
      features: the FeatureSpecs, in a fixed order (identical on every rank).
      plan: a FusionPlan over exactly these features; default ``plan_fusion(features)``.
      key_mode: "hashed" (default, any int64 ID) or "packed" (exact keys, IDs must fit in
        ``63 - ceil(log2(tables in group))`` bits) for dynamic tables.
      communicator: default ``tf_fusedemb.comm.get_communicator()``.
      exchange: per group (a dict by group name) or for all: "flat", "hierarchical"
        (TawPipe: node, then rail; several nodes of several ranks) or "auto" (the cheaper
        by ``tf_fusedemb.comm.cost_model`` under ``traffic``). Default "auto" (no
        environment variable changes it). ``describe()`` shows the choices and predicted
        costs.
      traffic: the cost model's TrafficHints (keys per rank, node dedup ratio, links);
        the default (no node dedup) keeps the flat exchange.
      wire_dtype: what the rows and their gradients travel in between ranks: "float32"
        (default) or "bfloat16", which halves the row and gradient AlltoAll bytes; rows
        are stored and their optimizer runs in float32 either way, and the layer's
        outputs are float32 (the rows rounded to bf16 on the way). Every rank the same.

    Call:
      inputs: {feature name: int32/int64 [B] | [B, L] | RaggedTensor [B, None] |
        SparseTensor [B, L]}, exactly the layer's features.
      Returns {feature name: float32[B, dim]} for pooled features (sum/mean/sqrtn over
      the sample's IDs; an empty sample gives zeros) and float32[B, L, dim] for sequence
      features (L = max_len for ragged/sparse input, zero-padded; L of a dense input).

    Training: the rows train wherever the layer's trainable variables are differentiated
    (plain ``Model.fit``, a ``tf.GradientTape`` loop, ``FusedModel``): the layer's one
    trainable scalar, its row-update marker, makes the tape differentiate through the
    lookup, and the gradient updates the owner rows with the group's row optimizer
    (``tf_fusedemb.layers.row_update``). On several ranks outside ``FusedModel``, wrap the
    dense optimizer in ``tf_fusedemb.training.DistributedOptimizer`` (checked).
    """
    keras_kind = KerasKind("tf_keras", "tf_fusedemb.layers.FusedEmbedding",
                           "tf_fusedemb.keras3.FusedEmbedding")

    def _is_symbolic_tensor(self, value: Any) -> bool:
        return tf_keras.backend.is_keras_tensor(value)


def _choose_exchanges(plan, topology, exchange, traffic):
    """{group name: ExchangeEstimate} (its ``kind`` is the group's exchange)."""
    if exchange is None:
        exchange = "auto"
    choices = {}
    for g in plan.groups:
        kind = exchange.get(g.name, "auto") if isinstance(exchange, Mapping) else exchange
        if kind not in ("auto", "flat", "hierarchical"):
            raise ValueError(f"group '{g.name}': exchange must be 'auto', 'flat' or "
                             f"'hierarchical', got {kind!r}")
        choices[g.name] = estimate(g.name, g.dim, topology, traffic,
                                   None if kind == "auto" else kind)
    return choices


def _no_ids(spec: FeatureSpec) -> tf.Tensor:
    """No IDs for ``spec``: int64[0] (pooled), int64[0, L] (sequence)."""
    return tf.zeros([0, spec.max_len] if spec.is_sequence else [0], tf.int64)


def _shape_output(spec, flat, emb):
    if not spec.is_sequence:
        return emb
    if flat.dense_length is not None:
        # The batch size is explicit: with -1, an empty [0, 0] input became [1, 0, dim] and
        # [B, 0] for B > 0 failed (the size of -1 cannot be inferred from 0 elements).
        shape = tf.stack([tf.cast(flat.batch_size, tf.int32), flat.dense_length, spec.dim])
        return tf.reshape(emb, shape)
    ragged = tf.RaggedTensor.from_row_splits(emb, flat.row_splits, validate=False)
    return ragged.to_tensor(shape=[None, spec.max_len, spec.dim])
