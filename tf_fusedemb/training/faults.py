"""The training job's declared fault points: no-ops unless a test installs a hook.

The main job (``tf_fusedemb.train``) calls :func:`inject` right before each training step
(``phase="step"``) and ``CheckpointManager.save`` calls it after writing this rank's shard
(``phase="save"``, with the shard's path). By default nothing happens and nothing is read
from the environment. Tests of killed workers install a hook through
``tf_fusedemb.testing.faults`` (a fault plan, and a wrapper command that installs it
before running the job); the plan's parsing and the kill live there, not here.
"""
from typing import Optional, Protocol

__all__ = ["FaultHook", "PHASES", "inject", "set_hook"]

PHASES = ("step", "save")


class FaultHook(Protocol):
    """What :func:`set_hook` installs: called at every fault point."""

    def __call__(self, phase: str, step: int, rank: int,
                 partial_file: Optional[str] = None) -> None:
        """``phase``: one of PHASES; ``step``: the 1-based training step (or checkpoint
        step); ``rank``: this process's rank; ``partial_file``: a file being written at
        this point (the checkpoint shard), or None."""


def _no_fault(phase: str, step: int, rank: int, partial_file: Optional[str] = None) -> None:
    del phase, step, rank, partial_file


_hook: FaultHook = _no_fault


def inject(phase: str, step: int, rank: int, partial_file: Optional[str] = None) -> None:
    """A fault point: calls the installed hook (by default, nothing)."""
    _hook(phase, int(step), int(rank), partial_file)


def set_hook(hook: Optional[FaultHook]) -> FaultHook:
    """Installs ``hook`` for this process (None: no faults); returns the previous one."""
    global _hook
    previous, _hook = _hook, (hook or _no_fault)
    return previous
