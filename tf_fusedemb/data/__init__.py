"""Data: dataset profiles and synthetic generators (numpy only at import time)."""
from .profile import CategoricalProfile, DatasetProfile, DenseProfile, load_profile
from .synthetic import (DENSE_MISSING, MISSING_ID, criteo_like_batch_keys, generate_criteo_like,
                        synthetic_dataset)

__all__ = ["CategoricalProfile", "DatasetProfile", "DenseProfile", "load_profile", "MISSING_ID",
           "DENSE_MISSING", "generate_criteo_like", "criteo_like_batch_keys", "synthetic_dataset"]
