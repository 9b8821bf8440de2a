"""Data: dataset profiles and synthetic generators (numpy only at import time)."""
from .profile import CategoricalProfile, DatasetProfile, DenseProfile, load_profile
from .synthetic import (DENSE_MISSING, MISSING_ID, criteo_like_batch_keys, generate_criteo_like,
                        synthetic_dataset)

__all__ = ["CategoricalProfile", "DatasetProfile", "DenseProfile", "load_profile", "MISSING_ID",
           "DENSE_MISSING", "generate_criteo_like", "criteo_like_batch_keys", "synthetic_dataset"]

# Real-data readers (criteo, movielens, avazu, pipeline): these modules import TensorFlow only
# inside their functions, so importing them here keeps `import tf_fusedemb.data` TF-free.
from .avazu import AVAZU_CATEGORICAL, avazu_dataset
from .criteo import CRITEO_CATEGORICAL, CRITEO_DENSE, criteo_dataset, criteo_eval_split
from .movielens import GENRES, NUM_GENRES, movielens_dataset, movielens_info
from .pipeline import equal_steps

__all__ += ["AVAZU_CATEGORICAL", "avazu_dataset", "CRITEO_CATEGORICAL", "CRITEO_DENSE",
            "criteo_dataset", "criteo_eval_split", "GENRES", "NUM_GENRES", "movielens_dataset",
            "movielens_info", "equal_steps"]
