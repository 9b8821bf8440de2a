"""Models and the sparse-aware training step of tf_fusedemb."""
from tf_fusedemb.models.fused_model import FusedModel, per_example_loss, train_step

__all__ = ["FusedModel", "per_example_loss", "train_step"]
