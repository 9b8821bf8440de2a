"""The one training step of a model with FusedEmbedding layers, and its evaluation step.

Correctness contract: with N ranks each holding a slice of the global batch, one step
computes exactly what ``tf_keras.Model.fit`` computes for the global batch in one process
(the loss of ``compile``, see :mod:`tf_fusedemb.training.loss`):

* each rank computes the additive pieces of its slice's loss (weighted sums, element
  counts, rows); one AllReduce sums them, so unequal or empty slices are exact too;
* each rank differentiates its own sums scaled by the global coefficients (plus 1/N of
  the regularisation losses, which every rank holds whole): the sum over ranks is the
  global gradient;
* dense gradients are summed over ranks (one grouped AllReduce: EmbRace's hybrid scheme);
* embedding-row gradients are summed over requesting ranks by the gradient AlltoAll and
  applied by each group's row optimizer to the touched rows on their owner.

A :class:`Schedule` decides only *when* parts of the step run (NestPipe Section VI): how
many micro-batches (FWP), which lookups were prepared ahead (DBP), what runs once the
local backward is done, and how the row updates are split (EmbRace). The synchronous
step is :class:`Schedule` itself; ``tf_fusedemb.pipeline`` provides the pipelined one.

With N > 1 micro-batches the step runs their dense compute one after another
(control dependencies, no value changes): micro-batch i+1's dense forward waits for i's
output, its backward for i's dense gradients. TensorFlow's executor would otherwise
interleave all N forwards and all N backwards, so every micro-batch's collectives
would become ready together at the end of each phase, with nothing left to overlap
them (seen in Horovod's timeline, docs/timelines/). A micro-batch's lookup starts once
the previous one's rows are retrieved, so its key and row AlltoAlls run while earlier
micro-batches compute, and micro-batch 0's rows come first.

The loss's sizes (element counts, rows) are summed over ranks at the step's start (they
depend on the labels only), so the backward never waits for a collective; the loss sums,
only needed for the reported value, travel with the dense gradients.
"""
import dataclasses
from typing import Any, Collection, List, NamedTuple, Optional, Sequence, Tuple

import tensorflow as tf
import tf_keras

from tf_fusedemb.comm import Communicator
from tf_fusedemb.layers.fused_embedding import (communicator_of, fused_embedding_layers,
                                                group_lookups, use_context)
from tf_fusedemb.layers.group_interface import DistributedGroupLookup
from tf_fusedemb.layers.keys_ahead import (KeysAhead, keys_ahead, route_ahead, serve_ahead,
                                           shared_tables)
from tf_fusedemb.layers.lookup_context import LookupContext
from tf_fusedemb.layers.routed_lookup import RoutedLookup
from tf_fusedemb.layers.row_update import RowUpdate, row_gradient
from tf_fusedemb.training import keysets
from tf_fusedemb.training.loss import KerasLoss, LossLike, LossPartial, LossTotals
from tf_fusedemb.training.micro_batches import batch_size_of, micro_batch_parts
from tf_fusedemb.training.replicas import build_by_tracing, replicas_of

LOSS_STATS = "fusedemb/loss_stats"
DENSE_GRADS = "fusedemb/dense_grads"


class StepResult(NamedTuple):
    """What a step returns (a tuple, so traced functions can return it): ``loss`` float32
    scalar (the global batch's loss, as Keras reports it per batch), ``weight`` (its
    weight in Keras's running ``loss`` Mean: the global batch's rows), this rank's
    ``predictions`` and ``per_output``: per output with a loss, its own loss on the global
    batch (``LossTotals.per_output``)."""
    loss: tf.Tensor
    weight: tf.Tensor
    predictions: object
    per_output: Tuple[tf.Tensor, ...] = ()


class Schedule:
    """The synchronous schedule (and the interface of pipelined ones): one micro-batch,
    every lookup routed during the forward pass, every row update applied at once.

    A schedule that *prepares* a micro-batch's lookups (:meth:`prepared`: routed and
    retrieved ahead of its forward pass, return values of the layers' ``route`` and
    ``retrieve``) gets their rows differentiated by the step, which hands each group's
    coalesced gradient to :meth:`apply_rows`; micro-batches and pipelines need that.
    Lookups done during the forward pass update their rows through the layers'
    row-update markers (``tf_fusedemb.layers.row_update``) as their gradient is computed,
    which also works when the model's ``call`` is a ``tf.function``.

    Args:
      micro_batches: N, the rank's batch is split into N micro-batches whose forward and
        backward (and collectives) are independent; gradients are applied once (needs a
        schedule that prepares the lookups, e.g. ``tf_fusedemb.pipeline.NestedPipeline``'s).
      exchange: "flat" or "hierarchical" for every group lookup of the step; None: each
        group's own (see ``LookupContext.exchange``).
    """

    def __init__(self, micro_batches: int = 1, exchange: Optional[str] = None):
        self.micro_batches = micro_batches
        self.exchange = exchange

    def context(self, i: int) -> LookupContext:
        """The LookupContext of micro-batch ``i``'s lookups (none prepared yet). The
        step's loss is the global batch's (scaled by global coefficients): row gradients
        summed over ranks are applied as they are."""
        return LookupContext(suffix=self.suffix(i), exchange=self.exchange,
                             row_update=RowUpdate(scale=1.0, marker_gradient=0.0))

    def suffix(self, i: int) -> str:
        """Collective-name suffix of micro-batch ``i`` (names must differ per micro-batch)."""
        return f"/mb{i}" if self.micro_batches > 1 else ""

    def prepared(self, i: int, x: Any) -> Optional[List[RoutedLookup]]:
        """Micro-batch ``i``'s lookups of its inputs ``x``, routed and retrieved (with
        ``rows``), one per group lookup of the model, in ``group_lookups`` order; None:
        the forward pass routes them."""
        del i, x
        return None

    def after_forward(self, i: int, outputs: Any) -> None:
        """Runs once micro-batch ``i``'s forward pass is built; ``outputs`` are its
        predictions (a pipeline starts the next batch's key routing after micro-batch 0,
        so its AlltoAlls queue behind the row AlltoAlls this batch's forward waits for)."""

    def after_backward(self, done: List[tf.Tensor]) -> None:
        """Runs once every micro-batch's local backward is computed (``done``): a
        pipeline's delayed writes and next-batch retrieval go here."""

    def apply_rows(self, index: int, lookup: DistributedGroupLookup, keys: tf.Tensor,
                   grads: tf.Tensor, init_keys: tf.Tensor) -> None:
        """Applies the coalesced row gradients (keys int64[u], grads float32[u, dim],
        init_keys int64[u]) of prepared group lookup ``index`` (its position in
        :meth:`prepared`'s lists), ``lookup``."""
        del index
        lookup.apply_gradients(keys, grads, init_keys)

    def update_dense(self, comm: Communicator, optimizer: tf_keras.optimizers.Optimizer,
                     grads: List[tf.Tensor], variables: List[tf.Variable],
                     row_grads: List[tf.Tensor], extras: List[tf.Tensor]) -> List[tf.Tensor]:
        """Sums this rank's dense ``grads`` (one per variable) over ranks and applies them
        with ``optimizer``; returns ``extras`` (other tensors to sum, e.g. the loss sums)
        summed over ranks. Two grouped AllReduces (EmbRace's dense AllReduce, split in
        time; the sums are the same):

        * the variables created last (a model's top layers, whose gradients the backward
          finishes first), up to half the elements (:func:`top_layers_split`): as soon as
          they are summed over the micro-batches, while the backward still runs;
        * the others and ``extras`` after ``row_grads`` (the received row gradients):
          Horovod runs one collective at a time, so the row AlltoAlls go first and the
          row updates compute while this AllReduce, the step's largest, is in flight.
        """
        split = top_layers_split(variables)
        top = comm.allreduce_sum_list(grads[split:], DENSE_GRADS + "/top") \
            if split < len(variables) else []
        late = list(comm.allreduce_sum_list(after(row_grads, grads[:split] + extras),
                                            DENSE_GRADS))
        optimizer.apply_gradients(zip(late[:split] + list(top), variables))
        return late[split:]


def as_keras_loss(loss: LossLike, model: Optional[tf_keras.Model] = None) -> KerasLoss:
    """``loss`` as a :class:`KerasLoss` (a loss name, function, Loss object, or already one)."""
    if isinstance(loss, KerasLoss):
        return loss
    return KerasLoss(loss, output_names=getattr(model, "output_names", None))


def regularization(model: tf_keras.Model) -> Optional[tf.Tensor]:
    """Sum of the model's regularisation losses (``model.losses``), or None."""
    losses = model.losses
    return tf.add_n([tf.cast(l, tf.float32) for l in losses]) if losses else None


def loss_totals(loss: KerasLoss, partials: Sequence[LossPartial], reg: Optional[tf.Tensor],
                comm: Communicator) -> LossTotals:
    """Sums the slices' ``partials`` over micro-batches and ranks (one AllReduce) and
    combines them (see KerasLoss)."""
    summed = tf.add_n([p.stacked() for p in partials])
    return loss.combine(partials[0], comm.allreduce_sum(summed, LOSS_STATS), reg)


@tf.autograph.experimental.do_not_convert  # TensorFlow control flow already: see FusedEmbedding
def train_step(model: tf_keras.Model, x: Any, y: Any, loss: LossLike,
               optimizer: tf_keras.optimizers.Optimizer, sample_weight: Any = None,
               communicator: Optional[Communicator] = None,
               schedule: Optional[Schedule] = None) -> StepResult:
    """One training step on this rank's slice ``(x, y, sample_weight)``.

    Args:
      model: a Keras model containing FusedEmbedding layers.
      x, y, sample_weight: this rank's slice of the global batch (labels [B] or [B, 1]
        against outputs [B, 1] alike, as in Keras).
      loss: a :class:`KerasLoss`, or anything ``compile(loss=...)`` accepts.
      optimizer: the Keras optimizer of the dense variables.
      communicator: default the model's layers' (``communicator_of``).
      schedule: default the synchronous :class:`Schedule`.
    """
    comm = communicator or communicator_of(model)
    loss = as_keras_loss(loss, model)
    schedule = schedule or Schedule()
    # Rank 0's dense state on every rank before the first forward reads it (automatic
    # control dependencies order the writes before the reads), and the replica guard.
    replicas = replicas_of(model)
    replicas.synchronize(comm, optimizer, x, training=True)
    # FWP: every micro-batch's forward first, then the backwards, so each one's
    # collectives can be in flight while another computes.
    lookups = group_lookups(model)
    forwards, reg = _forwards(model, x, y, sample_weight, loss, schedule, lookups)
    partials = [f.partial for f in forwards]
    # The loss's sizes (element counts, rows) depend on the labels only: summed over ranks
    # at the step's start, they give the backward its coefficients without waiting for
    # a collective between forward and backward. The sums (the reported value) travel
    # with the dense gradients at the end.
    sizes = comm.allreduce_sum(tf.add_n([p.stacked_sizes() for p in partials]), LOSS_STATS)
    scales = list(loss.coefficients(partials[0], sizes))
    reg_scale = loss.regularization_coefficient(partials[0], sizes) / comm.size
    dense_vars = list(model.trainable_variables)  # built by the first forward
    dense_sum, parts = _backwards(forwards, scales, reg, reg_scale, dense_vars, len(lookups))
    local_sums = tf.add_n([p.stacked_sums() for p in partials])
    schedule.after_backward(dense_sum or [local_sums])
    if dense_vars:
        row_grads = [g for group in parts for _, g, _ in group]
        sums, = schedule.update_dense(comm, optimizer, dense_sum, dense_vars, row_grads,
                                      [local_sums])
    else:
        sums = comm.allreduce_sum(local_sums, LOSS_STATS + "/sums")
    totals = loss.totals(partials[0], sizes, sums, reg)
    replicas.average_forward_state(comm)  # e.g. BatchNormalization's statistics
    if forwards[0].prepared:
        for j, lookup in enumerate(lookups):
            if forwards[0].prepared[j] is None:  # looked up during the forward pass
                continue
            keys, grads, init = _coalesce(parts[j], lookup.group.dim)
            schedule.apply_rows(j, lookup, keys, grads, init)
    preds = [f.predictions for f in forwards]
    pred = preds[0] if len(preds) == 1 else tf.nest.map_structure(
        lambda *p: tf.concat(p, 0), *preds)
    return StepResult(totals.value, totals.weight, pred, tuple(totals.per_output))


class MicroBatchForward(NamedTuple):
    """One micro-batch's forward pass: its ``tape``, loss ``partial``, model
    ``predictions`` and, per group lookup, the lookup its schedule ``prepared`` or the
    step routed ahead (``keys_ahead``), whose rows the tape watches (None for a group
    looked up during the forward pass; empty when the forward pass routed them all)."""
    tape: tf.GradientTape
    partial: LossPartial
    predictions: Any
    prepared: List[Optional[RoutedLookup]]


def _forwards(model: tf_keras.Model, x: Any, y: Any, sample_weight: Any, loss: KerasLoss,
              schedule: Schedule, lookups: Sequence[DistributedGroupLookup]
              ) -> Tuple[List[MicroBatchForward], Optional[tf.Tensor]]:
    """Every micro-batch's forward pass, in order, and the regularisation losses (of the
    first: once per batch, as in Keras)."""
    forwards: List[MicroBatchForward] = []
    reg: Optional[tf.Tensor] = None
    lookup_inputs = {f.name for layer in fused_embedding_layers(model) for f in layer.features}
    parts = micro_batch_parts((x, y, sample_weight), schedule.micro_batches,
                              lambda: batch_size_of(y))
    for i, (x_i, y_i, weight_i) in enumerate(parts):
        if forwards and isinstance(x_i, dict):  # x not a dict: which part feeds the lookups
            # is unknown. Dense compute after the previous micro-batch's; the lookups once
            # the previous micro-batch's rows are retrieved (its row AlltoAll then goes
            # while this one routes; all at once, they would share the core and micro-batch
            # 0's rows would come last of all).
            x_i = after(tf.nest.flatten(forwards[-1].predictions), x_i, skip=lookup_inputs)
            x_i = after([r.rows for r in forwards[-1].prepared if r is not None], x_i,
                        skip=[k for k in x_i if k not in lookup_inputs])
        mine: List[Optional[RoutedLookup]] = list(_prepared_lookups(schedule, i, x_i, lookups))
        context = schedule.context(i)
        ahead = None if mine else _keys_ahead(model, x_i)
        if ahead is not None:  # every table's keys first: one exchange per fused group
            mine = route_ahead(model, ahead, context)
        with tf.GradientTape() as tape:
            watched = [r for r in mine if r is not None]
            for routed in watched:  # their gradient is this step's to apply (apply_rows)
                tape.watch(routed.rows)
            if ahead is not None:
                context = dataclasses.replace(context,
                                              served=serve_ahead(model, ahead, mine, context))
            else:
                context = dataclasses.replace(context, prepared=tuple(zip(lookups, watched)))
            with use_context(model, context):
                pred = model(x_i, training=True)
            partial = loss.partial(y_i, pred, weight_i)
            if i == 0:
                reg = regularization(model)
        schedule.after_forward(i, pred)
        forwards.append(MicroBatchForward(tape, partial, pred, mine))
    return forwards, reg


def _keys_ahead(model: tf_keras.Model, x: Any) -> Optional[KeysAhead]:
    """``keys_ahead`` of a model built first (its variables are not made in the probe's
    scratch graph); None at once for a model whose layers share no tables."""
    if not shared_tables(model):
        return None
    if not model.built:
        build_by_tracing(model, x)
    return keys_ahead(model, x)


def _backwards(forwards: Sequence[MicroBatchForward], scales: List[tf.Tensor],
               reg: Optional[tf.Tensor], reg_scale: tf.Tensor, dense_vars: List[tf.Variable],
               num_lookups: int):
    """Every micro-batch's backward, in order: (the dense gradients summed over the
    micro-batches, one per variable; per prepared lookup, its micro-batches' (keys int64[u],
    row gradients float32[u, dim], init keys int64[u]))."""
    dense_sum = [tf.zeros_like(v) for v in dense_vars]
    parts: List[List[Tuple[tf.Tensor, tf.Tensor, tf.Tensor]]] = [[] for _ in range(num_lookups)]
    previous: List[tf.Tensor] = []
    for i, f in enumerate(forwards):
        targets, coefficients = list(f.partial.sums), list(scales)
        if i == 0 and reg is not None:
            targets.append(reg)
            coefficients.append(reg_scale)
        # This micro-batch's backward after the previous one's dense gradients (FWP: its
        # gradient AlltoAll is in flight meanwhile).
        watched = [(j, r) for j, r in enumerate(f.prepared) if r is not None]
        with tf.control_dependencies(previous):
            grads = f.tape.gradient(targets, dense_vars + [r.rows for _, r in watched],
                                    output_gradients=coefficients)
        local = [dense_gradient(g, v) for g, v in zip(grads, dense_vars)]
        previous = local if len(forwards) > 1 else []
        dense_sum = [a + g for a, g in zip(dense_sum, local)]
        for (j, r), g in zip(watched, grads[len(dense_vars):]):
            parts[j].append((r.keys, row_gradient(g, r.rows), r.init_keys))
    return dense_sum, parts


def test_step(model: tf_keras.Model, x: Any, y: Any, loss: LossLike, sample_weight: Any = None,
              communicator: Optional[Communicator] = None) -> StepResult:
    """The loss of this rank's slice in the global batch, without training (Keras's
    ``evaluate``); the same collectives on every rank."""
    comm = communicator or communicator_of(model)
    loss = as_keras_loss(loss, model)
    replicas_of(model).synchronize(comm, x=x)  # evaluating before any training step
    y_pred = model(x, training=False)
    totals = loss_totals(loss, [loss.partial(y, y_pred, sample_weight)], regularization(model),
                         comm)
    return StepResult(totals.value, totals.weight, y_pred, tuple(totals.per_output))


def top_layers_split(variables: Sequence[tf.Variable]) -> int:
    """Index splitting ``variables`` (a model's, in creation order) into the bottom ones
    and the top ones, created last, holding at most half the elements (at least one
    variable stays at the bottom)."""
    sizes = [v.shape.num_elements() or 0 for v in variables]
    split, top = len(sizes), 0
    while split > 1 and top + sizes[split - 1] <= sum(sizes) / 2:
        split -= 1
        top += sizes[split]
    return split


def dense_gradient(grad: Optional[tf.Tensor], var: tf.Variable) -> tf.Tensor:
    """A dense variable's gradient as a tensor; zeros for None, so every rank's
    collectives stay identical."""
    return tf.zeros_like(var) if grad is None else tf.convert_to_tensor(grad)


def after(deps: List[tf.Tensor], x: Any, skip: Collection[str] = ()) -> Any:
    """``x`` (a tensor, or a dict / list / tuple of them) whose plain tensors, except the
    dict entries named in ``skip``, are only available once ``deps`` are computed
    (identities with control dependencies): a schedule's ordering, never a value change.
    Ragged and sparse values pass unchanged."""
    def gate(value):
        if not isinstance(value, tf.Tensor) or not deps:
            return value
        with tf.control_dependencies(deps):
            return tf.identity(value)
    if isinstance(x, dict):
        return {k: v if k in skip else tf.nest.map_structure(gate, v) for k, v in x.items()}
    return tf.nest.map_structure(gate, x)


def _prepared_lookups(schedule: Schedule, i: int, x: Any,
                      lookups: Sequence[DistributedGroupLookup]) -> List[RoutedLookup]:
    """Micro-batch ``i``'s prepared lookups (``Schedule.prepared``), or [] when the forward
    pass routes them; checks that there is one per group lookup, and that micro-batches
    (whose row gradients are coalesced before one update) have them."""
    mine = schedule.prepared(i, x)
    if mine is None:
        if schedule.micro_batches > 1:
            raise ValueError("tf_fusedemb: micro-batches need a schedule that prepares each "
                             "micro-batch's lookups: train through "
                             "tf_fusedemb.pipeline.NestedPipeline (or fit(pipeline=...))")
        return []
    if len(mine) != len(lookups):
        raise ValueError(f"tf_fusedemb: the schedule prepared {len(mine)} lookups for "
                         f"micro-batch {i}; the model has {len(lookups)} group lookups")
    return list(mine)


def _coalesce(parts, dim):
    """One (keys, grads, init_keys) per group from its micro-batches' records."""
    if not parts:  # the group was not looked up: an empty update
        return tf.zeros([0], tf.int64), tf.zeros([0, dim]), tf.zeros([0], tf.int64)
    if len(parts) == 1:  # keys are unique already (the owner's lookup keys)
        return parts[0]
    return keysets.coalesce(*(tf.concat(list(c), 0) for c in zip(*parts)))
