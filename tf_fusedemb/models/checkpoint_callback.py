"""``ShardedCheckpoint``: Keras's ``BackupAndRestore`` for models with FusedEmbedding
layers. Put it in ``fit``'s callbacks and ``fit`` saves the sharded state every
``every_epochs`` epochs, and a ``fit`` started again (after a crash, or on another number
of ranks) resumes from the last complete checkpoint at the epoch after it, as if it had
not stopped.

    model.fit(data, epochs=10, callbacks=[ShardedCheckpoint("runs/ckpt")])

What it saves is :class:`~tf_fusedemb.training.checkpoint.CheckpointManager`'s checkpoint
(atomic, every rank's rows and the dense state and optimizer once): a collective, so every
rank passes the callback. It resumes the way Keras's own ``BackupAndRestore`` does: Keras
asks the model's ``_training_state`` for the epoch to start at, which this callback
provides after restoring (Keras's protocol, not an attribute of ours).
"""
import os
from typing import Any, Dict, Optional, Tuple

import tf_keras

from tf_fusedemb.training.checkpoint import CheckpointManager

__all__ = ["ShardedCheckpoint"]


class _ResumeAt:
    """What Keras's fit asks for the epoch and step to start at (``_training_state``)."""

    def __init__(self, epoch: int):
        self.epoch = epoch

    def maybe_load_initial_counters_from_ckpt(self, steps_per_epoch: Any, initial_epoch: int,
                                              mode: Any = None) -> Tuple[int, int]:
        del steps_per_epoch, mode
        return max(self.epoch, initial_epoch), 0


class ShardedCheckpoint(tf_keras.callbacks.Callback):
    """Saves the model's sharded state every ``every_epochs`` epochs (and at the end of
    ``fit``) into ``directory``, keeping ``max_to_keep``; resumes ``fit`` from the latest
    complete checkpoint there.

    Args:
      directory: shared by all ranks (one host, or a shared filesystem).
      every_epochs: save after every this many epochs (>= 1).
      max_to_keep: complete checkpoints kept.
    """

    def __init__(self, directory: str, every_epochs: int = 1, max_to_keep: int = 3):
        super().__init__()
        if int(every_epochs) < 1:
            raise ValueError(f"ShardedCheckpoint: every_epochs must be >= 1, got {every_epochs}")
        self.directory = directory
        self.every_epochs = int(every_epochs)
        self.max_to_keep = max_to_keep
        self._manager: Optional[CheckpointManager] = None
        self._saved_epoch = -1
        self._finished_epoch = 0

    def _checkpoints(self) -> CheckpointManager:
        if self._manager is None:
            self._manager = CheckpointManager(self.directory, self.model, self.model.optimizer,
                                              self.max_to_keep)
        return self._manager

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        os.makedirs(self.directory, exist_ok=True)
        meta = self._checkpoints().restore()
        epoch = int(meta["state"].get("epoch", 0)) if meta is not None else 0
        self._saved_epoch = self._finished_epoch = epoch
        self.model._training_state = _ResumeAt(epoch)  # Keras's resume protocol (see module doc)

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self._finished_epoch = epoch + 1
        if (epoch + 1) % self.every_epochs == 0:
            self._save(epoch + 1)

    def on_train_end(self, logs: Optional[Dict[str, Any]] = None) -> None:
        if self._finished_epoch > self._saved_epoch:
            self._save(self._finished_epoch)
        self.model._training_state = None

    def _save(self, epoch: int) -> None:
        flush = getattr(self.model, "flush_pipeline", None)
        if flush is not None:  # FusedModel's delayed row updates belong to this epoch
            flush()
        self._checkpoints().save(epoch, {"epoch": epoch})
        self._saved_epoch = epoch
