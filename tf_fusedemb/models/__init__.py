"""Models and the sparse-aware training step of tf_fusedemb."""
from tf_fusedemb.models.callbacks import CommCountersLogger, fused_embedding_layers
from tf_fusedemb.models.fused_model import FusedModel, per_example_loss, train_step

__all__ = ["CommCountersLogger", "FusedModel", "fused_embedding_layers", "per_example_loss",
           "train_step"]
