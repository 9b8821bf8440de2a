"""Training infrastructure: checkpoints (sharded, atomic, reshardable) and the main job."""
from tf_fusedemb.training.checkpoint import CheckpointManager

__all__ = ["CheckpointManager"]
