"""Training: the one synchronous step core (Keras loss semantics over ranks), rank-invariant
tracing, sharded checkpoints (atomic, reshardable) and the main job's building blocks."""
from tf_fusedemb.training.checkpoint import CheckpointManager
from tf_fusedemb.training.distributed_optimizer import DistributedOptimizer
from tf_fusedemb.training.loss import KerasLoss
from tf_fusedemb.training.step import StepResult, test_step, train_step

__all__ = ["CheckpointManager", "DistributedOptimizer", "KerasLoss", "StepResult", "test_step", "train_step"]
