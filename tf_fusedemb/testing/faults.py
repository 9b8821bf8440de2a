"""Deterministic fault injection for tests of killed workers.

A fault ``rank=1,step=30,phase=step`` makes rank 1 kill itself with SIGKILL (no clean-up,
no goodbye: as the OOM killer or a crashed host would) at one of the job's declared fault
points (``tf_fusedemb.training.faults``):

* ``phase=step``: right before it runs training step 30 (1-based: 29 steps are done),
  so the other ranks are inside that step's collectives, waiting for it;
* ``phase=save``: inside ``CheckpointManager.save`` of checkpoint 30, after the first
  half of its shard file is written (the rest is never written), while the others write
  their shards or wait at the save's barrier.

Switched on from here only: :func:`install` in a process, or the command, which installs
the plan and then runs a module or script as ``python`` would::

    python -m tf_fusedemb.testing.faults --fault rank=1,step=30,phase=step \\
        -m tf_fusedemb.train --steps 100 --checkpoint-dir runs/ckpt

(``make train TRAIN_FAULT=rank=1,step=3,phase=step`` runs the main job that way). A rerun
meant to resume runs the plain command, or the same rank dies at the same point again.
"""
import os
import runpy
import signal
import sys
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence

from tf_fusedemb import quiet

__all__ = ["Fault", "FaultPlan", "PHASES", "install", "main", "parse"]

PHASES = ("step", "save")  # those of tf_fusedemb.training.faults
USAGE = ("usage: python -m tf_fusedemb.testing.faults --fault rank=R,step=S,phase=step|save "
         "[--fault ...] (-m MODULE | SCRIPT) [ARGS...]")


@dataclass(frozen=True)
class Fault:
    """Rank ``rank`` dies in ``phase`` of step ``step``."""
    rank: int
    step: int
    phase: str


def parse(spec: Optional[str]) -> Optional[Fault]:
    """``"rank=1,step=30,phase=step"`` -> Fault; None for an empty spec."""
    if not spec or not spec.strip():
        return None
    fields = {}
    for part in spec.split(","):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in ("rank", "step", "phase"):
            raise ValueError(f"fault: expected 'rank=R,step=S,phase=step|save', got {spec!r}")
        fields[key.strip()] = value.strip()
    if set(fields) != {"rank", "step", "phase"}:
        raise ValueError(f"fault: needs rank, step and phase, got {spec!r}")
    if fields["phase"] not in PHASES:
        raise ValueError(f"fault: phase must be one of {PHASES}, got {fields['phase']!r}")
    try:
        return Fault(int(fields["rank"]), int(fields["step"]), fields["phase"])
    except ValueError:
        raise ValueError(f"fault: rank and step must be integers, got {spec!r}") from None


class FaultPlan:
    """A ``tf_fusedemb.training.faults.FaultHook``: SIGKILLs this process at the fault
    point that one of ``faults`` names; first cuts ``partial_file`` (if given) to half its
    size, as if the kill had come in the middle of writing it."""

    def __init__(self, faults: Iterable[Fault]):
        self.faults = tuple(faults)

    def __call__(self, phase: str, step: int, rank: int,
                 partial_file: Optional[str] = None) -> None:
        if Fault(int(rank), int(step), phase) not in self.faults:
            return
        if partial_file is not None:
            os.truncate(partial_file, os.path.getsize(partial_file) // 2)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os.write(2, f"tf_fusedemb.testing.faults: rank {rank} kills itself (SIGKILL) in "
                    f"{phase} {step}\n".encode())
        os.kill(os.getpid(), signal.SIGKILL)


def install(faults: Iterable[Fault]) -> FaultPlan:
    """Installs a :class:`FaultPlan` of ``faults`` at the job's fault points (this
    process); returns it. ``tf_fusedemb.training.faults.set_hook(None)`` removes it."""
    # Here, not at the top: importing tf_fusedemb.training loads TensorFlow, which the
    # plan's parsing does not need, and the command quiets TensorFlow first (see main).
    from tf_fusedemb.training import faults as fault_points  # pylint: disable=import-outside-toplevel
    plan = FaultPlan(faults)
    fault_points.set_hook(plan)
    return plan


def _split_argv(argv: Sequence[str]):
    """(faults, module or None, script or None, the target's args) of the command line."""
    faults: List[Fault] = []
    rest = list(argv)
    while rest and rest[0] in ("--fault", "-f"):
        if len(rest) < 2:
            raise ValueError("--fault needs a value")
        fault = parse(rest[1])
        if fault is not None:
            faults.append(fault)
        rest = rest[2:]
    if rest and rest[0] == "--":
        rest = rest[1:]
    if not rest:
        raise ValueError("no module or script to run")
    if rest[0] == "-m":
        if len(rest) < 2:
            raise ValueError("-m needs a module")
        return faults, rest[1], None, rest[2:]
    return faults, None, rest[0], rest[1:]


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The command: installs the plan, then runs the module (``-m``) or script as
    ``__main__`` with its own arguments (``sys.argv[1:]`` as it would see them)."""
    try:
        faults, module, script, args = _split_argv(sys.argv[1:] if argv is None else argv)
    except ValueError as e:
        raise SystemExit(f"{e}\n{USAGE}") from None
    quiet.install()  # as the project's commands do, before TensorFlow loads
    install(faults)
    if module is not None:
        sys.argv = [module, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [script, *args]
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
