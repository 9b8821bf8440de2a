"""Progress output readable on a terminal and under horovodrun.

Keras's Progbar redraws one line with carriage returns; horovodrun reads each rank's stdout
through a pipe and prefixes what it reads (``[0]<stdout>:``), so a redrawn bar becomes one
ever-growing line. On a pipe we print whole lines instead, a few per run.
"""
import sys
from typing import Dict, Optional, Sequence, TextIO, Tuple, Union

import tf_keras

__all__ = ["LineProgress", "progress_bar", "fit_verbosity"]


class LineProgress:
    """``Progbar.update``-compatible: one line ``step k/N - name: value ...`` every
    ``every`` steps and at the last step; values are averaged over the updates, except
    ``stateful_metrics`` (shown as given), as Progbar does."""

    def __init__(self, target: int, stateful_metrics: Sequence[str] = (), lines: int = 20,
                 stream: Optional[TextIO] = None):
        self.target = int(target)
        self.every = max(1, self.target // max(1, lines))
        self.stateful = set(stateful_metrics)
        self.stream = stream or sys.stdout
        self._sums: Dict[str, Tuple[float, int]] = {}  # metric -> (sum, count) of its values

    def update(self, current: int, values: Sequence[Tuple[str, float]] = ()) -> None:
        shown = []
        for name, value in values:
            if name not in self.stateful:
                total, count = self._sums.get(name, (0.0, 0))
                self._sums[name] = (total + float(value), count + 1)
                value = self._sums[name][0] / self._sums[name][1]
            shown.append(f"{name}: {_number(float(value))}")
        if current % self.every == 0 or current >= self.target:
            print(" - ".join([f"step {current}/{self.target}"] + shown), file=self.stream,
                  flush=True)


def _number(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4f}"


def progress_bar(target: int, stateful_metrics: Sequence[str] = ()
                 ) -> Union[tf_keras.utils.Progbar, LineProgress]:
    """Keras's Progbar on a terminal, :class:`LineProgress` on a pipe (horovodrun, CI logs)."""
    if sys.stdout.isatty():
        return tf_keras.utils.Progbar(target, stateful_metrics=list(stateful_metrics))
    return LineProgress(target, stateful_metrics)


def fit_verbosity(rank: int) -> int:
    """Keras ``fit`` verbosity when the caller gave none: 0 off rank 0 (one report per job),
    1 (the bar) on a terminal, 2 (one line per epoch) on a pipe."""
    if rank != 0:
        return 0
    return 1 if sys.stdout.isatty() else 2
