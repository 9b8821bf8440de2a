"""``ShardedCheckpoint``: Keras's ``BackupAndRestore`` for models with FusedEmbedding
layers. Put it in ``fit``'s callbacks and ``fit`` saves the sharded state every
``every_epochs`` epochs (and, with ``every_steps``, every that many training steps), and a
``fit`` started again (after a crash, or on another number of ranks) resumes from the last
complete checkpoint, as Keras's own ``BackupAndRestore`` resumes:

    model.fit(data, epochs=10, callbacks=[ShardedCheckpoint("runs/ckpt")])

With ``incremental=True`` the saves between full checkpoints (every ``full_every``-th)
write only the embedding blocks changed since the previous save, plus the dense state:

    model.fit(data, epochs=10, callbacks=[ShardedCheckpoint("runs/ckpt", every_steps=500,
                                                            incremental=True)])

What it saves is :class:`~tf_fusedemb.training.checkpoint.CheckpointManager`'s checkpoint
(atomic, every rank's rows and the dense state and optimizer once): a collective, so every
rank passes the callback. It resumes the way tf_keras's ``BackupAndRestore`` does: Keras
asks the model's ``_training_state`` for the epoch and step to start at, which this
callback provides after restoring (Keras's protocol, not an attribute of ours). After a
checkpoint saved inside an epoch, ``fit`` runs that epoch's remaining steps, reading them
from the epoch's data afresh (Keras's convention for ``BackupAndRestore(save_freq=N)``:
the data iterator is not part of a checkpoint).
"""
import dataclasses
import os
from typing import Any, Dict, Optional, Tuple

import tf_keras

from tf_fusedemb.training.checkpoint import CheckpointManager

__all__ = ["CheckpointSchedule", "ShardedCheckpoint"]


@dataclasses.dataclass(frozen=True)
class FitPosition:
    """Where ``fit`` stands: ``epoch`` (the one running, or the next after an epoch's end),
    ``step`` (steps of that epoch done) and ``steps`` (training steps done in all)."""
    epoch: int = 0
    step: int = 0
    steps: int = 0

    @staticmethod
    def of_state(state: Dict[str, Any]) -> "FitPosition":
        return FitPosition(int(state.get("epoch", 0)), int(state.get("step", 0)),
                           int(state.get("steps", 0)))


class _ResumeAt:
    """What Keras's fit asks for the epoch and step to start at (``_training_state``)."""

    def __init__(self, position: FitPosition):
        self.position = position

    def maybe_load_initial_counters_from_ckpt(self, steps_per_epoch: Any, initial_epoch: int,
                                              mode: Any = None) -> Tuple[int, int]:
        del mode
        epoch, step = self.position.epoch, self.position.step
        if steps_per_epoch is not None and step >= int(steps_per_epoch):
            epoch, step = epoch + 1, 0  # saved at an epoch's last step
        if epoch < initial_epoch:
            return initial_epoch, 0
        return epoch, step


class CheckpointSchedule:
    """When a ``fit`` callback saves and what it restores, for either Keras (mixed into
    its ``Callback``): the Keras-specific part is :meth:`_resume_at`, how that Keras is
    told where to start.

    Saves the model's sharded state every ``every_epochs`` epochs, every ``every_steps``
    training steps if given, and at the end of ``fit``, into ``directory``, keeping
    ``max_to_keep``; resumes ``fit`` from the latest complete checkpoint there.

    Args:
      directory: shared by all ranks (one host, or a shared filesystem).
      every_epochs: save after every this many epochs (>= 1).
      every_steps: also save after every this many training steps (>= 1; None: not
        inside epochs). With ``steps_per_execution`` > 1 a save falls on the first
        execution that reaches the count.
      max_to_keep: complete checkpoints kept (and the ones they build on, incremental).
      incremental: save deltas between full checkpoints: a save writes only the
        embedding blocks changed since the previous one, plus the dense state
        (CheckpointManager's ``incremental``).
      full_every: with ``incremental``, every ``full_every``-th save is full.
    """

    def __init__(self, directory: str, every_epochs: int = 1,
                 every_steps: Optional[int] = None, max_to_keep: int = 3,
                 incremental: bool = False, full_every: int = 10):
        super().__init__()
        if int(every_epochs) < 1:
            raise ValueError(f"ShardedCheckpoint: every_epochs must be >= 1, got {every_epochs}")
        if every_steps is not None and int(every_steps) < 1:
            raise ValueError(f"ShardedCheckpoint: every_steps must be >= 1 or None, "
                             f"got {every_steps}")
        self.directory = directory
        self.every_epochs = int(every_epochs)
        self.every_steps = None if every_steps is None else int(every_steps)
        self.max_to_keep = max_to_keep
        self.incremental = incremental
        self.full_every = full_every
        self._manager: Optional[CheckpointManager] = None
        self._position = FitPosition()
        self._saved_steps = 0
        self._saves = 0  # numbers the checkpoints: ckpt-<saves>

    def _checkpoints(self) -> CheckpointManager:
        if self._manager is None:
            self._manager = CheckpointManager(self.directory, self.model, self.model.optimizer,
                                              self.max_to_keep, incremental=self.incremental,
                                              full_every=self.full_every)
        return self._manager

    model: Any  # set by Keras (Callback.set_model)

    def _resume_at(self, position: Optional[FitPosition]) -> None:
        """Tells Keras where ``fit`` starts (None: at the end of ``fit``, forget it)."""
        raise NotImplementedError

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        os.makedirs(self.directory, exist_ok=True)
        meta = self._checkpoints().restore()
        self._position = FitPosition.of_state(meta["state"]) if meta else FitPosition()
        self._saves = int(meta["step"]) if meta else 0
        self._saved_steps = self._position.steps
        self._resume_at(self._position)

    def on_epoch_begin(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        resumed = epoch == self._position.epoch  # a resumed epoch starts at its saved step
        self._position = FitPosition(epoch, self._position.step if resumed else 0,
                                     self._position.steps)

    def on_train_batch_end(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        # ``batch``: the epoch's last step done, 0-based (with steps_per_execution > 1, the
        # last of the execution's steps).
        done = batch + 1 - self._position.step  # steps since the last call
        self._position = FitPosition(self._position.epoch, batch + 1, self._position.steps + done)
        if self.every_steps and self._position.steps - self._saved_steps >= self.every_steps:
            self._save()

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self._position = FitPosition(epoch + 1, 0, self._position.steps)
        if (epoch + 1) % self.every_epochs == 0:
            self._save()

    def on_train_end(self, logs: Optional[Dict[str, Any]] = None) -> None:
        if self._position.steps > self._saved_steps:  # steps since the last save
            self._save()
        self._resume_at(None)

    def _save(self) -> None:
        flush = getattr(self.model, "flush_pipeline", None)
        if flush is not None:  # FusedModel's delayed row updates belong to these steps
            flush()
        self._saves += 1
        self._checkpoints().save(self._saves, dataclasses.asdict(self._position))
        self._saved_steps = self._position.steps


class ShardedCheckpoint(CheckpointSchedule, tf_keras.callbacks.Callback):
    """tf_keras's ``fit`` callback: saves as :class:`CheckpointSchedule` says and resumes
    where the checkpoint was saved, at its epoch and step (as tf_keras's
    ``BackupAndRestore`` does). Keras 3: ``tf_fusedemb.keras3.ShardedCheckpoint``.

        model.fit(data, epochs=10, callbacks=[ShardedCheckpoint("runs/ckpt", every_steps=500)])
    """

    def _resume_at(self, position: Optional[FitPosition]) -> None:
        # tf_keras's resume protocol (see module doc): an epoch and a step.
        self.model._training_state = None if position is None else _ResumeAt(position)
