"""Embedding specifications and the fusion planner (FusedRec, equation (1)).

FusedRec fuses the features whose embedding specification ``spec(E) = (dim,
optimizer, initializer)`` matches into one group, so that a group needs one
SegmentUnique, one table per rank and 3 AlltoAll rounds per step instead of 3
per feature. This module is pure standard library (importing it never imports
TensorFlow); every rank runs :func:`plan_fusion` on the same feature list and
must get the same plan, which :meth:`FusionPlan.fingerprint` lets it check.

Example::

    >>> t = TableSpec("C1", dim=16, optimizer=OptimizerSpec.adagrad(0.01))
    >>> u = TableSpec("C2", dim=16, optimizer=OptimizerSpec.adagrad(0.01))
    >>> plan = plan_fusion([FeatureSpec("C1", t), FeatureSpec("C2", u)])
    >>> [(g.name, g.feature_names) for g in plan.groups]
    [('g0_d16_adagrad', ('C1', 'C2'))]
"""
from tf_fusedemb.specs.hyperparameters import InitializerSpec, OptimizerSpec
from tf_fusedemb.specs.plan import (FusedGroup, FusionPlan, describe_plan_difference,
                                    plan_fusion, unfused_plan)
from tf_fusedemb.specs.policies import AdmissionPolicy, EvictionPolicy
from tf_fusedemb.specs.tables import (COMBINERS, DEFAULT_STORAGE, KEY_DTYPES, STORAGES,
                                      FeatureSpec, TableSpec)

__all__ = ["OptimizerSpec", "InitializerSpec", "AdmissionPolicy", "EvictionPolicy", "TableSpec",
           "FeatureSpec", "FusedGroup", "FusionPlan", "describe_plan_difference", "plan_fusion",
           "unfused_plan", "COMBINERS", "KEY_DTYPES", "STORAGES", "DEFAULT_STORAGE"]
