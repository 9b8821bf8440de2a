"""Keras callbacks of tf_fusedemb."""
from typing import Any, Dict, List, Optional, Tuple

import logging

import tf_keras

from tf_fusedemb.comm import CommCounters
from tf_fusedemb.comm.counters import FIELDS as COUNTER_FIELDS
from tf_fusedemb.layers.fused_embedding import FusedEmbedding
from tf_fusedemb.layers.model_embeddings import fused_embedding_layers

logger = logging.getLogger("tf_fusedemb")




class CommCountersLogger(tf_keras.callbacks.Callback):
    """Per-step AlltoAll figures of every fused group, in the Keras logs and the log.

    After each training batch it adds to ``logs`` (so progress bars and TensorBoard's
    batch-level logging show them): ``a2a_rounds``, ``a2a_bytes_sent``,
    ``a2a_bytes_received`` and ``a2a_mean_message_bytes`` summed over groups for that
    step; at epoch end the same keys hold the epoch's per-step averages (History,
    CSVLogger, TensorBoard epoch scalars). Every ``log_every`` steps it logs the
    per-group figures with the ``tf_fusedemb`` logger.
    """

    def __init__(self, log_every: int = 100):
        super().__init__()
        self.log_every = log_every
        self._layers: List[FusedEmbedding] = []
        # The last counter snapshot of each (layer index, group name).
        self._last: Dict[Tuple[int, str], Dict[str, int]] = {}
        self._step = 0
        # Sums of this epoch's per-step totals, and the step count.
        self._epoch: Dict[str, float] = {}

    def _snapshot(self) -> Dict[Tuple[int, str], Dict[str, int]]:
        return {(i, g): c for i, layer in enumerate(self._layers)
                for g, c in layer.comm_counters().items()}

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        self._layers = fused_embedding_layers(self.model)
        self._last = self._snapshot()

    def on_train_batch_end(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        now = self._snapshot()
        per_group = {key: CommCounters.per_step(self._last[key], now[key]) for key in now}
        self._last = now
        self._step += 1
        if logs is not None and per_group:
            totals = {f: sum(d[f] for d in per_group.values()) for f in COUNTER_FIELDS}
            logs.update(_summary(totals))
            for f, v in totals.items():
                self._epoch[f] = self._epoch.get(f, 0) + v
            self._epoch["steps"] = self._epoch.get("steps", 0) + 1
        if self.log_every and self._step % self.log_every == 0:
            for (layer, group), d in sorted(per_group.items()):
                logger.info("step %d layer %d group %s: %d AlltoAll rounds, %d B sent, "
                            "%d B received, mean message %.0f B", self._step, layer, group,
                            d["rounds"], d["bytes_sent"], d["bytes_received"],
                            d["mean_message_bytes"])

    def on_epoch_begin(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self._epoch = {}

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if logs is not None and self._epoch.get("steps"):
            steps = self._epoch["steps"]
            logs.update(_summary({f: v / steps for f, v in self._epoch.items()
                                  if f != "steps"}))


def _summary(totals):
    return {"a2a_rounds": totals["rounds"], "a2a_bytes_sent": totals["bytes_sent"],
            "a2a_bytes_received": totals["bytes_received"],
            "a2a_mean_message_bytes": totals["bytes_sent"] / max(1, totals["messages"])}
