"""Training: the one synchronous step core (Keras loss semantics over ranks), rank-invariant
tracing, sharded checkpoints (atomic, reshardable, incremental) and the main job's building blocks."""
from tf_fusedemb.training.checkpoint import CheckpointManager
from tf_fusedemb.training.checkpoint_chain import BrokenChainError
from tf_fusedemb.training.distributed_optimizer import DistributedOptimizer
from tf_fusedemb.training.loss import KerasLoss
from tf_fusedemb.training.step import StepResult, test_step, train_step
from tf_fusedemb.training.step_variables import create_step_variables

__all__ = ["BrokenChainError", "CheckpointManager", "DistributedOptimizer", "KerasLoss", "StepResult", "create_step_variables",
           "test_step", "train_step"]
