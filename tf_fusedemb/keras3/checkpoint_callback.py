"""``ShardedCheckpoint`` for Keras 3's ``fit``: the tf_keras callback's schedule
(:class:`~tf_fusedemb.models.checkpoint_callback.CheckpointSchedule`) told to Keras 3 the
way Keras 3's own ``BackupAndRestore`` tells it, by the epoch to start at. Keras 3 has no
step to resume at: after a checkpoint saved inside an epoch, ``fit`` runs that epoch again
from the saved state, as it does after ``BackupAndRestore(save_freq=N)``.

    model.fit(data, epochs=10, callbacks=[ShardedCheckpoint("runs/ckpt")])
"""
from typing import Any, Dict, Optional

import keras

from tf_fusedemb.models.checkpoint_callback import CheckpointSchedule, FitPosition

__all__ = ["ShardedCheckpoint"]


class ShardedCheckpoint(CheckpointSchedule, keras.callbacks.Callback):
    """Keras 3's ``fit`` callback: saves as :class:`CheckpointSchedule` says (every
    ``every_epochs`` epochs, every ``every_steps`` steps if given, at the end of ``fit``;
    with ``incremental=True`` deltas between full checkpoints) and resumes at the epoch
    the latest checkpoint was saved in."""

    def _resume_at(self, position: Optional[FitPosition]) -> None:
        # Keras 3's resume protocol, as keras.callbacks.BackupAndRestore sets it.
        self.model._initial_epoch = None if position is None else position.epoch

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:
            # As BackupAndRestore does: the optimizer's variables exist before a restore
            # fills them (Keras 3 builds them lazily, at the first step).
            optimizer.build(self.model.trainable_variables)
        super().on_train_begin(logs)
