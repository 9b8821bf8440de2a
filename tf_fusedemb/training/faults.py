"""Deterministic fault injection for tests of killed workers.

``TF_FUSEDEMB_FAULT="rank=1,step=30,phase=step"`` makes rank 1 kill itself with SIGKILL
(no clean-up, no goodbye: as the OOM killer or a crashed host would) at one point:

* ``phase=step``: right before it runs training step 30 (1-based: 29 steps are done),
  so the other ranks are inside that step's collectives, waiting for it;
* ``phase=save``: inside ``CheckpointManager.save`` of checkpoint 30, after the first
  half of its shard file is written (the rest is never written), while the others write
  their shards or wait at the save's barrier.

Unset (the default), nothing happens. A rerun meant to resume must not carry the
variable, or the same rank dies at the same point again.
"""
import os
import signal
import sys
from dataclasses import dataclass

ENV = "TF_FUSEDEMB_FAULT"
PHASES = ("step", "save")


@dataclass(frozen=True)
class Fault:
    """Rank ``rank`` dies in ``phase`` of step ``step``."""
    rank: int
    step: int
    phase: str


def parse(spec):
    """``"rank=1,step=30,phase=step"`` -> Fault; None for an empty spec."""
    if not spec or not spec.strip():
        return None
    fields = {}
    for part in spec.split(","):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in ("rank", "step", "phase"):
            raise ValueError(f"{ENV}: expected 'rank=R,step=S,phase=step|save', got {spec!r}")
        fields[key.strip()] = value.strip()
    if set(fields) != {"rank", "step", "phase"}:
        raise ValueError(f"{ENV}: needs rank, step and phase, got {spec!r}")
    if fields["phase"] not in PHASES:
        raise ValueError(f"{ENV}: phase must be one of {PHASES}, got {fields['phase']!r}")
    try:
        return Fault(int(fields["rank"]), int(fields["step"]), fields["phase"])
    except ValueError:
        raise ValueError(f"{ENV}: rank and step must be integers, got {spec!r}") from None


def inject(phase, step, rank, partial_file=None):
    """SIGKILLs this process when TF_FUSEDEMB_FAULT names ``phase``, ``step`` and
    ``rank``; first cuts ``partial_file`` (if given) to half its size, as if the kill had
    come in the middle of writing it."""
    fault = parse(os.environ.get(ENV))
    if fault is None or (fault.phase, fault.step, fault.rank) != (phase, int(step), int(rank)):
        return
    if partial_file is not None:
        os.truncate(partial_file, os.path.getsize(partial_file) // 2)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.write(2, f"{ENV}: rank {rank} kills itself (SIGKILL) in {phase} {step}\n".encode())
    os.kill(os.getpid(), signal.SIGKILL)
