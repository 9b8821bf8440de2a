"""Sharded, atomic checkpoints that restore onto any number of ranks.

Layout of ``<dir>/ckpt-<step>/``:
  meta.json                     step, world size, fusion-plan fingerprints, user state
  dense.*                       tf.train.Checkpoint of the dense variables and optimizer
                                (identical on every rank; written by rank 0)
  shard-<r>-of-<N>.npz          rank r's embedding rows per group: keys, values, optimizer
                                slots, each key's (table, raw ID), access statistics (counts,
                                last steps: what admission and eviction decide by), step
  blocks/l<layer>-<group>-shard-<r>-of-<N>/
                                a storage-engine group's blocks on rank r instead (rows,
                                slots and statistics) as a RocksDB database, written in
                                C++ straight from the engine: a tiered group's SSD tier's
                                own checkpoint (its files hard-linked) with the DRAM
                                tier's blocks written over it, an untiered group's blocks
                                written anew; the .npz keeps the group's step
``<dir>/latest`` names the newest complete checkpoint.

Incremental checkpoints (``incremental=True``): every ``full_every``-th save is full as
above; the saves between are *deltas*. A delta's block directories hold only the blocks
of the keys whose row, slots or statistics changed since the previous save, and a
deletion (an empty value) for each key removed meanwhile (eviction, TTL, ``remove``); the
engine knows them from a per-shard set of changed keys it records while asked to
(custom_ops/engine_changes.h: the 28-byte block header has no bit to spare, and a removed
key has no header left). The dense state, meta.json and every group of other storage
(whose ``save_state`` returns arrays) are written in full in every delta. meta.json of a
delta names the checkpoint it builds on (``"base": "ckpt-<step>"`` and that one's
``"id"``); a restore reads the chain, the full checkpoint's blocks first and each delta's
over them, in order (checkpoint_chain.py), and gets every block exactly as a full save
of the same step would hold it, onto any number of ranks, tiered or not. A chain with a
link missing or damaged is refused, naming the link and the newest checkpoint that still
restores. Pruning (``max_to_keep``) never removes a checkpoint a kept one builds on. The
first save of a manager, and the first after a restore, a failed save or a save of the
same model by another manager, is full.

Atomicity: everything is written into ``ckpt-<step>.tmp`` first; after a barrier rank 0
writes meta.json, renames the directory into place and replaces ``latest`` with
``os.replace``. An interrupted save (an exception, or a rank killed half-way) leaves at
most a ``.tmp`` directory and never touches the last good checkpoint; the next save
removes such debris. The directory must be shared by all ranks (one host, or a shared
filesystem). A rank lost during a save makes the others raise PeerLostError naming it
(comm/watchdog.py) instead of waiting at the save's barrier.

Restore onto M ranks: every rank reads all N shards and keeps the rows it owns under M
(owner = mix64(raw ID) mod M, the rule of rankwise_sort), so no key and no slot is lost;
a storage-engine group's blocks are read from the N block directories the same way, in
C++, into the engine (tiered or not).
"""
import dataclasses
import json
import os
import shutil
import uuid
from typing import Any, Dict, List, Mapping, Optional

import numpy as np
import tensorflow as tf
import tf_keras

from tf_fusedemb.comm import Communicator
from tf_fusedemb.layers.model_embeddings import ModelEmbeddings
from tf_fusedemb.specs import describe_plan_difference
from tf_fusedemb.storage.engine_table import FULL_WRITE, BlockWrite
from tf_fusedemb.training import checkpoint_chain, faults
from tf_fusedemb.training.checkpoint_chain import DELTA, FULL, Link
from tf_fusedemb.training.replicas import dense_variables, replicas_of

LATEST = "latest"
BLOCKS_DIR = "blocks"
SSD_DIR = "ssd"  # where checkpoints of earlier versions hold a tiered group's blocks


def block_directory(checkpoint: str, layer: int, group: str, rank: int, size: int) -> str:
    """Where rank ``rank`` of ``size`` writes the blocks of storage-engine group ``group``
    of FusedEmbedding layer ``layer`` in checkpoint directory ``checkpoint``."""
    return os.path.join(checkpoint, BLOCKS_DIR, f"l{layer}-{group}-shard-{rank}-of-{size}")


def saved_block_directory(checkpoint: str, layer: int, group: str, rank: int,
                          size: int) -> str:
    """``block_directory``, or where a checkpoint of an earlier version holds it."""
    path = block_directory(checkpoint, layer, group, rank, size)
    earlier = os.path.join(checkpoint, SSD_DIR, os.path.basename(path))
    return earlier if not os.path.exists(path) and os.path.exists(earlier) else path


@dataclasses.dataclass(frozen=True)
class ChainPosition:
    """Where this manager's next delta would build: ``base`` (the link it saved last)
    and ``links`` (how many links its chain has, the full one included)."""
    base: Link
    links: int


def variable_record(variable: Any) -> List[Any]:
    """[name, shape, dtype name] of a dense variable (tf_keras's or Keras 3's), as
    meta.json records it to name the first difference of another model."""
    return [variable.name, tf.TensorShape(variable.shape).as_list(),
            tf.as_dtype(variable.dtype).name]


class CheckpointManager:
    """Saves and restores a model with FusedEmbedding layers, its optimizer and user state.

    Args:
      directory: where checkpoints go (shared by all ranks).
      model: the Keras model (its FusedEmbedding layers are found recursively).
      optimizer: the dense optimizer (its variables are saved with the dense weights).
      max_to_keep: complete checkpoints kept; older ones are deleted after a save, except
        those a kept one builds on (incremental).
      extra: {name: trackable} saved with the dense weights (rank 0's values, restored on
        every rank), e.g. the state of a running training metric, so that a resumed run
        reports what an uninterrupted one would.
      incremental: save deltas between full checkpoints (see the module doc): a delta
        writes the storage-engine blocks changed since the previous save, plus the dense
        state and the groups of other storage in full. The engines record changes for
        the manager that saved them last: after a save by another manager of the same
        model, the next save is full.
      full_every: with ``incremental``, every ``full_every``-th save is a full checkpoint
        (1: all of them), so a restore reads at most ``full_every`` links.
      embeddings: the model's ``ModelEmbeddings`` (default: found in ``model``).
    """

    def __init__(self, directory: str, model: tf_keras.Model,
                 optimizer: Optional[tf_keras.optimizers.Optimizer] = None, max_to_keep: int = 3,
                 communicator: Optional[Communicator] = None,
                 extra: Optional[Mapping[str, Any]] = None, incremental: bool = False,
                 full_every: int = 10, embeddings: Optional[ModelEmbeddings] = None):
        if not isinstance(incremental, bool):
            raise ValueError(f"CheckpointManager: incremental must be a bool, got {incremental!r}")
        if isinstance(full_every, bool) or not isinstance(full_every, int) or full_every < 1:
            raise ValueError(f"CheckpointManager: full_every must be an int >= 1, got "
                             f"{full_every!r}")
        self.directory = directory
        self.incremental = incremental
        self.full_every = full_every
        # The last link this manager saved, while the engines record changes since it,
        # for this manager (its id, unique in the process: the engines are the process's).
        self._chain: Optional[ChainPosition] = None
        self._owner = uuid.uuid4().hex
        embeddings = embeddings or ModelEmbeddings.of(model, communicator)
        self.comm = embeddings.communicator
        self.layers = embeddings.layers
        # (layer index, group store) per group: a shard names its arrays by both.
        self.groups = [(li, g.store) for li, layer in enumerate(self.layers)
                       for g in layer.groups]
        self._replicas = replicas_of(model)
        trackables = dict(extra or {}, dense=dense_variables(model))
        # What a restore compares first, to name a different model in one line.
        self._dense_vars = trackables["dense"]
        self._model_name = f"{type(model).__name__} '{model.name}'"
        if optimizer:
            trackables["optimizer"] = optimizer
        self._dense = tf.train.Checkpoint(**trackables)
        self.max_to_keep = max_to_keep

    # ---- save -------------------------------------------------------------------------
    def save(self, step: int, state: Optional[Dict[str, Any]] = None) -> str:
        """Writes checkpoint ``step`` (all ranks must call it): full, or with
        ``incremental`` a delta on the previous save (see the module doc); returns its
        path."""
        with self.comm.watch(f"checkpoint save {int(step)}"):
            try:
                return self._save(int(step), state)
            except BaseException:
                # The engines may have restarted their record of changes: the next save
                # writes every block.
                self._chain = None
                raise

    def _next_write(self, final: str) -> BlockWrite:
        """Whether the save into ``final`` writes every block or a delta, the same on
        every rank: a delta when this manager's chain goes on (each rank's manager has
        seen the same saves and restores) and every group on every rank records changes
        for it (none has been checkpointed by another manager since: a collective)."""
        if not self.incremental:
            return FULL_WRITE
        chain = self._chain
        full = BlockWrite(owner=self._owner)
        if (chain is None or chain.links >= self.full_every or os.path.exists(final)
                or not os.path.isdir(chain.base.path)):
            return full
        behind = sum(not g.records_changes_for(self._owner) for _, g in self.groups)
        with self.comm.watch("barrier fusedemb/ckpt_kind"):
            behind = int(self.comm.allreduce_sum(tf.constant(behind, tf.int32),
                                                 "fusedemb/ckpt_kind").numpy())
        return BlockWrite(delta=True, owner=self._owner) if behind == 0 else full

    def _save(self, step, state):
        final = os.path.join(self.directory, checkpoint_chain.checkpoint_name(step))
        tmp = final + ".tmp"
        write = self._next_write(final)  # before the directory changes (the rename)
        if self.comm.rank == 0:
            self._remove_debris()
            os.makedirs(tmp)
        self._barrier("ckpt_mkdir")
        shard = os.path.join(tmp, f"shard-{self.comm.rank}-of-{self.comm.size}.npz")
        np.savez(shard, **self._export_shards(tmp, write))
        faults.inject("save", step, self.comm.rank, partial_file=shard)  # a no-op hook (tests)
        if self.comm.rank == 0:
            self._dense.write(os.path.join(tmp, "dense"))
        self._barrier("ckpt_written")
        base = self._chain.base if write.delta and self._chain else None
        if self.comm.rank == 0:
            meta = {"step": step, "world_size": self.comm.size, "state": state or {},
                    "plans": [layer.plan.fingerprint(policies=False) for layer in self.layers],
                    "plan_specs": [layer.plan.to_dict(policies=False) for layer in self.layers],
                    "model": self._model_name,
                    "dense": [variable_record(v) for v in self._dense_vars]}
            # A new id per link tells a base written again since from the original.
            meta.update(checkpoint_chain.link_meta(
                DELTA if base else FULL, base, uuid.uuid4().hex,
                checkpoint_chain.written_files(tmp, BLOCKS_DIR)))
            with open(os.path.join(tmp, "meta.json"), "w") as f:
                json.dump(meta, f)
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
            pointer = os.path.join(self.directory, LATEST + ".tmp")
            with open(pointer, "w") as f:
                f.write(os.path.basename(final))
            os.replace(pointer, os.path.join(self.directory, LATEST))
            self._prune()
        self._barrier("ckpt_done")
        if not write.owner:  # not incremental
            self._chain = None
        else:
            # Every rank reads the link rank 0 wrote (its id), after the barrier.
            links = self._chain.links + 1 if base and self._chain else 1
            self._chain = ChainPosition(checkpoint_chain.read_link(final), links)
        return final

    def _remove_debris(self):
        """Removes what interrupted saves left (``ckpt-*.tmp``, ``latest.tmp``): no save
        runs while all ranks are in this one."""
        if not os.path.isdir(self.directory):
            return
        for name in os.listdir(self.directory):
            path = os.path.join(self.directory, name)
            if name.startswith("ckpt-") and name.endswith(".tmp"):
                shutil.rmtree(path, ignore_errors=True)
            elif name == LATEST + ".tmp":
                os.remove(path)

    def _export_shards(self, tmp, write: BlockWrite):
        """Every group's ``save_state``, its arrays named ``l<layer>/<group>/<name>``; a
        storage-engine group's blocks (all, or a delta's: ``write``) go to its directory
        under ``tmp/blocks``."""
        os.makedirs(os.path.join(tmp, BLOCKS_DIR), exist_ok=True)
        arrays = {}
        for li, g in self.groups:
            prefix = f"l{li}/{g.group.name}/"
            directory = block_directory(tmp, li, g.group.name, self.comm.rank, self.comm.size)
            arrays.update({prefix + k: v for k, v in g.save_state(directory, write).items()})
        return arrays

    def _prune(self):
        """Removes all but the newest ``max_to_keep`` checkpoints and the links they
        build on."""
        names = [checkpoint_chain.checkpoint_name(s)
                 for s in checkpoint_chain.steps_in(self.directory)]
        keep = checkpoint_chain.needed_by(self.directory, names[-self.max_to_keep:])
        for name in names:
            if name not in keep:
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    def _barrier(self, name):
        with self.comm.watch(f"barrier fusedemb/{name}"):
            self.comm.allreduce_sum(tf.constant(0, tf.int32), f"fusedemb/{name}").numpy()

    # ---- restore ----------------------------------------------------------------------
    def latest(self) -> Optional[str]:
        """Path of the newest complete checkpoint, or None."""
        pointer = os.path.join(self.directory, LATEST)
        if not os.path.exists(pointer):
            return None
        with open(pointer) as f:
            return os.path.join(self.directory, f.read().strip())

    def restore(self, path: Optional[str] = None) -> Optional[Dict[str, Any]]:
        """Restores ``path`` (default: the latest) onto this world size; returns its
        meta dict (with the user ``state``), or None when there is no checkpoint. A
        delta is restored with the links it builds on (see the class doc); a chain with
        a link missing or damaged raises a one-line ValueError (BrokenChainError) naming
        the link and the newest checkpoint that still restores, before anything is
        loaded."""
        path = path or self.latest()
        if path is None:
            return None
        chain = checkpoint_chain.chain_of(path)
        meta = chain[-1].meta
        self._check_same_model(path, meta)  # before anything is loaded
        size = meta["world_size"]
        shards = [np.load(os.path.join(path, f"shard-{r}-of-{size}.npz")) for r in range(size)]
        for li, g in self.groups:
            prefix = f"l{li}/{g.group.name}/"
            full, *deltas = [[saved_block_directory(link.path, li, g.group.name, r,
                                                    link.world_size)
                              for r in range(link.world_size)] for link in chain]
            g.restore_state([{k[len(prefix):]: s[k] for k in s.files if k.startswith(prefix)}
                             for s in shards], self.comm.rank, self.comm.size, full, deltas)
        self._dense.read(os.path.join(path, "dense")).expect_partial()
        self._chain = None  # the next save writes every block (and restarts the record)
        # Every rank read the same dense values; a step traced next still makes them rank
        # 0's bit for bit (tf_fusedemb.training.replicas), with no collective here.
        self._replicas.resync(now=False)
        return meta

    def _check_same_model(self, path, meta):
        """Raises a one-line ValueError naming the first difference (layer, feature and
        field; or dense variable and shape) when checkpoint ``path`` was written by
        another model, before any value is loaded (no TF shape error, no warnings)."""
        # Policies may change between runs: only the storage layout must match.
        plans = [layer.plan.fingerprint(policies=False) for layer in self.layers]
        if plans != meta["plans"]:
            saved = meta.get("plan_specs")  # absent in checkpoints of older versions
            if saved is None:
                why = "other fusion plans"
            elif len(saved) != len(self.layers):
                why = (f"{len(saved)} FusedEmbedding layer(s), the model has "
                       f"{len(self.layers)}")
            else:
                li = next(i for i, (a, b) in enumerate(zip(plans, meta["plans"])) if a != b)
                layer = self.layers[li]
                why = (f"another embedding spec for FusedEmbedding layer '{layer.name}': "
                       + describe_plan_difference(saved[li], layer.plan.to_dict(False),
                                                  "in the checkpoint", "in the model"))
            raise ValueError(f"checkpoint {path} was written with {why}; build the model with "
                             "the same FeatureSpecs and plan, or start afresh in another "
                             "checkpoint directory")
        saved = meta.get("dense")
        if saved is None:  # older checkpoints: the shapes from the checkpoint itself
            shapes, saved = dict(tf.train.list_variables(os.path.join(path, "dense"))), []
            while f"dense/{len(saved)}/.ATTRIBUTES/VARIABLE_VALUE" in shapes:
                key = f"dense/{len(saved)}/.ATTRIBUTES/VARIABLE_VALUE"
                saved.append([f"#{len(saved)}", shapes[key], None])
        mine = [variable_record(v) for v in self._dense_vars]
        # Positions are compared, not names (Keras numbers auto-named layers per process);
        # a longer list on either side is no error by itself: state that exists on one
        # side only (e.g. compile()'s loss tracker, last) stays as it is, as before.
        differ = [i for i, (a, b) in enumerate(zip(saved, mine))
                  if list(a[1]) != b[1] or a[2] not in (None, b[2])]
        if not differ:
            return

        def var(v):
            return f"'{v[0]}' {v[2] or ''}[{', '.join(map(str, v[1]))}]"
        i = differ[0]
        raise ValueError(
            f"checkpoint {path} holds the dense variables of another model "
            f"({meta.get('model', 'another model')}, {len(saved)} dense variables; this is "
            f"{self._model_name}, {len(mine)}): dense variable {i} is {var(saved[i])} in the "
            f"checkpoint, {var(mine[i])} in the model; build the same model, or start afresh "
            "in another checkpoint directory")
