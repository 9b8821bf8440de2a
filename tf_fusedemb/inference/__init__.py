"""Inference: single-host serving tables and SavedModel export."""
from tf_fusedemb.inference.export import export_saved_model
from tf_fusedemb.inference.serving import ServingGroup

__all__ = ["ServingGroup", "export_saved_model"]
