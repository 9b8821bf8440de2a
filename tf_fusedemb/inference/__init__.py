"""Inference: single-host serving tables and SavedModel export; sharded bounded-lag
inference over MPI (``distributed``, imported on demand: it needs mpi4py)."""
from tf_fusedemb.inference.export import export_saved_model
from tf_fusedemb.inference.serving import ServingGroup

__all__ = ["ServingGroup", "export_saved_model"]
